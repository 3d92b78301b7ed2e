"""The Task protocol: the few things a user writes. scaletrain owns everything else.

A task is any object with these methods (subclassing :class:`Task` is optional and gives
the defaults)::

    class DigitsTask(scaletrain.Task):
        def __init__(self, hidden: int = 128): ...
        def build_model(self) -> nn.Module: ...             # called after seeding: same init everywhere
        def train_dataset(self) -> Dataset: ...             # map-style: len() and [i]
        def eval_dataset(self) -> Dataset | None: ...       # optional
        def loss(self, model, batch) -> Tensor | tuple[Tensor, dict[str, Tensor | float]]: ...

Optional too: ``collate(samples)`` (default: torch's default_collate),
``example_input()``, a small input for ``model(...)`` used to export the final model for
MLflow (default: the first element of a two-sample training batch), and ``tokens_per_sample``
(an int attribute: a sequence model's tokens per sample, for tokens/s in the metrics).

The job file names a factory (a class or a function) as ``package.module:attr``; it is called
with ``task.args`` as keyword arguments in every worker.
"""

from __future__ import annotations

import importlib
import inspect
import sys
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol, runtime_checkable

from scaletrain.errors import TaskError

if TYPE_CHECKING:
    import torch
    from torch import nn
    from torch.utils.data import Dataset

__all__ = [
    "Task",
    "TaskProtocol",
    "check_task_target",
    "check_job_code",
    "add_to_sys_path",
    "resolve_task_factory",
    "build_task",
    "split_loss_output",
    "tokens_per_sample",
]

REQUIRED_METHODS = ("build_model", "train_dataset", "loss")


@runtime_checkable
class TaskProtocol(Protocol):
    def build_model(self) -> nn.Module: ...

    def train_dataset(self) -> Dataset: ...

    def loss(self, model: nn.Module, batch: Any) -> Any: ...


class Task:
    """Optional base class for tasks: documents the contract and supplies the optional parts."""

    def build_model(self) -> nn.Module:
        raise NotImplementedError("a task must define build_model()")

    def train_dataset(self) -> Dataset:
        raise NotImplementedError("a task must define train_dataset()")

    def eval_dataset(self) -> Dataset | None:
        """Held-out data evaluated every ``train.eval_every`` steps; None to skip evaluation."""
        return None

    def loss(self, model: nn.Module, batch: Any) -> torch.Tensor | tuple[torch.Tensor, dict]:
        """Return the mean loss of the batch, optionally with metrics (means over the batch)."""
        raise NotImplementedError("a task must define loss(model, batch)")

    def collate(self, samples: list[Any]) -> Any:
        """Turn a list of dataset items into a batch; torch's default_collate unless overridden."""
        from torch.utils.data import default_collate

        return default_collate(samples)


def add_to_sys_path(search_path: Sequence[str]) -> None:
    """Where a job's code is imported from (its folders, first one first), ahead of the rest."""
    for entry in reversed(search_path):
        if entry not in sys.path:
            sys.path.insert(0, entry)


def resolve_task_factory(target: str, search_path: Sequence[str] = (), section: str = "task") -> Callable[..., Any]:
    """Import ``package.module:attr``. Raises TaskError naming what did not resolve (in the
    job file's ``section``: task or loop)."""
    add_to_sys_path(search_path)
    module_name, _, attr_path = target.partition(":")
    try:
        module = importlib.import_module(module_name)
    except ModuleNotFoundError as exc:
        if exc.name and module_name.startswith(exc.name.split(".")[0]):
            raise TaskError(
                f"{section}.target '{target}': module '{exc.name}' not found; run from the "
                "directory that contains it or install its package"
            ) from None
        raise TaskError(
            f"{section}.target '{target}': importing '{module_name}' failed: "
            f"{type(exc).__name__}: {exc}"
        ) from None
    except Exception as exc:  # the user's module raised while importing
        raise TaskError(
            f"{section}.target '{target}': importing '{module_name}' failed: "
            f"{type(exc).__name__}: {exc}"
        ) from None
    obj: Any = module
    for part in attr_path.split("."):
        if not hasattr(obj, part):
            raise TaskError(
                f"{section}.target '{target}': '{module_name}' has no attribute '{attr_path}'"
                + _close_names(module, part)
            )
        obj = getattr(obj, part)
    if not callable(obj):
        raise TaskError(f"{section}.target '{target}' is not a class or function; it cannot be called")
    return obj


