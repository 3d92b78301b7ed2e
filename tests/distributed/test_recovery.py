"""Recovery with real faults on 2 gloo workers: kill, hang, preempt, corrupt; same final weights.

Faults come from SCALETRAIN_FAULT (scaletrain/recovery/faults.py). Every job here checkpoints every 10
steps of 40; the reference is the same job without faults (computed once per module).
"""

import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

import scaletrain
from scaletrain.checkpoint.manifest import Manifest
from scaletrain.errors import RunPreempted, WorkerFailedError
from scaletrain.recovery.faults import FAULT_ENV
from tests.helpers.run import (
    REPO,
    assert_same_losses_after,
    preempt_then_resume_on_one_worker,
    read_metrics,
    scaletrain_cli,
)
from tests.helpers.tasks import toy_job

pytestmark = pytest.mark.distributed

mlflow = pytest.importorskip("mlflow")
from mlflow import MlflowClient  # noqa: E402


def recovery_job(root, **sections):
    base = {
        "task": {"args": {"dropout": 0.1}},
        "train": {"max_steps": 40, "log_every": 1, "eval_every": 20},
        "checkpoint": {"every_steps": 10, "keep_last": 3},
        "scale": {"workers": 2},
        "recovery": {"max_restarts": 1, "grace_period_s": 20},
    }
    for key, value in sections.items():
        if key == "task":  # task args merge with the base ones (dropout stays)
            value = {"args": {**base["task"]["args"], **value.get("args", {})}}
        base[key] = {**base.get(key, {}), **value}
    return toy_job(root, **base)


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    """The uninterrupted run every faulty run must match bit for bit."""
    return scaletrain.run(recovery_job(tmp_path_factory.mktemp("reference")))


def run_with_fault(monkeypatch, fault, job):
    monkeypatch.setenv(FAULT_ENV, fault)
    try:
        return scaletrain.run(job)
    finally:
        monkeypatch.delenv(FAULT_ENV)


def checkpoint_names(summary):
    return sorted(p.name for p in (Path(summary["run_dir"]) / "checkpoints").iterdir())


def test_sigkill_between_checkpoints_resumes_to_the_same_weights(tmp_path, monkeypatch, reference):
    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    job = recovery_job(tmp_path)
    job["tracking"] = {"enabled": True, "uri": uri, "experiment": "restarts", "log_model": False}
    summary = run_with_fault(monkeypatch, "sigkill:rank=1:step=25", job)
    assert summary["restarts"] == 1 and summary["resumed_from_step"] == 20
    assert summary["weights_sha256"] == reference["weights_sha256"]
    assert [row["step"] for row in read_metrics(summary["run_dir"])] == list(range(1, 41))
    assert [row["step"] for row in read_metrics(summary["run_dir"], "eval")] == [20, 40]
    # keep_last 3 of 10, 20, 30, 40
    assert checkpoint_names(summary) == ["step-00000020", "step-00000030", "step-00000040"]
    # The same MLflow run, the restart counted, steps 21-25 redone and journaled once.
    run = MlflowClient(uri).get_run(summary["mlflow_run_id"])
    assert run.data.tags["scaletrain.restarts"] == "1"
    steps = [m.step for m in MlflowClient(uri).get_metric_history(run.info.run_id, "train/loss")]
    assert steps == list(range(1, 41))


def test_async_checkpoints_resume_to_the_same_weights(tmp_path, monkeypatch, reference):
    """Async saves reuse their CPU staging buffers: the newest committed one (after at least 4
    earlier saves; the one still writing at the kill is not committed) and an older one each
    resume to the uninterrupted weights."""
    job = recovery_job(tmp_path, checkpoint={"every_steps": 5, "keep_last": 10, "async_save": True})
    summary = run_with_fault(monkeypatch, "sigkill:rank=1:step=33", job)
    assert summary["restarts"] == 1 and summary["resumed_from_step"] in (25, 30), summary["resumed_from_step"]
    assert summary["weights_sha256"] == reference["weights_sha256"], "resumed from the newest async checkpoint"
    entries = [json.loads(l) for l in Path(summary["run_dir"], "logs", "worker-0.jsonl").read_text().splitlines()]
    saved = [e["step"] for e in entries if e["message"] == "checkpoint saved" and e["async"]]
    assert saved[:5] == [5, 10, 15, 20, 25], saved
    older = scaletrain.resume(str(Path(summary["run_dir"], "checkpoints", "step-00000010")))
    assert older["resumed_from_step"] == 10
    assert older["weights_sha256"] == reference["weights_sha256"], "resumed from the async step-10 checkpoint"


