"""DataLoaders built on the global-position sampler."""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any

from torch.utils.data import DataLoader, Dataset, Subset, default_collate

from scaletrain.data.sampler import DataLayout, GlobalBatchSampler, SeededDataset, shard_indices
from scaletrain.data.skipping import SkippingDataset, counted_batches, skipping_collate

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
    skip_errors: bool = False,
) -> Iterable[Any]:
    """The batches of this rank from ``start_step``; ``skip_errors`` (data.on_error: skip): a
    sample whose dataset raises is left out of its batch and counted (data/skipping.py)."""
    sampler = GlobalBatchSampler(
        layout, rank=rank, seed=seed, shuffle=shuffle, start_step=start_step, stop_step=stop_step
    )
    collate = collate or default_collate
    loader = DataLoader(
        SeededDataset(SkippingDataset(dataset) if skip_errors else dataset),
        batch_sampler=sampler,
        num_workers=loader_workers,
        collate_fn=skipping_collate(collate) if skip_errors else collate,
        pin_memory=pin_memory,
        persistent_workers=loader_workers > 0,
    )
    return counted_batches(loader) if skip_errors else loader


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
