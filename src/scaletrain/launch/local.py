"""Workers on this machine, started by torch.distributed elastic (what torchrun uses); with
``scale.nodes``, one such launcher per machine, meeting through the rendezvous (rendezvous.py).

On one machine every store listens on 127.0.0.1 alone. Workers run ``python -m
scaletrain.launch.worker``, forked from a process that has imported torch once
(warm_workers.py), or as fresh interpreters, as torchrun starts a script. When a worker fails the
agent stops the others; we surface the root cause.
"""

from __future__ import annotations

import json
import logging
import os
import signal
import sys
import threading
from pathlib import Path
from typing import Any

import psutil

from scaletrain.config.schema import JobConfig
from scaletrain.errors import RunInterrupted, StopTimedOut, WorkerFailedError
from scaletrain.launch.base import Launcher, checked_result
from scaletrain.launch.rendezvous import Rendezvous
from scaletrain.launch.rendezvous import register as register_rendezvous
from scaletrain.launch.warm_workers import WarmWorkers
from scaletrain.launch.warm_workers import enabled as warm_workers_enabled
from scaletrain.observe.telemetry import current as telemetry
from scaletrain.recovery.root_cause import failure_files, holds_hang, worker_error
from scaletrain.rundir import RESTART_COUNT_ENV, RunSpec
from scaletrain.rundir.atomic import write_text_atomic
from scaletrain.tracking.logs import LogContext, route_loggers_to_file
from scaletrain.tracking.redact import Redactor

__all__ = ["LocalLauncher", "launch_config"]

log = logging.getLogger(__name__)
_restart_log = logging.getLogger("scaletrain_launcher.restart")  # launcher.jsonl
WORKER, SCRIPT_WORKER = "scaletrain.launch.worker", "scaletrain.launch.script_worker"  # what each worker runs
_DIED_SILENTLY = "the process ended without an error (killed: SIGKILL, or out of memory)"

# torch's own loggers for the agent and multiprocessing: their lines go to the launcher log.
_TORCH_LOGGERS = ("torch.distributed.elastic", "torch.multiprocessing")


class LocalLauncher(Launcher):
    name = "local"

    def __init__(self, max_restarts: int = 0, grace_period_s: float = 60.0,
                 rendezvous: Rendezvous | None = None, job_workers: int | None = None,
                 worker_module: str = WORKER):
        self.max_restarts = max_restarts
        # What each worker process runs: the worker runtime, or for a script the script
        # worker that runs it as its child (launch/script_worker.py).
        self.worker_module = worker_module
        self.grace_period_s = grace_period_s
        self.rendezvous = rendezvous  # several nodes: opened by the caller; else one machine's
        self.job_workers = job_workers  # on all nodes together
        # The caller's warm workers (started as the job was read; it closes them), else ours
        self.warm_workers: WarmWorkers | None = None

    @classmethod
    def from_job(cls, job: JobConfig, rendezvous: Rendezvous | None = None) -> LocalLauncher:
        module = SCRIPT_WORKER if job.script is not None else WORKER
        return cls(job.recovery.max_restarts, job.recovery.grace_period_s, rendezvous,
                   job_workers=job.scale.workers, worker_module=module)

    def launch(self, spec: RunSpec, workers: int) -> dict[str, Any]:
        """Run ``workers`` workers on this machine (this node's share of the job)."""
        from torch.distributed.elastic.multiprocessing.api import SignalException
        from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
        from torch.distributed.launcher.api import LaunchConfig, elastic_launch

        rendezvous = self.rendezvous or Rendezvous.single_node(spec.run_id).open()
        register_rendezvous()
        script_store = self.worker_module == SCRIPT_WORKER and rendezvous.max_nodes == 1
        logs = _attempt_logs(spec, host_store_for_workers=script_store)
        config, config_env = launch_config(
            LaunchConfig,
            nproc_per_node=workers,
            max_restarts=self.max_restarts,
            monitor_interval=0.1,
            start_method="spawn",
            **rendezvous.launch_options(),
            logs_specs=logs,
            # The agent aborts on these. SIGTERM and SIGUSR1 are ours (_StopForwarder): the
            # workers checkpoint and stop, and the agent sees them finish, as on every node of
            # the job. (torchrun forwards no SIGUSR1, pytorch #154849.)
            signals_to_handle="SIGINT,SIGHUP,SIGQUIT",
            shutdown_timeout=max(1, int(self.grace_period_s)),
        )
        spec_file = spec.write()
        spec.worker_result().unlink(missing_ok=True)
        restore = route_loggers_to_file(_TORCH_LOGGERS, spec.launcher_log, logging.INFO,
                                        redactor=Redactor.for_config(spec.job),
                                        context=LogContext.for_spec(spec, rank=None))
        # A fresh workers' store per attempt (rank 0 hosts it): with the agent's shared one, a
        # restarted gloo rank can connect to the previous attempt's dead peer (torch 2.13; seen
        # with plain torchrun too). A script on one machine gets a fresh store per attempt that
        # this launcher hosts (AttemptLogs): one its rank 0 hosted would go away when rank 0
        # exits, under ranks still in destroy_process_group (they abort, SIGABRT).
        worker_env = {"TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1", **rendezvous.worker_env(), **config_env}
        restore_env = _set_environ(worker_env)  # the agent starts the workers with this env
        # Workers forked from one process that imported torch once (warm_workers.py): it
        # imports while the agent sets up, and every restart forks fresh workers from it.
        own_warm = self.warm_workers is None and self.worker_module == WORKER and warm_workers_enabled()
        warm = WarmWorkers() if own_warm else self.warm_workers if self.worker_module == WORKER else None
        command = (warm.command(self.worker_module, str(spec_file)) if warm is not None
                   else ("-m", self.worker_module, str(spec_file)))
        forwarder = _StopForwarder(self.grace_period_s).install()
        try:
            elastic_launch(config, sys.executable)(*command)
        except ChildFailedError as exc:
            if forwarder.killed is not None:  # the grace period after a stop ran out
                raise StopTimedOut(forwarder.killed, self.grace_period_s, spec.run_dir) from None
            exits = {rank: _describe_exit(f.exitcode) for rank, f in exc.failures.items()}
            ranks = range(workers)
            if rendezvous.max_nodes > 1:  # the driver hears from the other nodes' failed ranks
                ranks = range(self.job_workers or workers)
                if rendezvous.is_driver:
                    exits.update(_gather_failures(spec, rendezvous, ranks, exits, self.max_restarts))
                else:
                    rendezvous.publish_failures(
                        {rank: {"exit": text, "attempt": self.max_restarts} for rank, text in exits.items()})
            raise worker_error(spec, ranks, exits, logs.earlier) from None
        except SignalException as exc:  # the agent has stopped the workers (with the signal)
            result = _read_result(spec)
            if result is not None and result.get("preempted"):
                checked_result(spec, result)
            raise RunInterrupted(exc.sigval.name, int(exc.sigval)) from None
        finally:
            forwarder.restore()
            if own_warm and warm is not None:
                warm.close()
            restore()
            restore_env()
            if self.rendezvous is None:
                rendezvous.close()
        result = _read_result(spec)
        if result is None:
            raise worker_error(spec, range(workers), {0: "rank 0 left no result"}, logs.earlier)
        return checked_result(spec, result)


