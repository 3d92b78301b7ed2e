"""The ``scaletrain`` command. Thin: parse flags, call the API, print the outcome.

This module only puts the commands together: ``app`` and its shared options and error handling
are in ``cli/app.py``, each command group in its own module, the tables in ``cli/render.py``.
The order of the imports below is the order of the commands in ``scaletrain --help``.
Bad input ends with one ``error: ...`` line and exit code 2; a failed run with exit code 1.
"""

from __future__ import annotations

# ruff: noqa: I001  the imports' order is the commands' order in --help

from scaletrain.cli import train  # noqa: F401  run, resume
from scaletrain.cli import launch  # noqa: F401  launch (a torchrun script)
from scaletrain.cli import tune  # noqa: F401  tune
from scaletrain.cli import plan  # noqa: F401  plan
from scaletrain.cli import check  # noqa: F401  verify-resume, validate, check, schema
from scaletrain.cli import runs  # noqa: F401  runs, show, reproduce, ui
from scaletrain.cli import checkpoints  # noqa: F401  checkpoints ls|verify (groups list last)
from scaletrain.cli.app import app, entrypoint

__all__ = ["app", "entrypoint"]

if __name__ == "__main__":
    entrypoint()
