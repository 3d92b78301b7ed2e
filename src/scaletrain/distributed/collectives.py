"""Every collective scaletrain issues itself goes through here (a unit test holds it).

A tensor must reach a backend that takes its device: NCCL takes only CUDA tensors, gloo takes
CPU tensors (and CUDA ones, by copying them through host memory). The default group on GPUs is
``cpu:gloo,cuda:nccl`` (distributed/device.py), so a CPU control message goes over gloo without
syncing the GPU; and a tensor whose device no backend of its group takes (a group an engine
created with NCCL alone, a CPU-offloaded FSDP shard on an NCCL mesh) is copied to one that does,
reduced there and copied back. Without a process group every call is the identity.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

__all__ = [
    "active",
    "world_size",
    "all_reduce",
    "all_gather_object",
    "broadcast_object",
    "barrier",
    "new_gloo_group",
    "full_tensor",
    "device_for",
]

_OPS = {"sum": "SUM", "max": "MAX", "min": "MIN", "mean": "SUM"}


def active() -> bool:
    """True inside a process group (also one of a single rank)."""
    return dist.is_available() and dist.is_initialized()


def world_size(group: Any = None) -> int:
    return dist.get_world_size(group) if active() else 1


def device_for(device: torch.device, group: Any = None) -> torch.device:
    """``device`` if the group's backends take it, else the device they do take."""
    if not active():
        return device
    group = group if group is not None else dist.group.WORLD
    types = {d.type for d in getattr(group, "_device_types", ())}
    if not types or device.type in types:
        return device
    if "cuda" in types and torch.cuda.is_available():
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def all_reduce(tensor: torch.Tensor, op: str = "sum", group: Any = None) -> torch.Tensor:
    """Reduce ``tensor`` over the group, in place (``op``: sum, max, min, mean); returns it."""
    if not active():
        return tensor
    target = device_for(tensor.device, group)
    work = tensor if target == tensor.device else tensor.to(target)
    dist.all_reduce(work, op=getattr(dist.ReduceOp, _OPS[op]), group=group)
    if op == "mean":
        work /= dist.get_world_size(group)
    if work is not tensor:
        tensor.copy_(work)
    return tensor


def all_gather_object(obj: Any, group: Any = None) -> list[Any]:
    """Every rank's ``obj``, in rank order. Use a gloo group: objects travel as CPU bytes."""
    if not active():
        return [obj]
    gathered: list[Any] = [None] * dist.get_world_size(group)
    dist.all_gather_object(gathered, obj, group=group)
    return gathered


def broadcast_object(obj: Any, src: int = 0, group: Any = None) -> Any:
    """Rank ``src``'s ``obj`` on every rank."""
    if not active():
        return obj
    box = [obj]
    dist.broadcast_object_list(box, src=src, group=group)
    return box[0]


def barrier(group: Any = None) -> None:
    if active():
        dist.barrier(group=group)


def new_gloo_group() -> Any:
    """A CPU group beside the default one, for work that runs while training communicates
    (checkpoint writes in a background thread): collectives on one group must not interleave
    across threads. None without a process group."""
    return dist.new_group(backend="gloo") if active() else None


def full_tensor(value: torch.Tensor) -> torch.Tensor:
    """A DTensor gathered whole on every rank (a plain tensor is returned as it is), through a
    backend its device fits (a CPU-offloaded shard on an NCCL mesh goes through the GPU)."""
    gather = getattr(value, "full_tensor", None)
    if gather is None:
        return value
    mesh = value.device_mesh  # type: ignore[attr-defined]  # a DTensor here (it has full_tensor)
    groups = [mesh.get_group(dim) for dim in range(mesh.ndim)]
    target = value.device
    for group in groups:
        target = device_for(target, group)
    if target != value.device:
        return value.to(target).full_tensor().to(value.device)  # type: ignore[attr-defined]  # a DTensor here
    return gather()
