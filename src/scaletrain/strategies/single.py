"""One process, one device: the model as the user built it."""

from __future__ import annotations

from torch import nn

from scaletrain.distributed.device import Placement
from scaletrain.strategies.base import Strategy

__all__ = ["SingleStrategy"]


class SingleStrategy(Strategy):
    name = "single"

    def wrap(self, model: nn.Module, placement: Placement) -> nn.Module:
        return model.to(placement.device)
