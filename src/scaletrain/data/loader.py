"""DataLoaders built on the global-position sampler."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

from torch.utils.data import DataLoader, Dataset, Subset, default_collate

from scaletrain.data.prefetch import ThreadPrefetch
from scaletrain.data.sampler import ORDER, DataLayout, GlobalBatchSampler, SeededDataset, shard_indices
from scaletrain.data.shard_order import RowGroups
from scaletrain.data.skipping import SkippingDataset, counted_batches, skipping_collate

__all__ = ["train_loader", "eval_loader", "TrainBatches"]


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
    order: str = ORDER,
    row_groups: RowGroups | None = None,
) -> TrainBatches:
    """The batches of this rank from ``start_step``; ``skip_errors`` (data.on_error: skip): a
    sample whose dataset raises is left out of its batch and counted (data/skipping.py)."""
    sampler = GlobalBatchSampler(
        layout, rank=rank, seed=seed, shuffle=shuffle, start_step=start_step, stop_step=stop_step, order=order,
        row_groups=row_groups,
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
    # With workers, a thread receives their batches ahead of the loop (with pin_memory, torch's own
    # pinning thread does); without, batches are made on the training thread, seeded there.
    receive_ahead = _RECEIVE_AHEAD if loader_workers > 0 and not pin_memory else 0
    return TrainBatches(loader, counted=skip_errors, receive_ahead=receive_ahead)


_RECEIVE_AHEAD = 2  # batches received from the workers ahead of the loop


class TrainBatches:
    """This rank's batches, and how many its loader's workers have ready ahead of the training
    loop (the prefetch queue's depth: 0 at every report means the loop waits for data)."""

    def __init__(self, loader: DataLoader, counted: bool, receive_ahead: int = 0):
        self.loader, self.counted, self.receive_ahead = loader, counted, receive_ahead
        self._source: Any = None  # the DataLoader's iterator, once iterated
        self._ahead: ThreadPrefetch | None = None
        self._batches: Iterator[Any] | None = None

    def __iter__(self) -> TrainBatches:
        if self._batches is None:
            self._source = iter(self.loader)
            batches: Iterator[Any] = self._source
            if self.receive_ahead:
                batches = self._ahead = ThreadPrefetch(batches, self.receive_ahead, name="scaletrain-receive")
            self._batches = counted_batches(batches) if self.counted else batches
        return self

    def close(self) -> None:
        """Stop receiving and end the loader's worker processes now, by torch's own shutdown: a
        loader dropped after an error (its iterator held by the traceback's cycle) would end them
        at some later garbage collection, 5 s per worker (torch's join of each times out there)."""
        if self._ahead is not None:
            self._ahead.close()
        shutdown = getattr(self._source, "_shutdown_workers", None)  # torch's multiprocessing iterator
        if callable(shutdown):
            shutdown()

    def __next__(self) -> Any:
        return next(iter(self)._batches)  # type: ignore[arg-type]  # set by __iter__

    def ready(self) -> int | None:
        """Batches finished by the loader's workers and not yet taken by the loop: torch's
        multiprocessing iterator's result queue and its reorder buffer (private names, read
        defensively); None without workers (batches are made on demand) or when unknown."""
        source = self._source
        if source is None or not hasattr(source, "_task_info"):
            return None
        try:
            buffered = sum(1 for info in list(source._task_info.values()) if len(info) == 2)
            received = self._ahead.qsize() if self._ahead is not None else 0
            return int(source._data_queue.qsize()) + buffered + received
        except (AttributeError, NotImplementedError, TypeError, ValueError, OSError):
            return None


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
    n = len(dataset)  # type: ignore[arg-type]  # map-style datasets have a length
    if isinstance(getattr(dataset, "row_groups", None), RowGroups):
        # Shards: each rank a contiguous range, so it reads its own row groups once, not all of them.
        indices = list(range(rank * n // world_size, (rank + 1) * n // world_size))
    else:
        indices = shard_indices(n, rank, world_size)
    shard = Subset(dataset, indices)
    return DataLoader(
        shard,
        batch_size=batch_size,
        shuffle=False,
        num_workers=loader_workers,
        collate_fn=collate or default_collate,
        pin_memory=pin_memory,
    )
