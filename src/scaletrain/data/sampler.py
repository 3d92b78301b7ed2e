"""Global data position: which samples each rank sees is a pure function of
(seed, epoch, samples consumed so far), never of per-rank iterator state.

At optimizer step ``s`` the job consumes the global batch ``perm(seed, epoch)[s*G:(s+1)*G]``
with ``G = batch_size * world_size * grad_accum``. Micro-step ``m`` of rank ``r`` takes chunk
``c = m*W + r`` of it, the slice ``[c*b, (c+1)*b)``. So 2 workers x batch b see exactly the same
global batches as 1 worker x batch 2b, and resuming at step ``s`` needs nothing but ``s``.
Randomness is keyed by the chunk, not by (micro-step, rank): 2 workers and 1 worker accumulating
2 micro-steps (a job resumed on fewer workers, or continuing after losing a node) draw the same
dropout masks and augmentations for the same samples.
"""

from __future__ import annotations

import hashlib
import random
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
from torch.utils.data import Dataset, Sampler

__all__ = ["derive_seed", "DataLayout", "GlobalBatchSampler", "SeededBatch", "SeededDataset", "shard_indices"]


def derive_seed(*parts: Any) -> int:
    """A stable 63-bit seed from any tuple of ints/strings (same on every host and Python)."""
    digest = hashlib.blake2b(repr(parts).encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") & ((1 << 63) - 1)


@dataclass(frozen=True)
class DataLayout:
    """How one optimizer step's samples are laid out over micro-steps and ranks."""

    dataset_len: int
    batch_size: int  # per rank per micro-step
    world_size: int
    grad_accum: int

    @property
    def global_batch(self) -> int:
        return self.batch_size * self.world_size * self.grad_accum

    def chunk(self, micro: int, rank: int) -> int:
        """Which ``batch_size`` slice of the step's global batch micro-step ``micro`` of
        ``rank`` reads: the same samples whatever the world size and accumulation."""
        return micro * self.world_size + rank

    @property
    def steps_per_epoch(self) -> int:
        # Each epoch is a fresh permutation; the last partial global batch is dropped.
        return self.dataset_len // self.global_batch


class SeededBatch(list):
    """A list of dataset indices that carries the seed its augmentations must use."""

    seed: int = 0


class GlobalBatchSampler(Sampler[SeededBatch]):
    """Yields this rank's micro-batches from ``start_step`` to ``stop_step`` (exclusive)."""

    def __init__(
        self,
        layout: DataLayout,
        rank: int,
        seed: int,
        shuffle: bool = True,
        start_step: int = 0,
        stop_step: int | None = None,
    ):
        if layout.steps_per_epoch < 1:
            raise ValueError(
                f"the training set has {layout.dataset_len} samples but one step needs "
                f"{layout.global_batch} (batch_size {layout.batch_size} x workers "
                f"{layout.world_size} x grad_accum {layout.grad_accum}); lower data.batch_size"
            )
        self.layout = layout
        self.rank = rank
        self.seed = seed
        self.shuffle = shuffle
        self.start_step = start_step
        self.stop_step = stop_step

    def epoch_order(self, epoch: int) -> torch.Tensor:
        if not self.shuffle:
            return torch.arange(self.layout.dataset_len)
        generator = torch.Generator().manual_seed(derive_seed(self.seed, "epoch", epoch))
        return torch.randperm(self.layout.dataset_len, generator=generator)

    def indices(self, step: int, micro: int) -> list[int]:
        """This rank's sample indices for one micro-step (used by tests and by __iter__)."""
        epoch, within = divmod(step, self.layout.steps_per_epoch)
        return self._slice(self.epoch_order(epoch), within, micro)

    def _slice(self, order: torch.Tensor, within: int, micro: int) -> list[int]:
        b = self.layout.batch_size
        start = within * self.layout.global_batch + self.layout.chunk(micro, self.rank) * b
        return order[start : start + b].tolist()

    def __iter__(self) -> Iterator[SeededBatch]:
        step = self.start_step
        cached_epoch, order = -1, None
        while self.stop_step is None or step < self.stop_step:
            epoch, within = divmod(step, self.layout.steps_per_epoch)
            if epoch != cached_epoch:
                cached_epoch, order = epoch, self.epoch_order(epoch)
            for micro in range(self.layout.grad_accum):
                batch = SeededBatch(self._slice(order, within, micro))  # type: ignore[arg-type]  # set at the first step
                batch.seed = derive_seed(self.seed, "data", step, self.layout.chunk(micro, self.rank))
                yield batch
            step += 1

    def __len__(self) -> int:
        if self.stop_step is None:
            raise TypeError("an unbounded sampler has no length")
        return max(0, self.stop_step - self.start_step) * self.layout.grad_accum


class SeededDataset(Dataset):
    """Wraps a dataset so random augmentation inside a fetch is seeded by the batch (from
    seed, step, micro-step and rank), not by whichever process or iterator fetched it.

    It seeds torch's CPU generator, ``random`` and ``numpy.random``: seeding is a few
    microseconds, while saving and restoring numpy's state would cost 60 us a batch. The
    trainer reseeds torch for the forward pass after every fetch, so nothing depends on
    what the fetch left behind.
    """

    def __init__(self, dataset: Dataset):
        self.dataset = dataset

    def __len__(self) -> int:
        return len(self.dataset)  # type: ignore[arg-type]  # map-style datasets have a length

    def __getitem__(self, index: int) -> Any:
        return self.dataset[index]

    def __getitems__(self, batch: list[int]) -> list[Any]:
        seed = getattr(batch, "seed", None)
        if seed is not None:
            torch.default_generator.manual_seed(seed)
            random.seed(seed)
            np.random.seed(seed % (1 << 32))
        return [self.dataset[i] for i in batch]


def shard_indices(dataset_len: int, rank: int, world_size: int) -> list[int]:
    """Evaluation split: every sample exactly once over all ranks, no padding."""
    return list(range(rank, dataset_len, world_size))