def test_a_worker_that_raises_once_is_restarted_to_the_same_weights(tmp_path, monkeypatch, reference):
    """An exception (not a signal): the rank writes its error, exits non-zero, and the job
    restarts from the newest checkpoint; the launcher's log names the error."""
    summary = run_with_fault(monkeypatch, "raise:rank=1:step=25", recovery_job(tmp_path))
    assert (summary["status"], summary["restarts"], summary["resumed_from_step"]) == ("finished", 1, 20)
    assert summary["weights_sha256"] == reference["weights_sha256"]
    launcher_log = Path(summary["run_dir"], "logs", "launcher.jsonl").read_text()
    assert ("restarting the workers after worker rank 1 failed: RuntimeError: injected fault at step 25 on rank 1"
            in launcher_log), launcher_log[-3000:]


def test_two_faults_in_one_run(tmp_path, monkeypatch, reference):
    job = recovery_job(tmp_path, recovery={"max_restarts": 2})
    summary = run_with_fault(
        monkeypatch, "sigkill:rank=1:step=15;sigkill:rank=0:step=33:attempt=1", job
    )
    assert summary["restarts"] == 2 and summary["resumed_from_step"] == 30
    assert summary["weights_sha256"] == reference["weights_sha256"]


def test_crash_while_writing_a_checkpoint_uses_the_previous_one(tmp_path, monkeypatch, reference):
    summary = run_with_fault(monkeypatch, "checkpoint_crash:rank=0:step=30", recovery_job(tmp_path))
    assert summary["restarts"] == 1 and summary["resumed_from_step"] == 20
    assert summary["weights_sha256"] == reference["weights_sha256"]
    root = Path(summary["run_dir"]) / "checkpoints"
    assert not [p for p in root.iterdir() if p.name.startswith(".staging")]  # swept


def test_a_hang_is_dumped_ended_and_restarted(tmp_path, monkeypatch, reference):
    job = recovery_job(tmp_path, recovery={"hang_timeout_s": 8})
    summary = run_with_fault(monkeypatch, "hang:rank=1:step=25", job)
    assert summary["restarts"] == 1 and summary["resumed_from_step"] == 20
    assert summary["weights_sha256"] == reference["weights_sha256"]
    logs = Path(summary["run_dir"]) / "logs"
    stacks = (logs / "worker-1.stacks.txt").read_text()
    assert "Timeout (0:00:08)!" in stacks and "_fire" in stacks  # the hung frame is in the dump
    # Its peer, armed at the same check, dumped too before either ended (a grace period): it
    # waited in a collective, so the launcher names rank 1, the hang, as the cause.
    assert "Timeout (0:00:08)!" in (logs / "worker-0.stacks.txt").read_text()
    # The line names the hung rank, its last step and where it is, and what its peer waited in.
    restarts = [json.loads(line)["message"] for line in (logs / "launcher.jsonl").read_text().splitlines()
                if "restarting the workers" in line]
    assert len(restarts) == 1 and re.match(
        r"restarting the workers after worker rank 1 failed: made no progress for 8 s after step 25, "
        r"in faults\.py:\d+ _fire \(hang watchdog; rank 0 waited for it in the gradients' all-reduce "
        r"\(backward\)\)", restarts[0]), restarts  # the line itself when it differs


def test_a_rank_that_always_fails_ends_the_job_naming_it(tmp_path, monkeypatch):
    job = recovery_job(tmp_path, recovery={"max_restarts": 1})
    with pytest.raises(WorkerFailedError) as info:
        run_with_fault(monkeypatch, "raise:rank=1:step=15;raise:rank=1:step=15:attempt=1", job)
    assert str(info.value).startswith(
        "worker rank 1 failed: RuntimeError: injected fault at step 15 on rank 1"
    )
    assert info.value.rank == 1


def test_a_corrupted_newest_checkpoint_falls_back_with_one_warning(tmp_path, reference):
    """A run of 30 steps' newest checkpoint (30) gets a bit flipped; trained on to 40, it must
    resume from step 20 and end as the uninterrupted 40-step run."""
    first = scaletrain.run(recovery_job(tmp_path, train={"max_steps": 30}))  # saves 10, 20, 30
    run_dir = Path(first["run_dir"])
    shard = run_dir / "checkpoints" / "step-00000030" / "state.safetensors"
    data = bytearray(shard.read_bytes())
    data[100] ^= 0x10
    shard.write_bytes(bytes(data))
    resumed = scaletrain.resume(run_dir, ["train.max_steps=40"])
    assert (resumed["resumed_from_step"], resumed["steps"]) == (20, 40)
    assert resumed["weights_sha256"] == reference["weights_sha256"], (resumed["weights_sha256"], reference["weights_sha256"])
    warnings = [
        json.loads(line) for line in (run_dir / "logs" / "worker-0.jsonl").read_text().splitlines()
        if '"warning"' in line and "failed verification" in line
    ]
    assert len(warnings) == 1
    assert "step-00000030 failed verification (state.safetensors does not match its blake3 hash" in warnings[0]["message"]
    assert warnings[0]["message"].endswith("using the previous one")


