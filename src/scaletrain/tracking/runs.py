"""Reading runs back from MLflow for ``scaletrain runs``, ``show`` and ``reproduce``."""

from __future__ import annotations

import json
import tempfile
from pathlib import Path
from typing import Any

from scaletrain.errors import ScaletrainError
from scaletrain.tracking.sender import configure_mlflow_client

__all__ = ["RunNotFound", "list_runs", "find_run", "run_details", "download_json"]


class RunNotFound(ScaletrainError):
    exit_code = 2


def _client(uri: str) -> Any:
    from mlflow import MlflowClient

    configure_mlflow_client()
    return MlflowClient(tracking_uri=uri)


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
    """An MLflow run by its id, or by scaletrain's own run id (the run name)."""
    from mlflow.exceptions import MlflowException

    client = _client(uri)
    try:
        return client.get_run(run_ref)
    except MlflowException:
        pass
    ids = [e.experiment_id for e in client.search_experiments()]
    if ids:
        found = client.search_runs(ids, filter_string=f"tags.`scaletrain.run_id` = '{run_ref}'")
        if found:
            return found[0]
    raise RunNotFound(f"no run '{run_ref}' at {uri}; list them with: scaletrain runs")


def download_json(uri: str, run_id: str, artifact: str) -> dict[str, Any] | None:
    client = _client(uri)
    with tempfile.TemporaryDirectory() as tmp:
        try:
            path = client.download_artifacts(run_id, artifact, tmp)
        except Exception:
            return None
        return json.loads(Path(path).read_text(encoding="utf-8"))


def download_artifact(uri: str, run_id: str, artifact: str, destination: str | Path) -> Path:
    return Path(_client(uri).download_artifacts(run_id, artifact, str(destination)))


def run_details(uri: str, run_ref: str) -> dict[str, Any]:
    run = find_run(uri, run_ref)
    client = _client(uri)
    card = download_json(uri, run.info.run_id, "run_card.json") or {}
    git = card.get("git") or {}
    return {
        "run": run.info.run_id,
        "name": run.info.run_name,
        "status": run.info.status,
        "experiment": client.get_experiment(run.info.experiment_id).name,
        "params": dict(sorted(run.data.params.items())),
        "metrics": dict(sorted(run.data.metrics.items())),
        "artifacts": sorted(a.path for a in client.list_artifacts(run.info.run_id)),
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
