"""Engines that start workers, by name. The worker entry point (worker.py) is the same for all
of them; adding an engine means a Launcher module and a line in LAUNCHERS."""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

from scaletrain.launch.base import Launcher

if TYPE_CHECKING:  # light to import: a warm worker's client (warm_client.py) lives in this package
    from scaletrain.config.schema import JobConfig

__all__ = ["Launcher", "LAUNCHERS", "launcher_name", "launcher_for"]

# name -> "module:class", imported only when chosen (Ray only for the ray engine).
LAUNCHERS: dict[str, str] = {
    "in-process": "scaletrain.launch.inprocess:InProcessLauncher",
    "local": "scaletrain.launch.local:LocalLauncher",
    "ray": "scaletrain.launch.ray:RayLauncher",
}


def launcher_name(job: JobConfig, rendezvous: Any = None) -> str:
    """The job's engine; one worker runs in-process, unless it must survive its own death
    (restarts), is one node of several (``rendezvous``) or is a script (its own process)."""
    if job.scale.engine == "ray":
        return "ray"
    if job.scale.workers == 1 and job.recovery.max_restarts == 0 and rendezvous is None and job.script is None:
        return "in-process"
    return "local"


def launcher_for(job: JobConfig, rendezvous: Any = None) -> Launcher:
    """``rendezvous``: a job on several nodes, this node's side of it (launch/rendezvous.py)."""
    module, _, name = LAUNCHERS[launcher_name(job, rendezvous)].partition(":")
    launcher: type[Launcher] = getattr(importlib.import_module(module), name)
    return launcher.from_job(job, rendezvous)
