"""A small Keras task for the TensorFlow runner's tests: 512 samples of 16 features, 4 classes,
an MLP with dropout (so exact resume must restore the random state too)."""

from __future__ import annotations

import time

import keras
import numpy as np


class _Slow(keras.layers.Layer):
    """Sleeps in every training step (tests: a stop must land mid-run)."""

    def __init__(self, seconds: float, **kwargs):
        super().__init__(**kwargs)
        self.seconds = seconds

    def call(self, x, training=False):
        import tensorflow as tf

        if not training or not self.seconds:
            return x
        done = tf.py_function(lambda: time.sleep(self.seconds) or np.float32(0), [], tf.float32)
        done.set_shape([])
        return x + tf.cast(done, x.dtype)


class ToyKeras:
    def __init__(self, hidden: int = 32, step_sleep: float = 0.0, eval_set: bool = True):
        rng = np.random.default_rng(42)
        x = rng.standard_normal((512, 16)).astype("float32")
        y = (x @ rng.standard_normal((16, 4))).argmax(axis=-1).astype("int64")
        self.train, self.eval = (x, y), (x[:100], y[:100])
        self.hidden, self.step_sleep, self.eval_set = hidden, step_sleep, eval_set

    def build_model(self):
        layers = [keras.Input((16,)), keras.layers.Dense(self.hidden, activation="relu"),
                  keras.layers.Dropout(0.1), keras.layers.Dense(4)]
        if self.step_sleep:
            layers.insert(1, _Slow(self.step_sleep))
        return keras.Sequential(layers)

    def train_dataset(self):
        import tensorflow as tf

        return tf.data.Dataset.from_tensor_slices(self.train)  # a tf.data pipeline of samples

    def eval_dataset(self):
        return self.eval if self.eval_set else None  # arrays

    def compile_args(self):
        return {"loss": keras.losses.SparseCategoricalCrossentropy(from_logits=True), "metrics": ["accuracy"]}
