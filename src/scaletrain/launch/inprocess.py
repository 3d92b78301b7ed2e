"""One worker, in the calling process: no process group, no start-up cost."""

from __future__ import annotations

from typing import Any

from scaletrain.distributed.env import DistEnv
from scaletrain.errors import ScaletrainError
from scaletrain.launch.base import Launcher, checked_result
from scaletrain.launch.worker import run_worker
from scaletrain.recovery.root_cause import worker_error
from scaletrain.rundir import RunSpec

__all__ = ["InProcessLauncher"]


class InProcessLauncher(Launcher):
    name = "in-process"

    def launch(self, spec: RunSpec, workers: int) -> dict[str, Any]:
        if workers != 1:  # launcher_name picks this launcher only for one worker
            raise ValueError(f"the in-process launcher runs exactly one worker, not {workers}")
        try:
            # An explicit env: a stray RANK/WORLD_SIZE in the shell must not change the job.
            result = run_worker(spec, DistEnv())
        except ScaletrainError:
            raise
        except Exception as exc:
            raise worker_error(spec, [0], {0: f"{type(exc).__name__}: {exc}"}) from exc
        return checked_result(spec, result)
