"""TensorFlow jobs (task.framework: tensorflow) on 2 real TF workers on the CPU, joined by
MultiWorkerMirroredStrategy: the same seed gives the same weights; a killed and then a hung worker
restart and resume to the uninterrupted weights; SIGTERM to the launcher stops at an agreed step
with a checkpoint (exit 75) and `scaletrain resume` finishes the job; one MLflow run with the
Keras model. Few runs, sharing one reference: TensorFlow's import alone costs ~5 s a worker."""

import importlib.util
import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
import yaml

import scaletrain
from scaletrain.recovery.faults import FAULT_ENV
from tests.helpers.keras_jobs import keras_job
from tests.helpers.run import REPO, read_metrics, scaletrain_cli

pytestmark = pytest.mark.distributed

mlflow = pytest.importorskip("mlflow")
from mlflow import MlflowClient  # noqa: E402

REPORTED = [1, 10, 20, 30, 40]  # train.log_every 10 over 40 steps


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    """The uninterrupted job every other run must match bit for bit."""
    return scaletrain.run(keras_job(tmp_path_factory.mktemp("reference")))


def test_same_seed_same_weights_one_mlflow_run_and_a_keras_model_that_predicts(tmp_path, reference):
    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    summary = scaletrain.run(keras_job(tmp_path, tracking={"enabled": True, "uri": uri, "experiment": "keras"}))
    assert reference["weights_sha256"] and summary["weights_sha256"] == reference["weights_sha256"]
    assert (summary["strategy"], summary["world_size"], summary["steps"]) == ("mirrored", 2, 40)
    # The file holds what the hash says: the same rule as for PyTorch weights.
    from safetensors.torch import load_file

    from scaletrain.engine.weights import state_dict_sha256

    weights = load_file(summary["weights"])
    assert state_dict_sha256(weights) == summary["weights_sha256"]
    assert {name for name in weights} == {"sequential/dense/kernel", "sequential/dense/bias",
                                          "sequential/dense_1/kernel", "sequential/dense_1/bias"}

    client = MlflowClient(uri)
    run = client.get_run(summary["mlflow_run_id"])
    experiment = client.get_experiment_by_name("keras")
    assert [r.info.run_id for r in client.search_runs([experiment.experiment_id])] == [run.info.run_id]
    assert run.info.status == "FINISHED"
    params, tags = run.data.params, run.data.tags
    assert (params["task.framework"], params["task.target"]) == ("tensorflow", "tests.helpers.keras_tasks:ToyKeras")
    assert (params["optim.lr"], params["scale.workers"]) == ("0.01", "2")
    assert (tags["scaletrain.strategy"], tags["scaletrain.world_size"]) == ("mirrored", "2")
    # The PyTorch runner's metric names, at the same steps.
    for name in ("train/loss", "train/accuracy", "train/lr", "train/grad_norm", "train/samples_per_s"):
        assert [m.step for m in client.get_metric_history(run.info.run_id, name)] == REPORTED, name
    assert [m.step for m in client.get_metric_history(run.info.run_id, "eval/accuracy")] == [20, 40]
    assert [m.value for m in client.get_metric_history(run.info.run_id, "eval/accuracy")][-1] == pytest.approx(
        summary["eval"]["accuracy"])
    # The learning rate follows the job's schedule: warmup 5 steps, then cosine to 0 at step 40.
    lrs = {m.step: m.value for m in client.get_metric_history(run.info.run_id, "train/lr")}
    assert lrs[1] == pytest.approx(0.01 / 5) and lrs[40] == pytest.approx(0.0, abs=1e-4)
    card = json.loads((Path(summary["run_dir"]) / "run_card.json").read_text())
    import importlib.metadata

    assert card["tensorflow"]["version"].split("+")[0] == importlib.metadata.version("tensorflow-cpu")
    assert card["tensorflow"]["op_determinism"] is True and card["tensorflow"]["devices"]
    assert card["data_fingerprint"].startswith("sha256:")
    artifacts = {a.path for a in client.list_artifacts(run.info.run_id)}
    assert {"job.yaml", "summary.json", "logs", "weights", "run_card.json"} <= artifacts
    # The Keras model is an MLflow 3 logged model of the run (runs:/<run>/model resolves to it).
    (logged,) = client.search_logged_models(experiment_ids=[run.info.experiment_id])
    assert (logged.name, logged.source_run_id) == ("model", run.info.run_id)

    # Loaded as a user would, in a fresh process (this one keeps TensorFlow out until the
    # in-process test): the trained weights, predicting through the TF flavor and the pyfunc.
    code = (
        "import sys, numpy as np, mlflow, mlflow.tensorflow\n"
        "x = np.random.default_rng(0).standard_normal((5, 16)).astype(np.float32)\n"
        f"model = mlflow.tensorflow.load_model('runs:/{run.info.run_id}/model')\n"
        "print(tuple(model.predict(x, verbose=0).shape))\n"
        "np.save(sys.argv[1], model.weights[0].numpy())\n"
        f"print(np.asarray(mlflow.pyfunc.load_model('runs:/{run.info.run_id}/model').predict(x)).shape)\n"
    )
    kernel = tmp_path / "kernel.npy"
    loaded = subprocess.run([sys.executable, "-c", code, str(kernel)], capture_output=True, text=True, timeout=180,
                            env={**os.environ, "MLFLOW_TRACKING_URI": uri, "TF_CPP_MIN_LOG_LEVEL": "2"})
    assert loaded.returncode == 0, loaded.stderr[-3000:]
    assert [line for line in loaded.stdout.splitlines() if line.startswith("(")] == ["(5, 4)", "(5, 4)"], loaded.stdout
    np.testing.assert_array_equal(np.load(kernel), weights["sequential/dense/kernel"].numpy())


