"""Workers on a Ray cluster, started by Ray Train's TorchTrainer (Train v2).

Ray Train places the workers (``ScalingConfig``), sets the env contract (RANK, WORLD_SIZE,
LOCAL_RANK, MASTER_ADDR/PORT), creates the process group and restarts the whole worker group
after a failure (``FailureConfig``); each worker runs the same ``run_worker`` as the local
engine, which resumes from the newest verified checkpoint. Ray is optional and imported here
only. A small actor (the mailbox) carries what Ray Train does not: the attempt number, rank
0's result, and a stop request from the launcher (Ctrl-C, SIGTERM).

Safe by default: a local instance starts no dashboard (the one HTTP service that runs code
for whoever reaches it) and uses token authentication where the installed Ray has it, so its
RPC ports (Ray listens on every interface and has no option to restrict that) answer only
holders of the token. Ray's logs stay out of the console (``logs/ray-driver.jsonl``, and
``logs/ray`` links the session's logs).
"""

from __future__ import annotations

import contextlib
import logging
import os
import signal
import sys
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from scaletrain.errors import ConfigError, MissingExtraError, RunInterrupted, ScaletrainError
from scaletrain.launch.base import Launcher, checked_result, worker_error
from scaletrain.launch.spec import RunSpec

__all__ = ["RayLauncher", "import_ray", "ray_session"]

RAY_EXTRA_HINT = "pip install 'scaletrain[ray]'"
_log = logging.getLogger("scaletrain_launcher.ray")  # launcher.jsonl
_RAY_LOGGERS = ("ray", "ray.train", "ray.data", "ray.tune")


# Ray's switch for clusters on macOS/Windows; "0" keeps a local instance on 127.0.0.1.
LOCAL_ONLY_ENV = "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"


def import_ray(local_instance: bool = False):
    """Ray and Ray Train, or one line that names the extra to install.

    A local instance is made safe before Ray reads its settings (at import):
    - loopback only: Ray's local-only mode (its default on macOS and Windows) makes the node
      address 127.0.0.1, and every Ray server then listens on 127.0.0.1 alone; on Linux Ray
      would advertise the machine's address and listen on all interfaces;
    - token authentication: Ray 2.59+ turns it on for local instances by itself, 2.52-2.58
      need RAY_AUTH_MODE=token; either way Ray generates the token.
    Settings the user made stand.
    """
    os.environ.setdefault("RAY_TRAIN_V2_ENABLED", "1")
    if local_instance and "ray" not in sys.modules:
        os.environ.setdefault(LOCAL_ONLY_ENV, "0")
        os.environ.setdefault("RAY_AUTH_MODE", "token")
    try:
        import ray
        import ray.train  # noqa: F401
        import ray.train.torch  # noqa: F401
    except ImportError:
        raise MissingExtraError(
            f"the ray engine needs Ray Train, which is not installed: {RAY_EXTRA_HINT}"
        ) from None
    return ray


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

    def launch(self, spec: RunSpec, workers: int) -> dict[str, Any]:
        checkpoint_dir = (spec.job.get("checkpoint") or {}).get("dir") or ""
        if self.address and "://" not in checkpoint_dir:
            _log.warning(
                "checkpoints go to a local path (%s) while the workers may run on other machines: "
                "every node must see it (a shared filesystem), or set checkpoint.dir to s3://...",
                checkpoint_dir or str(Path(spec.run_dir) / "checkpoints"),
            )
        with ray_session(self.ray, self.address, spec.logs_dir):
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
        mailbox = _mailbox_class(ray).options(num_cpus=0).remote()
        trainer = TorchTrainer(
            _train_loop,
            train_loop_config={"spec": spec.__dict__, "mailbox": mailbox},
            torch_config=TorchConfig(backend=backend, timeout_s=int(self.hang_timeout_s)),
            scaling_config=ScalingConfig(
                num_workers=workers, use_gpu=bool(gpus), resources_per_worker=resources
            ),
            run_config=RunConfig(
                name=spec.run_id,
                storage_path=str(Path(spec.run_dir) / "ray"),
                failure_config=FailureConfig(max_failures=self.max_restarts),
                # Ray starts workers from the cluster's environment, not ours: the fault
                # injection testing facility (SCALETRAIN_FAULT) and the like travel along.
                worker_runtime_env={"env_vars": _forwarded_env()},
            ),
        )
        stop = _StopForwarder(mailbox).install()
        console = _ConsoleRelay(mailbox, spec).start()
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


