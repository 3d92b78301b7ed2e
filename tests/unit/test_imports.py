"""Every module imports on its own (no cycles), and the CLI stays light."""

import pkgutil
import subprocess
import sys

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
    assert len(all_modules()) > 20


def test_config_and_cli_do_not_import_torch():
    code = (
        "import sys, scaletrain, scaletrain.config, scaletrain.cli.main, scaletrain.errors\n"
        "heavy = [m for m in ('torch', 'ray', 'mlflow') if m in sys.modules]\n"
        "assert not heavy, heavy\n"
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert result.returncode == 0, result.stderr
