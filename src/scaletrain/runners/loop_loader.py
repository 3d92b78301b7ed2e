"""The loader a user's loop gets from ``ctx.loader``: the global-position sampler behind a
DataLoader-like object, so a resumed loop reads exactly the batches it would have read.

Its position is the number of batches it has handed out since the job began; a checkpoint keeps
it, and a restore puts it back. One ``for batch in loader`` is the rest of the current epoch
(all of it unless resumed in the middle), the way a DataLoader is one epoch. Before each batch
is handed out the step's random generators are seeded from (seed, position, rank): dropout and
noise in the forward pass draw the same numbers after a resume.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

import torch
from torch.utils.data import Dataset

from scaletrain.data.loader import train_loader
from scaletrain.data.sampler import ORDER, DataLayout, derive_seed
from scaletrain.distributed.device import seed_rng, to_device

__all__ = ["LoopLoader"]


class LoopLoader:
    def __init__(
        self,
        dataset: Dataset,
        batch_size: int,
        *,
        rank: int,
        world_size: int,
        seed: int,
        device: torch.device,
        shuffle: bool = True,
        collate_fn: Callable[[list[Any]], Any] | None = None,
        num_workers: int = 0,
        on_batch: Callable[[], None] | None = None,
        order: str = ORDER,
    ):
        if not hasattr(dataset, "__len__") or not hasattr(dataset, "__getitem__"):
            raise TypeError("ctx.loader needs a map-style dataset (with __len__ and __getitem__)")
        self.dataset = dataset
        self.layout = DataLayout(len(dataset), batch_size, world_size, 1)
        if self.layout.steps_per_epoch < 1:
            raise ValueError(
                f"the dataset has {len(dataset)} samples but one step needs {self.layout.global_batch} "
                f"(batch_size {batch_size} x {world_size} workers); lower batch_size"
            )
        self.rank, self.seed, self.device, self.shuffle = rank, seed, device, shuffle
        self.collate_fn, self.num_workers = collate_fn, num_workers
        self.on_batch = on_batch
        self.order = order  # the epoch order (a resumed run's is its checkpoint's)
        self.position = 0  # batches handed out since the job began (every rank alike)

    @property
    def epoch(self) -> int:
        """The epoch the next batch belongs to."""
        return self.position // self.layout.steps_per_epoch

    def __len__(self) -> int:
        """Batches in one whole epoch, as a DataLoader's length."""
        return self.layout.steps_per_epoch

    def __iter__(self) -> Iterator[Any]:
        end = (self.epoch + 1) * self.layout.steps_per_epoch
        loader = train_loader(
            self.dataset, self.layout, rank=self.rank, seed=self.seed, shuffle=self.shuffle,
            start_step=self.position, stop_step=end, loader_workers=self.num_workers,
            collate=self.collate_fn, pin_memory=self.device.type == "cuda", order=self.order,
        )
        for batch in loader:
            seed_rng(derive_seed(self.seed, "step", self.position, self.rank), self.device)
            self.position += 1
            if self.on_batch is not None:
                self.on_batch()
            yield to_device(batch, self.device)
