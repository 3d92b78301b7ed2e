"""The alerts of deploy/prometheus/alerts.yml, evaluated by the launcher itself, for users
without Prometheus: every ``every_s`` it adds up the run's telemetry files (as the endpoint
does), keeps 40 minutes of those snapshots, and applies the same rules to them.

When an alert fires: an error-level line in the launcher's log (and on the console) naming it
with its figures, a record for the summary and the MLflow run's tags, a POST to the webhook
in SCALETRAIN_ALERT_WEBHOOK_URL (retried; the URL is a secret, masked everywhere), and with
``action: stop`` the run stops at a step every rank agrees on, with a checkpoint, as on a
preemption signal. An alert that stops holding is said once, as resolved.
"""

from __future__ import annotations

import json
import logging
import os
import signal
import threading
import time
import urllib.request
from collections import deque
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from scaletrain.observe.exporter import read_shares

__all__ = ["AlertEvaluator", "AlertLoop", "Firing", "Snapshot", "WEBHOOK_ENV", "ALERTS_FIRING_FILE"]

WEBHOOK_ENV = "SCALETRAIN_ALERT_WEBHOOK_URL"
ALERT_CODE = "ST-ALERT"  # on an alert's error line (docs/observability.md)
# In the telemetry folder: the alerts firing now, one name a line (rewritten on each change; rank
# 0's progress bar shows them).
ALERTS_FIRING_FILE = "alerts-firing.txt"
_KEPT_S = 40 * 60  # the longest rule looks 35 minutes back


@dataclass
class Snapshot:
    """The job's figures at one moment, added up over the processes' shares."""

    at: float
    errors: dict[str, float] = field(default_factory=dict)
    work: dict[str, float] = field(default_factory=dict)
    samples: float = 0.0
    restarts: float = 0.0
    last_step_at: float | None = None
    last_checkpoint_at: float | None = None
    backlog: float | None = None

    @classmethod
    def read(cls, directory: Path, at: float) -> Snapshot:
        snap = cls(at)
        for share in read_shares(directory):
            figures = share["figures"]
            for name, into in (("errors_total", snap.errors), ("work_total", snap.work)):
                for kind, value in (figures.get(name) or {}).items():
                    into[kind] = into.get(kind, 0.0) + float(value)
            snap.samples += float(figures.get("samples_total", 0.0))
            snap.restarts += float(figures.get("restarts_total", 0.0))
            snap.last_step_at = _max(snap.last_step_at, figures.get("last_step_timestamp_seconds"))
            snap.last_checkpoint_at = _max(snap.last_checkpoint_at, figures.get("last_checkpoint_timestamp_seconds"))
            snap.backlog = _max(snap.backlog, figures.get("metrics_backlog_points"))
        return snap


def _max(a: float | None, b: Any) -> float | None:
    if not isinstance(b, (int, float)):
        return a
    return float(b) if a is None else max(a, float(b))


@dataclass(frozen=True)
class Firing:
    alert: str  # the Prometheus rule's name: ScaletrainErrorRateHigh
    key: str  # its settings in observability.alerts: error_rate
    labels: dict[str, str]
    value: float
    description: str
    severity: str

    @property
    def identity(self) -> tuple[str, tuple[tuple[str, str], ...]]:
        return self.alert, tuple(sorted(self.labels.items()))

    def as_dict(self) -> dict[str, Any]:
        return {"alert": self.alert, "labels": self.labels, "value": self.value, "description": self.description,
                "severity": self.severity}


