"""The launcher's MLflow side of one attempt: open the run, ship the journal, close the run.

Opening never holds training up. When the workers are other processes, a background thread
of the launcher imports MLflow and opens the run while they start (~4 s of CPU on a small
machine; rank 0 journals regardless). A lower priority for that thread was tried and made the
first step later: it holds the launcher's GIL while it waits for a core. In one process (the
in-process engine) the run is opened first: a thread there would take the interpreter from
the training loop. When the tracker does not answer, one warning is logged and a background
thread keeps trying with backoff while training goes on. When the run finally exists,
everything journaled so far is sent. A resumed job reopens its run (its id is kept in
``tracking/mlflow_run.json``) and counts one more attempt.
"""

from __future__ import annotations

import json
import logging
import threading
import time
from pathlib import Path
from typing import Any

from scaletrain.checkpoint.atomic import write_text_atomic
from scaletrain.config.schema import JobConfig

__all__ = ["TrackingSession", "recorded_run"]

RUN_FILE = "mlflow_run.json"


def recorded_run(run_dir: str | Path) -> dict[str, str] | None:
    """The MLflow run a run directory belongs to, if one was ever created."""
    try:
        data = json.loads((Path(run_dir) / "tracking" / RUN_FILE).read_text(encoding="utf-8"))
        return data if data.get("run_id") else None
    except (OSError, ValueError):
        return None


class TrackingSession:
    def __init__(self, config: JobConfig, spec: Any, engine: str, extra_tags: dict[str, str] | None,
                 log: logging.Logger, max_backoff_s: float = 10.0):
        self.config, self.spec, self.engine, self.extra_tags = config, spec, engine, extra_tags
        self.log = log
        self.run_dir = Path(spec.run_dir)
        self.run: Any = None  # TrackingRun, once opened
        self.shipper: Any = None
        self._ready = threading.Event()
        self._closing = threading.Event()
        self._max_backoff = max_backoff_s
        self._opener: threading.Thread | None = None
        self._deadline: float | None = None  # set when the attempt ends

    @property
    def run_id(self) -> str | None:
        return self.run.run_id if self.run is not None else None

    def start(self, background: bool = True) -> TrackingSession:
        """``background``: open while the workers start (they are other processes)."""
        if background:
            self._opener = threading.Thread(target=self._open_or_keep_trying, daemon=True,
                                            name="scaletrain-open-run")
            self._opener.start()
        elif not self._try_open():
            self._opener = threading.Thread(target=self._keep_trying, daemon=True, name="scaletrain-open-run")
            self._opener.start()
        return self

    def _open_or_keep_trying(self) -> None:
        if not self._try_open():
            self._keep_trying()

    def _try_open(self) -> bool:
        from scaletrain.tracking.sender import configure_mlflow_client

        try:
            configure_mlflow_client()
            self._open()
            return True
        except Exception as exc:
            self.log.warning(
                "cannot reach the tracking server to open the MLflow run (%s); training goes "
                "on, metrics are journaled in %s and sent once it answers",
                _one_line(exc), self.run_dir / "tracking",
            )
            return False

    def _open(self) -> None:
        from scaletrain.tracking.mlflow_run import TrackingRun
        from scaletrain.tracking.ship import ShipperProcess

        known = recorded_run(self.run_dir)
        if known:  # a resumed job continues its run
            run = TrackingRun.reopen(self.config, known["uri"], known["run_id"], self.spec.attempt)
        else:
            spec = self.spec
            run = TrackingRun.start(self.config, spec.run_id, spec.trace_id, self.engine,
                                    spec.python_path, self.extra_tags)
            write_text_atomic(self.run_dir / "tracking" / RUN_FILE,
                              json.dumps({"uri": run.uri, "run_id": run.run_id}))
            run.log_artifact(self.run_dir / "job.yaml")
        run.start_system_metrics(self.config.tracking.system_metrics_every_s)
        self.shipper = ShipperProcess(
            run.uri, run.run_id, self.run_dir / "tracking", self.spec.logs_dir / "launcher.jsonl",
            self.spec.run_id, self.spec.trace_id,
        ).start()
        self.spec.tracking_uri, self.spec.tracking_run_id = run.uri, run.run_id
        self.run = run
        self._ready.set()

    def _keep_trying(self) -> None:
        backoff = 1.0
        while not self._closing.is_set():
            if self._closing.wait(backoff):
                return
            try:
                self._open()
            except Exception:
                backoff = min(self._max_backoff, backoff * 2)
                continue
            self.log.warning("tracking server reachable: opened MLflow run %s; sending the "
                             "journaled metrics", self.run_id)
            return

    def finish_opening(self) -> str | None:
        """At the end of the attempt: give a run still being opened up to
        ``tracking.flush_timeout_s``; returns its id, or None if the tracker never answered."""
        self._deadline = time.monotonic() + self.config.tracking.flush_timeout_s
        if self._opener is not None:
            self._ready.wait(self.config.tracking.flush_timeout_s)
            self._closing.set()
            self._opener.join()
        return self.run_id

    def close(self, summary: dict[str, Any], status: str, artifacts: list[tuple[Path, str | None]]) -> None:
        """Deliver what is left within ``tracking.flush_timeout_s``, log ``artifacts``, end the run."""
        deadline = self._deadline or time.monotonic() + self.config.tracking.flush_timeout_s
        if self.run is None:
            self.log.warning(
                "the tracking server never answered: no MLflow run for this attempt; its metrics "
                "stay in %s (and metrics.jsonl)", self.run_dir / "tracking",
            )
            return
        shipped = self.shipper.close(max(0.0, deadline - time.monotonic()))
        left = shipped["left"]
        self.log.info(
            "metric shipper done: %s points delivered this attempt, %s CPU-seconds (%s of them "
            "starting up)", shipped["delivered"], shipped["cpu_s"], shipped["startup_cpu_s"],
            extra={"console": False, "points_delivered": shipped["delivered"],
                   "shipper_cpu_s": shipped["cpu_s"], "shipper_startup_cpu_s": shipped["startup_cpu_s"]},
        )
        if left < 0:
            self.log.warning("the metric shipper did not report back; what it could not send "
                             "stays in %s", self.run_dir / "tracking")
        elif left:
            self.log.warning(
                "%d metric points could not be delivered to the tracking server; they are kept in "
                "%s and sent by the next attempt", left, self.run_dir / "tracking",
            )
        try:
            for path, artifact_path in artifacts:
                self.run.log_artifact(path, artifact_path)
            tags: dict[str, Any] = {"scaletrain.steps": summary.get("steps", 0)}
            if summary.get("weights_sha256"):
                tags["scaletrain.weights_sha256"] = summary["weights_sha256"]
            self.run.finish(status, tags, restarts=summary.get("restarts", 0))
        except Exception as exc:
            self.log.warning("could not record the end of MLflow run %s (%s); the run directory "
                             "has it all", self.run_id, _one_line(exc))


def _one_line(exc: BaseException) -> str:
    text = str(exc).splitlines()[0][:200] if str(exc) else ""
    return f"{type(exc).__name__}: {text}" if text else type(exc).__name__
