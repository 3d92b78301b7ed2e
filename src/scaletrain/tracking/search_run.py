"""The MLflow parent run of a `scaletrain tune` search (the launcher's side, MLflow imported
lazily): created once per search directory and reopened by --resume; finished with the best
trial tagged on both runs, or KILLED when the search is interrupted."""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

from scaletrain.config.schema import JobConfig
from scaletrain.rundir.atomic import write_text_atomic

__all__ = ["SearchRun", "PARENT_RUN_FILE"]

PARENT_RUN_FILE = "mlflow_parent_run.txt"  # in the search directory: the parent run's id
log = logging.getLogger("scaletrain_launcher.tune")


class SearchRun:
    """A search's MLflow run, the trials' runs nest under it; a tracker that is down costs one
    warning, never the search."""

    def __init__(self, job: JobConfig, directory: Path, params: dict[str, Any]):
        self.run_id: str | None = None
        self.client = None
        if not job.tracking.enabled:
            return
        try:
            from mlflow import MlflowClient

            from scaletrain.tracking.mlflow_client import configure_mlflow_client
            from scaletrain.tracking.mlflow_run import experiment_for, resolve_tracking_uri

            configure_mlflow_client()
            uri = resolve_tracking_uri(job)
            self.client = MlflowClient(tracking_uri=uri)
            experiment_id = experiment_for(self.client, uri, job.tracking.experiment or job.name)
            state = directory / PARENT_RUN_FILE
            if state.exists():  # --resume: the same parent run
                self.run_id = state.read_text(encoding="utf-8").strip()
                self.client.update_run(self.run_id, status="RUNNING")
                return
            run = self.client.create_run(experiment_id, run_name=f"tune {directory.name}", tags={
                "scaletrain.tune": "search", "scaletrain.tune.search": directory.name,
            })
            self.run_id = run.info.run_id
            write_text_atomic(state, self.run_id)
            self.client.log_batch(self.run_id, params=[_param(k, v) for k, v in params.items()])
        except Exception as exc:
            log.warning("no MLflow parent run for this search (%s: %s); the trials are tracked alone",
                        type(exc).__name__, str(exc).splitlines()[0][:200] if str(exc) else "")
            self.run_id = None

    def interrupted(self) -> None:
        if self.client is not None and self.run_id is not None:
            try:
                self.client.set_terminated(self.run_id, "KILLED")
            except Exception:  # noqa: S110  interrupted anyway: a tracker down must not hide that
                pass

    def finish(self, best: dict[str, Any] | None, rows: list[dict[str, Any]], metric: str) -> None:
        if self.client is None or self.run_id is None:
            return
        try:
            if best is not None:
                self.client.set_tag(self.run_id, "scaletrain.tune.best_trial", best["trial"])
                if best.get("mlflow_run_id"):
                    self.client.set_tag(self.run_id, "scaletrain.tune.best_run_id", best["mlflow_run_id"])
                    self.client.set_tag(best["mlflow_run_id"], "scaletrain.tune.best", "true")
                self.client.log_metric(self.run_id, f"best/{metric}", best["metric"])
            for status in ("finished", "pruned", "failed"):
                self.client.log_metric(self.run_id, f"trials_{status}", sum(r["status"] == status for r in rows))
            self.client.set_terminated(self.run_id, "FINISHED")
        except Exception as exc:
            log.warning("could not finish the MLflow parent run: %s", exc)


def _param(key: str, value: Any):
    from mlflow.entities import Param

    return Param(key, str(value)[:6000])

