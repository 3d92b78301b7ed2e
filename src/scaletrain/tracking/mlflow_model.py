"""The final model in MLflow's PyTorch format, so ``mlflow.pytorch.load_model`` works on it.

Two halves, so that MLflow is never imported in a worker (its import and its scan of the
installed packages cost rank 0 ~1.7 s at the end of every job, with the other ranks waiting):

- rank 0, which holds the model, traces it with ``torch.export`` on an example input (the
  task's ``example_input()`` if it has one, else the first element of a two-sample batch; the
  batch dimension left dynamic) and writes ``data/model.pt2`` (MLflow's "pt2" format: a traced
  graph, nothing unpickled on load) and the example's input and output (``example.npz``);
- the tracking process, which has MLflow imported already, turns that folder into an MLflow
  model (``mlflow_package.py``) before it logs it.

A model that cannot be exported costs a warning, never the run.
"""

from __future__ import annotations

import logging
import shutil
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import nn

from scaletrain.tracking.mlflow_package import EXAMPLE_FILE, EXPORTED_PROGRAM

__all__ = ["MLFLOW_MODEL_DIR", "export_model", "example_input"]

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


def export_model(model: nn.Module, path: str | Path, example: Any) -> Path | None:
    """``torch.export`` of ``model`` on ``example`` (one numpy array: MLflow's pt2 models take
    one tensor) into ``path``, for the tracking process to package; None (and a warning) when
    the model cannot be exported."""
    path = Path(path)
    if path.exists():  # a previous attempt's copy
        shutil.rmtree(path)
    try:
        if not isinstance(example, np.ndarray):
            raise TypeError(
                f"MLflow's pt2 format takes a model with one tensor input; example_input() gave "
                f"{type(example).__name__}"
            )
        model = model.to("cpu").eval()
        inputs = torch.from_numpy(example)
        with torch.no_grad():
            output = model(inputs)
        # Any batch size at serving time: the batch dimension is left to the exporter (it
        # keeps it static only when the example's batch is 1).
        program = torch.export.export(model, (inputs,), dynamic_shapes=({0: torch.export.Dim.AUTO},))
        (path / "data").mkdir(parents=True)
        torch.export.save(program, str(path / EXPORTED_PROGRAM))
        if isinstance(output, torch.Tensor):
            np.savez(path / EXAMPLE_FILE, input=example, output=output.detach().cpu().numpy())
        else:  # a signature without outputs
            np.savez(path / EXAMPLE_FILE, input=example)
    except Exception as exc:
        log.warning(
            "the final model was not saved in MLflow's format (%s: %s); the weights are in "
            "model.safetensors",
            type(exc).__name__, str(exc).splitlines()[0][:300] if str(exc) else "",
        )
        shutil.rmtree(path, ignore_errors=True)
        return None
    return path
