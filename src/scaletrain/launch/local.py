"""Workers on this machine, started by torch.distributed elastic (what torchrun uses); with
``scale.nodes``, one such launcher per machine, meeting through the rendezvous (rendezvous.py).

On one machine every store listens on 127.0.0.1 alone. Workers are fresh interpreters running
``python -m scaletrain.launch.worker``, as torchrun starts a script. When a worker fails the
agent stops the others; we surface the root cause.
"""

from __future__ import annotations

import json
import logging
import os
import signal
import sys
from typing import Any

from scaletrain.errors import RunInterrupted
from scaletrain.launch.base import Launcher, checked_result, worker_error
from scaletrain.launch.rendezvous import Rendezvous
from scaletrain.launch.rendezvous import register as register_rendezvous
from scaletrain.launch.spec import RunSpec
from scaletrain.tracking.logs import route_loggers_to_file

__all__ = ["LocalLauncher"]

# torch's own loggers for the agent and multiprocessing: their lines go to the launcher log.
_TORCH_LOGGERS = ("torch.distributed.elastic", "torch.multiprocessing")


class LocalLauncher(Launcher):
    name = "local"

    def __init__(self, max_restarts: int = 0, grace_period_s: float = 60.0,
                 rendezvous: Rendezvous | None = None):
        self.max_restarts = max_restarts
        self.grace_period_s = grace_period_s
        self.rendezvous = rendezvous  # several nodes: opened by the caller; else one machine's

    def launch(self, spec: RunSpec, workers: int) -> dict[str, Any]:
        """Run ``workers`` workers on this machine (this node's share of the job)."""
        from torch.distributed.elastic.multiprocessing import DefaultLogsSpecs
        from torch.distributed.elastic.multiprocessing.api import SignalException
        from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
        from torch.distributed.launcher.api import LaunchConfig, elastic_launch

        rendezvous = self.rendezvous or Rendezvous.single_node(spec.run_id).open()
        register_rendezvous()
        config = LaunchConfig(
            nproc_per_node=workers,
            max_restarts=self.max_restarts,
            monitor_interval=0.1,
            start_method="spawn",
            **rendezvous.launch_options(),
            logs_specs=DefaultLogsSpecs(log_dir=str(spec.logs_dir / "elastic")),
            # The agent forwards these to the workers, which checkpoint and stop (preemption);
            # torchrun forwards no SIGUSR1 (pytorch #154849). LaunchConfig's field overrides
            # TORCHELASTIC_SIGNALS_TO_HANDLE, so it is set here.
            signals_to_handle="SIGTERM,SIGINT,SIGHUP,SIGQUIT,SIGUSR1",
            # How long the workers get to checkpoint before SIGKILL (torchrun: 30 s).
            shutdown_timeout=max(1, int(self.grace_period_s)),
        )
        spec_file = spec.write()
        spec.worker_result().unlink(missing_ok=True)
        restore = route_loggers_to_file(_TORCH_LOGGERS, spec.logs_dir / "launcher.jsonl", logging.INFO)
        # A fresh workers' store per attempt (rank 0 hosts it): with the agent's shared one, a
        # restarted gloo rank can connect to the previous attempt's dead peer (torch 2.13; seen
        # with plain torchrun too).
        worker_env = {"TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1", **rendezvous.worker_env()}
        saved = {name: os.environ.get(name) for name in worker_env}
        os.environ.update(worker_env)  # the agent starts the workers with this process's env
        try:
            elastic_launch(config, sys.executable)("-m", "scaletrain.launch.worker", str(spec_file))
        except ChildFailedError as exc:
            exits = {rank: _describe_exit(f.exitcode) for rank, f in exc.failures.items()}
            raise worker_error(spec, range(workers), exits) from None
        except SignalException as exc:  # the agent has stopped the workers (with the signal)
            result = _read_result(spec)
            if result is not None and result.get("preempted"):
                checked_result(spec, result)
            raise RunInterrupted(exc.sigval.name, int(exc.sigval)) from None
        finally:
            restore()
            for name, value in saved.items():
                if value is None:
                    os.environ.pop(name, None)
                else:
                    os.environ[name] = value
            if self.rendezvous is None:
                rendezvous.close()
        result = _read_result(spec)
        if result is None:
            raise worker_error(spec, range(workers), {0: "rank 0 left no result"})
        return checked_result(spec, result)


def _read_result(spec: RunSpec) -> dict[str, Any] | None:
    try:
        return json.loads(spec.worker_result().read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None


def _describe_exit(exitcode: int) -> str:
    if exitcode < 0:
        try:
            name = signal.Signals(-exitcode).name
        except ValueError:
            name = f"signal {-exitcode}"
        hint = " (out of memory?)" if name == "SIGKILL" else ""
        return f"the process was killed by {name}{hint}"
    return f"the process exited with code {exitcode}"