def test_a_killed_then_hung_worker_restarts_and_resumes_to_the_same_weights(tmp_path, monkeypatch, reference):
    job = keras_job(tmp_path, recovery={"max_restarts": 2, "hang_timeout_s": 12})
    # Rank 1 SIGKILLed at step 25; after the restart (from step 20), rank 0 hangs at step 33.
    monkeypatch.setenv(FAULT_ENV, "sigkill:rank=1:step=25;hang:rank=0:step=33:attempt=1")
    summary = scaletrain.run(job)
    monkeypatch.delenv(FAULT_ENV)
    assert summary["restarts"] == 2 and summary["resumed_from_step"] == 30
    assert summary["weights_sha256"] == reference["weights_sha256"]
    run_dir = Path(summary["run_dir"])
    launcher_log = (run_dir / "logs" / "launcher.jsonl").read_text()
    said = [json.loads(line)["message"] for line in launcher_log.splitlines() if "restart" in line]
    said += [p.read_text()[:500] for p in (run_dir / "logs").glob("worker-*.error.json")]
    assert ("restarting the workers after worker rank 1 failed: the process ended without an error (killed: "
            "SIGKILL, or out of memory)") in launcher_log, said
    assert re.search(r"restarting the workers after worker rank 0 failed: made no progress for 12 s after step 33, "
                     r"in faults\.py:\d+ _fire \(hang watchdog; rank 1 waited for it in (TensorFlow's compiled step|"
                     r"all_reduce)\)", launcher_log), said
    assert "File " in (run_dir / "logs" / "worker-0.stacks.txt").read_text()  # where it hung
    # Every reported step once, though steps 21-25 and 31-33 ran twice.
    assert [row["step"] for row in read_metrics(run_dir)] == REPORTED
    # Retention as for PyTorch (keep_last 2), and the data position beside TF's files.
    checkpoints = run_dir / "checkpoints"
    assert sorted(p.name for p in checkpoints.iterdir()) == ["step-00000030", "step-00000040"]
    files = sorted(p.name for p in (checkpoints / "step-00000040").iterdir())
    assert files == ["manifest.json", "tf.data-00000-of-00001", "tf.index", "trainer.json"]
    trainer = json.loads((checkpoints / "step-00000040" / "trainer.json").read_text())
    # 512 samples / 32 a step = 16 steps an epoch: step 40 is batch 8 of epoch 2.
    assert (trainer["kind"], trainer["epoch"], trainer["batch_in_epoch"]) == ("tensorflow", 2, 8)
    shown = scaletrain_cli("checkpoints", "verify", str(checkpoints))
    assert shown.returncode == 0 and shown.stdout.count("verified") == 2, shown.stdout + shown.stderr


def test_sigterm_to_the_launcher_stops_at_an_agreed_step_then_resume_finishes(tmp_path, reference, processes):
    job_file = tmp_path / "job.yaml"
    # Slow steps (a sleep in the model's training call), so the stop lands mid-run.
    job = keras_job(tmp_path, task={"args": {"step_sleep": 0.1}}, recovery={"max_restarts": 0})
    job_file.write_text(yaml.safe_dump(job))
    launcher = processes(
        [sys.executable, "-m", "scaletrain", "run", str(job_file), "--json"],
        cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
    )
    deadline = time.time() + 120
    while time.time() < deadline:  # step 10 reported: preempt
        found = list((tmp_path / "runs" / "keras").glob("*/metrics.jsonl"))
        if found and len(found[0].read_text().splitlines()) >= 2:
            break
        time.sleep(0.2)
    launcher.send_signal(signal.SIGTERM)
    out, err = launcher.communicate(timeout=120)
    assert launcher.returncode == 75, err[-3000:]
    assert json.loads(out)["status"] == "preempted"
    (line,) = [line for line in err.splitlines() if line.startswith("error: preempted by SIGTERM")]
    run_dir = line.rsplit(" ", 1)[-1]
    entries = [json.loads(line) for line in (Path(run_dir) / "logs" / "worker-0.jsonl").read_text().splitlines()]
    (stop,) = [e for e in entries if e["message"].startswith("stopping at step")]
    assert 10 <= stop["step"] < 40
    assert [e["step"] for e in entries if e["message"] == "checkpoint saved"][-1] == stop["step"]

    done = scaletrain_cli("resume", run_dir, "--json")
    assert done.returncode == 0, done.stderr[-3000:]
    summary = json.loads(done.stdout)
    assert summary["resumed_from_step"] == stop["step"] and summary["steps"] == 40
    assert summary["weights_sha256"] == reference["weights_sha256"]


