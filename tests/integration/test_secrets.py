"""Secrets are masked where they are and nowhere else: a real run (the CLI, an MLflow store)
leaves no secret in any file it writes or uploads, in any encoding, while the working
directory and ordinary names (pad_token_id, max_tokens...) stay as they are. Also the run
card's git state, artifacts behind links, `scaletrain ui`'s command line and a tune trial's
output."""

from __future__ import annotations

import hashlib
import json
import logging
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from urllib.parse import quote

import pytest
import yaml

from tests.helpers.run import REPO, scaletrain_cli
from tests.helpers.tasks import ToyTask, toy_job

API_TOKEN = 'p"ss\\w0rd-é'
HF_TOKEN = "hf_secret_éé_value"
URL_USER_TOKEN = "ghp_tokenuser0123456789"
QUERY_TOKEN = "qtok-5e6f7a8b"
SIGNATURE = "sigval-9a8b7c6d"
AT_PASSWORD = "p@ss-w0rd-42"
NOTE = (f"https://{URL_USER_TOKEN}@github.com/org/repo.git?token={QUERY_TOKEN}&X-Amz-Signature={SIGNATURE}"
        f"&page=2 and https://alice:{AT_PASSWORD}@data.example/x")
MASKED_NOTE = ("https://***@github.com/org/repo.git?token=***&X-Amz-Signature=***&page=2 and "
               "https://***@data.example/x")
PLANTED = (API_TOKEN, HF_TOKEN, URL_USER_TOKEN, QUERY_TOKEN, SIGNATURE, AT_PASSWORD, "ss-w0rd-42")
ORDINARY = {"pad_token_id": 3, "num_key_value_heads": 8, "session_len": 128, "max_tokens": 64,
            "tokenizer": "bpe-32k"}


class TokenizerTask(ToyTask):
    """A ToyTask with a language model's ordinary names and a credential, which it logs,
    prints and finally fails with."""

    def __init__(self, api_token=None, note="", pad_token_id=0, num_key_value_heads=1, session_len=8,
                 max_tokens=16, tokenizer="bpe", fail_after=None, print_kib=0, **kwargs):
        super().__init__(**kwargs)
        self.api_token, self.note, self.fail_after = api_token, note, fail_after
        logging.getLogger("scaletrain.task").info(
            "hub %s with token %s", note, api_token,
            extra={"hub_token": os.environ.get("HF_TOKEN"), "pad_token_id": pad_token_id},
        )
        for _ in range(print_kib):  # more than a pipe holds (64 KiB)
            print("x" * 1023, flush=True)

    def loss(self, model, batch):
        if model.training and self.fail_after is not None and self.calls >= self.fail_after:
            raise RuntimeError(f"upload to {self.note} refused {self.api_token} {os.environ.get('HF_TOKEN')}")
        return super().loss(model, batch)


def secret_job(tmp_path, **sections) -> dict:
    job = toy_job(tmp_path, **sections)
    job["task"] = {"target": "tests.integration.test_secrets:TokenizerTask",
                   "args": {"api_token": API_TOKEN, "note": NOTE, **ORDINARY, **job["task"]["args"]}}
    return job


def written_forms(secret: str) -> set[bytes]:
    forms = {secret, json.dumps(secret)[1:-1], json.dumps(secret, ensure_ascii=False)[1:-1],
             repr(secret)[1:-1], quote(secret, safe="")}
    return {form.encode("utf-8") for form in forms}


def leaks(root: Path, skip: set[Path]) -> list[str]:
    found = []
    for path in sorted(p for p in root.rglob("*") if p.is_file() and p not in skip):
        data = path.read_bytes()
        found += [f"{path.relative_to(root)}: {secret!r}" for secret in PLANTED
                  if any(form in data for form in written_forms(secret))]
    return found


def console_leaks(out: subprocess.CompletedProcess) -> list[str]:
    console = (out.stdout + out.stderr).encode("utf-8")
    return [f"console: {secret!r}" for secret in PLANTED if any(form in console for form in written_forms(secret))]


def cli_env(tmp_path) -> dict:
    return {"PYTHONPATH": f"{REPO / 'src'}{os.pathsep}{REPO}", "PWD": str(tmp_path), "HF_TOKEN": HF_TOKEN,
            "MLFLOW_TRACKING_URI": f"sqlite:///{tmp_path / 'mlflow.db'}"}


