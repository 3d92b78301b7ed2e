"""A user's own loop (``loop:``, ``scaletrain.run_loop``) on 2 gloo workers: killed, restarted and
resumed to the same weights as an uninterrupted run; preempted and resumed; verify-resume."""

import json
import os
import re
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

import scaletrain
from scaletrain.errors import RunPreempted
from scaletrain.recovery.faults import FAULT_ENV
from tests.helpers.loops import loop_job
from tests.helpers.run import REPO, read_metrics, scaletrain_cli

pytestmark = pytest.mark.distributed

mlflow = pytest.importorskip("mlflow")
from mlflow import MlflowClient  # noqa: E402


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    """The uninterrupted loop every interrupted one must match bit for bit."""
    return scaletrain.run(loop_job(tmp_path_factory.mktemp("reference")))


def test_a_killed_then_hung_loop_restarts_and_resumes_to_the_same_weights(tmp_path, monkeypatch, reference):
    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    job = loop_job(tmp_path, tracking={"enabled": True, "uri": uri, "experiment": "loops", "log_model": False},
                   recovery={"max_restarts": 2, "hang_timeout_s": 8})
    # Rank 1 SIGKILLed at step 25; after the restart (from step 20), rank 0 hangs at step 33.
    monkeypatch.setenv(FAULT_ENV, "sigkill:rank=1:step=25;hang:rank=0:step=33:attempt=1")
    summary = scaletrain.run(job)
    monkeypatch.delenv(FAULT_ENV)
    assert reference["restarts"] == 0 and reference["steps"] == 40 and reference["weights_sha256"]
    assert summary["restarts"] == 2 and summary["resumed_from_step"] == 30
    launcher_log = (Path(summary["run_dir"]) / "logs" / "launcher.jsonl").read_text()
    assert ("restarting the workers after worker rank 1 failed: the process ended without an error (killed: "
            "SIGKILL, or out of memory)") in launcher_log
    assert re.search(r"restarting the workers after worker rank 0 failed: made no progress for 8 s after step 33, "
                     r"in faults\.py:\d+ _fire \(hang watchdog; rank 1 waited for it in the gradients' all-reduce "
                     r"\(backward\)\)", launcher_log)
    assert summary["weights_sha256"] == reference["weights_sha256"]
    assert summary["strategy"] == "ddp"
    # Every step reported once: metrics.jsonl and the one MLflow run (steps 21-25 were redone).
    assert [row["step"] for row in read_metrics(summary["run_dir"])] == list(range(1, 41))
    client = MlflowClient(uri)
    assert [m.step for m in client.get_metric_history(summary["mlflow_run_id"], "train/loss")] == list(range(1, 41))
    assert client.get_run(summary["mlflow_run_id"]).data.tags["scaletrain.restarts"] == "2"
    # The loop's plain values travel in the checkpoint's JSON: 512 samples / 32 a step = 16 steps an epoch.
    trainer = json.loads((tmp_path / "runs" / "loop").glob("*/checkpoints/step-00000040/trainer.json").__next__().read_text())
    assert trainer["values"] == {"epochs_done": 2} and trainer["loaders"] == [40]


def test_a_preempted_loop_checkpoints_where_it_stopped_and_resumes(tmp_path, monkeypatch, reference):
    monkeypatch.setenv(FAULT_ENV, "sigterm:rank=1:step=13")
    # Slow steps: a stop is agreed within a quarter second, so the run must last longer.
    job = loop_job(tmp_path, loop={"args": {"steps": 40, "step_sleep": 0.02}}, recovery={"max_restarts": 0})
    with pytest.raises(RunPreempted) as stopped:
        scaletrain.run(job)
    monkeypatch.delenv(FAULT_ENV)
    # Stopped at the step every rank agreed on, after a checkpoint of it.
    assert stopped.value.checkpoint_step == stopped.value.step and 13 <= stopped.value.step < 40
    resumed = scaletrain.resume(stopped.value.run_dir)
    assert resumed["resumed_from_step"] == stopped.value.step and resumed["steps"] == 40
    assert resumed["weights_sha256"] == reference["weights_sha256"]


def test_verify_resume_passes_for_a_loop(tmp_path):
    job = tmp_path / "loop.yaml"
    job.write_text(json.dumps(loop_job(tmp_path, scale={"workers": 1})))
    result = scaletrain_cli("verify-resume", str(job), "--steps", "12")
    assert result.returncode == 0, result.stdout + result.stderr
    assert "PASS: resumed from step 6 after a kill at step 9" in result.stdout


def test_launch_from_a_script_runs_its_main_loop_on_two_workers(tmp_path, reference):
    """scaletrain.run_loop from a script, no __main__ guard: the loop (defined in the script) is
    handed to fresh workers by value; the script's top level runs once."""
    script = tmp_path / "notebook_like.py"
    script.write_text(textwrap.dedent(f"""
        import json, scaletrain
        from tests.helpers.loops import train_loop

        print("top level ran")

        def train(ctx):  # __main__'s own function, wrapping the module one
            train_loop(ctx)

        summary = scaletrain.run_loop(train, workers=2, config={{"steps": 40}},
                                    job={loop_job(tmp_path)!r})
        print("SUMMARY", json.dumps({{"sha": summary["weights_sha256"], "steps": summary["steps"]}}))
    """))
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO / "src"), str(REPO)])}  # it imports tests.helpers
    result = subprocess.run([sys.executable, str(script)], cwd=REPO, capture_output=True, text=True, timeout=240,
                            env=env)
    assert result.returncode == 0, result.stdout + result.stderr
    assert result.stdout.count("top level ran") == 1
    outcome = json.loads(result.stdout.split("SUMMARY", 1)[1])
    assert outcome == {"sha": reference["weights_sha256"], "steps": 40}


def test_a_sharded_loop_resumes_to_the_same_weights(tmp_path, monkeypatch):
    """ctx.prepare with fsdp: sharded parameters, the optimizer over DTensors, DCP's sharded state,
    gathered final weights; killed and resumed, the same as uninterrupted."""
    clean = scaletrain.run(loop_job(tmp_path / "clean", scale={"strategy": "fsdp"}))
    monkeypatch.setenv(FAULT_ENV, "sigkill:rank=1:step=25")
    killed = scaletrain.run(loop_job(tmp_path / "killed", scale={"strategy": "fsdp"}))
    monkeypatch.delenv(FAULT_ENV)
    assert clean["strategy"] == killed["strategy"] == "fsdp"
    assert (killed["restarts"], killed["resumed_from_step"]) == (1, 20)
    assert killed["weights_sha256"] == clean["weights_sha256"] != ""
    assert Path(clean["weights"]).is_file()
