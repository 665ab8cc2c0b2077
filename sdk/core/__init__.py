"""The client's core: contract names and files, instance catalog, model presets, the parallelism plan, errors, S3 URIs, job names.

STDLIB ONLY: the runtime imports these modules inside containers."""
