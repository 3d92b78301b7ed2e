"""Pre-flight: permissions before state changes. Before any worker starts, and before the
tracking process opens a run, check what the run will need to write, in milliseconds:

- the run directory can be written (a probe file in it, or in its nearest existing parent);
- the checkpoint location takes a write, a read back, a list and a delete of a probe object
  under the run's own prefix (local folder or object storage: read-only keys, a missing
  bucket or a full quota show up here, not at the first save after hours of training);
- the MLflow store: a local one can be written; a server answers and this user may create
  runs in the experiment (or update the run, on resume). MLflow has no dry run, so the probe
  is a request its schema rejects *after* the permission check: 400 means allowed, 403 denied,
  401 wrong credentials, and nothing is created. A server that does not answer is not a
  failure: the run journals its metrics and sends them later (one warning, from the tracker);
- free disk for the checkpoints kept (local locations), when their size is known here: on
  resume from the newest checkpoint, for ``scaletrain check`` from the model's shapes. A new
  run checks it on the workers, with the model built (``check_checkpoint_disk``).

Nothing here imports MLflow or builds the model unless asked: the run's start-up stays fast.
"""

from __future__ import annotations

import base64
import json
import os
import secrets
import shutil
import ssl
import time
import urllib.error
import urllib.parse
import urllib.request
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from scaletrain.config.schema import JobConfig
from scaletrain.errors import ConfigError

__all__ = ["Check", "PreflightError", "run_preflight", "raise_on_failure", "check_checkpoint_disk",
           "check_disk_for_model", "checkpoint_disk_need", "state_bytes_of_task"]

PROBE_PREFIX = ".scaletrain-preflight-"
HTTP_TIMEOUT_S = 5.0
DISK_MARGIN = 0.10  # beyond the checkpoints kept: logs, metrics, a slightly larger optimizer state


class PreflightError(ConfigError):
    """A pre-flight check failed: nothing was started (exit 2)."""

    code = "ST-PREFLIGHT"


@dataclass
class Check:
    name: str  # run directory | checkpoints | disk | tracking
    ok: bool
    detail: str  # what was checked, or the problem and how to fix it
    warning: bool = False  # passed, with something the user should know
    seconds: float = 0.0

    def line(self) -> str:
        mark = "FAIL" if not self.ok else "warn" if self.warning else "ok"
        return f"{mark:<4}  {self.name}: {self.detail}"


def run_preflight(config: JobConfig, spec: Any, *, checkpoint_bytes: int | None = None,
                  tracking_uri: str | None = None, recorded_run_id: str | None = None,
                  tidy: bool = False) -> list[Check]:
    """Every check for this run (``spec``: its RunSpec). ``checkpoint_bytes``: the size of one
    checkpoint when the caller knows it (the disk check runs only then, on local locations).
    ``tidy``: remove the folders the checkpoint probe created (``scaletrain check``). A run
    that passes keeps them (it writes there next, and removing a shared parent such as
    runs/<job> would race with runs starting beside it); one refused leaves none behind."""
    created: list[Path] = []
    checks = [_timed(_check_run_dir, Path(spec.run_dir))]
    location = spec.checkpoints
    if config.checkpoint.enabled and location:
        checks.append(_timed(_check_checkpoints, location, created))
        if checkpoint_bytes is None:
            checkpoint_bytes = _newest_checkpoint_bytes(location)
        if checkpoint_bytes is not None and "://" not in location:
            checks.append(_timed(check_checkpoint_disk, config, location, checkpoint_bytes))
    if config.tracking.enabled and spec.node_rank == 0:
        checks.append(_timed(_check_tracking, config, tracking_uri, recorded_run_id))
    if tidy or not all(c.ok for c in checks):
        for folder in created:  # innermost first
            try:
                folder.rmdir()
            except OSError:
                break
    return checks