def check_task_target(target: str, args: Mapping[str, Any] | None, search_path: Sequence[str] = (),
                      section: str = "task") -> None:
    """Check ``package.module:attr`` and its args without running the module.

    The launcher only needs to know the target exists before it starts workers; importing
    the user's module there (and everything it imports) would add seconds to every start.
    So: find the module, parse it, look for the name and the factory's parameters. Anything
    this cannot tell statically (star imports, module ``__getattr__``, inherited
    ``__init__``) falls back to a real import or is left to the workers. ``args`` None: the
    target's parameters are not checked (a loop function takes ctx).
    """
    import ast
    import importlib.util

    add_to_sys_path(search_path)
    module_name, _, attr_path = target.partition(":")
    try:
        spec = importlib.util.find_spec(module_name)
    except (ImportError, ValueError) as exc:
        raise TaskError(
            f"{section}.target '{target}': module '{getattr(exc, 'name', None) or module_name}' not "
            "found; run from the directory that contains it or install its package"
        ) from None
    if spec is None:
        raise TaskError(
            f"{section}.target '{target}': module '{module_name}' not found; run from the "
            "directory that contains it or install its package"
        )
    origin = spec.origin or ""
    if not origin.endswith(".py"):
        _check_args_by_import(target, args, search_path, section)
        return
    try:
        with open(origin, encoding="utf-8") as handle:
            tree = ast.parse(handle.read(), filename=origin)
    except SyntaxError as exc:
        raise TaskError(
            f"{section}.target '{target}': {origin} line {exc.lineno}: SyntaxError: {exc.msg}"
        ) from None
    except OSError:
        _check_args_by_import(target, args, search_path, section)
        return
    names = _top_level_names(tree)
    first = attr_path.split(".")[0]
    if names is None:  # star import or module __getattr__: only an import can tell
        _check_args_by_import(target, args, search_path, section)
        return
    if first not in names:
        import difflib

        close = difflib.get_close_matches(first, [n for n in names if not n.startswith("_")], n=1)
        raise TaskError(
            f"{section}.target '{target}': '{module_name}' has no attribute '{attr_path}'"
            + (f"; did you mean '{close[0]}'?" if close else "")
        )
    node = names[first]
    if args is not None and "." not in attr_path and node is not None:
        params = _static_parameters(node)
        if params is not None:
            _check_static_args(params, args, target)


def _check_args_by_import(target: str, args: Mapping[str, Any] | None, search_path: Sequence[str],
                          section: str) -> None:
    factory = resolve_task_factory(target, search_path, section)
    if args is not None:
        check_task_args(factory, args, target)


