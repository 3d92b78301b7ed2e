"""MLflow's client as every scaletrain process that talks to MLflow sets it up (the tracking
process, ``scaletrain runs``/``show``/``reproduce``, a search's parent run, rank 0's model)."""

from __future__ import annotations

import logging
import os

__all__ = ["configure_mlflow_client"]


def configure_mlflow_client() -> None:
    """MLflow retries HTTP calls for minutes by default; we retry ourselves, without blocking.
    It prints run URLs on stdout, which belongs to ``--json`` output, and it (and alembic)
    announce schema migrations at INFO. Imports mlflow: its import resets its log level."""
    import mlflow  # noqa: F401  imported for its side effect: it resets its log level on import

    for name in ("mlflow", "alembic"):
        logging.getLogger(name).setLevel(logging.WARNING)
    os.environ.setdefault("MLFLOW_HTTP_REQUEST_MAX_RETRIES", "0")
    os.environ.setdefault("MLFLOW_HTTP_REQUEST_TIMEOUT", "5")
    os.environ.setdefault("MLFLOW_SUPPRESS_PRINTING_URL_TO_STDOUT", "true")
