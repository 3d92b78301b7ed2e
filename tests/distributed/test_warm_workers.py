"""Warm workers (launch/warm_workers.py, warm_client.py): a worker forked from the warm process
runs as a fresh interpreter would, the agent's signals reach it, it ends as its client ends, and
none outlives the launcher. Real processes; the worker is a stand-in (tests/helpers/warm_target.py)."""

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest

from scaletrain.launch.warm_workers import WarmWorkers

REPO = Path(__file__).resolve().parents[2]
TARGET = "tests.helpers.warm_target"


@pytest.fixture
def warm(monkeypatch):
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join([str(REPO / "src"), str(REPO)]))
    workers = WarmWorkers()
    yield workers
    workers.close()


def client(warm, tmp_path, action, **kwargs):
    out = tmp_path / f"{action}.json"
    proc = subprocess.Popen([sys.executable, *warm.command(TARGET, str(out), action)], cwd=tmp_path,
                            env={**os.environ, "WARM_TEST": "from the client"}, start_new_session=True, **kwargs)
    return proc, out


def seen(out, timeout=60):
    deadline = time.time() + timeout
    while time.time() < deadline:
        try:
            return json.loads(out.read_text())
        except (OSError, ValueError):
            time.sleep(0.05)
    raise AssertionError(f"the worker never started: {out}")


def gone(pid, timeout=10):
    deadline = time.time() + timeout
    while time.time() < deadline:
        if not psutil.pid_exists(pid) or psutil.Process(pid).status() == psutil.STATUS_ZOMBIE:
            return True
        time.sleep(0.05)
    return False


def test_a_forked_worker_runs_as_a_fresh_interpreter_would(warm, tmp_path):
    proc, out = client(warm, tmp_path, "exit3", stdout=subprocess.PIPE, text=True)
    stdout, _ = proc.communicate(timeout=120)
    assert proc.returncode == 3 and stdout == "hello from the worker\n"  # its exit code and stdout are the client's
    worker = seen(out)
    assert worker["name"] == "__main__" and worker["argv"][1:] == [str(out), "exit3"]
    assert worker["argv"][0].endswith("warm_target.py")
    assert worker["env"] == "from the client" and worker["cwd"] == str(tmp_path)
    assert worker["ppid"] == warm.process.pid and worker["torch_preloaded"]  # forked: torch already there
    assert worker["pgid"] == worker["pid"]  # its own process group: signals reach its children too


def test_the_agents_signals_reach_the_worker_and_it_ends_as_its_client(warm, tmp_path):
    proc, out = client(warm, tmp_path, "stop-on-sigterm")
    seen(out)
    time.sleep(0.3)  # its handler installed
    proc.send_signal(signal.SIGTERM)
    assert proc.wait(timeout=30) == 0
    assert out.with_suffix(".stopped").read_text() == "SIGTERM"
    proc, out = client(warm, tmp_path, "sleep")
    os.kill(seen(out)["pid"], signal.SIGKILL)  # killed outright (out of memory, a fault)
    assert proc.wait(timeout=30) == -signal.SIGKILL  # the agent sees what a plain start shows


def test_a_client_killed_outright_takes_its_worker_with_it(warm, tmp_path):
    proc, out = client(warm, tmp_path, "sleep")
    pid = seen(out)["pid"]
    proc.kill()
    proc.wait(timeout=30)
    assert gone(pid), "the worker outlived its client"


def test_closing_ends_the_warm_process_and_every_worker_left(warm, tmp_path):
    proc, out = client(warm, tmp_path, "sleep")
    pid = seen(out)["pid"]
    warm.close()
    assert warm.process.poll() is not None and gone(pid)
    assert proc.wait(timeout=30) != 0
    assert not warm.folder.exists()


def test_without_a_warm_process_the_client_starts_the_worker_itself(tmp_path, monkeypatch):
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join([str(REPO / "src"), str(REPO)]))
    out = tmp_path / "plain.json"
    proc = subprocess.run([sys.executable, "-m", "scaletrain.launch.warm_client", str(tmp_path / "none.sock"),
                           TARGET, str(out), "exit3"], cwd=tmp_path, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 3 and proc.stdout == "hello from the worker\n"
    assert not seen(out)["torch_preloaded"]
