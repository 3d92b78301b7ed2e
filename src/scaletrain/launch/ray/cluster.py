"""The Ray cluster a run uses: Ray imported safely (loopback, token auth for a local instance),
joined within scale.connect_timeout_s or started for the run, its logs kept out of the console.
Also what `scaletrain tune` runs its trials in."""

from __future__ import annotations

import contextlib
import logging
import os
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from scaletrain.errors import MissingExtraError, ScaletrainError
from scaletrain.launch.ray.join import CONNECT_TIMEOUT_S, LOCAL_ONLY_ENV, check_cluster_answers, native_stderr_to
from scaletrain.tracking.logs import LogContext
from scaletrain.tracking.redact import Redactor

__all__ = ["import_ray", "ray_session", "RAY_EXTRA_HINT"]

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
        import ray.train  # noqa: F401  present, or the extra is missing
        import ray.train.torch  # noqa: F401  present, or the extra is missing
    except ImportError:
        raise MissingExtraError(
            f"the ray engine needs Ray Train, which is not installed: {RAY_EXTRA_HINT}"
        ) from None
    return ray


@contextlib.contextmanager
def ray_session(
    ray: Any, address: str | None, logs_dir: Path, connect_timeout_s: float = CONNECT_TIMEOUT_S,
    *, redactor: Redactor, context: LogContext | None = None,
) -> Iterator[None]:
    """Connected to ``address`` (default RAY_ADDRESS; none: a local instance started for the
    block), Ray's Python logs in ``logs_dir/ray-driver.jsonl``; disconnected (and a local
    instance stopped) after. Joining takes at most about ``connect_timeout_s``."""
    from scaletrain.tracking.logs import route_loggers_to_file

    restore_logs = route_loggers_to_file(_RAY_LOGGERS, logs_dir / "ray-driver.jsonl", redactor=redactor,
                                         context=context)
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
        from ray._raylet import AuthenticationMode, get_authentication_mode  # type: ignore[attr-defined]  # Ray's private API, guarded by ImportError
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
