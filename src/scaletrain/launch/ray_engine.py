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
holders of the token. Ray's logs stay out of the console (``logs/ray-driver.jsonl``, redacted);
a local session's own logs (workers' raw output) stay where Ray writes them, never in the run's
logs or MLflow: ``launcher.jsonl`` names the folder.

Joining a cluster (scale.address, RAY_ADDRESS) is checked first, within scale.connect_timeout_s:
something answers where Ray will connect, it is a Ray head, and it lets this process in, with
the token Ray's CLI would use when the head asks for one; else one line says what to do
(ray_join.py).
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
from scaletrain.launch.base import Launcher, checked_result
from scaletrain.recovery.root_cause import worker_error
from scaletrain.launch.ray_relay import FORCE_LOCAL_ENV, RunDirRelay, local_dir_for
from scaletrain.launch.ray_join import (
    CONNECT_TIMEOUT_S,
    LOCAL_ONLY_ENV,
    check_cluster_answers,
    native_stderr_to,
)
from scaletrain.rundir import RESTART_COUNT_ENV, RunSpec
from scaletrain.tracking.redact import Redactor

__all__ = ["RayLauncher", "import_ray", "ray_session"]

RAY_EXTRA_HINT = "pip install 'scaletrain[ray]'"
_log = logging.getLogger("scaletrain_launcher.ray")  # launcher.jsonl
_RAY_LOGGERS = ("ray", "ray.train", "ray.data", "ray.tune")




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
        timeout = (spec.job.get("scale") or {}).get("connect_timeout_s") or CONNECT_TIMEOUT_S
        with ray_session(self.ray, self.address, spec.logs_dir, connect_timeout_s=timeout,
                         redactor=Redactor.for_config(spec.job)):
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
        mailbox = _mailbox_class(ray).options(num_cpus=0).remote()
        trainer = TorchTrainer(
            _train_loop,
            train_loop_config={"spec": spec.__dict__, "mailbox": mailbox,
                               "driver_node": ray.get_runtime_context().get_node_id()},
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
def ray_session(
    ray: Any, address: str | None, logs_dir: Path, connect_timeout_s: float = CONNECT_TIMEOUT_S,
    *, redactor: Redactor,
) -> Iterator[None]:
    """Connected to ``address`` (default RAY_ADDRESS; none: a local instance started for the
    block), Ray's Python logs in ``logs_dir/ray-driver.jsonl``; disconnected (and a local
    instance stopped) after. Joining takes at most about ``connect_timeout_s``."""
    from scaletrain.tracking.logs import route_loggers_to_file

    restore_logs = route_loggers_to_file(_RAY_LOGGERS, logs_dir / "ray-driver.jsonl", redactor=redactor)
    connected = False
    try:
        connected = _connect(ray, address, logs_dir, connect_timeout_s)
        # Ray prints the cluster's messages ("(raylet) A worker died...") on stdout, where
        # `--json` promises one JSON object: they go to stderr instead.
        with contextlib.redirect_stdout(sys.stderr):
            yield
    finally:
        if connected:  # disconnects; stops the instance only if we started it
            ray.shutdown()
        restore_logs()


def _forwarded_env() -> dict[str, str]:
    return {name: value for name, value in os.environ.items() if name.startswith("SCALETRAIN_")}


def _connect(
    ray: Any, address: str | None, logs_dir: Path, connect_timeout_s: float = CONNECT_TIMEOUT_S
) -> bool:
    """Join ``address``, or start a local instance for this run. True when this call connected
    (the caller disconnects at the end); False when the process was connected already."""
    quiet = {"log_to_driver": False, "logging_level": logging.WARNING, "configure_logging": False}
    os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
    os.environ.setdefault("RAY_TRAIN_ENABLE_V2_MIGRATION_WARNINGS", "0")
    if ray.is_initialized():
        return False
    address = address or os.environ.get("RAY_ADDRESS") or None
    token_from, session_logs = None, None
    if address:
        # Ray's C++ client writes its warnings to stderr, not to a logger: the check's (an
        # unauthenticated first try, say) go to the file; ray.init, after it, is quiet.
        with native_stderr_to(logs_dir / "ray-connect.log"):
            token_from = check_cluster_answers(address, connect_timeout_s)
        try:
            context = ray.init(address=address, **quiet)
        except Exception as exc:
            raise ScaletrainError(
                f"cannot join the Ray cluster at {address!r}: "
                f"{(str(exc).strip().splitlines() or [type(exc).__name__])[0][:200]}"
            ) from None
        started = False
    else:  # token authentication: see import_ray
        context = ray.init(
            address="local",
            include_dashboard=False,
            runtime_env={"env_vars": {"RAY_TRAIN_V2_ENABLED": "1"}},
            **quiet,
        )
        session_logs = _session_logs(ray)
        started = True
    _log.info(
        "joined Ray cluster" if not started else "started a local Ray instance",
        extra={
            "ray_address": getattr(context, "address_info", {}).get("address"),
            "ray_node_ip": ray.util.get_node_ip_address(),
            "ray_dashboard": getattr(context, "dashboard_url", None) or None,
            "ray_auth_mode": _auth_mode(),
            "ray_token_from": token_from,  # where the token came from, never the token
            "ray_resources": ray.cluster_resources(),
            "ray_session_logs": session_logs,
        },
    )
    return True


def _auth_mode() -> str:
    try:
        from ray._raylet import AuthenticationMode, get_authentication_mode
    except ImportError:  # a Ray without token authentication (< 2.52)
        return "unsupported"
    return "token" if get_authentication_mode() == AuthenticationMode.TOKEN else "disabled"


def _session_logs(ray: Any) -> str | None:
    """Where the local session's logs are. Named, not linked: they hold the workers' raw
    output, and a link in ``logs/`` would copy them into MLflow with the run's logs."""
    try:
        return str(Path(ray._private.worker._global_node.get_session_dir_path()) / "logs")
    except AttributeError:
        return None


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

    def __init__(self, mailbox: Any, relay: Any = None):
        self.mailbox = mailbox
        self.log_handler = _WarningRelay(mailbox)
        # On another machine than the driver's: the run's files are relayed, up to date at
        # every checkpoint.
        self.before_checkpoint = relay.flush if relay is not None else None

    def mlflow_run_id(self) -> str | None:
        """The job's MLflow run, as the driver saw it open (for checkpoint manifests)."""
        import ray

        try:
            return ray.get(self.mailbox.mlflow_run.remote(), timeout=10)
        except Exception:
            return None

    def on_start(self, total_steps: int | None, start_step: int) -> None:
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
        self.run_dir = spec.run_dir
        self.mlflow_run_sent = False
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
            try:  # what workers on other machines relay for the run directory
                self._write_files(ray.get(self.mailbox.drain_files.remote(), timeout=60))
                self._answer(ray.get(self.mailbox.asked_files.remote(), timeout=10))
                self._share_mlflow_run()
            except Exception as exc:
                self.log.warning("relaying the run's files failed: %s: %s", type(exc).__name__, exc)
            for kind, data in events:
                self._show(kind, data)
            if stopping:
                return

    def _write_files(self, items: list) -> None:
        """Workers on other machines relay the run's files (ray_relay.py): written here."""
        from scaletrain.launch.ray_relay import write_relayed

        for path in write_relayed(self.run_dir, items):
            self.log.warning("ignored a relayed file outside the run's files: %r", path)

    def _answer(self, asked: list[str]) -> None:
        if asked:
            from scaletrain.launch.ray_relay import read_asked

            self.mailbox.provide_files.remote(read_asked(self.run_dir, asked))

    def _share_mlflow_run(self) -> None:
        """Once the tracking process has opened the job's MLflow run: its id, for checkpoint
        manifests written on other machines."""
        if self.mlflow_run_sent:
            return
        from scaletrain.tracking.session import recorded_run

        run_id = (recorded_run(self.run_dir) or {}).get("run_id")
        if run_id:
            self.mailbox.set_mlflow_run.remote(run_id)
            self.mlflow_run_sent = True

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
                self.files: list[tuple[str, int, bytes, bool, bool]] = []  # -> the run directory
                self.file_bytes = 0
                self.asked: list[str] = []  # files rank 0 continues, asked of the driver
                self.provided: dict[str, bytes] | None = None
                self.mlflow_run_id: str | None = None

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

            def write(self, path: str, offset: int, data: bytes, whole: bool, last: bool) -> None:
                """A piece of a file for the driver's run directory (ray_relay.py)."""
                self.files.append((path, offset, data, whole, last))
                self.file_bytes += len(data)

            def drain_files(self) -> list[tuple[str, int, bytes, bool, bool]]:
                files, self.files, self.file_bytes = self.files, [], 0
                return files

            def backlog(self) -> int:
                return self.file_bytes

            def ask_files(self, paths: list[str]) -> None:
                """Rank 0 on another machine asks for the driver's copies (ray_relay.py)."""
                self.asked, self.provided = list(paths), None

            def asked_files(self) -> list[str]:
                asked, self.asked = self.asked, []
                return asked

            def provide_files(self, files: dict[str, bytes]) -> None:
                self.provided = files

            def provided_files(self) -> dict[str, bytes] | None:
                return self.provided

            def set_mlflow_run(self, run_id: str) -> None:
                self.mlflow_run_id = run_id

            def mlflow_run(self) -> str | None:
                return self.mlflow_run_id

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
    from scaletrain.recovery.signals import StopRequest
    from scaletrain.launch.worker import run_worker

    spec = RunSpec(**config["spec"])
    mailbox = config["mailbox"]
    env = DistEnv.from_env()
    os.environ[RESTART_COUNT_ENV] = str(ray.get(mailbox.register.remote(env.rank)))
    stop = StopRequest()
    done = threading.Event()

    def poll_stop() -> None:  # the launcher's SIGTERM, relayed; rank 0's agreement tells the rest
        while not done.wait(0.5):
            try:
                requested = ray.get(mailbox.stop_requested.remote(), timeout=5)
            except Exception:
                continue
            if requested:
                stop.signal_name = stop.signal_name or requested
                return

    if env.rank == 0:
        threading.Thread(target=poll_stop, name="scaletrain-stop-poll", daemon=True).start()
    node = ray.get_runtime_context().get_node_id()
    relay = None
    if node != config["driver_node"] or os.environ.get(FORCE_LOCAL_ENV) == "1":
        # Another machine than the driver's: write here, relay to the driver's run directory.
        spec.local_dir = local_dir_for(spec.run_id, node)
        relay = RunDirRelay(mailbox, spec.local_dir, env.rank).watch_stacks()
        if env.rank == 0:
            relay.start()
    try:
        result = run_worker(
            spec, env, stop=stop, node=node, console=_RemoteConsole(mailbox, relay),
            device=_assigned_gpu(),
        )
    except BaseException:
        if relay is not None:
            relay.failed()
        raise
    finally:
        done.set()
    if relay is not None:  # rank 0: its files; every rank: its log
        relay.finish()
    if env.rank == 0:
        ray.get(mailbox.put_result.remote({**result, "restarts": int(os.environ[RESTART_COUNT_ENV])}))
