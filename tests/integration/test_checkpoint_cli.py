"""`scaletrain checkpoints ls|verify`, `verify-resume` and `resume`, as a user runs them."""

import json
from pathlib import Path

import pytest

from tests.helpers.run import scaletrain_cli
from tests.helpers.tasks import toy_job
from tests.integration.test_cli import assert_one_error_line, write_job


@pytest.fixture(scope="module")
def finished_run(tmp_path_factory):
    root = tmp_path_factory.mktemp("finished")
    job = write_job(root, toy_job(root, train={"max_steps": 30, "eval_every": 30},
                                  checkpoint={"every_steps": 10}))
    result = scaletrain_cli("run", str(job), "--json")
    assert result.returncode == 0, result.stderr
    return Path(json.loads(result.stdout)["run_dir"])


def test_ls_lists_committed_checkpoints_with_their_metrics(finished_run):
    result = scaletrain_cli("checkpoints", "ls", str(finished_run), "--json")
    assert result.returncode == 0, result.stderr
    rows = json.loads(result.stdout)
    assert [(r["name"], r["step"], r["status"]) for r in rows] == [
        ("step-00000020", 20, "committed"), ("step-00000030", 30, "committed")]
    assert rows[1]["world_size"] == 1 and rows[1]["bytes"] > 0
    assert set(rows[1]["metrics"]) >= {"train/loss", "eval/loss", "eval/accuracy"}
    table = scaletrain_cli("checkpoints", "ls", str(finished_run))
    assert "step-00000030" in table.stdout and "committed" in table.stdout


def test_verify_names_the_damaged_file_and_exits_1(tmp_path, finished_run):
    import shutil

    copy = tmp_path / "checkpoints"
    shutil.copytree(finished_run / "checkpoints", copy)
    good = scaletrain_cli("checkpoints", "verify", str(copy), "--json")
    assert good.returncode == 0 and {r["status"] for r in json.loads(good.stdout)} == {"verified"}
    with open(copy / "step-00000030" / "state.safetensors", "r+b") as handle:
        handle.seek(200)
        byte = handle.read(1)
        handle.seek(200)
        handle.write(bytes([byte[0] ^ 0xFF]))
    (copy / "step-00000020" / "manifest.json").unlink()
    bad = scaletrain_cli("checkpoints", "verify", str(copy), "--json")
    assert bad.returncode == 1
    rows = {r["name"]: r for r in json.loads(bad.stdout)}
    assert rows["step-00000030"]["status"] == "corrupt"
    assert rows["step-00000030"]["why"] == "state.safetensors does not match its blake3 hash (corrupted)"
    assert rows["step-00000020"]["status"] == "incomplete"
    assert rows["step-00000020"]["why"] == "no manifest (an unfinished save)"
    one = scaletrain_cli("checkpoints", "verify", str(copy / "step-00000030"), "--json")
    assert one.returncode == 1 and [r["name"] for r in json.loads(one.stdout)] == ["step-00000030"]


def test_verify_resume_passes_for_a_task_that_resumes_exactly(tmp_path):
    job = write_job(tmp_path, toy_job(tmp_path, task={"args": {"dropout": 0.1}}))
    result = scaletrain_cli("verify-resume", str(job), "--steps", "16")
    assert result.returncode == 0, result.stderr[-2000:]
    assert result.stdout.startswith("PASS: resumed from step 8 after a kill at step 12; final weights match")


def test_verify_resume_reports_the_step_the_workers_resumed_from(tmp_path, monkeypatch):
    """A restart that finds no checkpoint trains from step 0 to the same weights: verify-resume
    reports what the workers did, and fails. (Broken on purpose: no checkpoint before the kill.)"""
    import scaletrain.verify_resume as verify

    real_run = verify.run

    def no_checkpoint_before_the_kill(job, overrides):
        if "recovery.max_restarts=1" in overrides:
            overrides = [o if not o.startswith("checkpoint.every_steps=") else "checkpoint.every_steps=1000"
                         for o in overrides]
        return real_run(job, overrides)

    monkeypatch.setattr(verify, "run", no_checkpoint_before_the_kill)
    job = write_job(tmp_path, toy_job(tmp_path, task={"args": {"dropout": 0.1}}))
    outcome = verify.verify_resume(str(job), [], 16)
    assert outcome["uninterrupted_sha256"] == outcome["resumed_sha256"]
    assert (outcome["passed"], outcome["restarts"], outcome["resumed_from_step"]) == (False, 1, None)
    assert outcome["problem"] == ("the restarted workers found no checkpoint (one was due at step 8) and trained "
                                  "from step 0, which tests nothing about resuming")


