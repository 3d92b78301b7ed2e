from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]


@pytest.fixture(autouse=True)
def _repo_cwd(monkeypatch):
    """Task targets like tests.helpers.tasks:ToyTask resolve from the repository root."""
    monkeypatch.chdir(REPO)


@pytest.fixture(autouse=True, scope="session")
def _tracking_store_outside_the_repo(tmp_path_factory):
    """Jobs that track by default (the examples) write to a scratch store, not the checkout."""
    store = tmp_path_factory.mktemp("mlflow")
    patch = pytest.MonkeyPatch()
    patch.setenv("MLFLOW_TRACKING_URI", f"sqlite:///{store / 'mlflow.db'}")
    yield
    patch.undo()


@pytest.fixture
def mlflow_server(tmp_path):
    from tests.helpers.servers import MlflowServer

    server = MlflowServer(tmp_path).start()
    yield server
    server.stop()


@pytest.fixture(scope="module")
def s3_server(tmp_path_factory):
    """moto's S3 server for the module, with a bucket ``ckpt``; AWS_ENDPOINT_URL and test
    credentials are in the environment, so plain ``fsspec.filesystem("s3")`` talks to it."""
    pytest.importorskip("moto.server")
    from tests.helpers.servers import S3Server

    server = S3Server(tmp_path_factory.mktemp("s3")).start()
    patch = pytest.MonkeyPatch()
    try:
        server.make_bucket("ckpt")
        # These would override or switch off AWS_ENDPOINT_URL in botocore.
        patch.delenv("AWS_ENDPOINT_URL_S3", raising=False)
        patch.delenv("AWS_IGNORE_CONFIGURED_ENDPOINT_URLS", raising=False)
        for name, value in server.env().items():
            patch.setenv(name, value)
        yield server
    finally:
        patch.undo()
        server.stop()


@pytest.fixture
def processes():
    """``start(args, **popen_kwargs)``: subprocess.Popen in a process group of its own. Whatever
    still runs when the test ends, passed or failed, is stopped with its children."""
    import subprocess

    from tests.helpers.run import stop_group

    started: list[subprocess.Popen] = []

    def start(args, **kwargs) -> subprocess.Popen:
        proc = subprocess.Popen(args, start_new_session=True, **kwargs)
        started.append(proc)
        return proc

    yield start
    for proc in started:
        stop_group(proc)