class AlertEvaluator:
    """The rules over the snapshots; ``evaluate`` returns what fires now."""

    def __init__(self, settings: Any, started_at: float = 0.0):
        self.settings = settings
        # This launch's start: a resumed run's last step or checkpoint, hours old, is no
        # evidence of a stall now; time-based rules count from here at the earliest.
        self.started_at = started_at
        self.history: deque[Snapshot] = deque()

    def add(self, snap: Snapshot) -> None:
        self.history.append(snap)
        while self.history and self.history[0].at < snap.at - _KEPT_S:
            self.history.popleft()

    def _since(self, seconds: float) -> Snapshot | None:
        """The oldest snapshot of the last ``seconds`` (not the newest itself)."""
        now = self.history[-1].at
        for snap in list(self.history)[:-1]:
            if snap.at >= now - seconds:
                return snap
        return None

    def _at_or_before(self, when: float) -> Snapshot | None:
        found = None
        for snap in self.history:
            if snap.at > when:
                break
            found = snap
        return found

    def evaluate(self) -> list[Firing]:
        s, now = self.settings, self.history[-1]
        found: list[Firing] = []
        if s.error_rate.action != "off" and (base := self._since(s.error_rate.window_s)) is not None:
            for kind, work in sorted(now.work.items()):
                units = work - base.work.get(kind, 0.0)
                errors = now.errors.get(kind, 0.0) - base.errors.get(kind, 0.0)
                if units > 0 and errors / units > s.error_rate.threshold:
                    found.append(Firing(
                        "ScaletrainErrorRateHigh", "error_rate", {"kind": kind}, errors / units,
                        f"{kind} errors are {errors / units:.1%} of the {kind} work over the last "
                        f"{now.at - base.at:.0f} s ({errors:g} of {units:g}; threshold {s.error_rate.threshold:.0%})",
                        "warning"))
        if s.no_progress.action != "off" and now.last_step_at is not None:
            idle = now.at - max(now.last_step_at, self.started_at)
            if idle > s.no_progress.after_s:
                found.append(Firing("ScaletrainNoProgress", "no_progress", {}, idle,
                                    f"no rank finished a step for {idle:.0f} s", "critical"))
        if s.throughput_halved.action != "off":
            recent, before, oldest = self._since(300), self._at_or_before(now.at - 300), self._at_or_before(now.at - 2100)
            if recent is not None and before is not None and oldest is not None and before.at > oldest.at:
                rate_now = (now.samples - recent.samples) / max(now.at - recent.at, 1e-9)
                rate_before = (before.samples - oldest.samples) / (before.at - oldest.at)
                if rate_now < 0.5 * rate_before:
                    found.append(Firing("ScaletrainThroughputHalved", "throughput_halved", {}, rate_now,
                                        f"{rate_now:.1f} samples/s over 5 minutes, under half of the "
                                        f"{rate_before:.1f} of the 30 minutes before", "warning"))
        if s.checkpoint_stale.action != "off" and now.last_checkpoint_at is not None and now.last_step_at is not None:
            age = now.at - max(now.last_checkpoint_at, self.started_at)
            if age > s.checkpoint_stale.after_s and now.at - now.last_step_at < 600:
                found.append(Firing("ScaletrainCheckpointStale", "checkpoint_stale", {}, age,
                                    f"the newest checkpoint is {age:.0f} s old while training goes on", "warning"))
        if s.metrics_backlog.action != "off" and now.backlog is not None and now.backlog > s.metrics_backlog.points:
            earlier = self._at_or_before(now.at - 600)
            if earlier is not None and earlier.backlog is not None and earlier.backlog < now.backlog:
                found.append(Firing("ScaletrainMetricsBacklogGrowing", "metrics_backlog", {}, now.backlog,
                                    f"{now.backlog:.0f} metric points wait for the tracking server and the backlog "
                                    f"grows (it was {earlier.backlog:.0f} 10 minutes ago)", "warning"))
        if s.restarts.action != "off":
            base = self._since(900) or (self.history[0] if len(self.history) > 1 else None)
            if base is not None and now.restarts > base.restarts:
                count = now.restarts - base.restarts
                found.append(Firing("ScaletrainWorkersRestarted", "restarts", {}, count,
                                    f"{count:g} restart(s) of the workers after a failure in the last 15 minutes "
                                    "(the launcher's log says which rank failed and why)", "warning"))
        return found


