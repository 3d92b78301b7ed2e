from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]


@pytest.fixture(autouse=True)
def _repo_cwd(monkeypatch):
    """Task targets like tests.helpers.tasks:ToyTask resolve from the repository root."""
    monkeypatch.chdir(REPO)