def _attempt_logs(spec: RunSpec, host_store_for_workers: bool = False) -> Any:
    """torch's log folders per attempt, noting at every start of the workers (this launch, each
    restart) the error and stack files already in the logs: an earlier attempt's (of this launch
    or of one before a resume), never blamed for this one's failure."""
    from torch.distributed.elastic.multiprocessing import DefaultLogsSpecs

    class AttemptLogs(DefaultLogsSpecs):
        earlier: dict[str, Any] = {}
        starts = 0

        stores: list[Any] = []  # the workers' stores, one per attempt (host_store_for_workers)

        def reify(self, envs: dict[int, dict[str, str]]) -> Any:
            if host_store_for_workers:
                from scaletrain.distributed.stores import host_store

                store = host_store("127.0.0.1", 0, timeout_s=600)
                self.stores.append(store)
                for env in envs.values():
                    env.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(store.port),
                               TORCHELASTIC_USE_AGENT_STORE="True")
            # The workers learn which start this is from us: torch elastic's restart count is
            # this agent's failures only, so a node whose workers restart because another node's
            # failed (a membership change) would count none (and redo attempt-0 faults).
            for env in envs.values():
                env[RESTART_COUNT_ENV] = str(self.starts)
            now = failure_files(spec)
            if self.starts:  # a restart: counted for the metrics endpoint, and said where the user looks
                figures = telemetry()
                figures.add("restarts_total")
                figures.work("attempt", 1, errors=1)
                figures.flush(force=True)
                # An error, or a hang's stacks (a watchdog's empty stacks file is no failure: a
                # rank killed outright leaves its own behind).
                failed = sorted({int(path.rsplit("worker-", 1)[1].split(".")[0]) for path, state in now.items()
                                 if self.earlier.get(path) != state
                                 and (path.endswith(".error.json") or holds_hang(Path(path), self.earlier))})
                if failed:
                    # A rank that left no file died outright (SIGKILL, the OOM killer): when the
                    # others only lost their peer, it is the cause.
                    ranks = {int(env["RANK"]) for env in envs.values() if "RANK" in env}
                    silent = {rank: _DIED_SILENTLY for rank in ranks - set(failed)}
                    _restart_log.warning("restarting the workers after %s",
                                         worker_error(spec, failed, silent, self.earlier),
                                         extra={"code": WorkerFailedError.code})
            self.starts, self.earlier = self.starts + 1, now
            return super().reify(envs)

    return AttemptLogs(log_dir=str(spec.logs_dir / "elastic"))


