"""A launcher starts the workers of one attempt and returns rank 0's result."""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import TYPE_CHECKING, Any

from scaletrain.errors import RunPreempted
from scaletrain.rundir import RunSpec

if TYPE_CHECKING:
    from scaletrain.config.schema import JobConfig

__all__ = ["Launcher", "checked_result"]


class Launcher(ABC):
    name: str = ""  # its key in launch.LAUNCHERS

    @classmethod
    def from_job(cls, job: JobConfig, rendezvous: Any = None) -> Launcher:
        """The launcher for this job's settings (``rendezvous``: this node's side of a job on
        several nodes)."""
        return cls()

    @abstractmethod
    def launch(self, spec: RunSpec, workers: int) -> dict[str, Any]:
        """Run ``workers`` copies of the worker entry point; raise WorkerFailedError on failure."""


def checked_result(spec: RunSpec, result: dict[str, Any]) -> dict[str, Any]:
    """Rank 0's result, or RunPreempted when the workers stopped early on a signal."""
    if result.get("preempted"):
        raise RunPreempted(
            result["preempted"], result["steps"], result.get("last_checkpoint_step"), spec.run_dir
        )
    return result