def test_preemption_of_a_worker_then_resume_continues_the_same_mlflow_run(tmp_path, monkeypatch, reference):
    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    # Slow steps: a stop is agreed within a quarter second, so the run must last longer.
    job = recovery_job(tmp_path, task={"args": {"step_sleep": 0.02}}, recovery={"max_restarts": 0})
    job["tracking"] = {"enabled": True, "uri": uri, "experiment": "recovery", "log_model": False}
    monkeypatch.setenv(FAULT_ENV, "sigterm:rank=1:step=15")
    with pytest.raises(RunPreempted) as info:
        scaletrain.run(job)
    monkeypatch.delenv(FAULT_ENV)
    assert info.value.exit_code == 75
    stopped_at = info.value.step
    assert info.value.checkpoint_step == stopped_at and 15 <= stopped_at < 40
    client = MlflowClient(uri)
    runs = client.search_runs([client.get_experiment_by_name("recovery").experiment_id])
    assert len(runs) == 1 and runs[0].info.status == "KILLED"

    resumed = scaletrain.resume(info.value.run_dir)
    assert resumed["resumed_from_step"] == stopped_at and resumed["steps"] == 40
    assert resumed["weights_sha256"] == reference["weights_sha256"]
    assert resumed["mlflow_run_id"] == runs[0].info.run_id
    run = client.get_run(runs[0].info.run_id)
    assert run.info.status == "FINISHED"
    assert run.data.tags["scaletrain.attempts"] == "2"
    history = [m.step for m in client.get_metric_history(run.info.run_id, "train/loss")]
    assert history == list(range(1, 41))  # no gap, no duplicate across the two attempts
    manifest = Manifest.from_json(
        (Path(resumed["run_dir"]) / "checkpoints" / "step-00000040" / "manifest.json").read_text()
    )
    assert manifest.mlflow_run_id == run.info.run_id and manifest.world_size == 2


def test_resume_on_one_worker_reads_the_same_batches(tmp_path, monkeypatch):
    # No dropout: its draws depend on the rank, the only thing 2 ranks and 1 do not share.
    job = recovery_job(tmp_path, task={"args": {"dropout": 0.0, "step_sleep": 0.02}},
                       recovery={"max_restarts": 0})
    uninterrupted = scaletrain.run(job)
    # 1 worker x 32 reads the same global batches as 2 x 16.
    stopped_at, resumed = preempt_then_resume_on_one_worker(job, monkeypatch)
    assert_same_losses_after(uninterrupted, resumed, stopped_at, 40)


def test_sigterm_to_the_launcher_checkpoints_then_cli_resume(tmp_path, reference, processes):
    job_file = tmp_path / "job.yaml"
    job = recovery_job(tmp_path, task={"args": {"step_sleep": 0.05}}, recovery={"max_restarts": 0})
    import yaml

    job_file.write_text(yaml.safe_dump(job))
    launcher = processes(
        [sys.executable, "-m", "scaletrain", "run", str(job_file), "--json"],
        cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
    )
    metrics = None
    deadline = time.time() + 120
    while time.time() < deadline:  # wait for step 10 to be reported, then preempt
        found = list((tmp_path / "runs" / "toy").glob("*/metrics.jsonl"))
        if found and len(found[0].read_text().splitlines()) >= 10:
            metrics = found[0]
            break
        time.sleep(0.2)
    assert metrics is not None
    launcher.send_signal(signal.SIGTERM)
    out, err = launcher.communicate(timeout=120)
    assert launcher.returncode == 75, err[-2000:]
    assert json.loads(out)["status"] == "preempted"
    line = [l for l in err.splitlines() if l.startswith("error: preempted by SIGTERM")]
    assert len(line) == 1 and "continue with: scaletrain resume " in line[0]
    run_dir = line[0].rsplit(" ", 1)[-1]
    done = scaletrain_cli("resume", run_dir, "--json")
    assert done.returncode == 0, done.stderr[-2000:]
    summary = json.loads(done.stdout)
    assert summary["weights_sha256"] == reference["weights_sha256"]
    assert [row["step"] for row in read_metrics(run_dir)] == list(range(1, 41))

    # Any checkpoint gives the same weights: rank 0's log shows where it stopped and resumed.
    entries = [json.loads(l) for l in (Path(run_dir) / "logs" / "worker-0.jsonl").read_text().splitlines()]
    starts = [i for i, e in enumerate(entries) if e["message"] == "worker started"]
    assert len(starts) == 2, [e["message"] for e in entries]
    first, second = entries[starts[0]:starts[1]], entries[starts[1]:]
    (stop,) = [e for e in first if e["message"].startswith("stopping at step")]
    stopped_at = stop["step"]
    assert stop["message"] == f"stopping at step {stopped_at} on SIGTERM; saving a checkpoint"
    saved = [e["step"] for e in first if e["message"] == "checkpoint saved"]
    assert saved[-1] == stopped_at, saved
    (resumed,) = [e for e in second if e["message"] == "resumed"]
    trained = [[e["step"] for e in part if e["message"] == "train metrics"] for part in (first, second)]
    assert (resumed["step"], trained) == (stopped_at, [list(range(1, stopped_at + 1)), list(range(stopped_at + 1, 41))])


