"""What a Keras model needs, for `scaletrain plan` on a TensorFlow job: its weights' shapes, built
on the CPU from the task (Keras has no meta device: a model too big for this machine's memory is
planned as a what-if, --params). Activations and step time are not measured for Keras models
yet: the plan is by the model state, which is what decides between one process and mirrored."""

from __future__ import annotations

import math
from typing import Any

from scaletrain.keras_task import as_dataset, build_keras_model, build_keras_task
from scaletrain.plan.model_profile import ModelProfile
from scaletrain.plan.state_bytes import ParamShape

__all__ = ["profile_keras_task"]


def profile_keras_task(target: str, args: dict[str, Any], search_path: list[str], name: str) -> ModelProfile:
    import os

    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
    task = build_keras_task(target, args, search_path)
    features = as_dataset(task.train_dataset(), "train_dataset").element_spec[0]
    model, _ = build_keras_model(task, features)
    shapes = [_shape(v) for v in model.trainable_weights]
    buffers = sum(_shape(v).nbytes for v in model.non_trainable_weights)
    return ModelProfile(name=name, shapes=shapes, buffer_bytes=buffers)


def _shape(variable: Any) -> ParamShape:
    shape = tuple(int(d) for d in variable.shape)
    rows = shape[0] if shape else 1
    numel = math.prod(shape)
    itemsize = variable.value.dtype.size
    return ParamShape(rows, numel // rows if rows else 0, itemsize, len(shape))
