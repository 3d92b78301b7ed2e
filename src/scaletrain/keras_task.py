"""The Keras task: what a user writes for a TensorFlow job (task.framework: tensorflow), the same
shape as a PyTorch Task (task.py). TensorFlow is imported only when a task is used::

    class DigitsKeras:
        def __init__(self, hidden: int = 128): ...
        def build_model(self) -> keras.Model: ...        # called under the strategy's scope, after seeding
        def train_dataset(self): ...                     # a tf.data.Dataset of unbatched (x, y), or (x, y) arrays
        def eval_dataset(self): ...                      # optional, the same kinds
        def loss(self): ...                              # a Keras loss: an object, a name, or fn(y_true, y_pred)
        def metrics(self): ...                           # optional: Keras metrics, objects or names ("accuracy")

``compile_args()`` may stand in for loss() and metrics(): ``{"loss": ..., "metrics": [...]}``,
what one would pass to ``model.compile``. scaletrain owns the batching, the optimizer (optim:),
the distribution, the checkpoints and the export.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from scaletrain.errors import TaskError
from scaletrain.task import build_task

__all__ = ["build_keras_task", "build_keras_model", "LossAndMetrics", "loss_and_metrics", "as_dataset"]


def build_keras_task(target: str, args: Mapping[str, Any], search_path: Sequence[str] = ()) -> Any:
    return build_task(target, args, search_path, required=("build_model", "train_dataset", ("loss", "compile_args")),
                      see="a TensorFlow task has build_model(), train_dataset() and loss() (or compile_args())")


def build_keras_model(task: Any, features: Any) -> tuple[Any, Any]:
    """The task's model, built (one forward pass on a sample of zeros: no random draw), and its
    output; ``features``: the training set's per-sample feature spec."""
    import tensorflow as tf

    model = task.build_model()
    sample = tf.nest.map_structure(lambda spec: tf.zeros([1, *spec.shape], spec.dtype), features)
    return model, model(sample, training=False)


@dataclass
class LossAndMetrics:
    per_sample: Any  # (y_true, y_pred) -> one loss per sample
    metrics: list[Any]  # Keras Metric objects, named as they are reported


def loss_and_metrics(task: Any, label_spec: Any, output_shape: Sequence[int | None]) -> LossAndMetrics:
    """The task's loss as a per-sample function (scaletrain averages it over the global batch,
    as tf.distribute needs) and its metrics as Keras Metric objects, "accuracy" resolved as
    model.compile resolves it."""
    import keras

    if callable(getattr(task, "compile_args", None)):
        args = dict(task.compile_args())
        loss, metrics = args.get("loss"), list(args.get("metrics") or [])
        if loss is None:
            raise TaskError("compile_args() must give a 'loss'")
    else:
        loss = task.loss()
        metrics = list(task.metrics()) if callable(getattr(task, "metrics", None)) else []
    if isinstance(loss, str):
        loss = keras.losses.get(loss)
    if isinstance(loss, keras.losses.Loss):
        per_sample = loss.call  # the loss without its reduction
    elif callable(loss):
        per_sample = loss
    else:
        raise TaskError(f"the task's loss is a {type(loss).__name__}; give a Keras loss (an object, a name "
                        "such as 'sparse_categorical_crossentropy', or a function of (y_true, y_pred))")
    return LossAndMetrics(per_sample, [_metric(m, loss, label_spec, output_shape) for m in metrics])


def _metric(metric: Any, loss: Any, label_spec: Any, output_shape: Sequence[int | None]) -> Any:
    import keras

    if isinstance(metric, keras.metrics.Metric):
        return metric
    if isinstance(metric, str) and metric in ("accuracy", "acc"):
        return _accuracy(loss, label_spec, output_shape)
    if isinstance(metric, str):
        found = keras.metrics.get(metric)
        return found if isinstance(found, keras.metrics.Metric) else keras.metrics.MeanMetricWrapper(found, name=metric)
    if callable(metric):
        return keras.metrics.MeanMetricWrapper(metric, name=getattr(metric, "__name__", "metric"))
    raise TaskError(f"a metric must be a Keras metric, a name or a function; got {type(metric).__name__}")


def _accuracy(loss: Any, label_spec: Any, output_shape: Sequence[int | None]) -> Any:
    """"accuracy" as model.compile reads it: binary for one output, sparse for integer labels of
    one rank less than the output, categorical otherwise."""
    import keras

    if output_shape and output_shape[-1] == 1:
        return keras.metrics.BinaryAccuracy(name="accuracy")
    label_rank = len(label_spec.shape) + 1  # the spec is per sample; outputs are batched
    if label_rank < len(output_shape) or (label_rank == len(output_shape) and label_spec.shape[-1] == 1):
        return keras.metrics.SparseCategoricalAccuracy(name="accuracy")
    return keras.metrics.CategoricalAccuracy(name="accuracy")


def as_dataset(data: Any, what: str) -> Any:
    """A tf.data.Dataset of single samples: the task's dataset, or one built from arrays."""
    import tensorflow as tf

    if isinstance(data, tf.data.Dataset):
        if data.element_spec is None or not isinstance(data.element_spec, tuple) or len(data.element_spec) != 2:
            raise TaskError(f"{what}() must give samples as (features, label) pairs; got elements "
                            f"{data.element_spec}")
        label = data.element_spec[1]
        if label.shape.rank and label.shape[0] is None:
            raise TaskError(f"{what}() gives batches (its labels' first dimension is None); give single "
                            "samples: scaletrain batches them (data.batch_size per worker)")
        return data
    if isinstance(data, (tuple, list)) and len(data) == 2:
        return tf.data.Dataset.from_tensor_slices((data[0], data[1]))
    raise TaskError(f"{what}() must return a tf.data.Dataset of unbatched (features, label) pairs, or "
                    f"(features, labels) arrays; got {type(data).__name__}")
