"""The job's MLflow run: created (or reopened) by the tracking process (tracker_process.py) while the
workers start, with params (the flattened, redacted job), tags and the job file; at the end
the artifacts and the final status. Workers never talk to MLflow: rank 0 journals its
metrics and the tracking process sends them.
"""

from __future__ import annotations

import contextlib
import getpass
import json
import logging
import os
import re
import socket
import time
from importlib import metadata
from pathlib import Path
from typing import Any

from scaletrain.config.schema import JobConfig
from scaletrain.tracking.git_state import git_state
from scaletrain.tracking.mlflow_client import configure_mlflow_client
from scaletrain.tracking.redact import Redactor, flatten, redact_url

__all__ = ["TrackingRun", "experiment_for", "resolve_tracking_uri"]

log = logging.getLogger("scaletrain_launcher.tracking")
_PARAM_VALUE_LIMIT = 6000  # MLflow's limit on one param value
_PARAMS_PER_BATCH = 100


def resolve_tracking_uri(config: JobConfig | None = None) -> str:
    """Job file, else MLFLOW_TRACKING_URI, else an embedded sqlite store in the working dir."""
    if config is not None and config.tracking.uri:
        return config.tracking.uri
    if os.environ.get("MLFLOW_TRACKING_URI"):
        return os.environ["MLFLOW_TRACKING_URI"]
    return f"sqlite:///{Path.cwd() / 'mlflow.db'}"


# MLflow 3's UI opens an experiment in the view its kind names (GenAI's traces and evaluations
# otherwise): scaletrain's experiments train models.
EXPERIMENT_KIND_TAG, EXPERIMENT_KIND = "mlflow.experimentKind", "custom_model_development"


def experiment_for(client: Any, uri: str, name: str) -> str:
    """The id of experiment ``name``, created if new. In an sqlite store its artifacts go beside
    the database (``<db folder>/mlruns/<name>``): MLflow's default, ``./mlruns`` of whatever
    folder the first run started in, scatters one store's artifacts over working directories."""
    experiment = client.get_experiment_by_name(name)
    if experiment is not None:
        if EXPERIMENT_KIND_TAG not in (experiment.tags or {}):  # a kind the user chose stays
            with contextlib.suppress(Exception):
                client.set_experiment_tag(experiment.experiment_id, EXPERIMENT_KIND_TAG, EXPERIMENT_KIND)
        return experiment.experiment_id
    location = None
    if uri.startswith("sqlite:///"):
        folder = Path(uri.removeprefix("sqlite:///").split("?", 1)[0]).expanduser().resolve().parent
        location = (folder / "mlruns" / re.sub(r"[^\w.-]+", "_", name).strip("._")).as_uri()
    try:
        return client.create_experiment(name, artifact_location=location, tags={EXPERIMENT_KIND_TAG: EXPERIMENT_KIND})
    except Exception:  # another run created it meanwhile
        experiment = client.get_experiment_by_name(name)
        if experiment is None:
            raise
        return experiment.experiment_id


