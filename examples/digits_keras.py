"""Handwritten digits (scikit-learn's bundled 8x8 images) with a small Keras MLP: the TensorFlow
twin of examples/digits.py. The whole task a user writes: a model, two datasets, a loss and
metrics; scaletrain batches, distributes (tf.distribute), checkpoints and tracks it."""

import keras
import numpy as np
from sklearn.datasets import load_digits


class DigitsKeras:
    def __init__(self, hidden: int = 128, dropout: float = 0.1, eval_fraction: float = 0.2):
        images, labels = load_digits(return_X_y=True)
        x, y = (images / 16.0).astype("float32"), labels.astype("int64")
        order = np.random.default_rng(1234).permutation(len(x))
        n_eval = int(len(x) * eval_fraction)
        self.train, self.eval = (x[order[n_eval:]], y[order[n_eval:]]), (x[order[:n_eval]], y[order[:n_eval]])
        self.hidden, self.dropout = hidden, dropout

    def build_model(self) -> keras.Model:
        return keras.Sequential([
            keras.Input((64,)),
            keras.layers.Dense(self.hidden, activation="gelu"), keras.layers.Dropout(self.dropout),
            keras.layers.Dense(self.hidden, activation="gelu"), keras.layers.Dropout(self.dropout),
            keras.layers.Dense(10),
        ])

    def train_dataset(self):
        return self.train  # (features, labels) arrays; a tf.data.Dataset of (x, y) samples works too

    def eval_dataset(self):
        return self.eval

    def loss(self):
        return keras.losses.SparseCategoricalCrossentropy(from_logits=True)

    def metrics(self):
        return ["accuracy"]
