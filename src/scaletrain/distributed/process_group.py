"""Process-group lifetime: created for the block, barrier, destroyed."""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator
from datetime import timedelta
from typing import Any

import torch.distributed as dist

from scaletrain.distributed import collectives
from scaletrain.distributed.device import Placement
from scaletrain.distributed.env import DistEnv
from scaletrain.distributed.stores import connect_store, host_store

__all__ = ["process_group"]

_STORE_TIMEOUT_S = 600.0  # meeting the peers: workers start at their own pace


@contextlib.contextmanager
def process_group(
    env: DistEnv, placement: Placement, collective_timeout_s: float, needed: bool = False
) -> Iterator[bool]:
    """Join the job's process group for the duration of the block; yields whether one exists.

    ``collective_timeout_s``: the caller's backstop behind its hang watchdog; meeting the peers
    at the store waits at least _STORE_TIMEOUT_S.

    ``needed``: create one for a single worker too (ddp, fsdp and hsdp wrap the model in a
    group, also of one rank); it lives in this process (a HashStore: nothing listens).
    Several workers meet at MASTER_ADDR/MASTER_PORT, as torchrun and Ray Train set them
    (_job_store). On a clean exit all ranks meet at a barrier before the
    group is destroyed, so no rank tears down a connection another rank is still using. A
    group the engine created (Ray Train does) is used as it is and left for the engine.
    """
    if not (env.is_distributed or needed):
        yield False
        return
    if collectives.active():
        yield True
        collectives.barrier()
        return
    kwargs: dict[str, Any] = {}
    if placement.device.type == "cuda":
        kwargs["device_id"] = placement.device
    if env.is_distributed:
        kwargs.update(store=_job_store(env, max(_STORE_TIMEOUT_S, collective_timeout_s)), rank=env.rank, world_size=env.world_size)
    else:
        kwargs.update(store=dist.HashStore(), rank=0, world_size=1)
    dist.init_process_group(
        backend=placement.group_backend, timeout=timedelta(seconds=collective_timeout_s), **kwargs
    )
    ok = False
    try:
        yield True
        ok = True
    finally:
        if ok:
            collectives.barrier()
        dist.destroy_process_group()


def _job_store(env: DistEnv, timeout_s: float):
    """The workers' store at MASTER_ADDR:MASTER_PORT: rank 0 hosts it, listening on that address
    alone (127.0.0.1 for a job on one machine), the others connect. Where the agent shares its
    own store with the workers, everyone connects to it."""
    if env.master_port is None:
        raise RuntimeError("MASTER_PORT is not set: workers are started by an engine that sets it")
    if env.rank == 0 and os.environ.get("TORCHELASTIC_USE_AGENT_STORE") != "True":
        return host_store(env.master_addr, env.master_port, timeout_s, env.world_size)
    return connect_store(env.master_addr, env.master_port, timeout_s, env.world_size)
