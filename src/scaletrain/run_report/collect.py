"""Everything a report shows, read from the tracking store into plain data (no plotting here):
the run's metric histories, tags, params, run card and summary, and from its ``logs/`` artifact
the events of its time axis and each rank's telemetry; for a tune search, its trials."""

from __future__ import annotations

import json
import tempfile
from pathlib import Path
from typing import Any

from scaletrain.observe.catalog import STEP_BUCKETS
from scaletrain.run_report.events import launcher_events, rank_figures, read_lines, worker_events
from scaletrain.rundir import LAUNCHER_LOG, LOGS_DIR, RUN_CARD_FILE, SUMMARY_FILE, TELEMETRY_DIR, worker_log_name
from scaletrain.tracking.runs import download_artifact, download_json, find_run, read_error, tracking_client

__all__ = ["collect", "SEARCH_TAG"]

SEARCH_TAG = "scaletrain.tune"  # "search" on a search's parent run
_TRIAL_TAG = "scaletrain.tune.trial"
_MAX_TRIALS = 500


def collect(uri: str, run_ref: str) -> dict[str, Any]:
    """A run's report data, or a search's when ``run_ref`` is a search's parent run."""
    run = find_run(uri, run_ref)
    client = tracking_client(uri)
    if run.data.tags.get(SEARCH_TAG) == "search":
        return _search(client, uri, run)
    return _run(client, uri, run)


def _header(client: Any, uri: str, run: Any) -> dict[str, Any]:
    info, data = run.info, run.data
    try:
        experiment = client.get_experiment(info.experiment_id).name
    except Exception as exc:
        raise read_error(f"cannot read the experiment of run {info.run_id}", uri, exc) from None
    return {
        "mlflow_run_id": info.run_id,
        "run_id": data.tags.get("scaletrain.run_id") or info.run_name,
        "job": data.tags.get("scaletrain.job"),
        "name": info.run_name,
        "experiment": experiment,
        "status": info.status,
        "start": info.start_time / 1000 if info.start_time else None,
        "end": info.end_time / 1000 if info.end_time else None,
        "tags": {k: v for k, v in sorted(data.tags.items()) if not k.startswith("mlflow.")
                 or k in ("mlflow.source.git.commit", "mlflow.parentRunId")},
        "params": dict(sorted(data.params.items())),
        "final": dict(sorted(data.metrics.items())),
    }


def _histories(client: Any, uri: str, run_id: str, keys: list[str]) -> dict[str, list[tuple[int, float, float]]]:
    """key -> [(step, unix seconds, value)] sorted by step then time."""
    found = {}
    for key in keys:
        try:
            points = client.get_metric_history(run_id, key)
        except Exception as exc:
            raise read_error(f"cannot read metric {key} of run {run_id}", uri, exc) from None
        found[key] = sorted((int(p.step), p.timestamp / 1000, float(p.value)) for p in points)
    return found


def _run(client: Any, uri: str, run: Any) -> dict[str, Any]:
    report = {"kind": "run", **_header(client, uri, run)}
    run_id = run.info.run_id
    keys = sorted(k for k in run.data.metrics if k.startswith(("train/", "eval/")))
    report["metrics"] = _histories(client, uri, run_id, keys)
    report["summary"] = download_json(uri, run_id, SUMMARY_FILE)
    report["run_card"] = download_json(uri, run_id, RUN_CARD_FILE)
    with tempfile.TemporaryDirectory(prefix="scaletrain-report-") as tmp:
        worker = _text(uri, run_id, f"{LOGS_DIR}/{worker_log_name(0)}", tmp)
        launcher = _text(uri, run_id, f"{LOGS_DIR}/{LAUNCHER_LOG}", tmp)
        telemetry = _telemetry(uri, run_id, tmp)
    events = worker_events(read_lines(worker or "")) + launcher_events(read_lines(launcher or ""))
    report["events"] = sorted(events, key=lambda e: e.time)
    # The time axis starts when the job did: the MLflow run is opened while the workers start.
    earliest = [e.time for e in report["events"]] + [p[1] for v in report["metrics"].values() for p in v[:1]]
    if earliest and report["start"] is not None:
        report["start"] = min(report["start"], *earliest)
    report["ranks"] = rank_figures(telemetry, STEP_BUCKETS)
    report["alerts"] = list((report["summary"] or {}).get("alerts") or [])
    return report


def _text(uri: str, run_id: str, artifact: str, tmp: str) -> str | None:
    path = download_artifact(uri, run_id, artifact, Path(tmp, "a"))
    return path.read_text(encoding="utf-8", errors="replace") if path is not None else None


def _telemetry(uri: str, run_id: str, tmp: str) -> dict[str, dict[str, Any]]:
    """Each rank's telemetry file, the folder downloaded in one call."""
    folder = download_artifact(uri, run_id, f"{LOGS_DIR}/{TELEMETRY_DIR}", Path(tmp, "t"))
    found = {}
    for path in sorted(folder.glob("rank-*.json")) if folder is not None else []:
        try:
            document = json.loads(path.read_text(encoding="utf-8"))
        except ValueError:
            continue  # a torn file: that rank is left out of the per-rank table
        if isinstance(document, dict):
            found[path.name] = document
    return found


def _search(client: Any, uri: str, parent: Any) -> dict[str, Any]:
    report = {"kind": "search", **_header(client, uri, parent)}
    metric = report["params"].get("metric", "eval/loss")
    try:
        space = list(json.loads(report["params"].get("space", "{}")))
    except ValueError:
        space = []
    report.update(metric=metric, mode=report["params"].get("mode", "min"), space=space)
    try:
        runs = client.search_runs([parent.info.experiment_id], max_results=_MAX_TRIALS,
                                  filter_string=f"tags.`mlflow.parentRunId` = '{parent.info.run_id}'")
    except Exception as exc:
        raise read_error(f"cannot search the trials of run {parent.info.run_id}", uri, exc) from None
    trials = []
    for run in runs:
        header = _header(client, uri, run)
        keys = [k for k in (metric, "train/loss") if k in run.data.metrics]
        trials.append({
            **header,
            "trial": run.data.tags.get(_TRIAL_TAG, run.info.run_name),
            "best": run.data.tags.get("scaletrain.tune.best") == "true",
            "values": {key: header["params"].get(key) for key in space},
            "metrics": _histories(client, uri, run.info.run_id, keys),
        })
    report["trials"] = sorted(trials, key=lambda t: str(t["trial"]))
    return report