@contextlib.contextmanager
def ray_session(ray: Any, address: str | None, logs_dir: Path) -> Iterator[None]:
    """Connected to ``address`` (or a local instance started for the block), Ray's Python logs
    in ``logs_dir/ray-driver.jsonl``; disconnected (and a local instance stopped) after."""
    from scaletrain.tracking.logs import route_loggers_to_file

    restore_logs = route_loggers_to_file(_RAY_LOGGERS, logs_dir / "ray-driver.jsonl")
    connected = False
    try:
        connected = _connect(ray, address, logs_dir)
        yield
    finally:
        if connected:  # disconnects; stops the instance only if we started it
            ray.shutdown()
        restore_logs()


def _forwarded_env() -> dict[str, str]:
    return {name: value for name, value in os.environ.items() if name.startswith("SCALETRAIN_")}


def _connect(ray: Any, address: str | None, logs_dir: Path) -> bool:
    """Join ``address``, or start a local instance for this run. True when this call connected
    (the caller disconnects at the end); False when the process was connected already."""
    quiet = {"log_to_driver": False, "logging_level": logging.WARNING, "configure_logging": False}
    os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
    os.environ.setdefault("RAY_TRAIN_ENABLE_V2_MIGRATION_WARNINGS", "0")
    if ray.is_initialized():
        return False
    if address:
        try:
            context = ray.init(address=address, **quiet)
        except Exception as exc:
            raise ScaletrainError(
                f"cannot join the Ray cluster at {address!r}: {str(exc).splitlines()[0][:200]}; "
                "check --address / RAY_ADDRESS (and RAY_AUTH_TOKEN when the cluster uses tokens)"
            ) from None
        started = False
    else:  # token authentication: see import_ray
        context = ray.init(
            address="local",
            include_dashboard=False,
            runtime_env={"env_vars": {"RAY_TRAIN_V2_ENABLED": "1"}},
            **quiet,
        )
        _link_session_logs(ray, logs_dir)
        started = True
    _log.info(
        "joined Ray cluster" if not started else "started a local Ray instance",
        extra={
            "ray_address": getattr(context, "address_info", {}).get("address"),
            "ray_node_ip": ray.util.get_node_ip_address(),
            "ray_dashboard": getattr(context, "dashboard_url", None) or None,
            "ray_auth_mode": _auth_mode(),
            "ray_resources": ray.cluster_resources(),
        },
    )
    return True


def _auth_mode() -> str:
    try:
        from ray._raylet import AuthenticationMode, get_authentication_mode
    except ImportError:  # a Ray without token authentication (< 2.52)
        return "unsupported"
    return "token" if get_authentication_mode() == AuthenticationMode.TOKEN else "disabled"


def _link_session_logs(ray: Any, logs_dir: Path) -> None:
    try:
        session_dir = Path(ray._private.worker._global_node.get_session_dir_path())
        link = logs_dir / "ray"
        if not link.exists():
            link.symlink_to(session_dir / "logs", target_is_directory=True)
    except (AttributeError, OSError):
        pass


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


class _RemoteConsole:
    """Rank 0's side of the relay (a Reporter sink plus a logging handler): progress at the
    console cadence and warnings go to the mailbox, without waiting for it."""

    def __init__(self, mailbox: Any):
        self.mailbox = mailbox
        self.log_handler = _WarningRelay(mailbox)

    def on_start(self, total_steps: int, start_step: int) -> None:
        self.mailbox.push.remote("start", {"total": total_steps, "start": start_step})

    def on_step(self, step: int) -> None:
        pass

    def on_train_metrics(self, reports: list) -> None:
        last = reports[-1]
        self.mailbox.push.remote("progress", {"step": last.step, "metrics": last.metrics})

    def on_eval_metrics(self, step: int, metrics: dict[str, float]) -> None:
        self.mailbox.push.remote("eval", {"step": step, "metrics": metrics})

    def on_end(self) -> None:
        pass


class _WarningRelay(logging.Handler):
    def __init__(self, mailbox: Any):
        super().__init__(level=logging.WARNING)
        self.mailbox = mailbox

    def emit(self, record: logging.LogRecord) -> None:
        if getattr(record, "console", True):
            self.mailbox.push.remote("warning", record.getMessage())


