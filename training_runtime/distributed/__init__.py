"""Process groups, the mesh, MiCS sharding, collectives, gradient accumulation, communication statistics."""
