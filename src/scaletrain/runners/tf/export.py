"""The end of a TensorFlow job, on rank 0: the final weights as safetensors (named by their
Keras paths, hashed as a PyTorch job's are: the same sha256 rule), and the model in MLflow's
TensorFlow format (``mlflow.tensorflow.load_model`` and the pyfunc load it and predict; the
model is kept in Keras' own .keras format, loaded without running code from it)."""

from __future__ import annotations

import contextlib
import logging
import shutil
import sys
from importlib import metadata
from pathlib import Path
from typing import Any

import numpy as np
import torch

from scaletrain.engine.weights import save_state_weights, state_dict_sha256
from scaletrain.tracking.logs import LOGGER_NAME
from scaletrain.tracking.mlflow_client import configure_mlflow_client

__all__ = ["weights_of", "weights_sha256", "save_keras_weights", "save_mlflow_keras_model"]

log = logging.getLogger(f"{LOGGER_NAME}.worker")


def weights_of(model: Any) -> dict[str, torch.Tensor]:
    """The model's weights by Keras path (``sequential/dense/kernel``), as CPU tensors."""
    return {v.path: torch.from_numpy(np.ascontiguousarray(v.numpy())) for v in model.weights}


def weights_sha256(model: Any) -> str:
    return state_dict_sha256(weights_of(model))


def save_keras_weights(model: Any, path: str | Path, metadata: dict[str, str]) -> str:
    """model.safetensors (atomically); returns the weights' sha256."""
    weights = weights_of(model)
    save_state_weights(weights, path, metadata)
    return state_dict_sha256(weights)


def save_mlflow_keras_model(model: Any, path: str | Path, example: Any) -> Path | None:
    """A model that cannot be saved costs a warning, never the run."""
    path = Path(path)
    if path.exists():  # a previous attempt's copy
        shutil.rmtree(path)
    try:
        import mlflow.tensorflow

        configure_mlflow_client()
        tf_package = next((p for p in ("tensorflow", "tensorflow-cpu") if _installed(p)), "tensorflow")
        # MLflow checks the model by predicting: Keras' progress bar must not reach stdout,
        # which is the launcher's (`--json` prints the summary there).
        with contextlib.redirect_stdout(sys.stderr):
            mlflow.tensorflow.save_model(
                model, str(path), input_example=example,
                # Skips MLflow's requirement inference, which imports the model in a subprocess.
                pip_requirements=[f"{tf_package}=={metadata.version(tf_package)}"],
            )
    except Exception as exc:
        log.warning(
            "the final model was not saved in MLflow's format (%s: %s); the weights are in model.safetensors",
            type(exc).__name__, str(exc).splitlines()[0][:300] if str(exc) else "",
        )
        shutil.rmtree(path, ignore_errors=True)
        return None
    return path


def _installed(package: str) -> bool:
    try:
        metadata.version(package)
    except metadata.PackageNotFoundError:
        return False
    return True