def test_a_failed_run_leaves_no_secret_in_any_file_and_ordinary_names_alone(tmp_path):
    pytest.importorskip("mlflow")
    from mlflow import MlflowClient

    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    job = secret_job(tmp_path, run_dir="runs", task={"args": {"fail_after": 4}},
                     train={"max_steps": 8, "log_every": 2}, checkpoint={"every_steps": 2},
                     tracking={"enabled": True, "uri": uri, "experiment": "secrets", "log_model": False})
    job_file = tmp_path / "job.yaml"
    job_file.write_text(yaml.safe_dump(job, allow_unicode=True), encoding="utf-8")
    out = scaletrain_cli("run", str(job_file), "--json", cwd=tmp_path, env=cli_env(tmp_path))
    assert out.returncode == 1 and "RuntimeError: upload to" in out.stderr, out.stderr[-3000:]
    (run_dir,) = [p.parent for p in (tmp_path / "runs").glob("*/*/spec.json")]
    assert console_leaks(out) == []

    # Nothing the run wrote holds a secret, in any encoding: its files, the MLflow store and
    # artifacts. spec.json is what the workers need (unredacted), its owner's alone, never uploaded.
    assert (run_dir / "spec.json").stat().st_mode & 0o777 == 0o600
    assert leaks(tmp_path, skip={job_file, run_dir / "spec.json"}) == []
    summary = json.loads((run_dir / "summary.json").read_text(encoding="utf-8"))
    assert summary["status"] == "failed"
    assert "upload to https://***@github.com/org/repo.git?token=***" in summary["error"]
    assert "refused *** ***" in summary["error"]

    client = MlflowClient(uri)
    run = client.get_run(summary["mlflow_run_id"])
    assert run.info.artifact_uri.startswith(f"file://{tmp_path}") or run.info.artifact_uri.startswith(str(tmp_path))
    artifacts = {a.path for a in client.list_artifacts(run.info.run_id)}
    assert {"summary.json", "run_card.json", "job.yaml", "logs"} <= artifacts
    params = run.data.params
    assert params["task.args.api_token"] == "***"
    assert params["task.args.note"] == MASKED_NOTE
    assert {k: params[f"task.args.{k}"] for k in ORDINARY} == {k: str(v) for k, v in ORDINARY.items()}

    recorded = yaml.safe_load((run_dir / "job.yaml").read_text(encoding="utf-8"))
    assert recorded["task"]["args"] == {**ORDINARY, "api_token": "***", "note": MASKED_NOTE, "fail_after": 4}

    # The working directory is no secret: log lines show it as it is.
    lines = [json.loads(line) for line in (run_dir / "logs" / "worker-0.jsonl").read_text().splitlines()]
    saved = [entry["checkpoint"] for entry in lines if entry["message"] == "checkpoint saved"]
    assert saved and all(path.startswith(f"{tmp_path}/runs/") for path in saved), saved
    (hub,) = [entry for entry in lines if entry["message"].startswith("hub ")]
    assert (hub["message"], hub["hub_token"], hub["pad_token_id"]) == (f"hub {MASKED_NOTE} with token ***", "***", 3)


@pytest.fixture
def auth_server(tmp_path_factory):
    from tests.helpers.servers import MlflowAuthServer

    server = MlflowAuthServer(tmp_path_factory.mktemp("mlflow-auth")).start()
    yield server
    server.stop()


