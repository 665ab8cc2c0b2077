"""The Slurm target: sbatch and srun from the login node; the job's files on the shared disk."""
