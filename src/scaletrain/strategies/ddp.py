"""Data parallel: a full replica per worker, gradients all-reduced by DistributedDataParallel."""

from __future__ import annotations

import contextlib
from collections.abc import Sequence

from torch import nn
from torch.nn.parallel import DistributedDataParallel

from scaletrain.distributed.device import Placement
from scaletrain.strategies.base import Strategy

__all__ = ["DDPStrategy"]


class DDPStrategy(Strategy):
    name = "ddp"

    def wrap(self, model: nn.Module, placement: Placement, blocks: Sequence[nn.Module] = ()) -> nn.Module:
        model = model.to(placement.device)
        device_ids = [placement.device.index] if placement.device.type == "cuda" else None
        # DDP broadcasts rank 0's parameters at construction, so every replica starts equal.
        # Gradients live in DDP's communication buckets (one copy of them, not two).
        return DistributedDataParallel(model, device_ids=device_ids, gradient_as_bucket_view=True)

    def unwrap(self, model: nn.Module) -> nn.Module:
        return model.module if isinstance(model, DistributedDataParallel) else model

    def sync_gradients(self, model: nn.Module, sync: bool) -> contextlib.AbstractContextManager:
        if sync or not isinstance(model, DistributedDataParallel):
            return contextlib.nullcontext()
        return model.no_sync()