def _top_level_names(tree: Any) -> dict[str, Any] | None:
    """Module-level names -> their class/function node (None for other bindings)."""
    import ast

    names: dict[str, Any] = {}
    for node in tree.body:
        if isinstance(node, (ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
            if node.name == "__getattr__":
                return None
            names[node.name] = node
        elif isinstance(node, (ast.Import, ast.ImportFrom)):
            for alias in node.names:
                if alias.name == "*":
                    return None
                names[(alias.asname or alias.name).split(".")[0]] = None
        else:
            for child in ast.walk(node):
                if isinstance(child, ast.Name) and isinstance(child.ctx, ast.Store):
                    names.setdefault(child.id, None)
    return names


def _static_parameters(node: Any) -> tuple[list[str], list[str], bool] | None:
    """(all keyword-usable names, required names, accepts **kwargs) or None if unknown."""
    import ast

    if isinstance(node, ast.ClassDef):
        init = next(
            (n for n in node.body if isinstance(n, ast.FunctionDef) and n.name == "__init__"), None
        )
        if init is None:
            return None  # inherited: leave it to the workers
        function, skip_self = init, 1
    else:
        function, skip_self = node, 0
    a = function.args
    positional = [p.arg for p in a.posonlyargs + a.args]
    first_default = len(positional) - len(a.defaults)
    required = [n for i, n in enumerate(positional) if i < first_default][skip_self:]
    required += [p.arg for p, d in zip(a.kwonlyargs, a.kw_defaults) if d is None]
    by_keyword = {p.arg for p in a.args} | {p.arg for p in a.kwonlyargs}
    keyword = [n for n in positional[skip_self:] + [p.arg for p in a.kwonlyargs] if n in by_keyword]
    return keyword, required, a.kwarg is not None


def _check_static_args(params: tuple[list[str], list[str], bool], args: Mapping[str, Any], target: str) -> None:
    keyword, required, has_kwargs = params
    unknown = [name for name in args if name not in keyword]
    if unknown and not has_kwargs:
        import difflib

        close = difflib.get_close_matches(unknown[0], keyword, n=1)
        raise TaskError(
            f"task.args: {target} takes no argument '{unknown[0]}'"
            + (f"; did you mean '{close[0]}'?" if close else f"; it takes: {', '.join(keyword)}")
        )
    missing = [name for name in required if name not in args]
    if missing:
        raise TaskError(f"task.args: {target} needs '{missing[0]}'; add it under task.args")


def check_task_args(factory: Callable[..., Any], args: Mapping[str, Any], target: str) -> None:
    """Fail before any worker starts if ``task.args`` does not fit the factory's signature."""
    try:
        signature = inspect.signature(factory)
    except (TypeError, ValueError):
        return
    try:
        signature.bind(**args)
    except TypeError as exc:
        raise TaskError(f"task.args do not fit {target}{signature}: {exc}") from None


def build_task(target: str, args: Mapping[str, Any], search_path: Sequence[str] = (),
               required: Sequence[str | tuple[str, ...]] = REQUIRED_METHODS, see: str = "see scaletrain.Task") -> Any:
    """Resolve, call and check a task. Raises TaskError for anything the user must fix.
    ``required``: method names, or tuples of names any one of which will do."""
    factory = resolve_task_factory(target, search_path)
    check_task_args(factory, args, target)
    task = factory(**dict(args))
    alternatives = [(name,) if isinstance(name, str) else name for name in required]
    missing = [names[0] for names in alternatives if not any(callable(getattr(task, n, None)) for n in names)]
    if missing:
        raise TaskError(
            f"task '{target}' returned {type(task).__name__}, which lacks "
            f"{', '.join(m + '()' for m in missing)}; {see}"
        )
    return task


def split_loss_output(output: Any) -> tuple[torch.Tensor, dict[str, Any]]:
    """A task's loss() returns a loss tensor, or (loss, metrics). Normalise to the pair."""
    if isinstance(output, tuple) and len(output) == 2 and isinstance(output[1], Mapping):
        return output[0], dict(output[1])
    if isinstance(output, Mapping) and "loss" in output:
        metrics = {k: v for k, v in output.items() if k != "loss"}
        return output["loss"], metrics
    return output, {}


def _close_names(module: Any, name: str) -> str:
    import difflib

    public = [n for n in dir(module) if not n.startswith("_")]
    close = difflib.get_close_matches(name, public, n=1)
    return f"; did you mean '{close[0]}'?" if close else ""


def check_job_code(config: Any, search_path: Sequence[str] = ()) -> None:
    """The job's code exists (and a task's args fit it), without running it: ``task:`` or ``loop:``."""
    if config.script is not None:
        path = Path(config.script.path).expanduser()
        if not path.is_file():
            raise TaskError(f"script.path '{config.script.path}': no such file; give the script's path "
                            "relative to the directory the job starts from")
        return
    if config.kind == "tensorflow" and not _tensorflow_installed():
        raise TaskError("task.framework is tensorflow, but TensorFlow is not installed here; "
                        "pip install 'scaletrain[tensorflow]'")
    if config.loop is not None:
        if not config.loop.target.startswith("__main__:"):  # scaletrain.run_loop's: handed over by value
            check_task_target(config.loop.target, None, search_path, section="loop")
    else:
        check_task_target(config.task.target, config.task.args, search_path)


def _tensorflow_installed() -> bool:
    """Whether TensorFlow can be imported, without importing it (seconds, and GBs of memory)."""
    import importlib.util

    try:
        return importlib.util.find_spec("tensorflow") is not None
    except (ImportError, ValueError):  # ValueError: a stand-in module without a spec
        return False


def tokens_per_sample(task: Any) -> int | None:
    """The task's ``tokens_per_sample``, checked: a positive int, or None when it has none."""
    value = getattr(task, "tokens_per_sample", None)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
        raise TaskError(f"the task's tokens_per_sample must be a positive int (tokens in one sample), not {value!r}")
    return value