def raise_on_failure(checks: list[Check]) -> None:
    failed = [c for c in checks if not c.ok]
    if failed:
        more = f" (and {len(failed) - 1} more: `scaletrain check JOB` lists them)" if len(failed) > 1 else ""
        raise PreflightError(f"pre-flight: {failed[0].name}: {failed[0].detail}{more}")


def _timed(check: Any, *args: Any) -> Check:
    started = time.perf_counter()
    result = check(*args)
    result.seconds = time.perf_counter() - started
    return result


def _why(exc: BaseException) -> str:
    text = str(exc).strip().splitlines()[0][:200] if str(exc).strip() else ""
    return f"{type(exc).__name__}: {text}" if text else type(exc).__name__


# --- local folders -----------------------------------------------------------------------------


def _existing_parent(path: Path) -> Path:
    """``path`` or its nearest parent that exists (what a mkdir -p would start from)."""
    path = path.absolute()
    while not path.exists() and path != path.parent:
        path = path.parent
    return path


def _probe_folder(path: Path) -> str | None:
    """Write and remove a probe file in ``path`` (or where ``path`` would be created); the
    problem in words, or None. A real write, not os.access: root, ACLs and read-only mounts
    answer access() wrongly."""
    base = _existing_parent(path)
    if not base.is_dir():
        return f"{base} is not a folder"
    probe = base / f"{PROBE_PREFIX}{secrets.token_hex(4)}"
    try:
        with open(probe, "xb") as handle:
            handle.write(b"probe")
        probe.unlink()
    except OSError as exc:
        return f"cannot write in {base} ({_why(exc)})"
    return None


def _check_run_dir(run_dir: Path) -> Check:
    problem = _probe_folder(run_dir)
    if problem:
        return Check("run directory", False, f"{problem}; set run_dir to a folder you can write")
    return Check("run directory", True, f"{run_dir} can be written")


# --- checkpoints ---------------------------------------------------------------------------------


def _check_checkpoints(location: str, created: list[Path]) -> Check:
    """``created``: receives the local folders the probe made, innermost first."""
    name = f"{PROBE_PREFIX}{secrets.token_hex(6)}"
    payload = secrets.token_bytes(32)
    try:
        if "://" in location:
            _probe_object_storage(location, name, payload)
        else:
            _probe_local_checkpoints(Path(location), name, payload, created)
    except _ProbeFailed as exc:
        return Check("checkpoints", False, f"{location}: {exc}")
    return Check("checkpoints", True, f"{location}: write, read back, list and delete of a probe")


class _ProbeFailed(Exception):
    pass


def _probe_local_checkpoints(location: Path, name: str, payload: bytes, created: list[Path]) -> None:
    base = _existing_parent(location)
    created += [p for p in [location, *location.parents] if not p.exists()]
    try:
        try:
            location.mkdir(parents=True, exist_ok=True)
            (location / name).write_bytes(payload)
        except OSError as exc:
            raise _ProbeFailed(f"cannot write ({_why(exc)}); set checkpoint.dir to a folder you can write"
                               f"{'' if base.is_dir() else f' ({base} is not a folder)'}") from None
        try:
            if (location / name).read_bytes() != payload:
                raise _ProbeFailed("a probe file read back different bytes; check the file system")
            if name not in os.listdir(location):
                raise _ProbeFailed("a probe file written there is missing from its listing")
            (location / name).unlink()
        except OSError as exc:
            raise _ProbeFailed(f"cannot read, list or delete there ({_why(exc)})") from None
    finally:
        if location.is_dir():
            (location / name).unlink(missing_ok=True)


