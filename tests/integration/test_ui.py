"""``scaletrain ui``: the MLflow UI comes up on the store and listens on loopback only."""

import os
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

from tests.helpers.servers import free_port


def wait_healthy(proc, url, timeout=90):
    deadline = time.time() + timeout
    while time.time() < deadline:
        assert proc.poll() is None, f"scaletrain ui exited with {proc.returncode}"
        try:
            with urllib.request.urlopen(url, timeout=1) as response:
                if response.status == 200:
                    return
        except OSError:
            time.sleep(0.3)
    raise AssertionError(f"{url} did not answer 200 within {timeout} s")


def non_loopback_addresses():
    found = set()
    try:
        found.add(socket.gethostbyname(socket.gethostname()))
    except OSError:
        pass
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as probe:
        try:
            probe.connect(("192.0.2.1", 9))  # UDP: only picks the outgoing interface, sends nothing
            found.add(probe.getsockname()[0])
        except OSError:
            pass
    return {address for address in found if not address.startswith("127.") and address != "0.0.0.0"}


def listening_addresses(port):
    """Local addresses (hex, as the kernel writes them) of the TCP sockets listening on port."""
    found = set()
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        if not Path(table).exists():
            continue
        for line in Path(table).read_text().splitlines()[1:]:
            fields = line.split()
            address, port_hex = fields[1].split(":")
            if int(port_hex, 16) == port and fields[3] == "0A":  # 0A: LISTEN
                found.add(address)
    return found


def test_ui_serves_the_store_on_loopback_only(tmp_path):
    port = free_port()
    log = open(tmp_path / "ui.log", "wb")
    proc = subprocess.Popen(
        [sys.executable, "-m", "scaletrain", "ui",
         "--uri", f"sqlite:///{tmp_path}/mlflow.db", "--port", str(port)],
        stdout=log, stderr=subprocess.STDOUT, start_new_session=True,
    )
    try:
        wait_healthy(proc, f"http://127.0.0.1:{port}/health")
        for address in non_loopback_addresses():
            with socket.socket() as sock:
                sock.settimeout(2)
                assert sock.connect_ex((address, port)) != 0, f"ui answers on {address}:{port}"
        if Path("/proc/net/tcp").exists():
            assert listening_addresses(port) == {"0100007F"}  # 127.0.0.1, and nothing on IPv6
    finally:
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        proc.wait(timeout=30)
        log.close()
