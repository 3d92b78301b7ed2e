"""The run directory's own files: spec.json written whole, the launcher's lock, run ids."""

import json
import os
import socket
import subprocess
import sys

import pytest

from scaletrain.errors import ConfigError
from scaletrain.rundir import LOCK_FILE, RunInUse, RunLock, RunSpec, check_run_ref

_HOLD = (
    "import sys, time\n"
    "from scaletrain.rundir import RunLock\n"
    "RunLock(sys.argv[1], 'r1', int(sys.argv[2])).acquire()\n"
    "print('locked', flush=True)\n"
    "time.sleep(60)\n"
)


def spec_in(tmp_path):
    return RunSpec(job={"name": "toy", "task": {"args": {"api_token": "tok-123456"}}}, run_id="r1",
                   run_dir=str(tmp_path / "run"))


def test_spec_json_replaces_a_symlink_instead_of_writing_through_it(tmp_path):
    spec = spec_in(tmp_path)
    victim = tmp_path / "victim.txt"
    victim.write_text("not yours")
    victim.chmod(0o644)
    (tmp_path / "run").mkdir()
    (tmp_path / "run" / "spec.json").symlink_to(victim)
    path = spec.write()
    assert victim.read_text() == "not yours"
    assert not path.is_symlink() and path.stat().st_mode & 0o777 == 0o600
    assert RunSpec.read(path) == spec


def test_spec_json_gets_mode_0600_even_over_a_readable_one(tmp_path):
    spec = spec_in(tmp_path)
    (tmp_path / "run").mkdir()
    old = tmp_path / "run" / "spec.json"
    old.write_text("{}")
    old.chmod(0o644)
    assert spec.write().stat().st_mode & 0o777 == 0o600


def test_a_write_that_fails_leaves_the_previous_spec_whole(tmp_path, monkeypatch):
    spec = spec_in(tmp_path)
    before = spec.write().read_text()
    spec.attempt = 2

    def crash(*args, **kwargs):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr("scaletrain.rundir.atomic.os.fsync", crash)  # the temporary is written, not yet in place
    with pytest.raises(OSError):
        spec.write()
    assert (tmp_path / "run" / "spec.json").read_text() == before
    assert sorted(p.name for p in (tmp_path / "run").iterdir()) == ["spec.json"]  # no temporary left


def test_a_spec_json_from_an_older_version_with_its_retired_tracking_fields_still_reads(tmp_path):
    """A run started before RunSpec lost tracking_uri/tracking_run_id must still resume."""
    spec = spec_in(tmp_path)
    path = spec.write()
    old = json.loads(path.read_text())
    old.update(tracking_uri="sqlite:///mlflow.db", tracking_run_id="0123abcd")
    path.write_text(json.dumps(old))
    assert RunSpec.read(path) == spec


def hold_lock(start, run_dir, node_rank=0):
    holder = start([sys.executable, "-c", _HOLD, str(run_dir), str(node_rank)], stdout=subprocess.PIPE, text=True)
    assert holder.stdout.readline().strip() == "locked"
    return holder


def test_a_run_directory_is_refused_while_another_process_holds_it_and_free_when_it_dies(tmp_path, processes):
    holder = hold_lock(processes, tmp_path)
    try:
        with pytest.raises(RunInUse) as info:
            RunLock(tmp_path, "r1").acquire()
        assert str(info.value) == (
            f"run r1 is in use by pid {holder.pid} on host {socket.gethostname()}; wait for it or stop it"
        )
        assert info.value.exit_code == 2
    finally:
        holder.kill()  # SIGKILL: no chance to clean up
        holder.wait()
    with RunLock(tmp_path, "r1") as lock:  # no stale lock
        holder_record = json.loads((tmp_path / LOCK_FILE).read_text())
        assert holder_record["pid"] == os.getpid()
        assert (tmp_path / LOCK_FILE).stat().st_mode & 0o777 == 0o600
        with pytest.raises(RunInUse):  # a second launch within this process is refused too
            RunLock(tmp_path, "r1").acquire()
    assert lock._fd is None
    RunLock(tmp_path, "r1").acquire().release()


def test_nodes_sharing_one_run_directory_are_told_to_use_their_own(tmp_path, processes):
    holder = hold_lock(processes, tmp_path, node_rank=0)
    try:
        with pytest.raises(RunInUse) as info:
            RunLock(tmp_path, "r1", node_rank=1).acquire()
    finally:
        holder.kill()
        holder.wait()
    assert str(info.value) == (
        f"run r1: its directory {tmp_path} is in use by node 0's launcher (pid {holder.pid} on host "
        f"{socket.gethostname()}); on a shared filesystem give each node its own run directory "
        "(--set run_dir=runs-node-N)"
    )


@pytest.mark.parametrize("ref", ["20261204-190323-eb189b", "0a1b2c3d4e5f60718293a4b5c6d7e8f9", "run_1.b"])
def test_run_ids(ref):
    assert check_run_ref(ref) == ref


@pytest.mark.parametrize("ref", ["a'b", "*", "2026*", "run[1]", "..", "../x", "a b", "", "-x"])
def test_what_is_not_a_run_id(ref):
    with pytest.raises(ConfigError) as info:
        check_run_ref(ref)
    assert str(info.value) == (
        f"{ref!r} is not a run id: use the scaletrain or MLflow run id as `scaletrain runs` lists it "
        "(letters, digits, '.', '_' and '-')"
    )


def test_a_refusal_names_the_new_holder_not_the_dead_one_its_file_still_names(tmp_path):
    """The holder takes the lock, then writes its name: a refusal in between waits for the name
    instead of naming the holder before it (dead, killed without releasing the lock)."""
    import fcntl
    import threading
    import time

    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True,
                          text=True, check=True)
    path = tmp_path / LOCK_FILE
    path.write_text(json.dumps({"pid": int(dead.stdout), "host": socket.gethostname(), "node_rank": 0}))
    fd = os.open(path, os.O_RDWR)
    fcntl.flock(fd, fcntl.LOCK_EX)  # the new holder, its name not written yet

    def name_it():
        time.sleep(0.15)
        os.ftruncate(fd, 0)
        os.pwrite(fd, json.dumps({"pid": 4242424, "host": "other-host", "node_rank": 0}).encode(), 0)

    writer = threading.Thread(target=name_it)
    writer.start()
    try:
        with pytest.raises(RunInUse) as info:
            RunLock(tmp_path, "r1").acquire()
    finally:
        writer.join()
        os.close(fd)
    assert str(info.value) == "run r1 is in use by pid 4242424 on host other-host; wait for it or stop it"


def test_a_released_lock_names_no_holder(tmp_path):
    RunLock(tmp_path, "r1").acquire().release()
    assert (tmp_path / LOCK_FILE).read_bytes() == b""
