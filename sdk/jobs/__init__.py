"""The jobs layer: submit/status/logs/stop for every target, and the job store."""
