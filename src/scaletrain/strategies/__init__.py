"""Strategies by name. Adding one means a module and a line here; the loop does not change."""

from __future__ import annotations

from typing import TYPE_CHECKING

from scaletrain.strategies.base import Strategy
from scaletrain.strategies.ddp import DDPStrategy
from scaletrain.strategies.fsdp import FSDPStrategy, HSDPStrategy
from scaletrain.strategies.single import SingleStrategy
from scaletrain.strategies.zero1 import Zero1Strategy

if TYPE_CHECKING:
    from scaletrain.config.schema import ScaleConfig

__all__ = ["Strategy", "STRATEGIES", "get_strategy"]

STRATEGIES: dict[str, type[Strategy]] = {
    SingleStrategy.name: SingleStrategy,
    DDPStrategy.name: DDPStrategy,
    Zero1Strategy.name: Zero1Strategy,
    FSDPStrategy.name: FSDPStrategy,
    HSDPStrategy.name: HSDPStrategy,
}


def get_strategy(name: str, scale: ScaleConfig | None = None) -> Strategy:
    return STRATEGIES[name](scale)
