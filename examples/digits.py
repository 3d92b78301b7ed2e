"""Handwritten digits (scikit-learn's bundled 8x8 images) with a small MLP.

The whole task a user writes: a model, two datasets, a loss with metrics.
"""

import torch
from sklearn.datasets import load_digits
from torch import nn
from torch.utils.data import TensorDataset

import scaletrain


class DigitsTask(scaletrain.Task):
    def __init__(self, hidden: int = 128, dropout: float = 0.1, eval_fraction: float = 0.2):
        images, labels = load_digits(return_X_y=True)
        x = torch.tensor(images, dtype=torch.float32) / 16.0
        y = torch.tensor(labels, dtype=torch.long)
        order = torch.randperm(len(x), generator=torch.Generator().manual_seed(1234))
        n_eval = int(len(x) * eval_fraction)
        self.train = TensorDataset(x[order[n_eval:]], y[order[n_eval:]])
        self.eval = TensorDataset(x[order[:n_eval]], y[order[:n_eval]])
        self.hidden, self.dropout = hidden, dropout

    def build_model(self) -> nn.Module:
        return nn.Sequential(
            nn.Linear(64, self.hidden), nn.GELU(), nn.Dropout(self.dropout),
            nn.Linear(self.hidden, self.hidden), nn.GELU(), nn.Dropout(self.dropout),
            nn.Linear(self.hidden, 10),
        )

    def train_dataset(self):
        return self.train

    def eval_dataset(self):
        return self.eval

    def loss(self, model, batch):
        images, labels = batch
        logits = model(images)
        accuracy = (logits.argmax(dim=-1) == labels).float().mean()
        return nn.functional.cross_entropy(logits, labels), {"accuracy": accuracy}