def test_a_password_in_the_tracking_uri_is_nowhere_but_the_job_file(tmp_path, auth_server):
    """tracking.uri carries user:password@ to a real server that wants them: the run is tracked
    there, and resumed into the same MLflow run (the job file gives the password again), yet the
    password is in no file of the run (its workers' and launcher's logs included), nothing the
    server stored, and nothing on the console (the workers print there)."""
    password = "trk-Pw_5e6f7a8b"
    auth_server.call("users/create", {"username": "ana", "password": password})
    uri = auth_server.uri.replace("http://", f"http://ana:{password}@")
    job = secret_job(tmp_path, run_dir="runs", scale={"workers": 2}, train={"max_steps": 4, "log_every": 1},
                     tracking={"enabled": True, "uri": uri, "experiment": "secrets", "log_model": False})
    job_file = tmp_path / "job.yaml"
    job_file.write_text(yaml.safe_dump(job, allow_unicode=True), encoding="utf-8")
    env = {**cli_env(tmp_path), "MLFLOW_TRACKING_URI": ""}
    out = scaletrain_cli("run", str(job_file), cwd=tmp_path, env=env)
    assert out.returncode == 0, out.stderr[-3000:]
    (run_dir,) = [p.parent for p in (tmp_path / "runs").glob("*/*/spec.json")]
    again = scaletrain_cli("resume", str(run_dir), "--set", "train.max_steps=6", cwd=tmp_path, env=env)
    assert again.returncode == 0, again.stderr[-3000:]
    assert {"worker-0.jsonl", "worker-1.jsonl", "launcher.jsonl"} <= {p.name for p in (run_dir / "logs").iterdir()}

    secrets = (password, *PLANTED)
    console = (out.stdout + out.stderr + again.stdout + again.stderr).encode("utf-8")
    found = [f"console: {s!r}" for s in secrets if any(form in console for form in written_forms(s))]
    server_config = {auth_server.root / "basic_auth.ini"}  # the admin's, not ana's
    for root in (tmp_path, auth_server.root):
        for path in sorted(p for p in root.rglob("*") if p.is_file()):
            if path in {job_file, run_dir / "spec.json", *server_config}:
                continue
            data = path.read_bytes()
            found += [f"{path}: {s!r}" for s in secrets if any(form in data for form in written_forms(s))]
    assert found == [], "\n".join(found)

    from mlflow import MlflowClient

    os.environ["MLFLOW_TRACKING_USERNAME"], os.environ["MLFLOW_TRACKING_PASSWORD"] = "ana", password
    try:
        client = MlflowClient(auth_server.uri)
        (run,) = client.search_runs([client.get_experiment_by_name("secrets").experiment_id])
        steps = [m.step for m in client.get_metric_history(run.info.run_id, "train/loss")]
    finally:
        del os.environ["MLFLOW_TRACKING_USERNAME"], os.environ["MLFLOW_TRACKING_PASSWORD"]
    assert run.data.params["tracking.uri"] == auth_server.uri.replace("http://", "http://***@")
    assert (run.info.status, run.data.tags["scaletrain.attempts"], steps) == ("FINISHED", "2", [1, 2, 3, 4, 5, 6])


def test_a_ray_engine_run_leaves_no_secret_in_any_file_or_on_the_console(tmp_path):
    """The same planted secrets under the Ray engine (a local Ray scaletrain starts): Ray's
    routed driver log, the connect log, the workers' logs, the run's files and the store."""
    pytest.importorskip("ray")
    job = secret_job(tmp_path, run_dir="runs", scale={"engine": "ray", "workers": 2, "cpus_per_worker": 0.5},
                     train={"max_steps": 4, "log_every": 1},
                     tracking={"enabled": True, "uri": f"sqlite:///{tmp_path / 'mlflow.db'}", "log_model": False})
    job_file = tmp_path / "job.yaml"
    job_file.write_text(yaml.safe_dump(job, allow_unicode=True), encoding="utf-8")
    env = {**cli_env(tmp_path), "RAY_USAGE_STATS_ENABLED": "0"}
    out = scaletrain_cli("run", str(job_file), "--json", cwd=tmp_path, env=env, timeout=240)
    assert out.returncode == 0, out.stderr[-3000:]
    (run_dir,) = [p.parent for p in (tmp_path / "runs").glob("*/*/spec.json")]
    logs = {p.name for p in (run_dir / "logs").iterdir()}
    assert {"ray-driver.jsonl", "worker-0.jsonl", "worker-1.jsonl"} <= logs, logs
    assert console_leaks(out) == []
    assert leaks(tmp_path, skip={job_file, run_dir / "spec.json"}) == []


