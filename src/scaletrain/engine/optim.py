"""Optimizer construction from the job's ``optim`` section."""

from __future__ import annotations

import torch
from torch import nn

from scaletrain.config.schema import OptimConfig
from scaletrain.strategies.base import Strategy

__all__ = ["build_optimizer"]


def build_optimizer(model: nn.Module, config: OptimConfig, strategy: Strategy | None = None) -> torch.optim.Optimizer:
    """Weight decay applies to matrices (weights, embeddings), not to biases and norm scales,
    as in nanoGPT and most transformer recipes. ``strategy`` makes it (ZeRO-1 shards it)."""
    params = [p for p in model.parameters() if p.requires_grad]
    decay = [p for p in params if p.dim() >= 2]
    no_decay = [p for p in params if p.dim() < 2]
    groups = [
        {"params": decay, "weight_decay": config.weight_decay},
        {"params": no_decay, "weight_decay": 0.0},
    ]
    groups = [g for g in groups if g["params"]]
    make = strategy.make_optimizer if strategy is not None else (lambda cls, g, **kw: cls(g, **kw))
    if config.name == "sgd":
        return make(torch.optim.SGD, groups, lr=config.lr, momentum=config.momentum)
    return make(torch.optim.AdamW, groups, lr=config.lr, betas=tuple(config.betas))
