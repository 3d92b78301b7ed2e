"""Optimizer construction from the job's ``optim`` section."""

from __future__ import annotations

import torch
from torch import nn

from scaletrain.config.schema import OptimConfig

__all__ = ["build_optimizer"]


def build_optimizer(model: nn.Module, config: OptimConfig) -> torch.optim.Optimizer:
    """Weight decay applies to matrices (weights, embeddings), not to biases and norm scales,
    as in nanoGPT and most transformer recipes."""
    params = [p for p in model.parameters() if p.requires_grad]
    decay = [p for p in params if p.dim() >= 2]
    no_decay = [p for p in params if p.dim() < 2]
    groups = [
        {"params": decay, "weight_decay": config.weight_decay},
        {"params": no_decay, "weight_decay": 0.0},
    ]
    groups = [g for g in groups if g["params"]]
    if config.name == "sgd":
        return torch.optim.SGD(groups, lr=config.lr, momentum=config.momentum)
    return torch.optim.AdamW(groups, lr=config.lr, betas=tuple(config.betas))
