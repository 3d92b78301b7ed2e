"""The final model in MLflow's PyTorch format, so ``mlflow.pytorch.load_model`` works on it.

Rank 0 saves it into the run directory at the end (it holds the model in memory); the
launcher logs the directory as the run's ``model`` artifact. The format is MLflow's "pt2"
(torch.export: a traced graph, nothing unpickled on load), traced on an example input: the
task's ``example_input()`` if it has one, else the first element of a two-sample batch.
A model that cannot be exported costs a warning, never the run.
"""

from __future__ import annotations

import logging
import shutil
from importlib import metadata
from pathlib import Path
from typing import Any

import torch
from torch import nn

from scaletrain.tracking.mlflow_client import configure_mlflow_client

__all__ = ["MLFLOW_MODEL_DIR", "save_mlflow_model", "example_input"]

MLFLOW_MODEL_DIR = "mlflow_model"
log = logging.getLogger("scaletrain.tracking")


def example_input(task: Any, dataset: Any, collate: Any) -> Any:
    """What the model's forward takes, as numpy arrays (MLflow's pt2 format wants those)."""
    if callable(getattr(task, "example_input", None)):
        example = task.example_input()
    else:
        batch = collate([dataset[0], dataset[min(1, len(dataset) - 1)]])
        example = batch[0] if isinstance(batch, (tuple, list)) else batch
    if isinstance(example, (tuple, list)):
        return [e.detach().cpu().numpy() if isinstance(e, torch.Tensor) else e for e in example]
    return example.detach().cpu().numpy() if isinstance(example, torch.Tensor) else example


def save_mlflow_model(model: nn.Module, path: str | Path, example: Any) -> Path | None:
    path = Path(path)
    if path.exists():  # a previous attempt's copy
        shutil.rmtree(path)
    try:
        import mlflow.pytorch

        configure_mlflow_client()

        torch_version = metadata.version("torch").split("+")[0]
        mlflow.pytorch.save_model(
            model.to("cpu").eval(),
            str(path),
            input_example=example,
            serialization_format="pt2",
            # Skips MLflow's requirement inference, which imports the model in a subprocess.
            pip_requirements=[f"torch=={torch_version}"],
        )
    except Exception as exc:
        log.warning(
            "the final model was not saved in MLflow's format (%s: %s); the weights are in "
            "model.safetensors",
            type(exc).__name__, str(exc).splitlines()[0][:300] if str(exc) else "",
        )
        shutil.rmtree(path, ignore_errors=True)
        return None
    return path
