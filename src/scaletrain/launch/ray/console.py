"""The console relay: under Ray the workers' stderr does not reach the user, so rank 0 sends its
progress and warnings through the mailbox (RemoteConsole, in the worker) and the launcher shows
them as the local engine's workers would (ConsoleRelay, in the driver), writing the run's files
that workers on other machines relay (relay.py) on the way."""

from __future__ import annotations

import logging
import sys
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

from scaletrain.rundir import RunSpec

__all__ = ["RemoteConsole", "ConsoleRelay"]


class RemoteConsole:
    """Rank 0's side of the relay (a Reporter sink plus a logging handler): progress at each
    report and warnings go to the mailbox, without waiting for it."""

    def __init__(self, mailbox: Any, relay: Any = None):
        self.mailbox = mailbox
        self.log_handler: logging.Handler = _WarningRelay(mailbox)
        # On another machine than the driver's: the run's files are relayed, up to date at
        # every checkpoint.
        self.before_checkpoint: Callable[[], None] | None = relay.flush if relay is not None else None

    def mlflow_run_id(self) -> str | None:
        """The job's MLflow run, as the driver saw it open (for checkpoint manifests)."""
        import ray

        try:
            return ray.get(self.mailbox.mlflow_run.remote(), timeout=10)
        except Exception:
            return None

    def on_start(self, total_steps: int | None, start_step: int) -> None:
        self.mailbox.push.remote("start", {"total": total_steps, "start": start_step})

    def on_step(self, step: int) -> None:
        pass

    def on_train_metrics(self, reports: list) -> None:
        last = reports[-1]
        self.mailbox.push.remote("progress", {"step": last.step, "metrics": last.metrics})

    def on_eval_metrics(self, step: int, metrics: dict[str, float]) -> None:
        self.mailbox.push.remote("eval", {"step": step, "metrics": metrics})

    def on_end(self) -> None:
        pass


class _WarningRelay(logging.Handler):
    def __init__(self, mailbox: Any):
        super().__init__(level=logging.WARNING)
        self.mailbox = mailbox

    def emit(self, record: logging.LogRecord) -> None:
        if getattr(record, "console", True):
            self.mailbox.push.remote("warning", record.getMessage())


class ConsoleRelay:
    """The launcher's side: every half second, what rank 0 sent goes to this console, as the
    local engine's workers would show it (a progress bar on a terminal, JSON lines otherwise)."""

    def __init__(self, mailbox: Any, spec: RunSpec):
        self.mailbox = mailbox
        self.run_dir = spec.run_dir
        self.mlflow_run_sent = False
        self.total = 0
        self.log = logging.getLogger("scaletrain_launcher.ray.console")
        self.bar = None
        self.attempts = 0  # starts of the worker group seen (Ray Train restarts it on a failure)
        if sys.stderr.isatty():
            from scaletrain.tracking.progress import ProgressBar

            self.bar = ProgressBar(spec.job.get("name", "train"))
        self._done = threading.Event()
        self._thread = threading.Thread(target=self._run, name="scaletrain-ray-console", daemon=True)

    def start(self) -> ConsoleRelay:
        self._thread.start()
        return self

    def _run(self) -> None:
        import ray

        while True:
            stopping = self._done.wait(0.5)
            try:
                events = ray.get(self.mailbox.drain.remote(), timeout=10)
            except Exception:
                events = []
            try:  # what workers on other machines relay for the run directory
                self._write_files(ray.get(self.mailbox.drain_files.remote(), timeout=60))
                self._answer(ray.get(self.mailbox.asked_files.remote(), timeout=10))
                self._share_mlflow_run()
            except Exception as exc:
                self.log.warning("relaying the run's files failed: %s: %s", type(exc).__name__, exc)
            for kind, data in events:
                self._show(kind, data)
            try:
                self._count_restarts(ray.get(self.mailbox.attempts.remote(), timeout=10))
            except Exception:  # noqa: S110  the figures wait for the next look
                pass
            if stopping:
                return

    def _count_restarts(self, attempts: int) -> None:
        """Ray Train restarted the worker group: counted live (the endpoint, the alerts) and
        said in the launcher's log, as the local engine does."""
        from scaletrain.errors import WorkerFailedError
        from scaletrain.observe.telemetry import current as telemetry

        for attempt in range(max(self.attempts, 1), attempts):
            figures = telemetry()
            figures.add("restarts_total")
            figures.work("attempt", 1, errors=1)
            figures.flush(force=True)
            logging.getLogger("scaletrain_launcher.restart").warning(
                "restarting the workers (start %d) after a worker failure; the failed rank's error is in %s",
                attempt + 1, Path(self.run_dir) / "logs", extra={"code": WorkerFailedError.code})
        self.attempts = max(self.attempts, attempts)

    def _write_files(self, items: list) -> None:
        """Workers on other machines relay the run's files (relay.py): written here."""
        from scaletrain.launch.ray.relay import write_relayed

        for path in write_relayed(self.run_dir, items):
            self.log.warning("ignored a relayed file outside the run's files: %r", path)

    def _answer(self, asked: list[str]) -> None:
        if asked:
            from scaletrain.launch.ray.relay import read_asked

            self.mailbox.provide_files.remote(read_asked(self.run_dir, asked))

    def _share_mlflow_run(self) -> None:
        """Once the tracking process has opened the job's MLflow run: its id, for checkpoint
        manifests written on other machines."""
        if self.mlflow_run_sent:
            return
        from scaletrain.tracking.tracker_handle import recorded_run

        run_id = (recorded_run(self.run_dir) or {}).get("run_id")
        if run_id:
            self.mailbox.set_mlflow_run.remote(run_id)
            self.mlflow_run_sent = True

    def _show(self, kind: str, data: Any) -> None:
        from scaletrain.tracking.reporter import StepReport

        if kind == "warning":
            self.log.warning("%s", data)
        elif kind == "start":
            self.total = data["total"]
            if self.bar is not None:
                self.bar.on_start(data["total"], data["start"])
        elif kind == "progress" and self.bar is not None:
            self.bar.on_step(data["step"])
            self.bar.on_train_metrics([StepReport(data["step"], data["metrics"], 0.0)])
        elif kind in ("progress", "eval"):
            self.log.info("%s metrics", "train" if kind == "progress" else "eval",
                          extra={"step": data["step"], "metrics": data["metrics"]})

    def close(self) -> None:
        self._done.set()
        self._thread.join(timeout=15)
        if self.bar is not None:
            self.bar.on_end()
