"""Every module imports on its own (no cycles), and the CLI stays light."""

import pkgutil
import subprocess
import sys
from pathlib import Path

import scaletrain


def all_modules():
    prefix = scaletrain.__name__ + "."
    return sorted(
        m.name for m in pkgutil.walk_packages(scaletrain.__path__, prefix) if not m.name.endswith("__main__")
    )


def test_every_module_imports_alone():
    # One interpreter; before each module, forget every scaletrain module so a cycle shows up
    # as an ImportError for whichever module is imported first.
    code = (
        "import importlib, sys\n"
        f"modules = {all_modules()!r}\n"
        "failed = []\n"
        "for name in modules:\n"
        "    for loaded in [m for m in sys.modules if m == 'scaletrain' or m.startswith('scaletrain.')]:\n"
        "        del sys.modules[loaded]\n"
        "    try:\n"
        "        importlib.import_module(name)\n"
        "    except Exception as exc:\n"
        "        failed.append(f'{name}: {type(exc).__name__}: {exc}')\n"
        "print('\\n'.join(failed))\n"
        "sys.exit(1 if failed else 0)\n"
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert result.returncode == 0, result.stdout + result.stderr
    # A folder of modules without __init__.py is invisible to walk_packages (tune/ was).
    root = Path(scaletrain.__file__).parent
    hidden = [str(d.relative_to(root)) for d in root.rglob("*")
              if d.is_dir() and any(d.glob("*.py")) and not (d / "__init__.py").exists()]
    assert hidden == []
    assert {"scaletrain.tune.search", "scaletrain.tune.space"} <= set(all_modules())


def test_config_and_cli_do_not_import_torch():
    code = (
        "import sys, scaletrain, scaletrain.config, scaletrain.cli.main, scaletrain.errors\n"
        "heavy = [m for m in ('torch', 'ray', 'mlflow', 'tensorflow', 'keras') if m in sys.modules]\n"
        "assert not heavy, heavy\n"
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert result.returncode == 0, result.stderr


def test_a_ddp_worker_imports_no_sharding_no_dcp_and_no_mlflow():
    """What a worker of a DDP job loads before its first step (each costs start-up time the raw
    loop never pays): ZeRO-1's torch.distributed.optim pulls FSDP and DTensor in; DCP comes only
    with a large or sharded checkpoint; MLflow never (the tracking process has it)."""
    code = (
        "import sys\n"
        "import scaletrain.launch.worker, scaletrain.runners.task, scaletrain.engine.trainer\n"
        "from scaletrain.strategies import get_strategy\n"
        "get_strategy('ddp'); get_strategy('single')\n"
        "heavy = [m for m in ('torch.distributed.optim', 'torch.distributed.fsdp', 'torch.distributed.tensor',\n"
        "                     'torch.distributed.checkpoint', 'mlflow', 'ray') if m in sys.modules]\n"
        "assert not heavy, heavy\n"
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert result.returncode == 0, result.stderr[-2000:]


def test_every_strategy_is_registered_under_its_own_name():
    from scaletrain.strategies import STRATEGIES, strategy_class

    assert {name: strategy_class(name).name for name in STRATEGIES} == {name: name for name in STRATEGIES}


# The house from the bottom up (docs/architecture.md says the same): a part imports only parts
# on lower floors, lazily or not.
FLOORS = [
    {"errors", "quick_exit"},
    {"rundir", "config", "task", "observe"},
    {"distributed", "data", "keras_task"},
    {"strategies", "checkpoint", "tracking"},
    {"plan"},
    {"engine", "recovery"},
    {"preflight"},
    {"runners"},
    {"launch"},
    {"api", "script_hooks"},
    {"reproduce", "verify_resume", "tune", "launch_loop", "run_report"},
    {"cli", "__init__"},
    {"__main__"},
]
# The training loop knows nothing of how it was launched, planned or made to fail (engine and
# recovery share a floor: neither imports the other): the worker fills its hooks (after_step:
# fault injection) and hands it a stop source and a watchdog.
FORBIDDEN = {("engine", "launch"), ("engine", "plan"), ("engine", "recovery")}


def import_edges() -> dict[tuple[str, str], str]:
    """(importer, imported) parts of scaletrain -> one file where it happens."""
    import ast

    root = Path(scaletrain.__file__).parent
    edges: dict[tuple[str, str], str] = {}
    for path in sorted(root.rglob("*.py")):
        parts = path.relative_to(root).parts
        part = parts[0] if len(parts) > 1 else parts[0][:-3]
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            names = [node.module] if isinstance(node, ast.ImportFrom) and node.module else (
                [a.name for a in node.names] if isinstance(node, ast.Import) else [])
            for name in names:
                if name.startswith("scaletrain.") and name.split(".")[1] != part:
                    edges.setdefault((part, name.split(".")[1]), str(path.relative_to(root)))
    return edges


def test_imports_point_down_the_house():
    floor = {part: level for level, parts in enumerate(FLOORS) for part in parts}
    root = Path(scaletrain.__file__).parent
    parts = {p.name for p in root.iterdir() if p.is_dir() and (p / "__init__.py").exists()}
    parts |= {p.stem for p in root.glob("*.py")}
    assert parts - set(floor) == set(), "a new part of the package: give it a floor in FLOORS"
    edges = import_edges()
    upward = [f"{a} -> {b} ({where})" for (a, b), where in sorted(edges.items()) if floor[b] >= floor[a]]
    assert upward == []
    assert [f"{a} -> {b} ({where})" for (a, b), where in sorted(edges.items()) if (a, b) in FORBIDDEN] == []


def test_engines_know_nothing_of_runners_or_the_loop():
    # The engines (in-process, local, Ray) start one worker entry point, launch/worker.py, which
    # picks the runner: a new kind of job never edits an engine.
    import ast

    root = Path(scaletrain.__file__).parent
    found = []
    for path in sorted((root / "launch").rglob("*.py")):
        if path.name == "worker.py":
            continue
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            module = node.module if isinstance(node, ast.ImportFrom) else None
            names = [module] if module else [a.name for a in getattr(node, "names", [])] if isinstance(node, ast.Import) else []
            found += [f"{path.relative_to(root)}: {name}" for name in names
                      if name and name.split(".")[:2] in (["scaletrain", "runners"], ["scaletrain", "engine"])]
    assert found == []