def _probe_object_storage(location: str, name: str, payload: bytes) -> None:
    from scaletrain.checkpoint.storage import _filesystem  # fsspec: the checkpoints' own client

    fs, root = _filesystem(location)
    key = f"{root.rstrip('/')}/{name}"
    hint = "check that the bucket exists and that these credentials may write, read, list and delete there"
    step = "write"
    try:
        fs.pipe_file(key, payload)
        step = "read back"
        if fs.cat_file(key) != payload:
            raise _ProbeFailed("a probe object read back different bytes")
        step = "list"
        fs.invalidate_cache(root)
        listed = {str(p).rstrip("/").rsplit("/", 1)[-1] for p in fs.ls(root, detail=False)}
        if name not in listed:
            raise _ProbeFailed("a probe object written there is missing from its listing")
        step = "delete"
        fs.rm_file(key)
    except _ProbeFailed:
        _remove_quietly(fs, key)
        raise
    except Exception as exc:  # botocore, aiohttp and fsspec raise many kinds
        _remove_quietly(fs, key)
        raise _ProbeFailed(f"cannot {step} a probe object ({_why(exc)}); {hint}") from None


def _remove_quietly(fs: Any, key: str) -> None:
    try:
        fs.rm_file(key)
    except Exception:  # noqa: S110  the probe's own cleanup: a failure here changes no verdict
        pass


def _newest_checkpoint_bytes(location: str) -> int | None:
    """The size of the newest committed checkpoint there (a resumed run), if any."""
    from scaletrain.checkpoint.storage import open_storage

    try:
        storage = open_storage(location)
        names = storage.names()
        return storage.read_manifest(names[-1]).total_bytes if names else None
    except Exception:  # unreadable: the restore will say why, with the run's own messages
        return None


def checkpoint_disk_need(config: JobConfig, checkpoint_bytes: int) -> int:
    """Bytes the checkpoints of this job hold at their peak: those retention keeps, plus the
    one being written before the oldest goes, plus a margin."""
    ckpt = config.checkpoint
    kept = ckpt.keep_last + (ckpt.keep_best.count if ckpt.keep_best else 0)
    if ckpt.keep_every and config.train.max_steps:
        kept += config.train.max_steps // ckpt.keep_every
    return int(checkpoint_bytes * (kept + 1) * (1 + DISK_MARGIN))


def check_checkpoint_disk(config: JobConfig, location: str, checkpoint_bytes: int) -> Check:
    """Free space where local checkpoints go, against what the ones kept will take (the ones
    already there count as free: retention replaces them)."""
    need = checkpoint_disk_need(config, checkpoint_bytes)
    base = _existing_parent(Path(location))
    try:
        free = shutil.disk_usage(base).free
    except OSError as exc:
        return Check("disk", False, f"cannot read the free space of {base} ({_why(exc)})")
    held = _bytes_under(Path(location))
    text = (f"{_size(free)} free at {base}; the checkpoints kept need about {_size(need)} "
            f"({_size(checkpoint_bytes)} each)")
    if free + held < need:
        return Check("disk", False, f"{text}: free some space, lower checkpoint.keep_last or set "
                                    "checkpoint.dir to a larger disk")
    return Check("disk", True, text)


def _bytes_under(path: Path) -> int:
    total = 0
    if path.is_dir():
        for root, _, files in os.walk(path):
            for name in files:
                try:
                    total += os.path.getsize(os.path.join(root, name))
                except OSError:
                    pass
    return total


def _size(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if n < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n:.1f} TiB"


def check_disk_for_model(config: JobConfig, location: str, model: Any) -> None:
    """On a new run's workers (each machine's first), once the model is built and before the
    first step: the exact size of a checkpoint against the free disk, on local locations
    (the launcher would need the model for it, seconds of start-up it does not spend)."""
    if "://" in location:
        return
    from scaletrain.plan.state_bytes import ParamShape, optimizer_bytes

    shapes = [ParamShape.of(p) for p in model.parameters() if p.requires_grad]  # global shapes
    size = (sum(s.nbytes for s in shapes) + sum(b.nbytes for b in model.buffers())
            + optimizer_bytes(shapes, config.optim.name, config.optim.momentum))
    check = check_checkpoint_disk(config, location, size)
    if not check.ok:
        raise PreflightError(f"pre-flight: disk: {check.detail}")


