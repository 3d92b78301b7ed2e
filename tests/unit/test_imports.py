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
        "heavy = [m for m in ('torch', 'ray', 'mlflow') if m in sys.modules]\n"
        "assert not heavy, heavy\n"
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert result.returncode == 0, result.stderr


def test_no_two_parts_of_the_package_import_each_other():
    """Imports point one way (docs/architecture.md): no subpackage or top module of scaletrain
    imports another that imports it back, lazily or not."""
    import ast
    from pathlib import Path

    root = Path(scaletrain.__file__).parent
    edges: dict[str, set[str]] = {}
    for path in root.rglob("*.py"):
        parts = path.relative_to(root).parts
        part = parts[0] if len(parts) > 1 else parts[0][:-3]
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            names = [node.module] if isinstance(node, ast.ImportFrom) and node.module else (
                [a.name for a in node.names] if isinstance(node, ast.Import) else [])
            for name in names:
                if name.startswith("scaletrain.") and name.split(".")[1] != part:
                    edges.setdefault(part, set()).add(name.split(".")[1])
    both_ways = sorted({tuple(sorted((a, b))) for a, targets in edges.items() for b in targets
                        if a in edges.get(b, ())})
    assert both_ways == []