class _ConsoleRelay:
    """The launcher's side: every half second, what rank 0 sent goes to this console, as the
    local engine's workers would show it (a progress bar on a terminal, JSON lines otherwise)."""

    def __init__(self, mailbox: Any, spec: RunSpec):
        self.mailbox = mailbox
        self.total = 0
        self.log = logging.getLogger("scaletrain_launcher.ray.console")
        self.bar = None
        if sys.stderr.isatty():
            from scaletrain.tracking.progress import ProgressBar

            self.bar = ProgressBar(spec.job.get("name", "train"))
        self._done = threading.Event()
        self._thread = threading.Thread(target=self._run, name="scaletrain-ray-console", daemon=True)

    def start(self) -> _ConsoleRelay:
        self._thread.start()
        return self

    def _run(self) -> None:
        import ray

        while True:
            stopping = self._done.wait(0.5)
            try:
                events = ray.get(self.mailbox.drain.remote(), timeout=10)
            except Exception:
                events = []
            for kind, data in events:
                self._show(kind, data)
            if stopping:
                return

    def _show(self, kind: str, data: Any) -> None:
        from scaletrain.tracking.reporter import StepReport

        if kind == "warning":
            self.log.warning("%s", data)
        elif kind == "start":
            self.total = data["total"]
            if self.bar is not None:
                self.bar.on_start(data["total"], data["start"])
        elif kind == "progress" and self.bar is not None:
            self.bar.on_step(data["step"])
            self.bar.on_train_metrics([StepReport(data["step"], data["metrics"], 0.0)])
        elif kind in ("progress", "eval"):
            self.log.info("%s metrics", "train" if kind == "progress" else "eval",
                          extra={"step": data["step"], "metrics": data["metrics"]})

    def close(self) -> None:
        self._done.set()
        self._thread.join(timeout=15)
        if self.bar is not None:
            self.bar.on_end()


_MAILBOX = None


def _mailbox_class(ray: Any):
    global _MAILBOX
    if _MAILBOX is None:

        class Mailbox:
            def __init__(self) -> None:
                self.starts: dict[int, int] = {}
                self.stop: str | None = None
                self._result: dict[str, Any] | None = None
                self.events: list[tuple[str, Any]] = []  # rank 0 -> the launcher's console

            def register(self, rank: int) -> int:
                """This rank's attempt number (all ranks restart together)."""
                attempt = self.starts.get(rank, 0)
                self.starts[rank] = attempt + 1
                return attempt

            def put_result(self, result: dict[str, Any]) -> None:
                self._result = result

            def result(self) -> dict[str, Any] | None:
                return self._result

            def push(self, kind: str, data: Any) -> None:
                self.events.append((kind, data))

            def drain(self) -> list[tuple[str, Any]]:
                events, self.events = self.events, []
                return events

            def request_stop(self, signal_name: str) -> None:
                self.stop = signal_name

            def stop_requested(self) -> str | None:
                return self.stop

        _MAILBOX = ray.remote(Mailbox)
    return _MAILBOX


def _assigned_gpu():
    """The GPU Ray Train gave this worker (it set CUDA_VISIBLE_DEVICES and the device), or None."""
    if not ray_gpu_ids():
        return None
    import ray.train.torch

    return ray.train.torch.get_device()


def ray_gpu_ids() -> list:
    import ray

    try:
        return list(ray.get_gpu_ids())
    except Exception:
        return []


def _train_loop(config: dict[str, Any]) -> None:
    """Runs in every Ray Train worker: the engine-agnostic worker entry point."""
    import ray

    from scaletrain.distributed.env import DistEnv
    from scaletrain.engine.control import StopRequest
    from scaletrain.launch.worker import RESTART_COUNT_ENV, run_worker

    spec = RunSpec(**config["spec"])
    mailbox = config["mailbox"]
    env = DistEnv.from_env()
    os.environ[RESTART_COUNT_ENV] = str(ray.get(mailbox.register.remote(env.rank)))
    stop = StopRequest()
    done = threading.Event()

    def poll_stop() -> None:  # the launcher's SIGTERM, relayed; rank 0's agreement tells the rest
        while not done.wait(1.0):
            try:
                requested = ray.get(mailbox.stop_requested.remote(), timeout=5)
            except Exception:
                continue
            if requested:
                stop.signal_name = stop.signal_name or requested
                return

    if env.rank == 0:
        threading.Thread(target=poll_stop, name="scaletrain-stop-poll", daemon=True).start()
    try:
        result = run_worker(
            spec, env, stop=stop, node=ray.get_runtime_context().get_node_id(),
            console=_RemoteConsole(mailbox), device=_assigned_gpu(),
        )
    finally:
        done.set()
    if env.rank == 0:
        ray.get(mailbox.put_result.remote({**result, "restarts": int(os.environ[RESTART_COUNT_ENV])}))
