"""`scaletrain tune` on a local Ray instance: 4 trials, ASHA, nested MLflow runs, best job."""

import importlib.util
import json
from pathlib import Path

import pytest
import yaml

from tests.helpers.run import scaletrain_cli
from tests.helpers.tasks import toy_job

pytestmark = pytest.mark.distributed

if importlib.util.find_spec("ray") is None:
    pytest.skip("Ray is not installed (pip install 'scaletrain[ray]')", allow_module_level=True)


def test_a_search_with_asha_nests_its_trials_and_writes_the_best_job(tmp_path):
    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    job = toy_job(
        tmp_path,
        train={"max_steps": 40, "eval_every": 10, "log_every": 10},
        checkpoint={"every_steps": 10},
        tracking={"enabled": True, "uri": uri, "experiment": "search"},
    )
    job_file = tmp_path / "job.yaml"
    job_file.write_text(yaml.safe_dump(job))
    space = tmp_path / "space.yaml"
    # In this order, one at a time: the second trial (a learning rate that does not learn)
    # is behind the first at the first evaluation, so ASHA stops it there.
    space.write_text("optim.lr: {grid: [0.05, 1.0e-7, 0.02, 2.0e-7]}\n")
    out = scaletrain_cli(
        "tune", str(job_file), "--space", str(space), "--trials", "1", "--metric", "eval/loss",
        "--mode", "min", "--scheduler", "asha", "--json", timeout=600,
    )
    assert out.returncode == 0, out.stderr[-3000:]
    summary = json.loads(out.stdout)
    rows = {row["config"]["optim.lr"]: row for row in summary["trials"]}
    assert sorted(rows) == [1.0e-7, 2.0e-7, 0.02, 0.05]
    assert rows[0.05]["status"] == "finished" and rows[0.05]["reports"] == 4
    assert rows[1.0e-7]["status"] == "pruned" and rows[1.0e-7]["reports"] < 4
    assert summary["best"]["config"]["optim.lr"] in (0.05, 0.02)
    best_job = yaml.safe_load(Path(summary["best_job"]).read_text())
    assert best_job["optim"]["lr"] == summary["best"]["config"]["optim.lr"]

    from mlflow import MlflowClient

    client = MlflowClient(uri)
    experiment = client.get_experiment_by_name("search")
    runs = client.search_runs([experiment.experiment_id])
    parents = [r for r in runs if r.data.tags.get("scaletrain.tune") == "search"]
    assert len(parents) == 1
    parent = parents[0]
    trials = [r for r in runs if r.data.tags.get("mlflow.parentRunId") == parent.info.run_id]
    assert len(trials) == 4
    best = [r for r in trials if r.data.tags.get("scaletrain.tune.best") == "true"]
    assert [r.info.run_id for r in best] == [summary["best"]["mlflow_run_id"]]
    assert parent.data.tags["scaletrain.tune.best_run_id"] == summary["best"]["mlflow_run_id"]
    assert parent.data.metrics["trials_pruned"] >= 1
    pruned_run = client.get_run(rows[1.0e-7]["mlflow_run_id"])
    assert pruned_run.info.status == "KILLED"  # stopped at a checkpoint, like a preemption


def test_a_bad_space_is_one_line(tmp_path):
    job_file = tmp_path / "job.yaml"
    job_file.write_text(yaml.safe_dump(toy_job(tmp_path, train={"max_steps": 20, "eval_every": 10})))
    space = tmp_path / "space.yaml"
    space.write_text("optim.lr: {uniform: [0.5, 0.1]}\n")
    out = scaletrain_cli("tune", str(job_file), "--space", str(space))
    assert out.returncode == 2
    assert out.stderr.strip().splitlines() == [
        f"error: {space}: optim.lr: uniform low end 0.5 is not below its high end 0.1; write [low, high]"
    ]
