"""Process-group lifetime and the few collectives the engine needs."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from datetime import timedelta

import torch
import torch.distributed as dist

from scaletrain.distributed.device import Placement
from scaletrain.distributed.env import DistEnv

__all__ = ["process_group", "all_reduce_sum", "all_reduce_mean"]


@contextlib.contextmanager
def process_group(env: DistEnv, placement: Placement, timeout_s: float = 600) -> Iterator[None]:
    """Join the job's process group for the duration of the block (no-op for one worker).

    Reads MASTER_ADDR/MASTER_PORT (or the agent's store) through ``env://``, as torchrun and
    Ray Train set them. On a clean exit all ranks meet at a barrier before the group is
    destroyed, so no rank tears down a connection another rank is still using. A group the
    engine created (Ray Train does) is used as it is and left for the engine to destroy.
    """
    if not env.is_distributed:
        yield
        return
    if _is_distributed():
        yield
        dist.barrier()
        return
    kwargs = {}
    if placement.device.type == "cuda":
        kwargs["device_id"] = placement.device
    dist.init_process_group(
        backend=placement.backend,
        init_method="env://",
        rank=env.rank,
        world_size=env.world_size,
        timeout=timedelta(seconds=timeout_s),
        **kwargs,
    )
    ok = False
    try:
        yield
        ok = True
    finally:
        if ok:
            dist.barrier()
        dist.destroy_process_group()


def _is_distributed() -> bool:
    return dist.is_available() and dist.is_initialized()


def all_reduce_sum(tensor: torch.Tensor) -> torch.Tensor:
    if _is_distributed():
        dist.all_reduce(tensor, op=dist.ReduceOp.SUM)
    return tensor


def all_reduce_mean(tensor: torch.Tensor) -> torch.Tensor:
    if _is_distributed():
        dist.all_reduce(tensor, op=dist.ReduceOp.SUM)
        tensor /= dist.get_world_size()
    return tensor
