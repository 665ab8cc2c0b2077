"""Trainer, optimizer, schedule, checkpoints, data and metrics."""
