"""scaletrain: one job file, from one process to many, with production guardrails.

Importing this package is cheap (no torch): the public names load on first use.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

__version__ = "0.1.0"

__all__ = ["run", "resume", "run_loop", "report", "should_stop", "Task", "LoopContext", "JobConfig", "load_job",
           "__version__"]

if TYPE_CHECKING:
    from scaletrain.api import resume, run
    from scaletrain.config import JobConfig, load_job
    from scaletrain.launch_loop import run_loop
    from scaletrain.runners.loop import LoopContext
    from scaletrain.script_hooks import report, should_stop
    from scaletrain.task import Task

_LAZY = {
    "run": "scaletrain.api",
    "resume": "scaletrain.api",
    "run_loop": "scaletrain.launch_loop",
    "LoopContext": "scaletrain.runners.loop",
    "report": "scaletrain.script_hooks",
    "should_stop": "scaletrain.script_hooks",
    "Task": "scaletrain.task",
    "JobConfig": "scaletrain.config",
    "load_job": "scaletrain.config",
}


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        import importlib

        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'scaletrain' has no attribute {name!r}")
