"""What the model, its gradients, the optimizer and buffers take on this rank, measured on the
live objects (a DTensor counts its local shard): logged once per attempt, what the planner's
prediction (plan/state_bytes.py) is checked against."""

from __future__ import annotations

import torch
from torch import nn

__all__ = ["measure_state_bytes"]


def _local(tensor: torch.Tensor) -> torch.Tensor:
    return getattr(tensor, "_local_tensor", tensor)  # a DTensor's shard on this rank


def measure_state_bytes(model: nn.Module, optimizer: torch.optim.Optimizer) -> dict[str, int]:
    params = [p for p in model.parameters() if p.requires_grad]
    state = 0
    # ZeRO-1: this rank's share (its wrapper's own state is empty)
    for per_param in getattr(optimizer, "local_optimizer", optimizer).state.values():
        for value in per_param.values():
            if isinstance(value, torch.Tensor):
                state += _local(value).nbytes
    return {
        "params": sum(_local(p).nbytes for p in params),
        "grads": sum(_local(p.grad).nbytes for p in params if p.grad is not None),
        "optimizer": state,
        "buffers": sum(b.nbytes for b in model.buffers()),
    }
