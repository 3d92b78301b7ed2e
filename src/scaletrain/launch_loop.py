"""``scaletrain.run_loop(train, workers=2, config={...})``: a loop run as a job in one call, from a
notebook or a script, with no job file and no ``if __name__ == "__main__"`` guard.

The workers are fresh processes (the local engine) or Ray actors; they never re-import the
caller's ``__main__``. A loop defined in an importable module is named by its import path, as in
a job file; one defined in ``__main__`` (a notebook cell, the script itself) is handed over by
value (runners/pickled_loop.py).
"""

from __future__ import annotations

import importlib
import os
import re
import sys
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

from scaletrain.errors import ConfigError

__all__ = ["run_loop"]


def run_loop(
    loop: Callable[[Any], Any],
    *,
    workers: int = 1,
    config: dict[str, Any] | None = None,
    job: str | os.PathLike | dict[str, Any] | None = None,
    engine: str | None = None,
    overrides: list[str] | tuple[str, ...] = (),
) -> dict[str, Any]:
    """Run ``loop(ctx)`` on ``workers`` workers and return the run's summary (as scaletrain.run).

    ``config``: what the loop reads as ``ctx.config``. ``job``: any other job settings (a
    mapping or a YAML file: tracking, checkpoint, recovery, scale...), ``engine``: local, ray;
    ``overrides``: ``key=value`` strings, as ``--set``. Tracked in MLflow, checkpointed and
    restarted as the job's settings say, like a job file with ``loop:``."""
    from scaletrain.api import run
    from scaletrain.config import load_job

    if not callable(loop):
        raise ConfigError(f"scaletrain.run_loop runs a function that takes ctx, got {type(loop).__name__}")
    if isinstance(job, dict):
        settings = dict(job)
    elif job is not None:
        settings = load_job(Path(job)).model_dump(mode="json", exclude_none=False)
    else:
        settings = {}
    if settings.get("task") is not None:
        raise ConfigError("scaletrain.run_loop runs a loop; the job given names a task: (use scaletrain.run)")
    settings.pop("task", None)
    target, search_path = _target_of(loop)
    settings["loop"] = {"target": target, "args": dict(config or {})}
    settings.setdefault("name", _job_name(loop))
    scale = dict(settings.get("scale") or {})
    scale["workers"] = workers
    if engine is not None:
        scale["engine"] = engine
    settings["scale"] = scale
    if not target.startswith("__main__:"):
        return run(settings, list(overrides), search_path=search_path)
    from scaletrain.runners.pickled_loop import write_loop

    with tempfile.TemporaryDirectory(prefix="scaletrain-loop-") as folder:
        handed = write_loop(loop, Path(folder))
        previous = {name: os.environ.get(name) for name in handed}
        os.environ.update(handed)  # the workers' environment (local: inherited; Ray: forwarded)
        try:
            return run(settings, list(overrides), search_path=search_path)
        finally:
            for name, value in previous.items():
                if value is None:
                    os.environ.pop(name, None)
                else:
                    os.environ[name] = value


def _target_of(loop: Callable[..., Any]) -> tuple[str, list[str]]:
    """``module:qualname`` when the workers can import it, else ``__main__:name`` (by value);
    and where to import it from (the module's root on sys.path, then the current directory)."""
    module_name = getattr(loop, "__module__", None) or "__main__"
    qualname = getattr(loop, "__qualname__", getattr(loop, "__name__", "loop"))
    search_path = [os.getcwd()]
    if module_name != "__main__" and "<" not in qualname:
        module = sys.modules.get(module_name) or importlib.import_module(module_name)
        found: Any = module
        for part in qualname.split("."):
            found = getattr(found, part, None)
        if found is loop:
            file = getattr(module, "__file__", None)
            if file:
                root = Path(file).resolve().parent
                for _ in range(module_name.count(".") + (1 if Path(file).name == "__init__.py" else 0)):
                    root = root.parent
                search_path.append(str(root))
            return f"{module_name}:{qualname}", search_path
    name = re.sub(r"\W", "_", getattr(loop, "__name__", "loop")) or "loop"
    if not re.match(r"[A-Za-z_]", name):
        name = "loop_" + name
    return f"__main__:{name}", search_path


def _job_name(loop: Callable[..., Any]) -> str:
    name = re.sub(r"[^\w.-]", "_", getattr(loop, "__name__", "loop"))[:100]
    return name if name not in ("", ".", "..") else "loop"
