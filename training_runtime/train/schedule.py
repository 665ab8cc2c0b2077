"""Learning-rate schedule: linear warm-up, then cosine decay to ``min_lr_ratio × lr``.

A pure function of the optimizer step, so resuming needs only the step number.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class WarmupCosine:
    lr: float
    total_steps: int
    warmup_steps: int = 0
    min_lr_ratio: float = 0.1

    def __post_init__(self) -> None:
        if self.lr <= 0 or self.total_steps < 1:
            raise ValueError(f"lr must be > 0 and steps >= 1, got lr={self.lr}, "
                             f"steps={self.total_steps}")
        if not 0 <= self.warmup_steps <= self.total_steps:
            raise ValueError(f"warmup_steps={self.warmup_steps} must be between 0 and "
                             f"steps={self.total_steps}; lower it")
        if not 0 <= self.min_lr_ratio <= 1:
            raise ValueError(f"min_lr_ratio must be in [0, 1], got {self.min_lr_ratio}")

    def lr_at(self, step: int) -> float:
        """The learning rate of update number ``step`` (0-based): the peak once, at the last
        warm-up update (the first update without warm-up), ``min_lr_ratio × lr`` at the last
        update, ``total_steps - 1``."""
        if step < self.warmup_steps:
            return self.lr * (step + 1) / self.warmup_steps
        peak = max(0, self.warmup_steps - 1)
        progress = min(1.0, (step - peak) / max(1, self.total_steps - 1 - peak))
        cosine = 0.5 * (1 + math.cos(math.pi * progress))
        return self.lr * (self.min_lr_ratio + (1 - self.min_lr_ratio) * cosine)

    def apply(self, optimizer: torch.optim.Optimizer, step: int,
              peaks: list[float] | None = None) -> float:
        """Set every group's learning rate for update ``step``; returns the first group's.
        ``peaks``: each group's own peak (an optimizer the user built), which the schedule
        shapes alike, instead of ``lr`` for all."""
        lr = self.lr_at(step)
        for index, group in enumerate(optimizer.param_groups):
            value = lr if peaks is None else peaks[index] * lr / self.lr
            if isinstance(group["lr"], torch.Tensor):  # a capturable optimizer's: in place
                group["lr"].fill_(value)
            else:
                group["lr"] = value
        return float(optimizer.param_groups[0]["lr"])
