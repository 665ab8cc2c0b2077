"""The local target: simulated hosts as processes on this machine."""
