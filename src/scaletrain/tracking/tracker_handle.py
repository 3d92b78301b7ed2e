"""In the launcher: its handle on the tracking process (tracker_process.py) of one attempt.

The launcher never imports MLflow: the tracking process opens the run while the workers start
and ships the journal while they train; the launcher only learns the run's id and, at the
end, tells it the final status and the artifacts to log. Nothing here waits for the tracker
except the end of the attempt, which gives an unreachable one ``tracking.flush_timeout_s``.
A resumed job reopens its run (its id is kept in ``tracking/mlflow_run.json``).
"""

from __future__ import annotations

import json
import logging
import os
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

from scaletrain.config.schema import JobConfig
from scaletrain.rundir import EXTRA_TAGS_ENV, MLFLOW_RUN_FILE, TRACKING_DIR
from scaletrain.tracking.redact import redact_url

__all__ = ["TrackingSession", "WarmTracker", "record_run", "recorded_run"]

ARTIFACTS_TIMEOUT_S = 600.0


def recorded_run(run_dir: str | Path, config: JobConfig | None = None) -> dict[str, str] | None:
    """The MLflow run a run directory belongs to, if one was ever created. Its store's URI is
    recorded without credentials (see record_run); with ``config``, the job's own URI stands
    in for it when it names the same store, credentials and all."""
    try:
        data = json.loads((Path(run_dir) / TRACKING_DIR / MLFLOW_RUN_FILE).read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    if not isinstance(data, dict) or not data.get("run_id"):
        return None
    if config is not None and data.get("uri"):
        from scaletrain.tracking.mlflow_run import resolve_tracking_uri

        current = resolve_tracking_uri(config)
        if redact_url(current) == data["uri"]:
            data["uri"] = current
    if "://***@" in str(data.get("uri")):  # another store's credentials: MLFLOW_TRACKING_USERNAME's, if any
        data["uri"] = data["uri"].replace("://***@", "://", 1)
    return data


def record_run(run_dir: str | Path, uri: str, run_id: str) -> None:
    """Remember the job's MLflow run for a resume. A password in the URI stays out of the run
    directory (it is copied, shared and uploaded): the job file or the environment gives it again."""
    from scaletrain.rundir.atomic import write_text_atomic

    write_text_atomic(Path(run_dir) / TRACKING_DIR / MLFLOW_RUN_FILE, json.dumps({"uri": redact_url(uri), "run_id": run_id}))


class WarmTracker:
    """The tracking process started as soon as the job is read, before the launcher imports
    torch: MLflow's import (~3 s of CPU with the sqlite store's) then runs on the core the
    launcher's single-threaded start-up leaves idle, not on the cores the starting workers
    need. It waits for the attempt's details on stdin (TrackingSession.start); closed unused
    (a refused job, no attempt), it reads end of file and exits."""

    def __init__(self, config: JobConfig):
        from scaletrain.tracking.mlflow_run import resolve_tracking_uri

        scheme = resolve_tracking_uri(config).split(":", 1)[0]  # never the URI: it may hold a password
        self.process: subprocess.Popen | None = subprocess.Popen(  # noqa: S603  our module, no shell
            [sys.executable, "-m", "scaletrain.tracking.tracker_process", "--warm", scheme],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
        )

    def take(self) -> subprocess.Popen | None:
        process, self.process = self.process, None
        return process

    def discard(self) -> None:
        """Not used (the job stopped before its attempt): end it."""
        process = self.take()
        if process is None:
            return
        try:
            assert process.stdin is not None  # noqa: S101  started with pipes
            process.stdin.close()
            process.wait(10)
        except (OSError, subprocess.TimeoutExpired):
            process.kill()
            process.wait()


class TrackingSession:
    def __init__(self, config: JobConfig, spec: Any, engine: str, extra_tags: dict[str, str] | None,
                 log: logging.Logger, max_backoff_s: float = 10.0):
        self.config, self.spec, self.engine, self.extra_tags = config, spec, engine, extra_tags
        self.log = log
        self.run_dir = Path(spec.run_dir)
        self.run_id: str | None = None
        self._max_backoff = max_backoff_s
        self._proc: subprocess.Popen | None = None
        self._settled = threading.Event()  # the run is open, or the process has ended
        self._exited = threading.Event()
        self._report: dict[str, Any] | None = None
        self._deadline: float | None = None  # set when the attempt ends

    def start(self, warm: WarmTracker | None = None) -> TrackingSession:
        """Start the tracking process, or hand the attempt to the one ``warm`` started (it
        reads the run's spec.json, written before)."""
        args = [str(self.run_dir), str(self.spec.launcher_log), self.engine, str(self._max_backoff)]
        self._proc = warm.take() if warm is not None else None
        if self._proc is not None:
            try:  # the extra tags go down the pipe: other users can read a command line
                assert self._proc.stdin is not None  # noqa: S101  started with pipes
                self._proc.stdin.write(json.dumps({"args": args, "extra_tags": self.extra_tags or {}}) + "\n")
                self._proc.stdin.flush()
            except OSError:  # it died while warming: start one the usual way
                self._proc.wait()
                self._proc = None
        if self._proc is None:
            self._proc = subprocess.Popen(  # noqa: S603  this interpreter and our module, no shell
                [sys.executable, "-m", "scaletrain.tracking.tracker_process", *args],
                stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
                # In the environment, not the command line: other users can read a command line.
                env={**os.environ, EXTRA_TAGS_ENV: json.dumps(self.extra_tags or {})},
            )
        threading.Thread(target=self._read, name="scaletrain-tracking", daemon=True).start()
        return self

    def _read(self) -> None:
        assert self._proc is not None and self._proc.stdout is not None  # noqa: S101  started with pipes
        for line in self._proc.stdout:
            try:
                message = json.loads(line)
            except ValueError:
                continue
            if message.get("event") == "opened":
                self.run_id = message["run_id"]
                self._settled.set()
            elif message.get("event") == "closed":
                self._report = message
        self._exited.set()
        self._settled.set()

    def finish_opening(self) -> str | None:
        """At the end of the attempt: give a run still being opened up to
        ``tracking.flush_timeout_s``; returns its id, or None if the tracker never answered."""
        self._deadline = time.monotonic() + self.config.tracking.flush_timeout_s
        self._settled.wait(self.config.tracking.flush_timeout_s)
        return self.run_id

    def close(self, summary: dict[str, Any], status: str, metrics: dict[str, float],
              artifacts: list[tuple[Path, str | None]]) -> None:
        """Deliver what is left within ``tracking.flush_timeout_s``, log ``artifacts`` and the
        job's final ``metrics`` (system/...), end the run."""
        assert self._proc is not None and self._proc.stdin is not None  # noqa: S101  started with pipes
        deadline = self._deadline or time.monotonic() + self.config.tracking.flush_timeout_s
        timeout = max(0.0, deadline - time.monotonic())
        tags: dict[str, Any] = {}
        if summary.get("steps") is not None:  # unknown (a worker killed outright): no tag, not 0
            tags["scaletrain.steps"] = summary["steps"]
        if summary.get("weights_sha256"):
            tags["scaletrain.weights_sha256"] = summary["weights_sha256"]
        if summary.get("alerts"):  # the built-in alerts that fired (observe/alerts.py)
            tags["scaletrain.alerts"] = ", ".join(sorted({a["alert"] for a in summary["alerts"]}))
        if summary.get("stopped_by"):
            tags["scaletrain.stopped_by"] = summary["stopped_by"]
        if isinstance(summary.get("goodput"), dict):  # this launch's (observe/goodput.py)
            tags["scaletrain.goodput"] = summary["goodput"]["ratio"]
        command = {"timeout_s": timeout, "status": status, "tags": tags, "restarts": summary.get("restarts", 0),
                   "metrics": metrics, "step": summary.get("steps"),
                   "artifacts": [[str(path), artifact_path] for path, artifact_path in artifacts]}
        try:
            self._proc.stdin.write(json.dumps(command) + "\n")
            self._proc.stdin.close()
        except OSError:  # it is gone: what it reported (or not) is all there is
            pass
        # Delivery gets ``timeout``; uploading the artifacts (the weights, twice) gets more.
        if not self._exited.wait(timeout + ARTIFACTS_TIMEOUT_S):
            self._proc.kill()
        self._proc.wait()
        report = self._report
        if report is None and self.run_id is not None:
            self.log.warning("the tracking process did not report back; what it could not send "
                             "stays in %s", self.run_dir / TRACKING_DIR)
            return
        if report is None or not report.get("opened"):
            self.log.warning(
                "the tracking server never answered: no MLflow run for this attempt; its metrics "
                "stay in %s (and metrics.jsonl)", self.run_dir / TRACKING_DIR,
            )
            return
        self.log.info(
            "metric shipper done: %s points delivered this attempt, %s CPU-seconds (%s of them "
            "starting up)", report["delivered"], report["cpu_s"], report.get("startup_cpu_s"),
            extra={"console": False, "points_delivered": report["delivered"],
                   "shipper_cpu_s": report["cpu_s"], "shipper_startup_cpu_s": report.get("startup_cpu_s")},
        )
        if report["left"]:
            self.log.warning(
                "%d metric points could not be delivered to the tracking server; they are kept in "
                "%s and sent by the next attempt", report["left"], self.run_dir / TRACKING_DIR,
            )
