"""``scaletrain report``: collect a run's (or a search's) data, draw it, write ``report.html``
and its PNGs to a folder, and attach them to the MLflow run under ``report/``."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from scaletrain.errors import ScaletrainError
from scaletrain.run_report import plots
from scaletrain.run_report.collect import collect
from scaletrain.run_report.page import render
from scaletrain.rundir import write_text_atomic
from scaletrain.tracking.runs import read_error, tracking_client

__all__ = ["write_report", "REPORT_FILE", "REPORT_ARTIFACT_DIR", "ReportError"]

REPORT_FILE = "report.html"
REPORT_ARTIFACT_DIR = "report"


class ReportError(ScaletrainError):
    code = "ST-REPORT"


def write_report(uri: str, run_ref: str, out: Path | None, attach: bool = True) -> dict[str, Any]:
    """The report of ``run_ref`` in ``out`` (default ``reports/<run id>``); what was written."""
    report = collect(uri, run_ref)
    drawings = ("trials",) if report["kind"] == "search" else ("curves", "timeline", "speed", "ranks")
    images = {}
    for name in drawings:
        image = getattr(plots, name)(report)
        if image is not None:
            images[name] = image
    folder = out if out is not None else Path("reports") / _folder_name(report)
    try:
        folder.mkdir(parents=True, exist_ok=True)
        for name, image in images.items():
            (folder / f"{name}.png").write_bytes(image)
        write_text_atomic(folder / REPORT_FILE, render(report, images))
    except OSError as exc:
        raise ReportError(f"cannot write the report to {folder}: {exc.strerror or exc}; "
                          "choose another folder with --out") from None
    attached = None
    if attach:
        try:
            tracking_client(uri).log_artifacts(report["mlflow_run_id"], str(folder), REPORT_ARTIFACT_DIR)
            attached = f"{REPORT_ARTIFACT_DIR}/{REPORT_FILE}"
        except Exception as exc:
            raise read_error(f"the report is in {folder / REPORT_FILE}, but attaching it to run "
                             f"{report['mlflow_run_id']} failed", uri, exc) from None
    return {
        "kind": report["kind"],
        "report": str(folder / REPORT_FILE),
        "images": sorted(f"{folder / name}.png" for name in images),
        "mlflow_run_id": report["mlflow_run_id"],
        "artifact": attached,
    }


def _folder_name(report: dict[str, Any]) -> str:
    name = str(report["run_id"] if report["kind"] == "run" else f"tune-{report['name']}")
    return "".join(c if c.isalnum() or c in "-_." else "-" for c in name).strip(".") or report["mlflow_run_id"]
