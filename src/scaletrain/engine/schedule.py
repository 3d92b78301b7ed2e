"""Learning-rate schedules: linear warmup, then constant, cosine or linear decay."""

from __future__ import annotations

import math
from dataclasses import dataclass

from torch.optim import Optimizer
from torch.optim.lr_scheduler import LambdaLR

__all__ = ["LRSchedule", "build_scheduler"]


@dataclass(frozen=True)
class LRSchedule:
    """Multiplier of the peak lr for the optimizer step with 0-based index ``step``."""

    kind: str
    warmup_steps: int
    total_steps: int
    min_ratio: float = 0.0

    def __call__(self, step: int) -> float:
        if step < self.warmup_steps:
            return (step + 1) / self.warmup_steps
        if self.kind == "constant":
            return 1.0
        span = max(1, self.total_steps - self.warmup_steps)
        progress = min(1.0, (step - self.warmup_steps) / span)
        if self.kind == "cosine":
            decay = 0.5 * (1.0 + math.cos(math.pi * progress))
        else:  # linear
            decay = 1.0 - progress
        return self.min_ratio + (1.0 - self.min_ratio) * decay


def build_scheduler(optimizer: Optimizer, schedule: LRSchedule) -> LambdaLR:
    # A dataclass (not a lambda) so the scheduler's state dict stays picklable-free.
    return LambdaLR(optimizer, schedule)
