"""The node agent: one per host, starts and supervises the workers."""
