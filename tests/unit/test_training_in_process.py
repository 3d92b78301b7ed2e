"""The loop in one process (the in-process engine): learning, accumulation, determinism."""

import json
from pathlib import Path

import pytest
from safetensors.torch import load_file

import scaletrain
from scaletrain.engine.trainer import TrainingDiverged
from scaletrain.engine.weights import state_dict_sha256
from scaletrain.errors import WorkerFailedError
from tests.helpers.run import read_metrics
from tests.helpers.tasks import toy_job


def test_trains_reports_and_writes_the_run_directory(tmp_path):
    summary = scaletrain.run(toy_job(tmp_path, train={"max_steps": 30, "eval_every": 10}))
    run_dir = Path(summary["run_dir"])
    assert summary["status"] == "finished"
    assert summary["steps"] == 30
    assert run_dir.parent == tmp_path / "runs" / "toy"
    losses = [row["loss"] for row in read_metrics(run_dir)]
    assert len(losses) == 30
    assert losses[-1] < 0.5 * losses[0]
    assert [row["step"] for row in read_metrics(run_dir, "eval")] == [10, 20, 30]
    assert summary["eval"]["accuracy"] > 0.8
    assert json.loads((run_dir / "summary.json").read_text()) == summary
    assert (run_dir / "job.yaml").exists()
    weights = load_file(run_dir / "model.safetensors")
    assert state_dict_sha256(weights) == summary["weights_sha256"]


def test_gradient_accumulation_matches_a_bigger_batch(tmp_path):
    big = scaletrain.run(toy_job(tmp_path, data={"batch_size": 32}))
    accumulated = scaletrain.run(
        toy_job(tmp_path, data={"batch_size": 8}, train={"max_steps": 20, "log_every": 1, "grad_accum": 4})
    )
    a = [row["loss"] for row in read_metrics(big["run_dir"])]
    b = [row["loss"] for row in read_metrics(accumulated["run_dir"])]
    assert a == pytest.approx(b, abs=1e-5)


def test_same_seed_same_bits_other_seed_other_bits(tmp_path):
    job = toy_job(tmp_path, task={"args": {"dropout": 0.2}})
    first = scaletrain.run(job)
    second = scaletrain.run(job)
    other = scaletrain.run({**job, "seed": 8})
    assert first["weights_sha256"] == second["weights_sha256"]
    assert other["weights_sha256"] != first["weights_sha256"]


def test_epochs_set_the_number_of_steps(tmp_path):
    # 512 samples / 64 per step = 8 steps per epoch.
    summary = scaletrain.run(
        toy_job(tmp_path, data={"batch_size": 64}, train={"max_steps": None, "epochs": 3, "log_every": 5})
    )
    assert summary["steps"] == 24


def test_bf16_autocast_trains(tmp_path):
    summary = scaletrain.run(toy_job(tmp_path, train={"max_steps": 30, "precision": "bf16"}))
    losses = [row["loss"] for row in read_metrics(summary["run_dir"])]
    assert losses[-1] < losses[0]


def test_divergence_stops_with_a_clear_error(tmp_path):
    job = toy_job(tmp_path, task={"args": {"nan_at_step": 4}}, train={"log_every": 2})
    with pytest.raises(TrainingDiverged) as info:
        scaletrain.run(job)
    assert str(info.value).startswith("the loss became nan at step 6; lower optim.lr")


def test_a_failing_task_fails_the_run_with_its_error(tmp_path):
    job = toy_job(tmp_path, task={"args": {"fail_rank": 0, "fail_at_step": 3}})
    with pytest.raises(WorkerFailedError) as info:
        scaletrain.run(job)
    assert str(info.value).startswith("worker rank 0 failed: RuntimeError: injected failure on rank 0")
    run_dir = next((tmp_path / "runs" / "toy").iterdir())
    assert json.loads((run_dir / "summary.json").read_text())["status"] == "failed"