class TrackingRun:
    """A handle on the job's MLflow run, held by the tracking process."""

    def __init__(self, client: Any, run_id: str, uri: str, redactor: Redactor):
        self.client = client
        self.run_id = run_id
        self.uri = uri
        self.redactor = redactor
        self.system_metrics: Any = None

    def start_system_metrics(self, every_s: float) -> None:
        """MLflow's own sampler (system/* metrics), in a thread of the tracking process (at
        idle priority: a sample can come late on saturated cores, never at training's cost)."""
        if every_s <= 0:
            return
        try:
            from mlflow.system_metrics.system_metrics_monitor import SystemMetricsMonitor

            self.system_metrics = SystemMetricsMonitor(
                self.run_id, sampling_interval=every_s, tracking_uri=self.uri
            )
            self.system_metrics.start()
        except Exception as exc:  # e.g. psutil missing: the run goes on without them
            log.warning("system metrics are off: %s: %s", type(exc).__name__, exc)
            self.system_metrics = None

    @classmethod
    def start(
        cls,
        config: JobConfig,
        local_run_id: str,
        trace_id: str,
        engine: str,
        python_path: list[str],
        extra_tags: dict[str, str] | None = None,
    ) -> TrackingRun:
        from mlflow import MlflowClient
        from mlflow.entities import Param

        configure_mlflow_client()

        uri = resolve_tracking_uri(config)
        client = MlflowClient(tracking_uri=uri)
        name = config.tracking.experiment or config.name
        experiment_id = experiment_for(client, uri, name)
        raw = config.model_dump(mode="json")
        redactor = Redactor.for_config(raw)
        tags = _run_tags(config, local_run_id, trace_id, engine, uri)
        tags["scaletrain.python_path"] = json.dumps(python_path)
        tags = redactor.mapping({**tags, **(extra_tags or {})})
        run = client.create_run(experiment_id, run_name=local_run_id, tags=tags)
        params = redactor.mapping(job_params(raw))
        items = [Param(k, _param_text(v)) for k, v in params.items()]
        for i in range(0, len(items), _PARAMS_PER_BATCH):
            client.log_batch(run.info.run_id, params=items[i : i + _PARAMS_PER_BATCH])
        log.info("tracking run %s in experiment '%s' at %s", run.info.run_id, name, redact_url(uri))
        return cls(client, run.info.run_id, uri, redactor)

    @classmethod
    def reopen(cls, config: JobConfig, uri: str | None, run_id: str, attempt: int) -> TrackingRun:
        """Continue the job's run after a resume: RUNNING again, one more attempt counted."""
        from mlflow import MlflowClient

        uri = uri or resolve_tracking_uri(config)
        client = MlflowClient(tracking_uri=uri)
        client.update_run(run_id, status="RUNNING")
        client.set_tag(run_id, "scaletrain.attempts", str(attempt))
        log.info("continuing tracking run %s (attempt %d) at %s", run_id, attempt, redact_url(uri))
        return cls(client, run_id, uri, Redactor.for_config(config.model_dump(mode="json")))

    def log_artifact(self, path: str | Path, artifact_path: str | None = None) -> None:
        """A file, or a folder's files; links are never followed (MLflow's local store copies
        what a link points at: a link in ``logs/`` would upload another tree, unredacted)."""
        path = Path(path)
        if path.is_symlink():
            return
        if path.is_dir():
            for folder, dirs, files in os.walk(path):
                dirs[:] = [d for d in dirs if not Path(folder, d).is_symlink()]
                inside = Path(folder).relative_to(path).as_posix()
                target = "/".join(p for p in (artifact_path, inside if inside != "." else None) if p)
                for name in sorted(files):
                    if not Path(folder, name).is_symlink():
                        self.client.log_artifact(self.run_id, os.path.join(folder, name), target or None)
        elif path.exists():
            self.client.log_artifact(self.run_id, str(path), artifact_path)

    def log_model(self, folder: str | Path, name: str, step: int | None) -> str:
        """The saved model folder as an MLflow 3 logged model of this run (its page lists it; it
        can be registered from the UI; ``runs:/<run>/<name>`` and ``models:/<id>`` load it);
        returns its id."""
        from mlflow.entities import LoggedModelOutput, LoggedModelStatus

        run = self.client.get_run(self.run_id)
        model = self.client.create_logged_model(
            experiment_id=run.info.experiment_id, name=name, source_run_id=self.run_id,
            tags={"scaletrain.run_id": run.data.tags.get("scaletrain.run_id", "")},
        )
        try:
            self.client.log_model_artifacts(model.model_id, str(folder))
        except Exception:
            self.client.finalize_logged_model(model.model_id, LoggedModelStatus.FAILED)
            raise
        self.client.finalize_logged_model(model.model_id, LoggedModelStatus.READY)
        self.client.log_outputs(self.run_id, [LoggedModelOutput(model.model_id, step or 0)])
        return str(model.model_id)

    def finish(self, status: str, tags: dict[str, Any] | None = None, restarts: int = 0,
               metrics: dict[str, float] | None = None, step: int | None = None) -> None:
        """``status``: FINISHED, FAILED or KILLED. ``restarts``: this attempt's worker restarts,
        added to the run's count. ``metrics``: the job's figures as it ends, at ``step``."""
        if self.system_metrics is not None:
            self.system_metrics.finish()
            self.system_metrics = None
        previous = self.client.get_run(self.run_id).data.tags.get("scaletrain.restarts", "0")
        tags = {**(tags or {}), "scaletrain.restarts": int(previous) + int(restarts)}
        for key, value in tags.items():
            self.client.set_tag(self.run_id, key, self.redactor.text(str(value)))
        if metrics:
            from mlflow.entities import Metric

            now = int(time.time() * 1000)
            self.client.log_batch(self.run_id, metrics=[
                Metric(key, float(value), now, int(step or 0)) for key, value in metrics.items()])
        self.client.set_terminated(self.run_id, status)


