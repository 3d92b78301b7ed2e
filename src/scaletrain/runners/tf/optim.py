"""The job's optim: section as a Keras optimizer: AdamW or SGD with the same schedule as a
PyTorch job's (engine/schedule.py: linear warmup, then constant, cosine or linear decay)."""

from __future__ import annotations

import math
from typing import Any

from scaletrain.config.schema import JobConfig
from scaletrain.engine.schedule import LRSchedule

__all__ = ["build_optimizer", "lr_schedule"]


def lr_schedule(job: JobConfig, total_steps: int) -> Any:
    import keras
    import tensorflow as tf

    shape = LRSchedule(job.optim.schedule, job.optim.warmup_steps, total_steps, job.optim.min_lr_ratio)

    class Schedule(keras.optimizers.schedules.LearningRateSchedule):
        """The peak lr times LRSchedule's multiplier, at the optimizer's 0-based step."""

        def __init__(self, peak: float):
            self.peak = peak

        def __call__(self, step: Any) -> Any:
            step = tf.cast(step, tf.float32)
            warmup = float(max(1, shape.warmup_steps))
            span = float(max(1, shape.total_steps - shape.warmup_steps))
            progress = tf.minimum(1.0, (step - shape.warmup_steps) / span)
            if shape.kind == "constant":
                decay = tf.ones_like(progress)
            elif shape.kind == "cosine":
                decay = 0.5 * (1.0 + tf.cos(math.pi * progress))
            else:
                decay = 1.0 - progress
            after = shape.min_ratio + (1.0 - shape.min_ratio) * decay
            multiplier = tf.where(step < shape.warmup_steps, (step + 1.0) / warmup, after)
            return self.peak * multiplier

        def get_config(self) -> dict[str, Any]:
            return {"peak": self.peak}

    return Schedule(job.optim.lr)


def build_optimizer(job: JobConfig, schedule: Any) -> Any:
    """Built under the strategy's scope by the caller, with lr_schedule's schedule; gradient
    clipping is the runner's (over the all-reduced gradients: Keras' clipnorm would clip each
    worker's part)."""
    import keras

    optim = job.optim
    if optim.name == "adamw":
        return keras.optimizers.AdamW(learning_rate=schedule, weight_decay=optim.weight_decay,
                                      beta_1=optim.betas[0], beta_2=optim.betas[1], epsilon=1e-8)
    return keras.optimizers.SGD(learning_rate=schedule, momentum=optim.momentum,
                                weight_decay=optim.weight_decay or None)
