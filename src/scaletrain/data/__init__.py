"""Data: the global-position sampler, the loaders built on it, and Parquet shards for datasets
that do not fit in memory (``ParquetShards``, ``write_shards``)."""

from scaletrain.data.loader import eval_loader, train_loader
from scaletrain.data.sampler import DataLayout, GlobalBatchSampler, derive_seed
from scaletrain.data.shards import ParquetShards, write_shards

__all__ = ["DataLayout", "GlobalBatchSampler", "derive_seed", "train_loader", "eval_loader", "ParquetShards",
           "write_shards"]
