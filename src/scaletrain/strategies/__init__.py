"""Strategies by name. Adding one means a module and a line here; the loop does not change.

Each strategy's module is imported when a job asks for it: ZeRO-1's imports
torch.distributed.optim, which imports FSDP and DTensor (~0.5 s of a worker's start-up that
a DDP job never uses)."""

from __future__ import annotations

from importlib import import_module
from typing import TYPE_CHECKING

from scaletrain.strategies.base import Strategy

if TYPE_CHECKING:
    from scaletrain.config.schema import ScaleConfig

__all__ = ["Strategy", "STRATEGIES", "get_strategy", "strategy_class"]

STRATEGIES: dict[str, str] = {  # name -> "module:class"
    "single": "scaletrain.strategies.single:SingleStrategy",
    "ddp": "scaletrain.strategies.ddp:DDPStrategy",
    "zero1": "scaletrain.strategies.zero1:Zero1Strategy",
    "fsdp": "scaletrain.strategies.fsdp:FSDPStrategy",
    "hsdp": "scaletrain.strategies.fsdp:HSDPStrategy",
}


def strategy_class(name: str) -> type[Strategy]:
    module, _, attr = STRATEGIES[name].partition(":")
    cls: type[Strategy] = getattr(import_module(module), attr)
    return cls


def get_strategy(name: str, scale: ScaleConfig | None = None) -> Strategy:
    return strategy_class(name)(scale)
