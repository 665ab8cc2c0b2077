"""Training FLOPs per token: the one formula the planner and the runtime's MFU both use."""

from __future__ import annotations


def flops_per_token(*, num_parameters: int, num_layers: int, hidden_size: int, seq_len: int,
                    activation_checkpointing: bool = False) -> float:
    """Training FLOPs per token: 6·N + 12·L·h·s, ×4/3 with activation checkpointing.

    The runtime's MFU uses the same function, so planned and measured MFU mean the same thing.
    """
    flops = 6 * num_parameters + 12 * num_layers * hidden_size * seq_len
    return flops * 4 / 3 if activation_checkpointing else float(flops)
