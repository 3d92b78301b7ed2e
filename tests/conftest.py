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
