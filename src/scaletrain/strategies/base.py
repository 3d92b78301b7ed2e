"""A strategy decides how the model is spread over the workers. The loop never asks which."""

from __future__ import annotations

import contextlib
from abc import ABC, abstractmethod

import torch
from torch import nn

from scaletrain.distributed.device import Placement

__all__ = ["Strategy"]


class Strategy(ABC):
    name: str = ""

    @abstractmethod
    def wrap(self, model: nn.Module, placement: Placement) -> nn.Module:
        """Move the model to its device and wrap it for this strategy."""

    def unwrap(self, model: nn.Module) -> nn.Module:
        """The user's module, for evaluation and state dicts."""
        return model

    def sync_gradients(self, model: nn.Module, sync: bool) -> contextlib.AbstractContextManager:
        """Context for one micro-step; ``sync=False`` skips gradient communication."""
        return contextlib.nullcontext()

    def clip_grad_norm(self, model: nn.Module, max_norm: float) -> torch.Tensor:
        """Clip the global gradient norm in place and return the norm before clipping."""
        return nn.utils.clip_grad_norm_(model.parameters(), max_norm)

    def grad_norm(self, model: nn.Module) -> torch.Tensor:
        """The global gradient norm, without changing any gradient."""
        grads = [p.grad for p in model.parameters() if p.grad is not None]
        if not grads:
            return torch.zeros(())
        return nn.utils.get_total_norm(grads)
