"""Integrity of runs: one launcher per run directory, resume acts on the run named (never from
step 0 over a run that saved checkpoints), failures are the attempt's own, and the run ids users
type are checked before they reach a glob or MLflow."""

import json
import shutil
import signal
import socket
import subprocess
import sys
import time

import pytest
import yaml

import scaletrain
from scaletrain.errors import ConfigError, ScaletrainError, WorkerFailedError
from scaletrain.recovery.faults import FAULT_ENV
from tests.helpers.run import REPO, scaletrain_cli
from tests.helpers.tasks import toy_job

TOKEN = "tok-real-123456"
# The CLI run from another directory still finds the test tasks (and nothing relative).
ENV = {"PYTHONPATH": str(REPO)}


def failed_run(tmp_path, monkeypatch, **sections):
    """A run that saved checkpoints at steps 2 and 4, then failed at step 5; its run directory."""
    checkpoint = {"every_steps": 2, **sections.pop("checkpoint", {})}
    job = toy_job(tmp_path, checkpoint=checkpoint, **sections)
    monkeypatch.setenv(FAULT_ENV, "raise:rank=0:step=5")
    with pytest.raises(WorkerFailedError):
        scaletrain.run(job)
    monkeypatch.delenv(FAULT_ENV)
    (run_dir,) = (tmp_path / "runs" / "toy").iterdir()
    return run_dir


def write_job(path, job):
    path.write_text(yaml.safe_dump(job))
    return path


def one_error_line(result):
    assert "Traceback" not in result.stderr, result.stderr[-3000:]
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1, result.stderr[-3000:]
    return lines[0]


def wait_for(condition, timeout=60.0):
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.05)


# --------------------------------------------------------------------------- the run lock