def test_verify_resume_fails_for_a_task_with_hidden_state(tmp_path):
    job = write_job(tmp_path, toy_job(tmp_path, task={"target": "tests.helpers.tasks:HiddenStateTask"}))
    result = scaletrain_cli("verify-resume", str(job), "--steps", "16")
    assert result.returncode == 1
    assert result.stdout.startswith("FAIL: ") and "max abs difference" in result.stdout


def test_resume_from_one_checkpoint_sets_the_newer_ones_aside(tmp_path):
    job = write_job(tmp_path, toy_job(tmp_path, train={"max_steps": 30}, checkpoint={"every_steps": 10, "keep_last": 5}))
    first = json.loads(scaletrain_cli("run", str(job), "--json").stdout)
    run_dir = Path(first["run_dir"])
    result = scaletrain_cli("resume", str(run_dir / "checkpoints" / "step-00000010"), "--json")
    assert result.returncode == 0, result.stderr[-2000:]
    summary = json.loads(result.stdout)
    assert summary["resumed_from_step"] == 10 and summary["attempt"] == 2
    assert summary["weights_sha256"] == first["weights_sha256"]
    names = sorted(p.name for p in (run_dir / "checkpoints").iterdir())
    assert names == ["step-00000010", "step-00000020", "step-00000030",
                     "superseded-step-00000020", "superseded-step-00000030"]


def test_resume_bad_input_is_one_line(tmp_path):
    assert_one_error_line(
        scaletrain_cli("resume", str(tmp_path / "missing")),
        f"error: cannot resume '{tmp_path / 'missing'}': not a run directory (with spec.json), a "
        "checkpoint folder (with manifest.json) or a run id under ./runs; see `scaletrain runs`",
    )
    assert_one_error_line(
        scaletrain_cli("checkpoints", "ls", str(tmp_path / "missing")),
        f"error: '{tmp_path / 'missing'}' does not exist; pass a run directory or a checkpoint folder",
    )


def test_an_object_store_without_its_driver_is_bad_input(tmp_path):
    job = write_job(tmp_path, toy_job(tmp_path, checkpoint={"dir": "nosuchproto://bucket/x"}))
    result = scaletrain_cli("run", str(job))
    assert result.returncode == 2
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: checkpoint.dir 'nosuchproto://bucket/x': ")
    assert not (tmp_path / "runs").exists() or not any((tmp_path / "runs").rglob("model.safetensors"))


def test_resuming_a_finished_run_says_so_and_changes_nothing(finished_run):
    """No worker, no lock, no file rewritten: one line (the summary with --json), exit 0;
    asked for more steps, it trains them."""
    def state():
        return {str(p): (p.stat().st_mtime_ns, p.stat().st_size) for p in finished_run.rglob("*")}

    before = state()
    summary = json.loads((finished_run / "summary.json").read_text())
    note = (f"run {summary['run_id']} finished at step 30: nothing to resume (to train it longer, "
            "pass --set train.max_steps=N)")
    result = scaletrain_cli("resume", str(finished_run))
    assert (result.returncode, result.stdout.strip().splitlines()) == (0, [note]), result.stderr
    as_json = scaletrain_cli("resume", str(finished_run), "--json", "--set", "train.max_steps=30")
    assert as_json.returncode == 0, as_json.stderr
    assert json.loads(as_json.stdout) == {**summary, "note": note}
    assert state() == before
    longer = scaletrain_cli("resume", str(finished_run), "--json", "--set", "train.max_steps=32")
    assert longer.returncode == 0, longer.stderr
    resumed = json.loads(longer.stdout)
    assert (resumed["resumed_from_step"], resumed["steps"], resumed["attempt"]) == (30, 32, 2)
