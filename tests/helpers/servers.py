"""Real servers for tests, on loopback, started and stopped by the tests themselves."""

from __future__ import annotations

import importlib.metadata
import os
import secrets
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path
from typing import TypeVar

_S = TypeVar("_S", bound="_LoopbackServer")


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


class _LoopbackServer:
    """A server process on 127.0.0.1:``port`` in its own session (so stop() ends the whole
    process group), logging to ``root / log_name``. start() returns once ``health_path``
    answers 200; stop() and start() again reuse the same port."""

    name = "server"
    log_name = "server.log"
    health_path = "/health"

    def __init__(self, root: Path, port: int | None = None):
        self.root = Path(root)
        self.port = port or free_port()
        self.proc: subprocess.Popen | None = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def command(self) -> list[str]:
        raise NotImplementedError

    def start(self: _S, timeout: float = 90) -> _S:
        log_path = self.root / self.log_name
        with open(log_path, "ab") as log:  # the child keeps its own copy of the descriptor
            self.proc = subprocess.Popen(
                self.command(), stdout=log, stderr=subprocess.STDOUT, start_new_session=True
            )
        deadline = time.time() + timeout
        while time.time() < deadline:
            if self.proc.poll() is not None:
                self.stop()  # ends anything its process group left behind
                raise RuntimeError(f"{self.name} exited: {log_path.read_text()[-2000:]}")
            try:
                with urllib.request.urlopen(self.url + self.health_path, timeout=1) as response:
                    if response.status == 200:
                        return self
            except OSError:
                time.sleep(0.3)
        self.stop()
        raise RuntimeError(f"{self.name} did not answer {self.health_path} in time")

    def stop(self) -> None:
        if self.proc is None:
            return
        try:
            os.killpg(self.proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        self.proc.wait(timeout=30)
        self.proc = None


class MlflowServer(_LoopbackServer):
    """``mlflow server`` on 127.0.0.1 with a sqlite store in ``root``; stop() and start() again
    on the same port to simulate an outage."""

    name = "mlflow server"

    @property
    def uri(self) -> str:
        return self.url

    def command(self) -> list[str]:
        return [
            str(Path(sys.executable).parent / "mlflow"), "server",
            "--backend-store-uri", f"sqlite:///{self.root / 'server.db'}",
            "--artifacts-destination", str(self.root / "artifacts"),
            "--host", "127.0.0.1", "--port", str(self.port), "--workers", "1",
        ]


class MlflowAuthServer(MlflowServer):
    """``mlflow server --app-name basic-auth``: users with passwords and permissions (the
    default for a new user: READ on every experiment). Its user store lives in ``root``."""

    name = "mlflow server (basic-auth)"
    admin, admin_password = "admin", "admin-password-1234"

    def command(self) -> list[str]:
        return [*super().command(), "--app-name", "basic-auth"]

    def start(self, timeout: float = 120) -> MlflowAuthServer:
        config = self.root / "basic_auth.ini"
        config.write_text(
            "[mlflow]\ndefault_permission = READ\n"
            f"database_uri = sqlite:///{self.root / 'auth.db'}\n"
            f"admin_username = {self.admin}\nadmin_password = {self.admin_password}\n"
            "authorization_function = mlflow.server.auth:authenticate_request_basic_auth\n"
        )
        saved = {k: os.environ.get(k) for k in ("MLFLOW_AUTH_CONFIG_PATH", "MLFLOW_FLASK_SERVER_SECRET_KEY")}
        os.environ.update(MLFLOW_AUTH_CONFIG_PATH=str(config), MLFLOW_FLASK_SERVER_SECRET_KEY="tests-only")
        try:
            return super().start(timeout)
        finally:
            for key, value in saved.items():
                os.environ.pop(key, None) if value is None else os.environ.__setitem__(key, value)

    def call(self, endpoint: str, body: dict, user: str | None = None, password: str | None = None) -> dict:
        """A REST call as ``user`` (default the admin)."""
        import base64
        import json

        token = base64.b64encode(f"{user or self.admin}:{password or self.admin_password}".encode()).decode()
        request = urllib.request.Request(
            f"{self.url}/api/2.0/mlflow/{endpoint}", data=json.dumps(body).encode(), method="POST",
            headers={"Content-Type": "application/json", "Authorization": f"Basic {token}"})
        with urllib.request.urlopen(request, timeout=30) as response:
            return json.loads(response.read() or b"{}")


class S3Server(_LoopbackServer):
    """moto in server mode on 127.0.0.1: an S3-compatible endpoint held in memory (lost on
    stop()). Clients find it through env(); botocore, and so s3fs, read AWS_ENDPOINT_URL."""

    name = "moto server"
    log_name = "moto.log"
    health_path = "/moto-api/data.json"
    access_key = secret_key = "testing"
    region = "us-east-1"

    @property
    def endpoint(self) -> str:
        return self.url

    def command(self) -> list[str]:
        return [sys.executable, "-m", "moto.server", "-H", "127.0.0.1", "-p", str(self.port)]

    def env(self) -> dict[str, str]:
        return {
            "AWS_ENDPOINT_URL": self.endpoint,
            "AWS_ACCESS_KEY_ID": self.access_key,
            "AWS_SECRET_ACCESS_KEY": self.secret_key,
            "AWS_DEFAULT_REGION": self.region,
        }

    def client(self):
        """A boto3 S3 client for this server, whatever the environment says."""
        import boto3

        return boto3.client(
            "s3", endpoint_url=self.endpoint, region_name=self.region,
            aws_access_key_id=self.access_key, aws_secret_access_key=self.secret_key,
        )

    def make_bucket(self, name: str) -> None:
        self.client().create_bucket(Bucket=name)


def user_env(home: Path, **extra: str) -> dict[str, str]:
    """A shell of a user who set nothing for Ray (the test runner's RAY_* are not theirs)."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("RAY_")}
    return {**env, "HOME": str(home), "RAY_USAGE_STATS_ENABLED": "0", **extra}


class RayHead:
    """`ray start --head` in its own HOME and temp dir (short: Ray's socket paths are limited),
    in its own process group: the daemons it leaves stay in that group, and are stopped by it."""

    def __init__(self) -> None:
        self.root = Path(tempfile.mkdtemp(prefix="st-join-", dir="/tmp"))
        self.home = self.root / "home"
        (self.home / ".ray").mkdir(parents=True)
        (self.home / ".ray" / "auth_token").write_text(secrets.token_hex(32))
        self.port = free_port()
        self.pgid: int | None = None

    def start(self) -> "RayHead":
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


def require_tool(name: str, package: str) -> str:
    """The path of a command-line tool the test needs: missing under CI=true is a failure (make
    test installs it), elsewhere a skip that names the package."""
    import pytest

    path = shutil.which(name)
    if path is None:
        message = f"{name} is missing: install Debian's {package} package (make test does, as root)"
        if os.environ.get("CI") == "true":
            pytest.fail(message)
        pytest.skip(message)
    return path


class PrometheusServer(_LoopbackServer):
    """A real Prometheus on 127.0.0.1 scraping ``targets`` every second and evaluating
    ``rule_files`` every second, its data in ``root``."""

    name = "prometheus"
    log_name = "prometheus.log"
    health_path = "/-/ready"

    def __init__(self, root: Path, targets: list[str], rule_files: list[Path], port: int | None = None):
        super().__init__(root, port)
        self.targets, self.rule_files = targets, rule_files

    def command(self) -> list[str]:
        import json

        config = self.root / "prometheus.yml"
        config.write_text(json.dumps({  # YAML is a superset of JSON
            "global": {"scrape_interval": "1s", "evaluation_interval": "1s"},
            "rule_files": [str(path) for path in self.rule_files],
            "scrape_configs": [{"job_name": "train", "static_configs": [{"targets": self.targets}]}],
        }))
        return [require_tool("prometheus", "prometheus"), f"--config.file={config}",
                f"--storage.tsdb.path={self.root / 'tsdb'}", f"--web.listen-address=127.0.0.1:{self.port}"]

    def api(self, path: str, **params: str) -> dict:
        import json
        import urllib.parse

        query = f"?{urllib.parse.urlencode(params)}" if params else ""
        with urllib.request.urlopen(f"{self.url}/api/v1/{path}{query}", timeout=10) as response:
            return json.loads(response.read())