def state_bytes_of_task(config: JobConfig, search_path: list[str]) -> int:
    """One checkpoint's size from the model's shapes (built on the meta device: no memory, no
    weights): parameters and buffers, and the optimizer's state (the planner's formula)."""
    import torch

    from scaletrain.plan.state_bytes import ParamShape, optimizer_bytes
    from scaletrain.task import build_task

    if config.task is None:
        raise ValueError("a loop job builds its model in the loop: its size is not known before it runs")
    task = build_task(config.task.target, config.task.args, search_path)
    with torch.device("meta"):
        model = task.build_model()
    shapes = [ParamShape.of(p) for p in model.parameters() if p.requires_grad]
    params = sum(s.nbytes for s in shapes)
    buffers = sum(b.nbytes for b in model.buffers())
    return params + buffers + optimizer_bytes(shapes, config.optim.name, config.optim.momentum)


# --- tracking ------------------------------------------------------------------------------------


def _check_tracking(config: JobConfig, uri: str | None, recorded_run_id: str | None) -> Check:
    from scaletrain.tracking.mlflow_run import resolve_tracking_uri
    from scaletrain.tracking.redact import redact_url

    uri = uri or resolve_tracking_uri(config)
    shown = redact_url(uri)
    scheme = urllib.parse.urlsplit(uri).scheme
    if scheme in ("http", "https"):
        return _check_server(config, uri, shown, recorded_run_id)
    if scheme == "sqlite":
        path = Path(uri.split(":///", 1)[1]) if ":///" in uri else None
        if path is None or str(path) in ("", ":memory:"):
            return Check("tracking", True, f"{shown}: in memory, nothing to check")
        return _check_local_store(shown, path, is_file=True)
    if scheme in ("", "file"):
        path = Path(urllib.parse.urlsplit(uri).path if scheme == "file" else uri)
        return _check_local_store(shown, path, is_file=False)
    return Check("tracking", True, f"{shown}: not checked ({scheme}:// stores are MLflow plugins)", warning=True)


def _check_local_store(shown: str, path: Path, is_file: bool) -> Check:
    if is_file and path.exists():
        try:
            with open(path, "ab"):
                pass
        except OSError as exc:
            return Check("tracking", False, f"{shown}: cannot write the store ({_why(exc)}); set "
                                            "tracking.uri or MLFLOW_TRACKING_URI to a store you can write")
        return Check("tracking", True, f"{shown} can be written")
    problem = _probe_folder(path.parent if is_file else path)
    if problem:
        return Check("tracking", False, f"{shown}: {problem}; set tracking.uri or MLFLOW_TRACKING_URI "
                                        "to a store you can write")
    return Check("tracking", True, f"{shown} can be written")


class _Server:
    """MLflow's REST API with the client's own environment: MLFLOW_TRACKING_USERNAME and
    _PASSWORD (basic auth) or MLFLOW_TRACKING_TOKEN (bearer), and its TLS settings."""

    def __init__(self, uri: str):
        self.base = uri.rstrip("/") + "/api/2.0/mlflow/"
        self.headers = {"Content-Type": "application/json", "User-Agent": "scaletrain-preflight"}
        user, password = os.environ.get("MLFLOW_TRACKING_USERNAME"), os.environ.get("MLFLOW_TRACKING_PASSWORD")
        if user and password:
            token = base64.b64encode(f"{user}:{password}".encode()).decode()
            self.headers["Authorization"] = f"Basic {token}"
        elif os.environ.get("MLFLOW_TRACKING_TOKEN"):
            self.headers["Authorization"] = f"Bearer {os.environ['MLFLOW_TRACKING_TOKEN']}"
        self.user = user
        self.context = None
        if uri.startswith("https"):
            if os.environ.get("MLFLOW_TRACKING_INSECURE_TLS", "").lower() == "true":
                self.context = ssl._create_unverified_context()  # noqa: S323  the user asked: MLflow's own MLFLOW_TRACKING_INSECURE_TLS
            else:
                self.context = ssl.create_default_context(cafile=os.environ.get("MLFLOW_TRACKING_SERVER_CERT_PATH"))

    def call(self, method: str, endpoint: str, body: dict | None = None,
             query: dict | None = None) -> tuple[int, dict]:
        url = self.base + endpoint + (f"?{urllib.parse.urlencode(query)}" if query else "")
        data = json.dumps(body).encode() if body is not None else None
        # http(s) only: _check_server is reached for those schemes alone
        request = urllib.request.Request(url, data=data, method=method, headers=self.headers)  # noqa: S310  http(s) only
        try:
            with urllib.request.urlopen(request, timeout=HTTP_TIMEOUT_S, context=self.context) as response:  # noqa: S310  http(s) only
                return response.status, _json(response.read())
        except urllib.error.HTTPError as exc:
            return exc.code, _json(exc.read())


