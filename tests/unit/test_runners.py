"""The runner seam: the worker runs whatever runner the job's kind names, and gives every runner
the same runtime (reporting, the agreed stop, error files), whatever it trains."""

import json
import os
import signal
import sys
from pathlib import Path

import pytest

import scaletrain
from scaletrain import runners
from scaletrain.config import parse_job
from scaletrain.errors import ConfigError, RunPreempted, WorkerFailedError
from scaletrain.runners.base import RESULT_KEYS, Runner
from scaletrain.runners.task import TaskRunner
from tests.helpers.run import read_metrics
from tests.helpers.tasks import toy_job


class ProbeRunner(Runner):
    """A runner with no model at all: reports a made-up loss, stops when told, fails on demand."""

    kind = "task"
    signal_at: int | None = None
    fail_at: int | None = None

    def run(self, runtime):
        for step in range(1, 6):
            if step == self.fail_at:
                raise ValueError(f"probe broke at step {step}")
            runtime.report(step, {"loss": 1.0 / step})
            if step == self.signal_at:
                os.kill(os.getpid(), signal.SIGUSR1)
            if stopped := runtime.should_stop(step):
                return {key: None for key in RESULT_KEYS} | {"steps": step, "preempted": stopped}
        return {key: None for key in RESULT_KEYS} | {"steps": 5, "weights_sha256": "", "train": {"loss": 0.2}}


@pytest.fixture
def probe(monkeypatch):
    monkeypatch.setitem(runners.RUNNERS, "task", f"{__name__}:ProbeRunner")
    yield ProbeRunner
    ProbeRunner.signal_at = ProbeRunner.fail_at = None


def test_a_job_runs_the_runner_its_kind_names():
    job = parse_job(toy_job(Path("/tmp")))
    assert runners.runner_kind(job) == "task"
    assert isinstance(runners.get_runner("task"), TaskRunner)
    with pytest.raises(ConfigError, match=r"no runner for jobs of kind 'jax'; known: loop, task, tensorflow"):
        runners.get_runner("jax")


def test_any_runner_reports_through_the_runtime(tmp_path, probe):
    summary = scaletrain.run(toy_job(tmp_path))
    assert summary["status"] == "finished" and summary["steps"] == 5
    assert [(row["step"], row["loss"]) for row in read_metrics(summary["run_dir"])] == [
        (1, 1.0), (2, 0.5), (3, pytest.approx(1 / 3)), (4, 0.25), (5, 0.2)]


def test_any_runner_gets_the_agreed_stop(tmp_path, probe):
    probe.signal_at = 3
    with pytest.raises(RunPreempted):
        scaletrain.run(toy_job(tmp_path))
    [run_dir] = (tmp_path / "runs" / "toy").iterdir()
    summary = json.loads((run_dir / "summary.json").read_text())
    assert (summary["status"], summary["steps"]) == ("preempted", 3)
    assert "SIGUSR1" in summary["error"]


def test_any_runners_failure_is_named_by_the_runtime(tmp_path, probe):
    probe.fail_at = 3
    with pytest.raises(WorkerFailedError, match=r"worker rank 0 failed: ValueError: probe broke at step 3"):
        scaletrain.run(toy_job(tmp_path))
    [run_dir] = (tmp_path / "runs" / "toy").iterdir()
    error = json.loads((run_dir / "logs" / "worker-0.error.json").read_text())
    assert (error["type"], error["steps"]) == ("ValueError", 2)  # the last step it reported
    assert sys.modules[__name__].ProbeRunner is probe
