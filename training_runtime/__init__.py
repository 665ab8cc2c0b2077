"""The in-container runtime: node agent, process groups, MiCS sharding, models, trainer."""
