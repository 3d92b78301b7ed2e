"""The launcher's built-in alerts apply the rules of deploy/prometheus/alerts.yml to the job's
figures: each fires when it should and not before (the same cases as alerts_test.yml)."""

from __future__ import annotations

from scaletrain.config.schema import AlertsConfig
from scaletrain.observe.alerts import AlertEvaluator, Snapshot


def run(snapshots: list[Snapshot], started_at: float = 0.0, **settings) -> list[tuple[str, dict, float]]:
    evaluator = AlertEvaluator(AlertsConfig.model_validate(settings), started_at)
    for snap in snapshots:
        evaluator.add(snap)
    return [(f.alert, f.labels, round(f.value, 3)) for f in evaluator.evaluate()]


def minutes(n: int, **figures) -> list[Snapshot]:
    """A snapshot a minute for ``n`` minutes; each figure a function of the minute."""
    return [Snapshot(60.0 * m, **{k: f(m) for k, f in figures.items()}) for m in range(n + 1)]


def test_the_error_rate_of_each_kind_over_the_window():
    snaps = minutes(10, errors=lambda m: {"sample": 10.0 * m, "step": 1.0 * m},
                    work=lambda m: {"sample": 100.0 * m, "step": 100.0 * m})
    assert run(snaps) == [("ScaletrainErrorRateHigh", {"kind": "sample"}, 0.1)]  # 1% of steps: none
    assert run(snaps, error_rate={"threshold": 0.2}) == []
    assert run(snaps, error_rate={"action": "off"}) == []
    assert run(snaps[:1]) == []  # one snapshot: no rate yet


def test_no_progress_after_the_last_step():
    snaps = minutes(18, last_step_at=lambda m: 60.0 * min(m, 5) + 60)
    assert run(snaps[:17]) == []  # 600 s since the last step, not more
    assert run(snaps) == [("ScaletrainNoProgress", {}, 720.0)]
    # A resumed run: its last step is hours old, but this launch started 5 minutes ago.
    assert run(snaps, started_at=60.0 * 13) == []


def test_throughput_halved_against_the_30_minutes_before():
    rate = lambda m: 100.0 * m if m <= 40 else 4000.0 + 30 * (m - 40)  # noqa: E731  per minute: 100, then 30
    assert run(minutes(30, samples=rate)) == []
    assert run(minutes(50, samples=rate)) == [("ScaletrainThroughputHalved", {}, 0.5)]


def test_a_stale_checkpoint_while_steps_go_on():
    snaps = minutes(61, last_checkpoint_at=lambda m: 0.0, last_step_at=lambda m: 60.0 * m)
    assert run(snaps[:60]) == []
    assert run(snaps) == [("ScaletrainCheckpointStale", {}, 3660.0)]
    assert run(snaps, started_at=60.0 * 30) == []  # resumed from that checkpoint 31 minutes ago


def test_a_growing_metrics_backlog():
    snaps = minutes(20, backlog=lambda m: 200.0 * m)
    assert run(snaps[:5]) == []  # 1000 points, not more
    assert run(snaps) == [("ScaletrainMetricsBacklogGrowing", {}, 4000.0)]


def test_a_restart_in_the_last_15_minutes():
    snaps = minutes(30, restarts=lambda m: float(m >= 3))
    assert run(snaps[:6]) == [("ScaletrainWorkersRestarted", {}, 1.0)]
    assert run(snaps) == []


def test_the_webhook_is_posted_with_retries_and_its_url_never_logged(tmp_path, monkeypatch, caplog):
    """The first POST gets a 503, the second is taken: one delivery, retried, and the URL (a
    secret) in no log line."""
    import http.server
    import json
    import logging
    import threading
    import time

    from scaletrain.observe import alerts as alerts_module
    from scaletrain.observe.alerts import AlertLoop
    from scaletrain.observe.telemetry import Telemetry

    got: list[dict] = []

    class Hook(http.server.BaseHTTPRequestHandler):
        calls = 0

        def do_POST(self):  # noqa: N802  http.server's name
            Hook.calls += 1
            body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
            self.send_response(503 if Hook.calls == 1 else 200)
            self.end_headers()
            if Hook.calls > 1:
                got.append(body)

        def log_message(self, *args):
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Hook)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    url = f"http://127.0.0.1:{server.server_port}/hooks/T0/B0/s3cr3t"
    monkeypatch.setenv(alerts_module.WEBHOOK_ENV, url)
    monkeypatch.setattr(alerts_module, "RETRY_DELAY_S", 0.01)
    share = Telemetry(tmp_path / "rank-0.json", {"rank": "0"}, every_s=0)
    loop = AlertLoop(AlertsConfig(), tmp_path, {"run_id": "r1", "job": "toy"}, logging.getLogger("test.alerts"))
    with caplog.at_level(logging.INFO, logger="test.alerts"):
        loop.evaluate()  # the baseline: nothing counted yet
        share.work("sample", 100, errors=20)
        share.flush()
        loop.evaluate()
        deadline = time.monotonic() + 10
        while not got and time.monotonic() < deadline:
            time.sleep(0.05)
    server.shutdown()
    server.server_close()
    assert Hook.calls == 2 and len(got) == 1
    assert (got[0]["status"], got[0]["alert"], got[0]["labels"], got[0]["run_id"]) == (
        "firing", "ScaletrainErrorRateHigh", {"kind": "sample"}, "r1")
    assert got[0]["value"] == 0.2 and [f["alert"] for f in loop.fired] == ["ScaletrainErrorRateHigh"]
    said = [r.getMessage() for r in caplog.records]
    assert said[0].startswith("alert ScaletrainErrorRateHigh: sample errors are 20.0% of the sample work")
    assert not any("s3cr3t" in line for line in said)


