"""The model's repeated blocks: the unit FSDP shards and activation checkpointing recomputes.

A task may say what they are (``blocks(model) -> list of modules``); otherwise they are the
members of the largest ``nn.ModuleList`` (by parameter count) whose members are all of one
class, the way transformer stacks are written (nanoGPT's ``transformer.h``, torchtitan's
``layers``). A model without one has no blocks: FSDP then shards the model as one unit.
"""

from __future__ import annotations

from typing import Any

from torch import nn

__all__ = ["find_blocks"]


def find_blocks(model: nn.Module, task: Any = None) -> list[nn.Module]:
    declared = getattr(task, "blocks", None)
    if callable(declared):
        blocks = list(declared(model))
        owned = {id(m) for m in model.modules()}
        if not all(isinstance(b, nn.Module) and id(b) in owned for b in blocks):
            raise TypeError("task.blocks(model) must return submodules of the model it is given")
        return blocks
    best: list[nn.Module] = []
    best_params = 0
    for module in model.modules():
        if not isinstance(module, nn.ModuleList) or len(module) < 2:
            continue
        members = list(module)
        if len({type(m) for m in members}) != 1:
            continue
        params = sum(p.numel() for p in module.parameters())
        if params > best_params:
            best, best_params = members, params
    return best
