"""The torch.distributed.checkpoint calls, in one module imported only when a checkpoint is
written or read: importing DCP costs about a second, which a worker's start must not pay."""

from __future__ import annotations

import io
import warnings
from concurrent.futures import Future
from typing import Any

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint._nested_dict import set_element
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict, set_state_dict
from torch.distributed.checkpoint.staging import DefaultStager, StagingOptions

__all__ = ["state_of", "save", "async_save", "load", "new_stager"]

# DCP announces "assuming single process" on every call without a process group.
warnings.filterwarnings("ignore", message=".*torch.distributed is disabled.*")
warnings.filterwarnings("ignore", message=".*assuming the intent is to (save|load) in a single process.*")


class _SafeLoadPlanner(DefaultLoadPlanner):
    """DCP's default planner unpickles non-tensor items with ``weights_only=False``; ours
    reads them with the restricted unpickler (optimizer hyperparameters are plain data)."""

    def load_bytes(self, read_item, value: io.BytesIO) -> None:
        loaded = torch.load(value, weights_only=True)
        if self.flatten_state_dict:
            set_element(self.original_state_dict, self.mappings[read_item.dest_index.fqn], loaded)
        else:
            self.state_dict[read_item.dest_index.fqn] = loaded


def state_of(model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> dict[str, Any]:
    """Model and optimizer state keyed by parameter names, for any strategy (DDP unwrapped)."""
    model_sd, optim_sd = get_state_dict(model, optimizer, options=StateDictOptions())
    return {"model": model_sd, "optim": optim_sd}


def save(state: dict[str, Any], path: str, group: Any) -> None:
    dcp.save(state, checkpoint_id=path, process_group=group)


def new_stager() -> DefaultStager:
    """Reused across saves: its CPU copies of the state are allocated once."""
    return DefaultStager(StagingOptions(False, False, False, False))


def async_save(state: dict[str, Any], path: str, group: Any, stager: DefaultStager) -> Future:
    """Copies the state (the only stall), then writes in a background thread."""
    return dcp.async_save(state, checkpoint_id=path, process_group=group, async_stager=stager)


def load(model: torch.nn.Module, optimizer: torch.optim.Optimizer, path: str, group: Any) -> None:
    """Load a verified checkpoint into the model and optimizer, resharding as needed."""
    state = state_of(model, optimizer)
    dcp.load(state, checkpoint_id=path, planner=_SafeLoadPlanner(), process_group=group)
    set_state_dict(model, optimizer, model_state_dict=state["model"],
                   optim_state_dict=state["optim"], options=StateDictOptions())