def _json(raw: bytes) -> dict:
    try:
        value = json.loads(raw or b"{}")
        return value if isinstance(value, dict) else {}
    except ValueError:
        return {}


def _check_server(config: JobConfig, uri: str, shown: str, recorded_run_id: str | None) -> Check:
    server = _Server(uri)
    experiment = config.tracking.experiment or config.name
    who = f"user {server.user!r}" if server.user else "this client (no MLFLOW_TRACKING_USERNAME)"
    try:
        if recorded_run_id:  # a resumed run continues its MLflow run: may we update it?
            status, body = server.call("POST", "runs/update", {"run_id": recorded_run_id, "end_time": "preflight"})
            what = f"update run {recorded_run_id}"
        else:
            status, body = server.call("GET", "experiments/get-by-name", query={"experiment_name": experiment})
            if status == 200:
                experiment_id = body.get("experiment", {}).get("experiment_id")
                status, body = server.call("POST", "runs/create",
                                           {"experiment_id": experiment_id, "start_time": "preflight"})
                what = f"create runs in experiment {experiment!r}"
                if status == 200 and body.get("run", {}).get("info", {}).get("run_id"):  # a lax server made one
                    server.call("POST", "runs/delete", {"run_id": body["run"]["info"]["run_id"]})
                    status = 400
            elif status == 404:
                status, body = server.call("POST", "experiments/create", {"name": experiment, "artifact_location": 0})
                what = f"create experiment {experiment!r}"
            else:
                what = f"read experiment {experiment!r}"
    except (urllib.error.URLError, OSError, ValueError) as exc:
        reason = getattr(exc, "reason", exc)
        return Check("tracking", True, f"{shown} does not answer ({_why(reason) if isinstance(reason, BaseException) else reason}): "
                     "the run goes on and journals its metrics, sent once it answers", warning=True)
    if status == 400 and body.get("error_code") == "INVALID_PARAMETER_VALUE":
        return Check("tracking", True, f"{shown}: {who} may {what}")
    if status == 401:
        return Check("tracking", False, f"{shown} refused the credentials (HTTP 401): set MLFLOW_TRACKING_USERNAME "
                                        "and MLFLOW_TRACKING_PASSWORD (or MLFLOW_TRACKING_TOKEN) to an account of that server")
    if status == 403:
        return Check("tracking", False, f"{shown}: {who} may not {what} (HTTP 403): ask the server's admin "
                                        "for EDIT on the experiment, or set tracking.experiment to one you may write")
    if status == 404 and recorded_run_id:
        return Check("tracking", False, f"{shown}: the run's MLflow run {recorded_run_id} is gone (HTTP 404); "
                                        "restore it, or start a new run")
    if status >= 500:
        return Check("tracking", True, f"{shown} answered HTTP {status}: the run goes on and journals its "
                                       "metrics, sent once it answers", warning=True)
    message = str(body.get("message", ""))[:200]
    return Check("tracking", True, f"{shown}: could not tell whether {who} may {what} (HTTP {status}"
                                   f"{': ' + message if message else ''})", warning=True)