class AlertLoop:
    """The launcher's thread: snapshot, evaluate, act on what starts or stops firing."""

    def __init__(self, settings: Any, directory: Path, info: dict[str, str], logger: logging.Logger):
        self.settings, self.directory, self.info, self.log = settings, Path(directory), info, logger
        self.evaluator = AlertEvaluator(settings, started_at=time.time())
        self.can_stop = True  # until the launch ends: a stop signal then would find no handler
        self.active: dict[Any, Firing] = {}
        self.fired: list[dict[str, Any]] = []  # every alert that fired, for the summary and MLflow
        self.stopped_by: Firing | None = None
        self.webhook = os.environ.get(WEBHOOK_ENV) or None
        if self.webhook and not self.webhook.lower().startswith(("http://", "https://")):
            logger.warning("%s is not an http(s) URL: alerts are not posted to it", WEBHOOK_ENV)
            self.webhook = None
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="scaletrain-alerts", daemon=True)

    def start(self) -> AlertLoop:
        self.evaluate()  # the baseline, before any worker counts anything
        self._thread.start()
        return self

    def close(self) -> None:
        self.can_stop = False
        self._stop.set()
        self._thread.join(timeout=10)
        self.evaluate()  # what the workers counted last

    def _run(self) -> None:
        while not self._stop.wait(self.settings.every_s):
            self.evaluate()

    def evaluate(self) -> None:
        try:
            self.evaluator.add(Snapshot.read(self.directory, time.time()))
            firing = {f.identity: f for f in self.evaluator.evaluate()}
        except Exception as exc:  # alerts must never take the run down
            self.log.warning("alert evaluation failed: %s: %s", type(exc).__name__, exc)
            return
        changed = set(firing) != set(self.active)
        for identity, alert in firing.items():
            if identity not in self.active:
                self._fire(alert)
        for identity, alert in list(self.active.items()):
            if identity not in firing:
                del self.active[identity]
                self.log.info("alert %s resolved", alert.alert, extra={"alert": alert.alert, "labels": alert.labels})
                self._post(alert, "resolved")
        self.active.update(firing)
        if changed:
            self._write_firing()

    def _write_firing(self) -> None:
        """The names firing now, for rank 0's progress bar (a figure: a failed write is no error)."""
        names = sorted({alert.alert for alert in self.active.values()})
        path = self.directory / ALERTS_FIRING_FILE
        temporary = path.with_name(f".{path.name}.tmp")
        try:
            temporary.write_text("".join(f"{name}\n" for name in names), encoding="utf-8")
            os.replace(temporary, path)
        except OSError:
            pass

    def _fire(self, alert: Firing) -> None:
        action = getattr(self.settings, alert.key).action
        record = {**alert.as_dict(), "at": time.time(), "action": action}
        self.fired.append(record)
        self.log.error("alert %s: %s", alert.alert, alert.description,
                       extra={"alert": alert.alert, "severity": alert.severity, "labels": alert.labels,
                              "value": alert.value, "action": action, "code": ALERT_CODE})
        self._post(alert, "firing")
        if action == "stop" and self.stopped_by is None and self.can_stop:
            # The launcher's stop path, as on preemption; only where a handler takes the signal
            # (SIGUSR1's default action would end this process outright).
            if signal.getsignal(signal.SIGUSR1) in (signal.SIG_DFL, signal.SIG_IGN, None):
                self.log.warning("alert %s asks to stop the run, but it cannot be stopped at this point",
                                 alert.alert)
                return
            self.stopped_by = alert
            self.log.error("stopping the run at a step every rank agrees on, with a checkpoint "
                           "(observability.alerts.%s.action: stop)", alert.key)
            os.kill(os.getpid(), signal.SIGUSR1)

    def _post(self, alert: Firing, status: str) -> None:
        if not self.webhook:
            return
        body = json.dumps({"status": status, **alert.as_dict(), **self.info}).encode()
        threading.Thread(target=_deliver, args=(self.webhook, body, self.log), name="scaletrain-webhook",
                         daemon=True).start()


RETRY_DELAY_S = 1.0  # then doubled after each failed try


def _deliver(url: str, body: bytes, log: logging.Logger, tries: int = 4) -> None:
    """POST with retries (1, 2, 4 s apart); a failure is one warning, never the run's."""
    delay = RETRY_DELAY_S
    for attempt in range(1, tries + 1):
        request = urllib.request.Request(  # noqa: S310  http(s) only: checked in AlertLoop
            url, data=body, method="POST", headers={"Content-Type": "application/json"})
        try:
            with urllib.request.urlopen(request, timeout=10) as response:  # noqa: S310  as above
                if 200 <= response.status < 300:
                    return
                problem = f"HTTP {response.status}"
        except Exception as exc:
            problem = f"{type(exc).__name__}: {exc}"
        if attempt < tries:
            time.sleep(delay)
            delay *= 2
    log.warning("the alert webhook (%s) did not take the alert after %d tries: %s", WEBHOOK_ENV, tries, problem)
