"""Joining a Ray cluster the way its users start one: `ray start --head` in a HOME that holds
Ray's token file (~/.ray/auth_token, left by any earlier local Ray), which turns the head's
token authentication on, then `scaletrain run --engine ray --address 127.0.0.1:PORT` from a
plain shell (no RAY_* variables). And the addresses that cannot be joined: each ends within
scale.connect_timeout_s with one `error:` line that says what to do, without Ray's warnings.
"""

import importlib.metadata
import importlib.util
import json
import os
import secrets
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest

import scaletrain
from tests.helpers.run import REPO
from tests.helpers.tasks import toy_job

pytestmark = pytest.mark.distributed

# Not imported here: Ray reads its settings when it is imported; each scaletrain runs in its own
# process, as a user's would.
if importlib.util.find_spec("ray") is None:
    pytest.skip("Ray is not installed (pip install 'scaletrain[ray]')", allow_module_level=True)


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("", 0))
        return probe.getsockname()[1]


def user_env(home: Path, **extra: str) -> dict[str, str]:
    """A shell of a user who set nothing for Ray (the test runner's RAY_* are not theirs)."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("RAY_")}
    return {**env, "HOME": str(home), "RAY_USAGE_STATS_ENABLED": "0", **extra}


def scaletrain_run(job: dict, where: Path, *args: str, env: dict[str, str], timeout: float = 240):
    job_file = where / "job.json"
    job_file.write_text(json.dumps(job))
    return subprocess.run(
        [sys.executable, "-m", "scaletrain", "run", str(job_file), "--engine", "ray", *args],
        cwd=REPO, env=env, capture_output=True, text=True, timeout=timeout,
    )


def small_job(root: Path) -> dict:
    return toy_job(root, train={"max_steps": 6, "log_every": 1},
                   scale={"workers": 2, "cpus_per_worker": 0.5})


class Head:
    """`ray start --head` in its own HOME and temp dir (short: Ray's socket paths are limited),
    in its own process group: the daemons it leaves stay in that group, and are stopped by it."""

    def __init__(self) -> None:
        self.root = Path(tempfile.mkdtemp(prefix="st-join-", dir="/tmp"))
        self.home = self.root / "home"
        (self.home / ".ray").mkdir(parents=True)
        (self.home / ".ray" / "auth_token").write_text(secrets.token_hex(32))
        self.port = free_port()
        self.pgid: int | None = None

    def start(self) -> "Head":
        env = user_env(self.home)
        if _ray_version() < (2, 59):  # older Rays turn tokens on only when asked
            env["RAY_AUTH_MODE"] = "token"
        ray_cli = Path(sys.executable).with_name("ray")
        command = [str(ray_cli) if ray_cli.exists() else shutil.which("ray") or "ray",
                   "start", "--head", f"--port={self.port}", "--num-cpus=2",
                   "--include-dashboard=false", f"--temp-dir={self.root / 'ray'}"]
        start = subprocess.Popen(command, cwd=self.root, env=env, start_new_session=True,
                                 stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        self.pgid = start.pid  # session leader: its daemons keep this process group
        out, _ = start.communicate(timeout=120)
        assert start.returncode == 0, out[-3000:]
        assert "Token authentication is enabled" in out or "RAY_AUTH_MODE" in env, out[-3000:]
        return self

    def stop(self) -> None:
        if self.pgid is not None:
            for sig in (signal.SIGTERM, signal.SIGKILL):
                try:
                    os.killpg(self.pgid, sig)
                except ProcessLookupError:
                    break
                time.sleep(2 if sig == signal.SIGTERM else 0)
        shutil.rmtree(self.root, ignore_errors=True)


def _ray_version() -> tuple[int, int]:
    major, minor = importlib.metadata.version("ray").split(".")[:2]
    return int(major), int(minor)


@pytest.fixture(scope="module")
def head():
    cluster = Head()
    try:
        yield cluster.start()
    finally:
        cluster.stop()


def test_a_ray_start_head_is_joined_with_its_token_and_gives_the_local_weights(head, tmp_path):
    reference = scaletrain.run(small_job(tmp_path / "local"))  # the local engine, same job
    out = scaletrain_run(small_job(tmp_path / "ray"), tmp_path, "--json",
                         "--address", f"127.0.0.1:{head.port}", env=user_env(head.home))
    assert out.returncode == 0, out.stderr[-3000:]
    summary = json.loads(out.stdout)
    assert summary["engine"] == "ray" and summary["status"] == "finished" and summary["steps"] == 6
    assert summary["weights_sha256"] == reference["weights_sha256"]
    launcher_log = Path(summary["run_dir"]) / "logs" / "launcher.jsonl"
    joined = [json.loads(line) for line in launcher_log.read_text().splitlines()
              if '"joined Ray cluster"' in line]
    assert len(joined) == 1
    assert joined[0]["ray_auth_mode"] == "token"
    assert joined[0]["ray_token_from"] == "~/.ray/auth_token"
    assert "Traceback" not in out.stderr and "gcs_client" not in out.stderr


def test_a_cluster_that_wants_a_token_we_lack_is_one_line_naming_the_fix(head, tmp_path):
    started = time.monotonic()
    out = scaletrain_run(small_job(tmp_path), tmp_path, "--address", f"127.0.0.1:{head.port}",
                         env=user_env(tmp_path / "empty-home"), timeout=60)
    assert time.monotonic() - started < 30
    assert out.returncode == 2, out.stderr[-3000:]
    assert out.stderr.strip().splitlines() == [
        f"error: cannot join the Ray cluster at '127.0.0.1:{head.port}': the cluster requires a "
        "token and none is set; set RAY_AUTH_TOKEN to the cluster's token (`ray get-auth-token` "
        "on the head prints it)"
    ]


def test_an_address_where_nothing_listens_fails_within_the_timeout(tmp_path):
    port = free_port()
    started = time.monotonic()
    out = scaletrain_run(small_job(tmp_path), tmp_path, "--address", f"127.0.0.1:{port}",
                         "--set", "scale.connect_timeout_s=5", env=user_env(tmp_path), timeout=60)
    elapsed = time.monotonic() - started
    assert out.returncode == 2, out.stderr[-3000:]
    lines = out.stderr.strip().splitlines()
    assert len(lines) == 1, out.stderr[-3000:]  # no traceback, no Ray warnings
    assert lines[0].startswith(f"error: cannot join the Ray cluster at '127.0.0.1:{port}': "
                               "nothing answered at ")
    assert f"within 5 s; is `ray start --head --port {port}` running there" in lines[0]
    assert 5 <= elapsed < 30


def test_a_head_on_loopback_only_is_named(tmp_path):
    """Ray dials 127.0.0.1 as the machine's address: a head that listens on 127.0.0.1 alone
    (Ray's local-only mode) never answers there."""
    try:
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as probe:
            probe.connect(("8.8.8.8", 53))  # no packet is sent; the route picks the address
            machine = probe.getsockname()[0]
    except OSError:
        machine = "127.0.0.1"
    if machine.startswith("127."):
        pytest.skip("this machine has no address besides loopback")
    with socket.socket() as loopback_only:
        loopback_only.bind(("127.0.0.1", 0))
        loopback_only.listen()
        port = loopback_only.getsockname()[1]
        out = scaletrain_run(small_job(tmp_path), tmp_path, "--address", f"127.0.0.1:{port}",
                             "--set", "scale.connect_timeout_s=20", env=user_env(tmp_path),
                             timeout=60)
    assert out.returncode == 2, out.stderr[-3000:]
    assert out.stderr.strip().splitlines() == [
        f"error: cannot join the Ray cluster at '127.0.0.1:{port}': its head listens on 127.0.0.1 "
        "only (Ray's local-only mode, RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=0 when it started) while "
        f"Ray dials 127.0.0.1 as this machine's address {machine}; run scaletrain with "
        "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=0 as well, or restart the head without it"
    ]
