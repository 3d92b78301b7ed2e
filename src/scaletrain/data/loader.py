"""DataLoaders built on the global-position sampler."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from torch.utils.data import DataLoader, Dataset, Subset, default_collate

from scaletrain.data.sampler import DataLayout, GlobalBatchSampler, SeededDataset, shard_indices

__all__ = ["train_loader", "eval_loader"]


def train_loader(
    dataset: Dataset,
    layout: DataLayout,
    *,
    rank: int,
    seed: int,
    shuffle: bool,
    start_step: int,
    stop_step: int,
    loader_workers: int,
    collate: Callable[[list[Any]], Any] | None,
    pin_memory: bool = False,
) -> DataLoader:
    sampler = GlobalBatchSampler(
        layout, rank=rank, seed=seed, shuffle=shuffle, start_step=start_step, stop_step=stop_step
    )
    return DataLoader(
        SeededDataset(dataset),
        batch_sampler=sampler,
        num_workers=loader_workers,
        collate_fn=collate or default_collate,
        pin_memory=pin_memory,
        persistent_workers=loader_workers > 0,
    )


def eval_loader(
    dataset: Dataset,
    *,
    batch_size: int,
    rank: int,
    world_size: int,
    loader_workers: int,
    collate: Callable[[list[Any]], Any] | None,
    pin_memory: bool = False,
) -> DataLoader:
    shard = Subset(dataset, shard_indices(len(dataset), rank, world_size))  # type: ignore[arg-type]  # map-style datasets have a length
    return DataLoader(
        shard,
        batch_size=batch_size,
        shuffle=False,
        num_workers=loader_workers,
        collate_fn=collate or default_collate,
        pin_memory=pin_memory,
    )
