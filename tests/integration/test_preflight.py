"""Pre-flight: what a run will write is checked before any worker starts, and a refusal is one
line, exit 2, with nothing started and nothing left behind. Real parts: the CLI as a user
runs it, the moto S3 server, `mlflow server --app-name basic-auth` with real users."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from tests.helpers.run import REPO, scaletrain_cli

DIGITS = str(REPO / "examples" / "digits.yaml")
QUICK = ["--set", "train.max_steps=2", "--set", "train.epochs=null", "--set", "train.eval_every=null",
         "--set", "scale.workers=1"]


def _one_error_line(result) -> str:
    assert "Traceback" not in result.stderr + result.stdout
    errors = [line for line in result.stderr.splitlines() if line.startswith("error:")]
    assert len(errors) == 1, result.stderr
    return errors[0]


def _files_under(folder: Path) -> list[str]:
    return sorted(str(p.relative_to(folder)) for p in folder.rglob("*"))


def test_check_passes_on_a_fresh_folder_and_changes_nothing(tmp_path):
    result = scaletrain_cli("check", DIGITS, cwd=tmp_path)
    assert result.returncode == 0, result.stderr
    lines = result.stdout.splitlines()
    assert [line.split(":")[0].split()[-1] for line in lines[:-1]] == [
        "directory", "checkpoints", "disk", "tracking"]
    assert all(line.startswith("ok ") for line in lines[:-1]), result.stdout
    assert "write, read back, list and delete of a probe" in lines[1]
    assert re.search(r"the checkpoints kept need about [\d.]+ MiB \(306\.1 KiB each\)", lines[2]), lines[2]
    assert re.fullmatch(r"pre-flight passed: 4 checks in \d+ ms", lines[-1]), lines[-1]
    assert _files_under(tmp_path) == []  # no run directory, no probe, no mlflow.db


def test_unwritable_checkpoint_dir_is_refused_before_any_worker(tmp_path):
    blocker = tmp_path / "not-a-folder"
    blocker.write_text("a file where the checkpoints' folder would be")
    result = scaletrain_cli("run", DIGITS, *QUICK, "--set", f"checkpoint.dir={blocker}/ckpt", cwd=tmp_path)
    assert result.returncode == 2
    line = _one_error_line(result)
    assert line.startswith(f"error: pre-flight: checkpoints: {blocker}/ckpt/digits/"), line
    assert "set checkpoint.dir to a folder you can write" in line
    assert _files_under(tmp_path) == ["not-a-folder"]  # no run directory, no MLflow store


def test_unwritable_run_dir_is_refused(tmp_path):
    blocker = tmp_path / "runs"
    blocker.write_text("a file where the runs' folder would be")
    result = scaletrain_cli("run", DIGITS, *QUICK, cwd=tmp_path)
    assert result.returncode == 2
    line = _one_error_line(result)
    assert line == (f"error: pre-flight: run directory: {blocker} is not a folder; set run_dir to a folder you "
                    "can write (and 1 more: `scaletrain check JOB` lists them)")  # the checkpoints under it
    assert _files_under(tmp_path) == ["runs"]


def test_disk_too_small_for_the_checkpoints_kept(tmp_path):
    # ~160 billion parameters on the meta device: terabytes of checkpoints, no memory used.
    huge = ["--set", "task.target=tiny_gpt:TinyGPTTask", "--set", "task.args={layers: 200, dim: 8192, heads: 64}"]
    result = scaletrain_cli("check", DIGITS, *huge, cwd=tmp_path, timeout=120)
    assert result.returncode == 2
    line = _one_error_line(result)
    assert re.match(r"error: pre-flight: disk: [\d.]+ [GT]iB free at .*; the checkpoints kept need about "
                    r"[\d.]+ TiB \([\d.]+ TiB each\): free some space, lower checkpoint.keep_last", line), line


def test_object_storage_probe_and_missing_bucket(tmp_path, s3_server):
    result = scaletrain_cli("check", DIGITS, "--set", "checkpoint.dir=s3://ckpt/team", "--json", cwd=tmp_path)
    assert result.returncode == 0, result.stderr
    outcome = json.loads(result.stdout)
    probe = next(c for c in outcome["checks"] if c["name"] == "checkpoints")
    assert probe["ok"] and probe["detail"].startswith("s3://ckpt/team/digits/")
    listed = s3_server.client().list_objects_v2(Bucket="ckpt").get("KeyCount")
    assert listed == 0  # the probe object is gone
    print(f"pre-flight on the local S3 server: {outcome['seconds'] * 1000:.0f} ms "
          f"(checkpoint probe {probe['seconds'] * 1000:.0f} ms)")

    result = scaletrain_cli("run", DIGITS, *QUICK, "--set", "checkpoint.dir=s3://no-such-bucket/x", cwd=tmp_path)
    assert result.returncode == 2
    line = _one_error_line(result)
    assert line.startswith("error: pre-flight: checkpoints: s3://no-such-bucket/x/digits/"), line
    assert "cannot write a probe object" in line and "check that the bucket exists" in line
    assert not (tmp_path / "runs").exists()


@pytest.fixture(scope="module")
def auth_server(tmp_path_factory):
    from tests.helpers.servers import MlflowAuthServer

    server = MlflowAuthServer(tmp_path_factory.mktemp("mlflow-auth")).start()
    try:
        server.call("users/create", {"username": "reader", "password": "reader-password-1234"})
        server.call("experiments/create", {"name": "digits"})
        yield server
    finally:
        server.stop()


def _as(server, user: str, password: str) -> dict[str, str]:
    return {"MLFLOW_TRACKING_URI": server.uri, "MLFLOW_TRACKING_USERNAME": user, "MLFLOW_TRACKING_PASSWORD": password}


def test_mlflow_basic_auth_right_wrong_and_read_only(tmp_path, auth_server):
    ok = scaletrain_cli("check", DIGITS, cwd=tmp_path, env=_as(auth_server, auth_server.admin, auth_server.admin_password))
    assert ok.returncode == 0, ok.stderr
    assert f"ok    tracking: {auth_server.uri}: user 'admin' may create runs in experiment 'digits'" in ok.stdout

    wrong_password = "not-the-password-9f3b"
    wrong = scaletrain_cli("run", DIGITS, *QUICK, cwd=tmp_path, env=_as(auth_server, "admin", wrong_password))
    assert wrong.returncode == 2
    assert _one_error_line(wrong) == (
        f"error: pre-flight: tracking: {auth_server.uri} refused the credentials (HTTP 401): set "
        "MLFLOW_TRACKING_USERNAME and MLFLOW_TRACKING_PASSWORD (or MLFLOW_TRACKING_TOKEN) to an account of that server")

    reader = scaletrain_cli("run", DIGITS, *QUICK, cwd=tmp_path, env=_as(auth_server, "reader", "reader-password-1234"))
    assert reader.returncode == 2
    assert _one_error_line(reader).startswith(
        f"error: pre-flight: tracking: {auth_server.uri}: user 'reader' may not create runs in experiment 'digits' (HTTP 403)")

    for result in (wrong, reader):
        assert wrong_password not in result.stdout + result.stderr
        assert "reader-password-1234" not in result.stdout + result.stderr
    assert not (tmp_path / "runs").exists()  # no run directory: no worker ever started
    runs = auth_server.call("runs/search", {"experiment_ids": ["1"]})
    assert runs.get("runs", []) == []  # the probes created nothing


def test_a_server_that_is_down_is_a_warning_not_a_failure(tmp_path):
    from tests.helpers.servers import free_port

    down = f"http://127.0.0.1:{free_port()}"
    result = scaletrain_cli("check", DIGITS, cwd=tmp_path, env={"MLFLOW_TRACKING_URI": down})
    assert result.returncode == 0, result.stderr
    assert f"warn  tracking: {down} does not answer" in result.stdout
    assert "the run goes on and journals its metrics" in result.stdout


def test_a_new_run_checks_the_disk_on_its_workers_before_the_first_step(tmp_path):
    """The launcher does not build the model (seconds of start-up); the workers do, and check the
    exact size of a checkpoint against the disk before any step. keep_every=1 over 10^8 steps
    keeps ~30 TiB of digits checkpoints."""
    result = scaletrain_cli("run", DIGITS, "--set", "scale.workers=1", "--set", "train.epochs=null",
                            "--set", "train.max_steps=100000000", "--set", "checkpoint.keep_every=1",
                            cwd=tmp_path)
    assert result.returncode == 2, result.stderr
    line = _one_error_line(result)
    assert re.match(r"error: worker rank 0 failed: PreflightError: pre-flight: disk: [\d.]+ [GT]iB free at "
                    r".*; the checkpoints kept need about [\d.]+ TiB \(306\.1 KiB each\)", line), line
    run_dir = next((tmp_path / "runs" / "digits").iterdir())
    metrics = run_dir / "metrics.jsonl"
    assert not metrics.exists() or metrics.read_text() == ""  # not one step trained
