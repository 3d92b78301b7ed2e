"""Strategies by name. Adding one means a module and a line here; the loop does not change."""

from __future__ import annotations

from scaletrain.strategies.base import Strategy
from scaletrain.strategies.ddp import DDPStrategy
from scaletrain.strategies.single import SingleStrategy

__all__ = ["Strategy", "STRATEGIES", "get_strategy"]

STRATEGIES: dict[str, type[Strategy]] = {
    SingleStrategy.name: SingleStrategy,
    DDPStrategy.name: DDPStrategy,
}


def get_strategy(name: str) -> Strategy:
    return STRATEGIES[name]()
