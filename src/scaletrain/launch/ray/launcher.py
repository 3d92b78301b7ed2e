"""The Ray engine's launcher: a TorchTrainer (Ray Train v2) over the job's workers, each running
the worker entry point (worker_fn.py); the driver's side of the mailbox and console relay; Ray
Train's failure turned into our one-line root cause."""

from __future__ import annotations

import logging
import math
import os
import signal
import threading
from pathlib import Path
from typing import Any

from scaletrain.config.schema import JobConfig
from scaletrain.errors import ConfigError, RunInterrupted, ScaletrainError
from scaletrain.launch.base import Launcher, checked_result
from scaletrain.launch.ray.cluster import import_ray, ray_session
from scaletrain.launch.ray.console import ConsoleRelay
from scaletrain.launch.ray.join import CONNECT_TIMEOUT_S
from scaletrain.launch.ray.mailbox import mailbox_actor
from scaletrain.launch.ray.worker_fn import train_loop
from scaletrain.recovery.root_cause import worker_error
from scaletrain.recovery.watchdog import collective_timeout_s
from scaletrain.rundir import RunSpec
from scaletrain.tracking.logs import LogContext
from scaletrain.tracking.redact import Redactor

__all__ = ["RayLauncher"]

_log = logging.getLogger("scaletrain_launcher.ray")  # launcher.jsonl


class RayLauncher(Launcher):
    name = "ray"

    def __init__(
        self,
        address: str | None,
        max_restarts: int,
        cpus_per_worker: float,
        gpus_per_worker: float | None,
        hang_timeout_s: float,
        backend: str = "auto",
    ):
        self.address = address or os.environ.get("RAY_ADDRESS") or None
        self.max_restarts = max_restarts
        self.cpus_per_worker = cpus_per_worker
        self.gpus_per_worker = gpus_per_worker
        self.hang_timeout_s = hang_timeout_s
        self.backend = backend
        # Before any run directory exists: a missing extra is bad input.
        self.ray = import_ray(local_instance=self.address is None)

    @classmethod
    def from_job(cls, job: JobConfig, rendezvous: Any = None) -> RayLauncher:
        return cls(
            address=job.scale.address,
            max_restarts=job.recovery.max_restarts,
            cpus_per_worker=job.scale.cpus_per_worker,
            gpus_per_worker=job.scale.gpus_per_worker,
            hang_timeout_s=job.recovery.hang_timeout_s,
            backend=job.scale.backend,
        )

    def launch(self, spec: RunSpec, workers: int) -> dict[str, Any]:
        checkpoint_dir = (spec.job.get("checkpoint") or {}).get("dir") or ""
        timeout = (spec.job.get("scale") or {}).get("connect_timeout_s") or CONNECT_TIMEOUT_S
        with ray_session(self.ray, self.address, spec.logs_dir, connect_timeout_s=timeout,
                         redactor=Redactor.for_config(spec.job), context=LogContext.for_spec(spec, rank=None)):
            machines = len({n.get("NodeManagerAddress") for n in self.ray.nodes() if n.get("Alive")})
            if spec.checkpoints and "://" not in spec.checkpoints and machines > 1:
                if not checkpoint_dir:
                    raise ConfigError(
                        f"the Ray cluster spans {machines} machines and checkpoint.dir is not set: "
                        f"checkpoints would go to {spec.checkpoints}, on this machine only; set "
                        "checkpoint.dir to s3://... or a path every node mounts"
                    )
                _log.warning(
                    "checkpoints go to a path (%s) while the workers may run on other machines: "
                    "every node must mount it, or set checkpoint.dir to s3://...", spec.checkpoints,
                )
            return self._fit(self.ray, spec, workers)

    def _fit(self, ray: Any, spec: RunSpec, workers: int) -> dict[str, Any]:
        from ray.train import FailureConfig, RunConfig, ScalingConfig
        from ray.train.torch import TorchConfig, TorchTrainer

        gpus = self.gpus_per_worker
        if gpus is None:
            gpus = 1.0 if ray.cluster_resources().get("GPU", 0) >= 1 else 0.0
        resources = {"CPU": self.cpus_per_worker}
        if gpus:
            resources["GPU"] = gpus
            if gpus < 1 and self.backend != "gloo":  # NCCL refuses two ranks on one GPU
                raise ConfigError(
                    f"scale.gpus_per_worker {gpus:g} puts several workers on one GPU, which NCCL "
                    "refuses; use whole GPUs, or scale.backend: gloo to share them (slower)"
                )
        # On GPUs the group is NCCL for CUDA tensors and gloo for CPU ones (control messages).
        backend = "cpu:gloo,cuda:nccl" if gpus and self.backend != "gloo" else "gloo"
        mailbox = mailbox_actor(ray).options(num_cpus=0).remote()
        trainer = TorchTrainer(
            train_loop,
            train_loop_config={"spec": spec.__dict__, "mailbox": mailbox,
                               "driver_node": ray.get_runtime_context().get_node_id()},
            torch_config=TorchConfig(backend=backend, timeout_s=math.ceil(collective_timeout_s(self.hang_timeout_s))),
            scaling_config=ScalingConfig(
                num_workers=workers, use_gpu=bool(gpus), resources_per_worker=resources
            ),
            run_config=RunConfig(  # type: ignore[call-arg]  # Ray Train v2's RunConfig has it
                name=spec.run_id,
                storage_path=str(Path(spec.run_dir) / "ray"),
                failure_config=FailureConfig(max_failures=self.max_restarts),
                # Ray starts workers from the cluster's environment, not ours: the fault
                # injection testing facility (SCALETRAIN_FAULT) and the like travel along.
                worker_runtime_env={"env_vars": _forwarded_env()},
            ),
        )
        stop = _StopForwarder(mailbox).install()
        console = ConsoleRelay(mailbox, spec).start()
        try:
            trainer.fit()
        except KeyboardInterrupt:
            raise RunInterrupted("SIGINT", int(signal.SIGINT)) from None
        except Exception as exc:  # Ray Train's TrainingFailedError (WorkerGroupError, ControllerError)
            result = ray.get(mailbox.result.remote())
            if result is not None and result.get("preempted"):
                checked_result(spec, result)
            raise _failure(spec, workers, exc) from None
        finally:
            console.close()
            stop.restore()
        result = ray.get(mailbox.result.remote())
        if result is None:
            raise worker_error(spec, range(workers), {0: "rank 0 left no result"})
        return checked_result(spec, result)  # RunPreempted when a stop was relayed


