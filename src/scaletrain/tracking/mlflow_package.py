"""The tracking process's half of the final model (the worker's is ``mlflow_model.py``): the
folder rank 0 exported (``data/model.pt2`` and the example's input and output) made into an
MLflow model of the PyTorch flavor, as ``mlflow.pytorch.save_model(..., serialization_format=
"pt2")`` lays it out: ``MLmodel`` (pytorch and python_function flavors, the signature, the
input example), ``requirements.txt``, ``conda.yaml``, ``python_env.yaml``. Here MLflow is
imported already and torch is not needed: nothing is traced or loaded again."""

from __future__ import annotations

import platform
from importlib import metadata
from pathlib import Path

import yaml

__all__ = ["EXPORTED_PROGRAM", "EXAMPLE_FILE", "package_pytorch_model", "is_exported_model"]

EXPORTED_PROGRAM = "data/model.pt2"  # where MLflow's pytorch flavor reads a pt2 model
EXAMPLE_FILE = "example.npz"  # the traced input and its output (the signature); removed once packaged


def is_exported_model(folder: str | Path) -> bool:
    return Path(folder, EXPORTED_PROGRAM).is_file() and Path(folder, EXAMPLE_FILE).is_file()


def package_pytorch_model(folder: str | Path) -> None:
    """Write the MLflow model files around the exported program in ``folder``."""
    import numpy as np
    from mlflow import pyfunc
    from mlflow.models import Model, infer_signature

    folder = Path(folder)
    with np.load(folder / EXAMPLE_FILE, allow_pickle=False) as arrays:
        example = arrays["input"]
        output = arrays["output"] if "output" in arrays.files else None
    model = Model()
    model.signature = infer_signature(example, output)
    try:  # the example shown in the UI and used by `mlflow models predict`: nice to have
        from mlflow.models.utils import _save_example

        _save_example(model, example, str(folder))
    except Exception:  # noqa: S110  MLflow moved its helper: the model is whole without it
        pass
    versions = {name: version for name in ("mlflow", "torch", "pip", "setuptools", "wheel")
                if (version := _version(name))}
    requirements = [f"mlflow=={versions['mlflow']}", f"torch=={versions['torch'].split('+')[0]}"]
    (folder / "requirements.txt").write_text("\n".join(requirements))
    python = platform.python_version()
    (folder / "python_env.yaml").write_text(yaml.safe_dump({
        "python": python,
        "build_dependencies": [f"{name}=={versions[name]}" for name in ("pip", "setuptools", "wheel")
                               if name in versions],
        "dependencies": ["-r requirements.txt"],
    }, sort_keys=False))
    (folder / "conda.yaml").write_text(yaml.safe_dump({
        "channels": ["conda-forge"],
        "dependencies": [f"python={python}", "pip", {"pip": requirements}],
        "name": "mlflow-env",
    }, sort_keys=False))
    model.add_flavor("pytorch", model_data="data", pytorch_version=versions["torch"], code=None)
    pyfunc.add_to_model(
        model, loader_module="mlflow.pytorch", data="data",
        pickle_module_name="mlflow.pytorch.pickle_module", code=None,
        conda_env="conda.yaml", python_env="python_env.yaml", model_config={"device": None},
    )
    (folder / EXAMPLE_FILE).unlink()
    model.model_size_bytes = sum(p.stat().st_size for p in folder.rglob("*") if p.is_file())
    model.save(str(folder / "MLmodel"))


def _version(name: str) -> str | None:
    try:
        return metadata.version(name)
    except metadata.PackageNotFoundError:
        return None
