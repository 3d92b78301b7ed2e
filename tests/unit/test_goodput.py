"""Goodput from rank 0's figures before and after a launch: steps from their marks (they outlive a
SIGKILL), their time at the mean step time the figures counted; the parts add up to the wall."""

import pytest

from scaletrain.observe.goodput import goodput
from scaletrain.observe.telemetry import Telemetry, TelemetrySink


def test_a_launch_that_resumed_behind_the_step_reached_and_restarted_once(tmp_path):
    # The run reached step 25 in an earlier launch, its newest checkpoint is step 20; this launch
    # resumes from 20 (steps 21-25 again), reaches 33, restarts from 30 (31-33 again), ends at 40.
    telemetry = Telemetry(tmp_path / "rank-0.json", {"rank": "0"})
    telemetry.figures.update({"steps_total": 25, "step_seconds": {"counts": [], "sum": 2.5}})
    before = dict(telemetry.figures)
    first = TelemetrySink(telemetry, 1, True, request_id="launch-2", reached_before=25)
    first.on_start(40, 20)
    first.on_step(21)
    first_step_at = telemetry.figures["first_step_timestamp_seconds"]
    again = TelemetrySink(telemetry, 1, True, request_id="launch-2", reached_before=33)
    again.on_start(40, 30)
    again.on_step(31)
    assert telemetry.figures["first_step_timestamp_seconds"] == first_step_at  # the launch's first
    telemetry.figures.update({"steps_total": 25 + 23, "step_seconds": {"counts": [], "sum": 2.5 + 2.3}})
    started = first_step_at - 4.0
    spent = goodput(before, dict(telemetry.figures), 40, started, 10.0, "launch-2")
    assert spent == {"ratio": 0.15, "productive_s": 1.5, "startup_s": 4.0, "checkpoint_stall_s": 0.0,
                     "redone_s": 0.8, "other_s": 3.7}
    assert sum(v for k, v in spent.items() if k != "ratio") == pytest.approx(10.0)


def test_no_goodput_without_a_step_of_this_launch():
    figures = {"steps_total": 10, "step_seconds": {"sum": 1.0}, "first_step_request_id": "old",
               "launch_request_id": "old", "first_step_timestamp_seconds": 1.0, "launch_progress_from": 0}
    assert goodput(figures, figures, 10, 0.0, 5.0, "old") is None  # no step ran
    after = {**figures, "steps_total": 20, "step_seconds": {"sum": 2.0}}
    assert goodput(figures, after, 20, 0.0, 5.0, "new") is None  # another launch's figures


def test_tokens_per_sample_must_be_a_positive_int():
    from scaletrain.errors import TaskError
    from scaletrain.task import tokens_per_sample

    class Task:
        tokens_per_sample = 128

    assert tokens_per_sample(Task()) == 128 and tokens_per_sample(object()) is None
    Task.tokens_per_sample = "128"
    with pytest.raises(TaskError, match="tokens_per_sample must be a positive int"):
        tokens_per_sample(Task())
