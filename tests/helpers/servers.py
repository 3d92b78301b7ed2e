"""Real servers for tests, on loopback, started and stopped by the tests themselves."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


class MlflowServer:
    """``mlflow server`` on 127.0.0.1 with a sqlite store in ``root``; stop() and start() again
    on the same port to simulate an outage."""

    def __init__(self, root: Path, port: int | None = None):
        self.root = root
        self.port = port or free_port()
        self.uri = f"http://127.0.0.1:{self.port}"
        self.proc: subprocess.Popen | None = None

    def start(self, timeout: float = 90) -> MlflowServer:
        mlflow_bin = Path(sys.executable).parent / "mlflow"
        self.proc = subprocess.Popen(
            [
                str(mlflow_bin), "server",
                "--backend-store-uri", f"sqlite:///{self.root / 'server.db'}",
                "--artifacts-destination", str(self.root / "artifacts"),
                "--host", "127.0.0.1", "--port", str(self.port), "--workers", "1",
            ],
            stdout=open(self.root / "server.log", "ab"),
            stderr=subprocess.STDOUT,
            start_new_session=True,  # so stop() can end the whole server process group
        )
        deadline = time.time() + timeout
        while time.time() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"mlflow server exited: {(self.root / 'server.log').read_text()[-2000:]}")
            try:
                with urllib.request.urlopen(f"{self.uri}/health", timeout=1) as response:
                    if response.status == 200:
                        return self
            except OSError:
                time.sleep(0.3)
        self.stop()
        raise RuntimeError("mlflow server did not answer /health in time")

    def stop(self) -> None:
        if self.proc is None:
            return
        try:
            os.killpg(self.proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        self.proc.wait(timeout=30)
        self.proc = None
