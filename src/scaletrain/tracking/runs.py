"""Reading runs back from MLflow for ``scaletrain runs``, ``show`` and ``reproduce``."""

from __future__ import annotations

import json
import os
import tempfile
from pathlib import Path
from typing import Any

from scaletrain.errors import ScaletrainError
from scaletrain.rundir import RUN_CARD_FILE, check_run_ref
from scaletrain.tracking.mlflow_client import configure_mlflow_client
from scaletrain.tracking.redact import redact_url

__all__ = ["RunNotFound", "TrackingReadError", "list_runs", "find_run", "run_details", "download_json",
           "download_artifact", "tracking_client", "read_error"]


class RunNotFound(ScaletrainError):
    exit_code = 2
    code = "ST-RUN-NOT-FOUND"


class TrackingReadError(ScaletrainError):
    """The tracking store did not answer as asked (auth, network, a broken artifact store):
    said as such, never taken for a run or artifact that is not there."""

    code = "ST-TRACKING-READ"


def tracking_client(uri: str) -> Any:
    """An MlflowClient for ``uri``, configured as scaletrain's readers want it."""
    from mlflow import MlflowClient

    configure_mlflow_client()
    # Its download bars would surround the one line a refusal or a failure gets on stderr.
    os.environ.setdefault("MLFLOW_ENABLE_ARTIFACTS_PROGRESS_BAR", "false")
    return MlflowClient(tracking_uri=uri)


_client = tracking_client


def list_runs(uri: str, experiment: str | None, limit: int) -> list[dict[str, Any]]:
    """Newest first: run, status, steps, final loss, duration, git SHA."""
    client = _client(uri)
    if experiment:
        found = client.get_experiment_by_name(experiment)
        if found is None:
            names = sorted(e.name for e in client.search_experiments())
            raise RunNotFound(
                f"no experiment named '{experiment}' at this tracking store; "
                f"experiments: {', '.join(names) or 'none'}"
            )
        ids = [found.experiment_id]
    else:
        ids = [e.experiment_id for e in client.search_experiments()]
    if not ids:
        return []
    runs = client.search_runs(ids, order_by=["attributes.start_time DESC"], max_results=limit)
    rows = []
    for run in runs:
        info, data = run.info, run.data
        duration = (info.end_time - info.start_time) / 1000 if info.end_time else None
        rows.append(
            {
                "run": info.run_id,
                # What show, reproduce and resume take, and what the run directory is named.
                "run_id": data.tags.get("scaletrain.run_id"),
                "name": info.run_name,
                "experiment": client.get_experiment(info.experiment_id).name,
                "status": info.status,
                "steps": int(data.tags["scaletrain.steps"]) if "scaletrain.steps" in data.tags else None,
                "final_loss": data.metrics.get("train/loss"),
                "duration_s": duration,
                "git_sha": (data.tags.get("mlflow.source.git.commit") or "")[:10] or None,
            }
        )
    return rows


def find_run(uri: str, run_ref: str) -> Any:
    """An MLflow run by its id or scaletrain's own run id (the run name), or by a prefix of
    either that only one run has (as git and docker take ids). ``run_ref`` is checked first:
    it goes into MLflow's filter text."""
    from mlflow.exceptions import MlflowException

    check_run_ref(run_ref)
    client = _client(uri)
    try:
        return client.get_run(run_ref)
    except MlflowException as exc:
        if exc.error_code not in ("RESOURCE_DOES_NOT_EXIST", "INVALID_PARAMETER_VALUE"):
            raise read_error(f"cannot read run {run_ref}", uri, exc) from None
    try:
        ids = [e.experiment_id for e in client.search_experiments()]
        found = ids and client.search_runs(ids, filter_string=f"tags.`scaletrain.run_id` = '{run_ref}'")
        if not found and ids:
            # LIKE: '_' (allowed in ids) matches any character there, so the prefix is checked again.
            found = [run for query in (f"attributes.run_id LIKE '{run_ref}%'",
                                       f"tags.`scaletrain.run_id` LIKE '{run_ref}%'")
                     for run in client.search_runs(ids, filter_string=query, max_results=50)]
            found = list({run.info.run_id: run for run in found if _starts(run, run_ref)}.values())
    except Exception as exc:
        raise read_error(f"cannot search the runs for {run_ref}", uri, exc) from None
    if len(found or []) > 1 and found[0].data.tags.get("scaletrain.run_id") != run_ref:
        names = ", ".join(sorted(_ref_of(run, run_ref) for run in found)[:5])
        more = f" and {len(found) - 5} more" if len(found) > 5 else ""
        raise RunNotFound(f"'{run_ref}' is the start of {len(found)} runs' ids ({names}{more}); "
                          "type more of it")
    if found:
        return found[0]
    raise RunNotFound(f"no run '{run_ref}' at {redact_url(uri)}; list them with: scaletrain runs")


