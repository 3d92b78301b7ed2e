"""The launcher's built-in alerts apply the rules of deploy/prometheus/alerts.yml to the job's
figures: each fires when it should and not before (the same cases as alerts_test.yml)."""

from __future__ import annotations

from scaletrain.config.schema import AlertsConfig
from scaletrain.observe.alerts import AlertEvaluator, Snapshot


def run(snapshots: list[Snapshot], **settings) -> list[tuple[str, dict, float]]:
    evaluator = AlertEvaluator(AlertsConfig.model_validate(settings))
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


def test_throughput_halved_against_the_30_minutes_before():
    rate = lambda m: 100.0 * m if m <= 40 else 4000.0 + 30 * (m - 40)  # noqa: E731  per minute: 100, then 30
    assert run(minutes(30, samples=rate)) == []
    assert run(minutes(50, samples=rate)) == [("ScaletrainThroughputHalved", {}, 0.5)]


def test_a_stale_checkpoint_while_steps_go_on():
    snaps = minutes(61, last_checkpoint_at=lambda m: 0.0, last_step_at=lambda m: 60.0 * m)
    assert run(snaps[:60]) == []
    assert run(snaps) == [("ScaletrainCheckpointStale", {}, 3660.0)]


def test_a_growing_metrics_backlog():
    snaps = minutes(20, backlog=lambda m: 200.0 * m)
    assert run(snaps[:5]) == []  # 1000 points, not more
    assert run(snaps) == [("ScaletrainMetricsBacklogGrowing", {}, 4000.0)]


def test_a_restart_in_the_last_15_minutes():
    snaps = minutes(30, restarts=lambda m: float(m >= 3))
    assert run(snaps[:6]) == [("ScaletrainWorkersRestarted", {}, 1.0)]
    assert run(snaps) == []
