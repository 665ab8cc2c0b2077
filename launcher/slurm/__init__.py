"""The Slurm target: sbatch + srun from the login node, the job's files on the shared file system."""
