"""The report's reading of a run's logs and telemetry: events from real log-line shapes, a torn or
foreign line skipped, and per-rank step-time quantiles the way Prometheus estimates them."""

import json

import pytest

from scaletrain.observe.catalog import STEP_BUCKETS
from scaletrain.run_report.events import histogram_quantile, launcher_events, rank_figures, read_lines, worker_events


def line(message, at="2026-12-06T20:14:04.412+00:00", **fields):
    return json.dumps({"timestamp": at, "level": "info", "message": message, "rank": 0, "step": None, **fields})


def test_worker_and_launcher_lines_become_events_in_order():
    worker = "\n".join([
        line("worker started", world_size=2, device="cpu"),
        line("checkpoint saved", at="2026-12-06T20:14:05.000+00:00", step=10),
        '{"timestamp": "2026-12-06T20:14:05.5', # torn by a SIGKILL
        "not json at all",
        line("resuming from checkpoint /runs/toy/x/checkpoints/step-00000010", at="2026-12-06T20:14:07.000+00:00"),
        line("stopping at step 57 on SIGUSR1; saving a checkpoint", at="2026-12-06T20:14:09.000+00:00"),
        line("train metrics", step=12),
    ])
    launcher = "\n".join([
        line("restarting the workers after worker rank 1 failed: killed", at="2026-12-06T20:14:06.000+00:00"),
        line("alert ScaletrainErrorRateHigh: sample errors are 10.4%", at="2026-12-06T20:14:08.000+00:00",
             code="ST-ALERT", alert="ScaletrainErrorRateHigh"),
        line("alert ScaletrainErrorRateHigh resolved", alert="ScaletrainErrorRateHigh"),
    ])
    events = sorted(worker_events(read_lines(worker)) + launcher_events(read_lines(launcher)), key=lambda e: e.time)
    assert [(e.kind, e.step) for e in events] == [
        ("start", None), ("checkpoint", 10), ("restart", None), ("resume", 10), ("alert", None), ("stop", 57)]
    assert events[0].text == "workers started (2 ranks, cpu)"
    assert events[1].time - events[0].time == pytest.approx(0.588)


def test_histogram_quantile_interpolates_inside_the_bucket():
    buckets = (0.001, 0.01, 0.1)
    # 10 observations in (0.001, 0.01], 10 in (0.01, 0.1]
    assert histogram_quantile(0.5, buckets, [0, 10, 10, 0]) == pytest.approx(0.01)
    assert histogram_quantile(0.25, buckets, [0, 10, 10, 0]) == pytest.approx(0.0055)
    assert histogram_quantile(0.9, buckets, [0, 10, 10, 0]) == pytest.approx(0.082)
    assert histogram_quantile(0.99, buckets, [0, 0, 0, 5]) == 0.1  # +Inf bucket: its lower bound
    assert histogram_quantile(0.5, buckets, [0, 0, 0, 0]) is None


def test_rank_figures_from_telemetry_files():
    counts = [0] * (len(STEP_BUCKETS) + 1)
    counts[3] = 40  # (0.005, 0.01]
    telemetry = {
        "rank-1.json": {"labels": {"rank": "1"}, "figures": {
            "steps_total": 40, "samples_total": 640, "data_wait_seconds_total": 0.03,
            "step_seconds": {"counts": counts, "sum": 0.3}}},
        "rank-0.json": {"labels": {"rank": "0"}, "figures": {
            "steps_total": 40, "samples_total": 640, "step_seconds": {"counts": counts, "sum": 0.32}}},
        "rank-2.json": {"labels": {"rank": "2"}, "figures": {}},  # no step yet: left out
    }
    rows = rank_figures(telemetry, STEP_BUCKETS)
    assert [r["rank"] for r in rows] == [0, 1]
    assert rows[1]["step_mean_s"] == pytest.approx(0.0075)
    assert rows[1]["samples_per_s"] == pytest.approx(640 / 0.3)
    assert rows[1]["data_wait_share"] == pytest.approx(0.1)
    assert rows[0]["data_wait_share"] == 0.0
    assert 0.005 < rows[1]["step_p50_s"] < rows[1]["step_p90_s"] <= 0.01
