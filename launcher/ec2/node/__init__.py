"""The EC2 target's node side: what runs on each instance at boot."""
