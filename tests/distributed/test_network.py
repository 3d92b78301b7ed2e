"""A job on one machine listens on loopback only: the rendezvous store (torch elastic unpickles
what it reads there), the workers' store and gloo's sockets. A connection to the machine's
other addresses is refused."""

import ipaddress
import json
import socket
import subprocess
import sys
import time

import psutil
import pytest
import yaml

from tests.helpers.run import REPO
from tests.helpers.tasks import toy_job

pytestmark = pytest.mark.distributed


def machine_addresses() -> list[str]:
    """This machine's addresses that are not loopback (where an outsider would connect)."""
    found = []
    for addresses in psutil.net_if_addrs().values():
        for item in addresses:
            if item.family not in (socket.AF_INET, socket.AF_INET6):
                continue
            address = ipaddress.ip_address(item.address.split("%")[0])
            if not (address.is_loopback or address.is_link_local):
                found.append(str(address))
    return found


def listening(pids: set[int]) -> set[tuple[str, int]]:
    return {
        (conn.laddr.ip, conn.laddr.port)
        for conn in psutil.net_connections(kind="tcp")
        if conn.status == psutil.CONN_LISTEN and conn.pid in pids
    }


def test_a_one_machine_job_listens_on_loopback_only(tmp_path, processes):
    job = toy_job(tmp_path, scale={"workers": 2}, task={"args": {"step_sleep": 0.05}},
                  train={"max_steps": 120}, recovery={"max_restarts": 1})
    job_file = tmp_path / "job.yaml"
    job_file.write_text(yaml.safe_dump(job))
    proc = processes([sys.executable, "-m", "scaletrain", "run", str(job_file), "--json"],
                     cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    seen: set[tuple[str, int]] = set()
    workers_seen = 0
    try:
        deadline = time.time() + 60
        while time.time() < deadline and proc.poll() is None:
            try:
                tree = psutil.Process(proc.pid).children(recursive=True)
            except psutil.NoSuchProcess:
                break
            workers = [p for p in tree if "scaletrain.launch.worker" in " ".join(_cmdline(p))]
            workers_seen = max(workers_seen, len(workers))
            seen |= listening({proc.pid, *(p.pid for p in tree)})
            if workers_seen == 2 and len(seen) >= 3:  # rendezvous store, workers' store, gloo
                break
            time.sleep(0.2)
        assert workers_seen == 2
        assert seen, "nothing listening: the probe missed the run"
        assert {ip for ip, _ in seen} <= {"127.0.0.1", "::1"}, seen
        for address in machine_addresses():
            for _, port in seen:
                with pytest.raises(OSError):
                    socket.create_connection((address, port), timeout=2).close()
    finally:
        out, err = proc.communicate(timeout=120)
    assert proc.returncode == 0, err[-2000:]
    assert json.loads(out)["status"] == "finished"


def _cmdline(process: psutil.Process) -> list[str]:
    try:
        return process.cmdline()
    except psutil.Error:
        return []
