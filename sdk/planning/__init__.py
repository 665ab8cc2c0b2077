"""plan(spec): the parallelism plan, memory, traffic, step time and cost."""