def _forwarded_env() -> dict[str, str]:
    return {name: value for name, value in os.environ.items() if name.startswith("SCALETRAIN_")}


def _failure(spec: RunSpec, workers: int, exc: Exception) -> ScaletrainError:
    """Ray Train's failure as our one-line root cause (the workers' error files first)."""
    failures = getattr(exc, "worker_failures", None) or {}
    fallback: dict[int, str] = {}
    for rank, error in failures.items():
        fallback[int(rank)] = _describe(error)
    if not failures:
        fallback[0] = _describe(exc)
    return worker_error(spec, range(workers), fallback)


def _describe(error: BaseException) -> str:
    name = type(error).__name__
    if "ActorDied" in name or "died" in str(error).lower() and "actor" in str(error).lower():
        return "the process died (killed by a signal, or out of memory?)"
    cause = getattr(error, "cause", None) or error.__cause__
    if cause is not None and cause is not error:
        return _describe(cause)
    text = str(error).strip().splitlines()
    return f"{name}: {text[-1][:300]}" if text else name


class _StopForwarder:
    """SIGTERM/SIGUSR1 to the launcher -> the workers stop at an agreed step and checkpoint."""

    def __init__(self, mailbox: Any):
        self.mailbox = mailbox
        self.signal_name: str | None = None
        self._previous: dict[int, Any] = {}

    def install(self) -> _StopForwarder:
        if threading.current_thread() is threading.main_thread():
            for sig in (signal.SIGTERM, signal.SIGUSR1):
                self._previous[sig] = signal.signal(sig, self._handle)
        return self

    def _handle(self, signum: int, frame: object) -> None:
        self.signal_name = signal.Signals(signum).name
        self.mailbox.request_stop.remote(self.signal_name)

    def restore(self) -> None:
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)