def test_a_webhook_that_is_not_http_is_refused_in_one_warning(tmp_path, monkeypatch, caplog):
    import logging

    from scaletrain.observe import alerts as alerts_module
    from scaletrain.observe.alerts import AlertLoop

    monkeypatch.setenv(alerts_module.WEBHOOK_ENV, "file:///etc/passwd")
    with caplog.at_level(logging.WARNING, logger="test.alerts"):
        loop = AlertLoop(AlertsConfig(), tmp_path, {}, logging.getLogger("test.alerts"))
    assert loop.webhook is None
    assert [r.getMessage() for r in caplog.records] == [
        "SCALETRAIN_ALERT_WEBHOOK_URL is not an http(s) URL: alerts are not posted to it"]


def test_a_stop_with_no_handler_to_take_it_is_a_warning_not_a_killed_launcher(tmp_path, monkeypatch, caplog):
    import logging
    import signal

    from scaletrain.observe.alerts import AlertLoop
    from scaletrain.observe.telemetry import Telemetry

    monkeypatch.setattr(signal, "getsignal", lambda signum: signal.SIG_DFL)  # no stop handler installed
    sent = []
    monkeypatch.setattr("os.kill", lambda pid, signum: sent.append(signum))
    share = Telemetry(tmp_path / "rank-0.json", {"rank": "0"}, every_s=0)
    loop = AlertLoop(AlertsConfig.model_validate({"error_rate": {"action": "stop"}}), tmp_path, {},
                     logging.getLogger("test.alerts"))
    with caplog.at_level(logging.WARNING, logger="test.alerts"):
        loop.evaluate()
        share.work("sample", 100, errors=20)
        share.flush()
        loop.evaluate()
    assert sent == [] and loop.stopped_by is None
    assert "alert ScaletrainErrorRateHigh asks to stop the run, but it cannot be stopped at this point" in [
        r.getMessage() for r in caplog.records]


def test_the_alerts_firing_are_in_a_file_the_progress_bar_shows(tmp_path):
    """The launcher's loop writes the alerts firing now on each change; rank 0's bar reads the
    file at its cadence and says them, and says nothing once they resolve."""
    import logging

    from scaletrain.observe.alerts import ALERTS_FIRING_FILE, AlertLoop
    from scaletrain.observe.telemetry import Telemetry
    from scaletrain.tracking.progress import ProgressBar
    from scaletrain.tracking.reporter import StepReport

    firing = tmp_path / ALERTS_FIRING_FILE
    share = Telemetry(tmp_path / "rank-0.json", {"rank": "0"}, every_s=0)
    loop = AlertLoop(AlertsConfig.model_validate({"error_rate": {"window_s": 1}}), tmp_path, {},
                     logging.getLogger("test.alerts"))
    bar = ProgressBar("toy", firing)
    bar.on_start(100, 0)

    def said(step):
        bar.on_train_metrics([StepReport(step, {"loss": 1.0, "samples_per_s": 10.0}, 0.0)])
        return bar._progress.tasks[0].fields["alert"]

    try:
        loop.evaluate()
        assert not firing.exists() and said(1) == ""
        share.work("sample", 100, errors=20)
        share.flush()
        loop.evaluate()
        assert firing.read_text() == "ScaletrainErrorRateHigh\n"
        assert said(2) == "[bold red]alert: ScaletrainErrorRateHigh[/]"
        share.work("sample", 10000)
        share.flush()
        import time

        time.sleep(1.1)  # out of the 1 s window: the error rate falls to 0
        loop.evaluate()
        assert firing.read_text() == "" and said(3) == ""
    finally:
        bar.on_end()