def test_the_run_card_keeps_no_diff_and_git_runs_no_command_of_the_repository(tmp_path, monkeypatch):
    """A key pasted into a tracked file stays on this machine; the repository's external diff,
    textconv and fsmonitor programs never run."""
    from scaletrain.tracking.git_state import git_state

    repo = tmp_path / "repo"
    repo.mkdir()

    def git(*args):
        return subprocess.run(["git", *args], cwd=repo, check=True, capture_output=True, text=True).stdout

    git("init", "-q")
    git("config", "user.email", "t@example.com")
    git("config", "user.name", "t")
    (repo / "config.py").write_text("LR = 0.1\n")
    (repo / ".gitattributes").write_text("*.py diff=conv\n")
    git("add", ".")
    git("commit", "-qm", "first")
    for key, marker in (("diff.external", "external"), ("diff.conv.textconv", "textconv"),
                        ("core.fsmonitor", "fsmonitor")):
        script = tmp_path / f"{marker}.sh"
        script.write_text(f"#!/bin/sh\ntouch {tmp_path}/ran-{marker}\ncat \"$1\" 2>/dev/null\n")
        script.chmod(0o755)
        git("config", key, str(script))
    (repo / "config.py").write_text("LR = 0.1\nAPI_KEY = 'sk-live-0123456789abcdef'\n")
    monkeypatch.chdir(repo)

    state = git_state()

    assert sorted(p.name for p in tmp_path.glob("ran-*")) == []
    assert "sk-live" not in json.dumps(state)
    plain = subprocess.run(["git", "-c", "core.fsmonitor=false", "diff", "--no-ext-diff", "--no-textconv",
                            "--no-color", "HEAD"], cwd=repo, check=True, capture_output=True, text=True).stdout
    assert state == {"commit": git("rev-parse", "HEAD").strip(), "branch": git("rev-parse", "--abbrev-ref", "HEAD").strip(),
                     "dirty": True, "diff_sha256": hashlib.sha256(plain.encode()).hexdigest(),
                     "changed_files": ["config.py"]}


def test_folder_artifacts_never_follow_a_link(tmp_path):
    """MLflow's local store copies what a link points at: a link in logs/ (Ray's session logs
    were one) would upload another tree, unredacted."""
    pytest.importorskip("mlflow")
    from mlflow import MlflowClient

    from scaletrain.tracking.mlflow_run import TrackingRun
    from scaletrain.tracking.redact import Redactor

    outside = tmp_path / "ray-session" / "logs"
    outside.mkdir(parents=True)
    (outside / "worker-out.log").write_text(f"print({HF_TOKEN})\n")
    logs = tmp_path / "run" / "logs"
    (logs / "elastic").mkdir(parents=True)
    (logs / "worker-0.jsonl").write_text("{}\n")
    (logs / "elastic" / "error.json").write_text("{}\n")
    (logs / "ray").symlink_to(outside, target_is_directory=True)
    (logs / "linked.log").symlink_to(outside / "worker-out.log")
    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    client = MlflowClient(uri)
    experiment = client.create_experiment("links", artifact_location=str(tmp_path / "artifacts"))
    run_id = client.create_run(experiment).info.run_id

    TrackingRun(client, run_id, uri, Redactor(environ={})).log_artifact(logs, "logs")

    stored = sorted(p.relative_to(tmp_path / "artifacts").as_posix()
                    for p in (tmp_path / "artifacts").rglob("*") if p.is_file())
    assert stored == [f"{run_id}/artifacts/logs/elastic/error.json", f"{run_id}/artifacts/logs/worker-0.jsonl"]


def _group_cmdlines(pgid: int) -> list[str]:
    found = []
    for proc in Path("/proc").iterdir():
        if not proc.name.isdigit():
            continue
        try:
            if os.getpgid(int(proc.name)) == pgid:
                found.append((proc / "cmdline").read_bytes().replace(b"\0", b" ").decode())
        except (OSError, ProcessLookupError):
            continue
    return found