def _starts(run: Any, prefix: str) -> bool:
    return run.info.run_id.startswith(prefix) or run.data.tags.get("scaletrain.run_id", "").startswith(prefix)


def _ref_of(run: Any, prefix: str) -> str:
    """The id of ``run`` that starts with ``prefix`` (the one the user was typing)."""
    own = run.data.tags.get("scaletrain.run_id", "")
    return own if own.startswith(prefix) else run.info.run_id


def download_json(uri: str, run_id: str, artifact: str) -> dict[str, Any] | None:
    """The run's JSON artifact, or None when the run has no artifact by that name."""
    with tempfile.TemporaryDirectory() as tmp:
        path = download_artifact(uri, run_id, artifact, tmp)
        if path is None:
            return None
        try:
            return json.loads(path.read_text(encoding="utf-8"))
        except ValueError as exc:
            raise TrackingReadError(f"{artifact} of run {run_id} is not JSON: {exc}") from None


def download_artifact(uri: str, run_id: str, artifact: str, destination: str | Path) -> Path | None:
    """The run's artifact, downloaded; None when it has none by that name. MLflow reports any
    download failure as a missing path, so the listing (which says what failed) comes first."""
    client = _client(uri)
    folder = str(Path(artifact).parent) if "/" in artifact else None
    try:
        present = {a.path for a in client.list_artifacts(run_id, folder)}
    except Exception as exc:
        raise read_error(f"cannot list the artifacts of run {run_id}", uri, exc) from None
    if artifact not in present:
        return None
    try:
        return Path(client.download_artifacts(run_id, artifact, str(destination)))
    except Exception as exc:
        raise read_error(f"cannot download {artifact} of run {run_id}", uri, exc) from None


def read_error(what: str, uri: str, exc: BaseException) -> TrackingReadError:
    """``exc`` from the store as one line naming what was being read and where."""
    text = str(exc).strip().splitlines()[0][:300] if str(exc).strip() else ""
    why = f"{type(exc).__name__}: {text}" if text else type(exc).__name__
    return TrackingReadError(f"{what} at {redact_url(uri)}: {why}")


def run_details(uri: str, run_ref: str) -> dict[str, Any]:
    run = find_run(uri, run_ref)
    client = _client(uri)
    card = download_json(uri, run.info.run_id, RUN_CARD_FILE) or {}
    git = card.get("git") or {}
    return {
        "run": run.info.run_id,
        "name": run.info.run_name,
        "status": run.info.status,
        "experiment": client.get_experiment(run.info.experiment_id).name,
        "params": dict(sorted(run.data.params.items())),
        "metrics": dict(sorted(run.data.metrics.items())),
        "artifacts": _artifact_names(client, uri, run.info.run_id),
        "run_card": {
            "python": card.get("python"),
            "torch": (card.get("torch") or {}).get("version"),
            "host": (card.get("hardware") or {}).get("host"),
            "cpu": (card.get("hardware") or {}).get("cpu"),
            "gpus": (card.get("hardware") or {}).get("gpus"),
            "git_commit": git.get("commit"),
            "git_dirty": git.get("dirty"),
            "data_fingerprint": card.get("data_fingerprint"),
            "packages": len(card.get("packages", [])),
        }
        if card
        else None,
    }


def _artifact_names(client: Any, uri: str, run_id: str) -> list[str]:
    try:
        return sorted(a.path for a in client.list_artifacts(run_id))
    except Exception as exc:
        raise read_error(f"cannot list the artifacts of run {run_id}", uri, exc) from None