def _param_text(value: Any) -> str:
    text = value if isinstance(value, str) else json.dumps(value)
    return text if len(text) <= _PARAM_VALUE_LIMIT else text[: _PARAM_VALUE_LIMIT - 3] + "..."


def _run_tags(config: JobConfig, local_run_id: str, trace_id: str, engine: str, uri: str) -> dict[str, str]:
    tags = {
        "scaletrain.run_id": local_run_id,
        "scaletrain.trace_id": trace_id,
        "scaletrain.job": config.name,
        "scaletrain.engine": engine,
        "scaletrain.strategy": config.scale.resolved_strategy,
        "scaletrain.world_size": str(config.scale.workers),
        "scaletrain.attempts": "1",
        "scaletrain.host": socket.gethostname(),
        "scaletrain.version": _version("scaletrain"),
        "scaletrain.torch_version": _version("torch"),
        "mlflow.user": _user(),
    }
    tags.update(_git_tags())
    return tags


def _version(package: str) -> str:
    try:
        return metadata.version(package)
    except metadata.PackageNotFoundError:
        return "unknown"


def _user() -> str:
    try:
        return getpass.getuser()
    except (KeyError, OSError):
        return "unknown"


def _git_tags() -> dict[str, str]:
    """Commit, branch and dirty flag of the working directory's repository, when there is one."""
    state = git_state()
    if state is None:
        return {}
    return {
        "mlflow.source.git.commit": state["commit"],
        "scaletrain.git.branch": state["branch"],
        "scaletrain.git.dirty": "true" if state["dirty"] else "false",
    }


_SECTIONS_SOMETIMES_ABSENT = ("task", "loop", "script", "data", "optim")


def job_params(raw: dict[str, Any]) -> dict[str, Any]:
    """The job as MLflow params: its keys flattened (a section a job of its kind does not have is
    left out); a script's arguments also one by one (``--lr 0.1`` -> ``script.args.lr``)."""
    present = {k: v for k, v in raw.items() if not (k in _SECTIONS_SOMETIMES_ABSENT and v is None)}
    params = flatten(present)
    script = raw.get("script") or {}
    params.update({f"script.args.{name}": value for name, value in script_arguments(script.get("args") or []).items()})
    return params


def script_arguments(args: list[str]) -> dict[str, str]:
    """``--name value``, ``--name=value`` and ``--flag`` (true) by name; the rest by position."""
    found: dict[str, str] = {}
    position = 0
    i = 0
    while i < len(args):
        arg = args[i]
        if arg.startswith("-") and len(arg) > 1 and not _is_number(arg):
            name, equals, value = arg.lstrip("-").partition("=")
            if not equals:
                following = args[i + 1] if i + 1 < len(args) else None
                if following is not None and (not following.startswith("-") or _is_number(following)):
                    value, i = following, i + 1
                else:
                    value = "true"
            found[name.replace("-", "_")] = value
        else:
            found[str(position)] = arg
            position += 1
        i += 1
    return found


def _is_number(text: str) -> bool:
    try:
        float(text)
    except ValueError:
        return False
    return True
