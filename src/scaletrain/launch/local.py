"""N workers on this machine, started by torch.distributed elastic (what torchrun uses).

Rendezvous is c10d on a free loopback port chosen by the agent, so nothing listens beyond
127.0.0.1. Workers are fresh interpreters running ``python -m scaletrain.launch.worker``, as
torchrun starts a script. When a worker fails the agent stops the others; we surface the
root cause.
"""

from __future__ import annotations

import json
import logging
import signal
import sys
from pathlib import Path
from typing import Any

from scaletrain.errors import RunInterrupted
from scaletrain.launch.base import Launcher, worker_error
from scaletrain.launch.spec import RunSpec
from scaletrain.tracking.logs import JsonFormatter

__all__ = ["LocalLauncher"]

# torch's own loggers for the agent and multiprocessing: their lines go to the launcher log.
_TORCH_LOGGERS = ("torch.distributed.elastic", "torch.multiprocessing")


class LocalLauncher(Launcher):
    name = "local"

    def __init__(self, max_restarts: int = 0):
        self.max_restarts = max_restarts

    def launch(self, spec: RunSpec, workers: int) -> dict[str, Any]:
        from torch.distributed.elastic.multiprocessing import DefaultLogsSpecs
        from torch.distributed.elastic.multiprocessing.api import SignalException
        from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
        from torch.distributed.launcher.api import LaunchConfig, elastic_launch

        config = LaunchConfig(
            min_nodes=1,
            max_nodes=1,
            nproc_per_node=workers,
            run_id=spec.run_id,
            rdzv_backend="c10d",
            rdzv_endpoint="127.0.0.1:0",
            rdzv_configs={"timeout": 120},
            max_restarts=self.max_restarts,
            monitor_interval=0.1,
            start_method="spawn",
            local_addr="127.0.0.1",
            logs_specs=DefaultLogsSpecs(log_dir=str(spec.logs_dir / "elastic")),
        )
        spec_file = spec.write()
        restore = _route_torch_logs(spec.logs_dir / "launcher.jsonl")
        try:
            elastic_launch(config, sys.executable)("-m", "scaletrain.launch.worker", str(spec_file))
        except ChildFailedError as exc:
            exits = {rank: _describe_exit(f.exitcode) for rank, f in exc.failures.items()}
            raise worker_error(spec, range(workers), exits) from None
        except SignalException as exc:  # the agent has already stopped the workers
            raise RunInterrupted(exc.sigval.name, int(exc.sigval)) from None
        finally:
            restore()
        return json.loads(spec.worker_result().read_text(encoding="utf-8"))


def _describe_exit(exitcode: int) -> str:
    if exitcode < 0:
        try:
            name = signal.Signals(-exitcode).name
        except ValueError:
            name = f"signal {-exitcode}"
        hint = " (out of memory?)" if name == "SIGKILL" else ""
        return f"the process was killed by {name}{hint}"
    return f"the process exited with code {exitcode}"


def _route_torch_logs(path: Path):
    path.parent.mkdir(parents=True, exist_ok=True)
    handler = logging.FileHandler(path, encoding="utf-8")
    handler.setFormatter(JsonFormatter())
    saved = []
    for name in _TORCH_LOGGERS:
        logger = logging.getLogger(name)
        saved.append((logger, logger.propagate, logger.level))
        logger.addHandler(handler)
        logger.propagate = False
        logger.setLevel(logging.INFO)

    def restore() -> None:
        for logger, propagate, level in saved:
            logger.removeHandler(handler)
            logger.propagate = propagate
            logger.setLevel(level)
        handler.close()

    return restore
