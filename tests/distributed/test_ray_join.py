"""Joining a Ray cluster the way its users start one: `ray start --head` in a HOME that holds
Ray's token file (~/.ray/auth_token, left by any earlier local Ray), which turns the head's
token authentication on, then `scaletrain run --engine ray --address 127.0.0.1:PORT` from a
plain shell (no RAY_* variables). And the addresses that cannot be joined: each ends within
scale.connect_timeout_s with one `error:` line that says what to do, without Ray's warnings.
"""

import importlib.util
import json
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

import scaletrain
from tests.helpers.run import REPO
from tests.helpers.servers import RayHead, free_port, user_env
from tests.helpers.tasks import toy_job

pytestmark = pytest.mark.distributed

# Not imported here: Ray reads its settings when it is imported; each scaletrain runs in its own
# process, as a user's would.
if importlib.util.find_spec("ray") is None:
    pytest.skip("Ray is not installed (pip install 'scaletrain[ray]')", allow_module_level=True)


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


@pytest.fixture(scope="module")
def head():
    cluster = RayHead()
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


def test_a_wrong_token_is_refused_with_one_line_and_nothing_runs(head, tmp_path):
    started = time.monotonic()
    out = scaletrain_run(small_job(tmp_path), tmp_path, "--address", f"127.0.0.1:{head.port}",
                         env=user_env(tmp_path / "empty-home", RAY_AUTH_TOKEN="0" * 64), timeout=60)
    assert time.monotonic() - started < 30
    assert out.returncode == 2, out.stderr[-3000:]
    assert out.stderr.strip().splitlines() == [
        f"error: cannot join the Ray cluster at '127.0.0.1:{head.port}': the cluster refused the token "
        "from RAY_AUTH_TOKEN; set RAY_AUTH_TOKEN to the cluster's token (`ray get-auth-token` on the "
        "head prints it)"
    ]
    assert not list(tmp_path.rglob("metrics.jsonl")), "no step may run on a cluster that refused us"


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