def test_a_running_run_cannot_be_resumed_and_is_free_once_its_launcher_dies(tmp_path, processes):
    job = write_job(tmp_path / "job.yaml", toy_job(
        tmp_path, train={"max_steps": 60, "log_every": 1}, checkpoint={"every_steps": 2},
        task={"args": {"step_sleep": 0.2}}))
    first = processes([sys.executable, "-m", "scaletrain", "run", str(job)], cwd=REPO,
                      stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        runs = tmp_path / "runs" / "toy"
        wait_for(lambda: runs.is_dir() and any(runs.glob("*/checkpoints/step-*/manifest.json")))
        (run_dir,) = runs.iterdir()
        second = scaletrain_cli("resume", str(run_dir))
        assert second.returncode == 2
        assert one_error_line(second) == (
            f"error: run {run_dir.name} is in use by pid {first.pid} on host {socket.gethostname()}; "
            "wait for it or stop it"
        )
        assert first.poll() is None  # untouched
    finally:
        first.send_signal(signal.SIGKILL)  # the launcher dies without cleaning anything up
        first.wait()
    done = scaletrain_cli("resume", str(run_dir), "--set", "task.args.step_sleep=0", "--json")
    assert done.returncode == 0, done.stderr[-3000:]
    summary = json.loads(done.stdout)
    assert summary["status"] == "finished" and summary["steps"] == 60 and summary["resumed_from_step"] >= 2


def test_two_resumes_at_once_one_runs_and_the_other_is_refused(tmp_path, monkeypatch, processes):
    run_dir = failed_run(tmp_path, monkeypatch, task={"args": {"step_sleep": 0.3}})
    both = [processes([sys.executable, "-m", "scaletrain", "resume", str(run_dir)], cwd=REPO,
                      stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
            for _ in range(2)]
    results = [(p, *p.communicate(timeout=240)) for p in both]
    codes = sorted(p.returncode for p, _, _ in results)
    assert codes == [0, 2], [err[-2000:] for _, _, err in results]
    (winner,) = [p for p, _, _ in results if p.returncode == 0]
    (refused,) = [err for p, _, err in results if p.returncode == 2]
    assert refused.strip().splitlines() == [
        f"error: run {run_dir.name} is in use by pid {winner.pid} on host {socket.gethostname()}; "
        "wait for it or stop it"
    ]
    assert json.loads((run_dir / "summary.json").read_text())["attempt"] == 2


# --------------------------------------------------------------------------- resume acts on the run named


def test_a_relative_checkpoint_dir_resumes_from_another_directory(tmp_path):
    started_in, resumed_in = tmp_path / "a", tmp_path / "b"
    started_in.mkdir()
    resumed_in.mkdir()
    job = write_job(started_in / "job.yaml", toy_job(tmp_path, checkpoint={"every_steps": 2, "dir": "ckpt"}))
    first = scaletrain_cli("run", str(job), cwd=started_in, env={**ENV, FAULT_ENV: "raise:rank=0:step=5"})
    assert first.returncode == 1, first.stderr[-3000:]
    (run_dir,) = (tmp_path / "runs" / "toy").iterdir()
    assert sorted(p.name for p in (started_in / "ckpt" / "toy" / run_dir.name).iterdir()) == [
        "step-00000002", "step-00000004"]
    done = scaletrain_cli("resume", str(run_dir), "--json", cwd=resumed_in, env=ENV)
    assert done.returncode == 0, done.stderr[-3000:]
    assert json.loads(done.stdout)["resumed_from_step"] == 4
    assert not (resumed_in / "ckpt").exists()


def test_a_run_that_saved_checkpoints_is_never_trained_again_from_step_0(tmp_path, monkeypatch):
    run_dir = failed_run(tmp_path, monkeypatch)
    shutil.move(run_dir / "checkpoints", tmp_path / "elsewhere")  # unmounted, moved, deleted...
    with pytest.raises(ScaletrainError) as info:
        scaletrain.resume(run_dir)
    assert str(info.value) == (
        f"run {run_dir.name} saved checkpoints (the newest at step 4) but none are in "
        f"{run_dir / 'checkpoints'}: put them back there, or pass --set checkpoint.dir=WHERE they "
        "are; to train from step 0, start a new run with `scaletrain run`"
    )
    assert not (run_dir / "model.safetensors").exists()
    assert json.loads((run_dir / "spec.json").read_text())["attempt"] == 1  # nothing launched


def test_a_moved_run_directory_continues_where_it_is(tmp_path, monkeypatch):
    run_dir = failed_run(tmp_path, monkeypatch)
    moved = tmp_path / "backup" / run_dir.name
    moved.parent.mkdir()
    shutil.move(run_dir, moved)
    summary = scaletrain.resume(moved)
    assert summary["run_dir"] == str(moved) and summary["resumed_from_step"] == 4
    assert not run_dir.exists()  # the recorded place is neither written nor recreated
    spec = json.loads((moved / "spec.json").read_text())
    assert spec["run_dir"] == str(moved) and spec["checkpoints"] == str(moved / "checkpoints")
    assert sorted(p.name for p in (moved / "checkpoints").iterdir())[-1] == "step-00000020"


def test_nothing_of_a_failed_in_process_attempt_writes_after_it_returns(tmp_path, monkeypatch):
    """The in-process worker shares the caller's process: its background threads (run card,
    checkpoint writer and retention) end before run() raises, or a run directory moved or
    resumed next gets written in its old place (seen on CI)."""
    import threading

    from scaletrain.tracking import run_card as worker  # the runner's card, built here

    build = worker.build_run_card

    def slow_card(*args, **kwargs):
        time.sleep(1.5)  # the card is still being written when step 5 fails
        return build(*args, **kwargs)

    monkeypatch.setattr(worker, "build_run_card", slow_card)
    run_dir = failed_run(tmp_path, monkeypatch, checkpoint={"every_steps": 2, "async_save": True})
    assert [t.name for t in threading.enumerate() if t.name.startswith("scaletrain-")] == []
    assert (run_dir / "run_card.json").is_file()


def test_a_copy_of_a_run_directory_is_refused_while_the_original_is_there(tmp_path, monkeypatch):
    run_dir = failed_run(tmp_path, monkeypatch)
    copy = tmp_path / "copy" / run_dir.name
    shutil.copytree(run_dir, copy)
    with pytest.raises(ConfigError) as info:
        scaletrain.resume(copy)
    assert info.value.exit_code == 2
    assert str(info.value) == (
        f"{copy} is a copy of run directory {run_dir}, which is still there: resume that one "
        "(a copy would continue the same run in two places)"
    )
    assert json.loads((run_dir / "spec.json").read_text())["attempt"] == 1


def test_a_checkpoint_folder_outside_its_runs_location_is_refused(tmp_path, monkeypatch):
    run_dir = failed_run(tmp_path, monkeypatch)
    copy = tmp_path / "sent" / "step-00000002"
    shutil.copytree(run_dir / "checkpoints" / "step-00000002", copy)
    with pytest.raises(ConfigError) as info:
        scaletrain.resume(copy)
    assert str(info.value) == (
        f"checkpoint {copy} is not one of run {run_dir.name}'s checkpoints (they are in "
        f"{run_dir / 'checkpoints'}): name a folder there, or copy this one into it"
    )
    assert sorted(p.name for p in (run_dir / "checkpoints").iterdir()) == ["step-00000002", "step-00000004"]


def test_a_run_id_is_not_a_glob_pattern(tmp_path, monkeypatch):
    run_dir = failed_run(tmp_path, monkeypatch)
    monkeypatch.chdir(tmp_path)  # ./runs holds the run
    for pattern in ("*", "2*", "[0-9]*"):
        with pytest.raises(ConfigError) as info:
            scaletrain.resume(pattern)
        assert str(info.value).startswith(f"{pattern!r} is not a run id")
    assert json.loads((run_dir / "spec.json").read_text())["attempt"] == 1


# --------------------------------------------------------------------------- failures are the attempt's own

TWO_WORKERS = {"scale": {"workers": 2}, "checkpoint": {"every_steps": 4},
               "recovery": {"max_restarts": 0, "grace_period_s": 10}}
BOTH_KILLED = "sigkill:rank=0:step=10{a};sigkill:rank=1:step=10{a}"  # neither writes an error file


@pytest.mark.distributed
def test_a_resumed_attempt_is_not_blamed_on_the_previous_attempts_error(tmp_path, monkeypatch):
    job = toy_job(tmp_path, **TWO_WORKERS)
    monkeypatch.setenv(FAULT_ENV, "raise:rank=1:step=6")
    with pytest.raises(WorkerFailedError) as first:
        scaletrain.run(job)
    assert "worker rank 1 failed: RuntimeError: injected fault at step 6 on rank 1" in str(first.value)
    (run_dir,) = (tmp_path / "runs" / "toy").iterdir()
    monkeypatch.setenv(FAULT_ENV, BOTH_KILLED.format(a=""))
    with pytest.raises(WorkerFailedError) as second:
        scaletrain.resume(run_dir)
    assert "the process was killed by SIGKILL" in str(second.value), str(second.value)
    assert "injected fault" not in str(second.value)
    # The earlier attempt's record stays where it was.
    assert "injected fault" in (run_dir / "logs" / "worker-1.error.json").read_text()


@pytest.mark.distributed
def test_a_restarts_failure_is_not_blamed_on_the_first_starts_error(tmp_path, monkeypatch):
    job = toy_job(tmp_path, **{**TWO_WORKERS, "recovery": {"max_restarts": 1, "grace_period_s": 10}})
    monkeypatch.setenv(FAULT_ENV, "raise:rank=1:step=6;" + BOTH_KILLED.format(a=":attempt=1"))
    with pytest.raises(WorkerFailedError) as info:
        scaletrain.run(job)
    assert "the process was killed by SIGKILL" in str(info.value), str(info.value)
    assert "injected fault" not in str(info.value)


# --------------------------------------------------------------------------- show, reproduce


def tracked_run(tmp_path, uri):
    """A finished run tracked in ``uri`` whose task has a secret argument."""
    summary = scaletrain.run(toy_job(
        tmp_path, train={"max_steps": 6, "log_every": 3}, task={"args": {"api_token": TOKEN}},
        tracking={"enabled": True, "uri": uri, "experiment": "tests", "log_model": False}))
    assert summary["mlflow_run_id"]
    return summary


def runs_in(uri):
    from mlflow import MlflowClient

    client = MlflowClient(uri)
    return client.search_runs([e.experiment_id for e in client.search_experiments()])


@pytest.mark.parametrize("command", ["show", "reproduce"])
@pytest.mark.parametrize("ref", ["x' OR tags.a = 'b", "2026*"])
def test_show_and_reproduce_take_run_ids_only(tmp_path, command, ref):
    result = scaletrain_cli(command, ref, "--uri", f"sqlite:///{tmp_path / 'mlflow.db'}")
    assert result.returncode == 2
    assert one_error_line(result) == (
        f"error: {ref!r} is not a run id: use the scaletrain or MLflow run id as `scaletrain runs` "
        "lists it (letters, digits, '.', '_' and '-')"
    )


def test_reproduce_runs_the_real_job_and_tracks_it_in_the_store_given(tmp_path):
    recorded_in, given = f"sqlite:///{tmp_path / 'a.db'}", f"sqlite:///{tmp_path / 'b.db'}"
    summary = tracked_run(tmp_path, recorded_in)
    shutil.copy(tmp_path / "a.db", tmp_path / "b.db")  # the same runs, in another store
    result = scaletrain_cli("reproduce", summary["run_id"], "--uri", given, "--json")
    assert result.returncode == 0, result.stderr[-3000:]
    outcome = json.loads(result.stdout)
    assert outcome["weights_match"] is True
    assert f"job: {summary['run_dir']}/spec.json (the run's own, on this machine)" in result.stderr
    assert [r.info.run_id for r in runs_in(recorded_in)] == [summary["mlflow_run_id"]]
    new = {r.info.run_id: r for r in runs_in(given)}[outcome["new_run"]]
    assert new.data.tags["scaletrain.reproduces"] == summary["mlflow_run_id"]
    assert new.data.params["tracking.uri"] == given
    new_dir = tmp_path / "runs" / "toy" / new.data.tags["scaletrain.run_id"]
    assert json.loads((new_dir / "spec.json").read_text())["job"]["task"]["args"]["api_token"] == TOKEN


def test_reproduce_from_the_redacted_job_needs_its_secrets_and_imports_only_safe_folders(tmp_path):
    from mlflow import MlflowClient

    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    summary = tracked_run(tmp_path, uri)
    shutil.rmtree(summary["run_dir"])  # only the tracking server's (redacted) copy is left
    refused = scaletrain_cli("reproduce", summary["run_id"], "--uri", uri)
    assert refused.returncode == 2
    assert one_error_line(refused) == (
        f"error: run {summary['mlflow_run_id']}'s job on the tracking server is redacted: "
        "task.args.api_token is masked (***); supply it with --set KEY=VALUE, or reproduce on the "
        "machine that has the run directory (its spec.json holds the real job)"
    )
    # Whoever can write the run's tags names the folders its task is imported from.
    planted = tmp_path / "planted"
    (planted / "tests" / "helpers").mkdir(parents=True)
    for init in (planted / "tests" / "__init__.py", planted / "tests" / "helpers" / "__init__.py"):
        init.write_text("")
    marker = tmp_path / "planted-code-ran"
    (planted / "tests" / "helpers" / "tasks.py").write_text(f"open({str(marker)!r}, 'w').close()\n")
    planted.chmod(0o777)
    MlflowClient(uri).set_tag(summary["mlflow_run_id"], "scaletrain.python_path",
                              json.dumps([str(planted), str(tmp_path / "gone"), str(REPO)]))
    other = scaletrain_cli("reproduce", summary["run_id"], "--uri", uri, "--set", "optim.lr=1")
    assert other.returncode == 2
    assert one_error_line(other) == (
        "error: --set optim.lr: reproduce runs the recorded job; --set only supplies its masked "
        "values (task.args.api_token)"
    )
    result = scaletrain_cli("reproduce", summary["run_id"], "--uri", uri, "--set",
                            f"task.args.api_token={TOKEN}")
    assert result.returncode == 0, result.stderr[-3000:]
    assert result.stdout.startswith(f"final weights match bit for bit: {summary['weights_sha256']}")
    assert "job: the tracking server's job.yaml (redacted)" in result.stderr
    assert f"not importing the task from {planted}: others can write to it" in result.stderr
    assert f"not importing the task from {tmp_path / 'gone'}: it does not exist here" in result.stderr
    assert f"importing the task from {REPO} (recorded with the run)" in result.stderr
    assert not marker.exists()


def test_an_unreadable_artifact_store_is_said_not_taken_for_missing_artifacts(tmp_path):
    from mlflow import MlflowClient

    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    client = MlflowClient(uri)
    experiment = client.create_experiment("elsewhere", artifact_location="s3://bucket/artifacts")
    run = client.create_run(experiment, tags={"scaletrain.run_id": "20261204-000000-abcdef"})
    run_id = run.info.run_id
    unreachable = {"AWS_ENDPOINT_URL": "http://127.0.0.1:1", "AWS_ACCESS_KEY_ID": "test",
                   "AWS_SECRET_ACCESS_KEY": "test", "AWS_MAX_ATTEMPTS": "1",
                   "AWS_EC2_METADATA_DISABLED": "true"}
    for command in ("show", "reproduce"):
        result = scaletrain_cli(command, "20261204-000000-abcdef", "--uri", uri, env=unreachable)
        assert result.returncode == 1
        assert one_error_line(result).startswith(
            f"error: cannot list the artifacts of run {run_id} at {uri}: EndpointConnectionError: "
            "Could not connect to the endpoint URL")
