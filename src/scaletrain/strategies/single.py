"""One process, one device: the model as the user built it."""

from __future__ import annotations

from collections.abc import Sequence

from torch import nn

from scaletrain.distributed.device import Placement
from scaletrain.strategies.base import Strategy

__all__ = ["SingleStrategy"]


class SingleStrategy(Strategy):
    name = "single"

    def wrap(self, model: nn.Module, placement: Placement, blocks: Sequence[nn.Module] = ()) -> nn.Module:
        return model.to(placement.device)