def launch_config(config_class: Any, **options: Any) -> tuple[Any, dict[str, str]]:
    """torch's LaunchConfig from the options this torch has, and the environment that stands in
    for the ones it lacks. ``signals_to_handle`` is newer than torch 2.6 (older agents read
    TORCHELASTIC_SIGNALS_TO_HANDLE); ``shutdown_timeout`` came in torch 2.12 (pytorch #172596):
    before it the agent gives workers torch's 30 s between SIGTERM and SIGKILL when it stops
    them itself (Ctrl-C, SIGHUP), whatever recovery.grace_period_s says. A torch 2.11 GPU
    machine refused the field outright (bench/results/gpu.json of 2026-12-04)."""
    import dataclasses

    known = {f.name for f in dataclasses.fields(config_class)}
    env: dict[str, str] = {}
    if "signals_to_handle" not in known and "signals_to_handle" in options:
        env["TORCHELASTIC_SIGNALS_TO_HANDLE"] = options["signals_to_handle"]
    dropped = sorted(set(options) - known)
    if dropped:
        log.debug("this torch's LaunchConfig lacks %s", ", ".join(dropped))
    return config_class(**{k: v for k, v in options.items() if k in known}), env


def _set_environ(values: dict[str, str]) -> Any:
    """Set ``values`` in this process's environment; returns the function that puts it back."""
    saved = {name: os.environ.get(name) for name in values}
    os.environ.update(values)

    def restore() -> None:
        for name, value in saved.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value

    return restore


class _StopForwarder:
    """SIGTERM/SIGUSR1 to the launcher -> the same signal to this node's workers, which agree
    with every rank on a step, checkpoint and exit; those still running after the grace period
    are killed. Before any worker runs, the launch is aborted as on SIGINT."""

    _SIGNALS = (signal.SIGTERM, signal.SIGUSR1)

    def __init__(self, grace_period_s: float):
        self.grace_period_s = grace_period_s
        self._previous: dict[int, Any] = {}
        self._signalled: set[int] = set()
        self._timers: list[threading.Timer] = []
        self.killed: str | None = None  # the stop signal's name, once its grace period killed a worker

    def install(self) -> _StopForwarder:
        if threading.current_thread() is threading.main_thread():
            self._previous = {sig: signal.signal(sig, self._handle) for sig in self._SIGNALS}
        return self

    def restore(self) -> None:
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)
        for timer in self._timers:
            timer.cancel()

    def _handle(self, signum: int, frame: object) -> None:
        from torch.distributed.elastic.multiprocessing.api import SignalException

        workers = [p for p in _worker_processes() if p.pid not in self._signalled]
        if not workers and not self._signalled:
            raise SignalException(f"Process {os.getpid()} got signal: {signum}", signal.Signals(signum))
        for process in workers:
            try:
                process.send_signal(signum)
                self._signalled.add(process.pid)
            except psutil.NoSuchProcess:
                continue
        timer = threading.Timer(self.grace_period_s, self._kill, args=(workers, signal.Signals(signum).name))
        timer.daemon = True
        timer.start()
        self._timers.append(timer)


    def _kill(self, processes: list[psutil.Process], signal_name: str) -> None:
        """The grace period is over: workers still running are killed (torchrun does the same)."""
        for process in processes:
            try:
                if process.is_running() and process.status() != psutil.STATUS_ZOMBIE:
                    process.kill()
                    self.killed = signal_name
            except psutil.Error:
                continue


def _worker_processes() -> list[psutil.Process]:
    found = []
    for child in psutil.Process().children():
        try:
            if "scaletrain.launch.worker" in child.cmdline():
                found.append(child)
        except psutil.Error:
            continue
    return found


def _gather_failures(spec: RunSpec, rendezvous: Rendezvous, ranks: range,
                     local: dict[int, str], attempt: int) -> dict[int, str]:
    """Driver: failed ranks of other nodes, as they reported to its store in this last attempt
    (restarts exhausted): their error files and last log lines are written into this run
    directory (where worker_error looks), their exits returned."""
    exits: dict[int, str] = {}
    remote = [rank for rank in ranks if rank not in local and not spec.worker_log(rank).exists()]
    for rank, record in rendezvous.read_failures(remote, attempt).items():
        if record.get("error"):
            write_text_atomic(spec.worker_error(rank), json.dumps(record["error"]))
        if record.get("log_tail"):
            write_text_atomic(spec.worker_log(rank), "\n".join(record["log_tail"]) + "\n")
        if record.get("exit"):
            exits[rank] = record["exit"]
    return exits


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
