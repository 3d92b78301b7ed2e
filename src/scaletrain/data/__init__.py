"""Data: the global-position sampler and the loaders built on it."""

from scaletrain.data.loader import eval_loader, train_loader
from scaletrain.data.sampler import DataLayout, GlobalBatchSampler, derive_seed

__all__ = ["DataLayout", "GlobalBatchSampler", "derive_seed", "train_loader", "eval_loader"]