def test_plan_weighs_one_process_against_mirrored_for_a_keras_model(tmp_path):
    job_file = tmp_path / "job.yaml"
    job_file.write_text(yaml.safe_dump(keras_job(tmp_path)))
    out = scaletrain_cli("plan", str(job_file), "--json", "--gpu", "H100", "--devices-per-node", "4")
    assert out.returncode == 0, out.stderr[-2000:]
    plan = json.loads(out.stdout)
    # 16*32+32 + 32*4+4 parameters, fp32; AdamW keeps two moments.
    assert plan["model"]["params"] == 676 and plan["model"]["param_bytes"] == 676 * 4
    rows = {e["option"]["label"]: e for e in plan["estimates"]}
    assert sorted(rows) == ["mirrored", "single"] and rows["mirrored"]["option"]["world"] == 4
    assert rows["single"]["memory"]["params"] == rows["mirrored"]["memory"]["params"] == 676 * 4
    assert rows["mirrored"]["memory"]["optimizer"] == pytest.approx(2 * 676 * 4, abs=64)  # + step counters
    assert plan["notes"][0].startswith("a Keras model: parameters and model state are exact")


@pytest.mark.skipif(importlib.util.find_spec("ray") is None, reason="Ray is not installed (pip install 'scaletrain[ray]')")
def test_tune_searches_a_tensorflow_job(tmp_path):
    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    job = keras_job(tmp_path, scale={"workers": 1}, train={"max_steps": 20, "eval_every": 10},
                    tracking={"enabled": True, "uri": uri, "experiment": "search", "log_model": False})
    job_file = tmp_path / "job.yaml"
    job_file.write_text(yaml.safe_dump(job))
    space = tmp_path / "space.yaml"
    space.write_text("optim.lr: {grid: [0.03, 1.0e-7]}\n")
    out = scaletrain_cli("tune", str(job_file), "--space", str(space), "--trials", "1", "--metric",
                         "eval/accuracy", "--mode", "max", "--json", timeout=270)
    assert out.returncode == 0, out.stderr[-3000:]
    summary = json.loads(out.stdout)
    rows = {row["config"]["optim.lr"]: row for row in summary["trials"]}
    assert sorted(rows) == [1.0e-7, 0.03] and rows[0.03]["status"] == "finished"
    # The learning rate that does not learn is behind at the first evaluation: the scheduler may end it there.
    assert rows[1.0e-7]["status"] in ("finished", "pruned") and rows[1.0e-7]["metric"] < rows[0.03]["metric"]
    assert summary["best"]["config"]["optim.lr"] == 0.03
    best_job = yaml.safe_load(Path(summary["best_job"]).read_text())
    assert (best_job["optim"]["lr"], best_job["task"]["framework"]) == (0.03, "tensorflow")
    client = MlflowClient(uri)
    runs = client.search_runs([client.get_experiment_by_name("search").experiment_id])
    (parent,) = [r for r in runs if r.data.tags.get("scaletrain.tune") == "search"]
    trials = [r for r in runs if r.data.tags.get("mlflow.parentRunId") == parent.info.run_id]
    assert len(trials) == 2 and {r.data.params["task.framework"] for r in trials} == {"tensorflow"}


def test_one_worker_in_this_process_trains_as_one_local_worker_does(tmp_path):
    """The in-process engine (1 worker, no restarts: TF's default strategy, in the caller's
    process; twice, as from a notebook: TF's threads are set once per process) and the local
    engine's one worker give the same weights. Last: TensorFlow stays in this process after."""
    here = scaletrain.run(keras_job(tmp_path / "here", scale={"workers": 1}, recovery={"max_restarts": 0}))
    again = scaletrain.run(keras_job(tmp_path / "again", scale={"workers": 1}, recovery={"max_restarts": 0}))
    local = scaletrain.run(keras_job(tmp_path / "local", scale={"workers": 1}))
    assert (here["engine"], here["strategy"], local["engine"]) == ("in-process", "single", "local")
    assert here["weights_sha256"] == again["weights_sha256"] == local["weights_sha256"] != ""
    assert here["eval"] == local["eval"] and here["steps"] == 40
