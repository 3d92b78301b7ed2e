"""Engines that start workers. The worker entry point is the same for all of them."""

from __future__ import annotations

from typing import Any

from scaletrain.config.schema import JobConfig
from scaletrain.launch.base import Launcher

__all__ = ["Launcher", "launcher_for"]


def launcher_for(job: JobConfig, rendezvous: Any = None) -> Launcher:
    """One worker runs in-process, unless it must survive its own death (restarts); more go to
    the job's engine. The ray engine is used whenever the job asks for it. ``rendezvous``: a job
    on several nodes, this node's side of it (launch/rendezvous.py)."""
    if job.scale.engine == "ray":
        from scaletrain.launch.ray_engine import RayLauncher

        return RayLauncher(
            address=job.scale.address,
            max_restarts=job.recovery.max_restarts,
            cpus_per_worker=job.scale.cpus_per_worker,
            gpus_per_worker=job.scale.gpus_per_worker,
            hang_timeout_s=job.recovery.hang_timeout_s,
            backend=job.scale.backend,
        )
    if job.scale.workers == 1 and job.recovery.max_restarts == 0 and rendezvous is None:
        from scaletrain.launch.inprocess import InProcessLauncher

        return InProcessLauncher()
    from scaletrain.launch.local import LocalLauncher

    return LocalLauncher(job.recovery.max_restarts, job.recovery.grace_period_s, rendezvous,
                         job_workers=job.scale.workers)