def test_a_stop_checkpoint_that_outlasts_the_grace_period_is_not_used(tmp_path, reference, processes):
    """SIGTERM; rank 0's stop checkpoint never finishes (its files written, no manifest), so the
    launcher kills the workers when recovery.grace_period_s is over. The resume sweeps the
    half-written save and starts from the checkpoint before it, to the uninterrupted weights."""
    import yaml

    job = recovery_job(tmp_path, task={"args": {"step_sleep": 0.05}},
                       recovery={"max_restarts": 0, "grace_period_s": 3})
    job_file = tmp_path / "job.yaml"
    job_file.write_text(yaml.safe_dump(job))
    launcher = processes(
        [sys.executable, "-m", "scaletrain", "run", str(job_file), "--json"], cwd=REPO, text=True,
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, env={**os.environ, FAULT_ENV: "checkpoint_stall:rank=0:step=11"},
    )
    metrics = wait_for_steps(tmp_path, 12)
    stopped_at = time.monotonic()
    launcher.send_signal(signal.SIGTERM)
    out, err = launcher.communicate(timeout=120)
    assert time.monotonic() - stopped_at < 3 + 30, "the grace period ended the stalled save"
    run_dir = metrics.parent
    assert launcher.returncode == 75, err[-3000:]
    assert json.loads(out) == {"status": "preempted", "error": json.loads(out)["error"], "code": "ST-STOP-TIMED-OUT",
                               "run_dir": str(run_dir), "steps": None, "checkpoint_step": None}
    assert [l for l in err.splitlines() if l.startswith("error: ")] == [
        "error: preempted by SIGTERM; the workers were still running 3 s later (recovery.grace_period_s), "
        "saving their stop checkpoint or stuck, and were killed: that checkpoint is incomplete and will not "
        f"be used; continue with: scaletrain resume {run_dir} (from the newest complete checkpoint), and "
        "give a stop more time with recovery.grace_period_s"]
    root = run_dir / "checkpoints"
    assert [p.name for p in root.iterdir() if p.name.startswith(".staging")], "the stalled save is half-written"
    assert sorted(p.name for p in root.iterdir() if not p.name.startswith(".")) == ["step-00000010"]

    done = scaletrain_cli("resume", str(run_dir), "--json")
    assert done.returncode == 0, done.stderr[-3000:]
    summary = json.loads(done.stdout)
    assert summary["resumed_from_step"] == 10
    assert summary["weights_sha256"] == reference["weights_sha256"]
    assert not [p for p in root.iterdir() if p.name.startswith(".staging")]  # swept


def wait_for_steps(root: Path, steps: int, timeout_s: float = 120) -> Path:
    """The metrics file of the run under ``root`` once it shows ``steps`` steps."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        found = list((root / "runs").glob("*/*/metrics.jsonl"))
        if found and len(found[0].read_text().splitlines()) >= steps:
            return found[0]
        time.sleep(0.1)
    raise AssertionError(f"the run did not reach step {steps} in {timeout_s:g} s")


def test_object_storage_checkpoints_recover_and_verify(tmp_path, monkeypatch, s3_server, reference):
    job = recovery_job(tmp_path, checkpoint={"dir": "s3://ckpt/runs"})
    summary = run_with_fault(monkeypatch, "sigkill:rank=1:step=25", job)
    assert summary["restarts"] == 1 and summary["resumed_from_step"] == 20
    assert summary["weights_sha256"] == reference["weights_sha256"]
    location = f"s3://ckpt/runs/toy/{summary['run_id']}"
    verified = scaletrain_cli("checkpoints", "verify", location, "--json", env=s3_server.env())
    assert verified.returncode == 0, verified.stderr
    rows = json.loads(verified.stdout)
    assert [(r["name"], r["status"]) for r in rows] == [
        ("step-00000020", "verified"), ("step-00000030", "verified"), ("step-00000040", "verified")]
    assert os.path.isdir(Path(summary["run_dir"]) / "checkpoints") is False  # nothing local