def test_ui_keeps_the_store_off_every_command_line_and_prints_it_redacted(tmp_path):
    """`ps` shows every local user each process's command line: the store URI (a database
    password) goes through the environment, which MLflow reads; the line printed hides the
    URI's user-info."""
    pytest.importorskip("mlflow")
    from tests.helpers.servers import free_port

    hidden = tmp_path / "store-a1b2c3d4"
    hidden.mkdir()
    store = f"sqlite:///{hidden}/mlflow.db"
    proc = subprocess.Popen([sys.executable, "-m", "scaletrain", "ui", "--uri", store, "--port", str(free_port())],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
    try:
        deadline = time.monotonic() + 120
        while not (hidden / "mlflow.db").exists():  # MLflow opened the store it was given
            assert proc.poll() is None and time.monotonic() < deadline, "mlflow never opened the store"
            time.sleep(0.2)
        lines = _group_cmdlines(proc.pid)
        assert any(" ui --host 127.0.0.1 " in line for line in lines), lines
        assert not [line for line in lines if "store-a1b2c3d4" in line], lines
        environ = Path(f"/proc/{proc.pid}/environ").read_bytes().split(b"\0")
        assert f"MLFLOW_BACKEND_STORE_URI={store}".encode() in environ
    finally:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(timeout=30)

    port = free_port()
    proc = subprocess.Popen([sys.executable, "-m", "scaletrain", "ui", "--uri",
                             "postgresql://alice:pg-secret-77@127.0.0.1:9/mlflow", "--port", str(port)],
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, start_new_session=True)
    try:
        first = proc.stderr.readline().strip()
    finally:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(timeout=30)
        proc.stderr.close()
    assert first == f"MLflow UI for postgresql://***@127.0.0.1:9/mlflow at http://127.0.0.1:{port}"


def test_a_trial_that_prints_a_lot_never_blocks_and_its_files_are_private(tmp_path):
    """A trial's job runs with its output in files, not a pipe nobody reads while it runs
    (a task printing over 64 KiB blocked there for good); its job file, the only unredacted
    copy, is its owner's alone; a failure's reason comes from the outcome it printed."""
    pytest.importorskip("ray")
    from scaletrain.tune.trial import _trial_error
    from scaletrain.tune.trial import start_trial_job as _start_trial_job

    job = secret_job(tmp_path, task={"args": {"print_kib": 256}}, train={"max_steps": 2, "log_every": 1})
    started = time.monotonic()
    proc, trial_dir, runs = _start_trial_job("t1", {"optim.lr": 0.02}, job, tmp_path / "search", None, [str(REPO)])
    try:
        assert proc.wait(timeout=120) == 0, (trial_dir / "console.log").read_text()[-2000:]
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert time.monotonic() - started < 120
    assert (trial_dir / "stdout.log").stat().st_size > 256 * 1024
    assert json.loads((trial_dir / "stdout.log").read_text().splitlines()[-1])["status"] == "finished"
    for name in ("job.yaml", "stdout.log", "console.log"):
        assert (trial_dir / name).stat().st_mode & 0o777 == 0o600, name
    assert json.loads((trial_dir / "job.yaml").read_text())["task"]["args"]["api_token"] == API_TOKEN

    failing = secret_job(tmp_path, task={"args": {"fail_after": 1}}, train={"max_steps": 3})
    proc, trial_dir, _ = _start_trial_job("t2", {}, failing, tmp_path / "search", None, [str(REPO)])
    assert proc.wait(timeout=120) == 1
    assert _trial_error(trial_dir, 1).startswith("worker rank 0 failed: RuntimeError: upload to https://***@")


@pytest.mark.distributed
def test_a_search_keeps_secrets_out_of_its_files_and_its_files_private(tmp_path):
    """`scaletrain tune` writes the job, the --set values, the best job and the results
    redacted and owner-only; only a trial's own job file (what it runs) holds the secret."""
    pytest.importorskip("ray.tune")
    job = secret_job(tmp_path, train={"max_steps": 4, "eval_every": 2, "log_every": 2},
                     tracking={"enabled": False})
    job["task"]["args"]["api_token"] = "placeholder"
    job_file = tmp_path / "job.yaml"
    job_file.write_text(yaml.safe_dump(job, allow_unicode=True), encoding="utf-8")
    space = tmp_path / "space.yaml"
    space.write_text("optim.lr: {grid: [0.02]}\n")
    out = scaletrain_cli("tune", str(job_file), "--space", str(space), "--trials", "1", "--scheduler", "none",
                         "--set", f"task.args.api_token={json.dumps(API_TOKEN)}", "--json",
                         cwd=tmp_path, env=cli_env(tmp_path), timeout=240)
    assert out.returncode == 0, out.stderr[-3000:]
    summary = json.loads(out.stdout)
    search = Path(summary["search_dir"])
    unredacted = set(search.glob("trials/*/job.yaml")) | set(search.glob("trials/*/runs/*/*/spec.json"))
    assert len(unredacted) == 2
    assert all(path.stat().st_mode & 0o777 == 0o600 for path in unredacted)
    assert leaks(search, skip=unredacted) == []
    for name in ("job.yaml", "search.json", "best_job.yaml", "results.json"):
        assert (search / name).stat().st_mode & 0o777 == 0o600, name
    assert json.loads((search / "search.json").read_text())["options"]["overrides"] == ['task.args.api_token="***"']
    best = yaml.safe_load((search / "best_job.yaml").read_text(encoding="utf-8"))
    assert best["task"]["args"] == {**ORDINARY, "api_token": "***", "note": MASKED_NOTE}
    assert best["optim"]["lr"] == 0.02
    assert not [p for p in (search / "logs").rglob("*") if p.is_symlink()]
