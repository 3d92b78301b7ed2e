"""A strategy decides how the model is spread over the workers. The loop never asks which."""

from __future__ import annotations

import contextlib
from abc import ABC, abstractmethod
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from scaletrain.distributed import collectives
from scaletrain.distributed.device import Placement

if TYPE_CHECKING:
    from scaletrain.config.schema import ScaleConfig

__all__ = ["Strategy"]


class Strategy(ABC):
    name: str = ""
    sharded: bool = False  # parameters split over ranks: every rank must run every forward

    def __init__(self, scale: ScaleConfig | None = None):
        self.scale = scale

    @abstractmethod
    def wrap(self, model: nn.Module, placement: Placement, blocks: Sequence[nn.Module] = ()) -> nn.Module:
        """Move the model to its device and wrap it for this strategy (``blocks``: its
        repeated layers, for strategies that treat them one by one)."""

    def make_optimizer(self, optimizer_class: type[torch.optim.Optimizer], groups: list[dict[str, Any]],
                       **defaults: Any) -> torch.optim.Optimizer:
        """The job's optimizer over these parameter groups (ZeRO-1 splits its state)."""
        return optimizer_class(groups, **defaults)

    def unwrap(self, model: nn.Module) -> nn.Module:
        """The user's module (for FSDP: the same module, its parameters sharded)."""
        return model

    def full_state_dict(self, model: nn.Module) -> dict[str, torch.Tensor]:
        """Every weight, whole, on rank 0 (other ranks may get an empty dict). Collective:
        every rank calls it."""
        return self.unwrap(model).state_dict()

    def sync_gradients(self, model: nn.Module, sync: bool) -> contextlib.AbstractContextManager:
        """Context for one micro-step; ``sync=False`` skips gradient communication."""
        return contextlib.nullcontext()

    def clip_grad_norm(self, model: nn.Module, max_norm: float) -> torch.Tensor:
        """Clip the global gradient norm in place and return the norm before clipping."""
        params = list(model.parameters())  # one walk of the module tree a step, not two
        norm = self._grad_norm(params)
        nn.utils.clip_grads_with_norm_(params, max_norm, norm)
        return norm

    def grad_norm(self, model: nn.Module) -> torch.Tensor:
        """The global gradient norm, without changing any gradient (a plain tensor, also
        when gradients are sharded DTensors)."""
        return self._grad_norm(list(model.parameters()))

    def _grad_norm(self, params: list[nn.Parameter]) -> torch.Tensor:
        grads = [p.grad for p in params if p.grad is not None]
        if not grads:
            return torch.zeros((), device=params[0].device if params else None)
        # Sharded gradients (DTensors) give a DTensor norm: reduced over the shards.
        return collectives.full_tensor(nn.utils.get_total_norm(grads))
