"""Global data position: which samples each rank sees is a pure function of
(seed, epoch, samples consumed so far), never of per-rank iterator state.

At optimizer step ``s`` the job consumes the global batch ``perm(seed, epoch)[s*G:(s+1)*G]``
with ``G = batch_size * world_size * grad_accum``. Micro-step ``m`` of rank ``r`` takes chunk
``c = m*W + r`` of it, the slice ``[c*b, (c+1)*b)``. So 2 workers x batch b see exactly the same
global batches as 1 worker x batch 2b, and resuming at step ``s`` needs nothing but ``s``.
Randomness is keyed by the chunk, not by (micro-step, rank): 2 workers and 1 worker accumulating
2 micro-steps (a job resumed on fewer workers, or continuing after losing a node) draw the same
dropout masks and augmentations for the same samples.

``perm`` is a seeded bijection evaluated position by position (data/permutation.py): no rank
holds an epoch's order, so the sampler's memory does not grow with the dataset (a billion
samples cost what a thousand do). A dataset stored in row groups (data/shards.py) is read in
``SHARD_ORDER``: row groups permuted, samples shuffled within windows of them
(data/shard_order.py). Checkpoints say which order they were trained with
(``ORDER``); one from before it (``LEGACY_ORDER``: torch.randperm of the whole epoch) resumes in
that order, exactly.
"""

from __future__ import annotations

import hashlib
import math
import random
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
from torch.utils.data import Dataset, Sampler

from scaletrain.data.permutation import ROUNDS, IndexPermutation
from scaletrain.data.shard_order import RowGroups, WindowedShuffle

__all__ = ["derive_seed", "DataLayout", "GlobalBatchSampler", "SeededBatch", "SeededDataset", "shard_indices",
           "ORDER", "LEGACY_ORDER", "SHARD_ORDER", "ORDERS"]

ORDER = "feistel-1"  # the epoch order of new runs, kept in their checkpoints
LEGACY_ORDER = "randperm"  # what a checkpoint that names no order was trained with
SHARD_ORDER = "row-groups-feistel-1"  # a dataset in row groups (data/shard_order.py)
ORDERS = (ORDER, SHARD_ORDER, LEGACY_ORDER)
_BLOCK_STEPS = 64  # steps whose indices are computed in one vectorised call


def derive_seed(*parts: Any) -> int:
    """A stable 63-bit seed from any tuple of ints/strings (same on every host and Python)."""
    digest = hashlib.blake2b(repr(parts).encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") & ((1 << 63) - 1)


@dataclass(frozen=True)
class DataLayout:
    """How one optimizer step's samples are laid out over micro-steps and ranks."""

    dataset_len: int | None  # None: a stream (data/stream.py), whose length nobody knows
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
        if self.dataset_len is None:
            raise ValueError("a stream's epochs have no length known in advance")
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
        order: str = ORDER,
        row_groups: RowGroups | None = None,
    ):
        if layout.steps_per_epoch < 1:
            raise ValueError(
                f"the training set has {layout.dataset_len} samples but one step needs "
                f"{layout.global_batch} (batch_size {layout.batch_size} x workers "
                f"{layout.world_size} x grad_accum {layout.grad_accum}); lower data.batch_size"
            )
        if order not in ORDERS:
            raise ValueError(f"unknown data order {order!r}: this version knows {', '.join(ORDERS)}")
        if order == SHARD_ORDER and (row_groups is None or row_groups.rows != layout.dataset_len):
            raise ValueError(f"data order {order} needs the dataset's row groups ({layout.dataset_len} rows)")
        self.layout = layout
        self.rank = rank
        self.seed = seed
        self.shuffle = shuffle
        self.start_step = start_step
        self.stop_step = stop_step
        self.order = order
        self.row_groups = row_groups

    @property
    def dataset_len(self) -> int:
        return self.layout.dataset_len or 0  # a sampler's layout has one (steps_per_epoch checked it)

    def permutation(self, epoch: int) -> IndexPermutation | WindowedShuffle:
        if self.order == SHARD_ORDER and self.row_groups is not None:  # the one needs the other (__init__)
            return WindowedShuffle(self.row_groups, lambda *name: self._keys(epoch, *name))
        return IndexPermutation(self.dataset_len, self._keys(epoch))

    def _keys(self, epoch: int, *name: object) -> list[int]:
        return [derive_seed(self.seed, "epoch", epoch, *name, "round", r) for r in range(ROUNDS)]

    def epoch_order(self, epoch: int) -> torch.Tensor:
        """The whole epoch's order (O(dataset) memory: for tests and small datasets only)."""
        n = self.dataset_len
        if not self.shuffle:
            return torch.arange(n)
        if self.order == LEGACY_ORDER:
            generator = torch.Generator().manual_seed(derive_seed(self.seed, "epoch", epoch))
            return torch.randperm(n, generator=generator)
        return torch.from_numpy(self.permutation(epoch)(np.arange(n)))

    def indices(self, step: int, micro: int) -> list[int]:
        """This rank's sample indices for one micro-step (used by tests and by __iter__)."""
        epoch, within = divmod(step, self.layout.steps_per_epoch)
        return self._block(epoch, within, 1, self._epoch_source(epoch))[0, micro].tolist()

    def _epoch_source(self, epoch: int) -> object:
        """What maps an epoch's positions to samples: its permutation, or (legacy) its order."""
        if not self.shuffle:
            return None
        if self.order == LEGACY_ORDER:
            return self.epoch_order(epoch).numpy()
        return self.permutation(epoch)

    def _block(self, epoch: int, within: int, steps: int, source: object) -> np.ndarray:
        """This rank's indices for ``steps`` steps from step ``within`` of ``epoch``, shaped
        (step, micro-step, sample)."""
        layout, b = self.layout, self.layout.batch_size
        chunks = np.arange(layout.grad_accum) * layout.world_size + self.rank
        positions = ((within + np.arange(steps))[:, None, None] * layout.global_batch
                     + chunks[None, :, None] * b + np.arange(b)[None, None, :])
        if source is None:
            return positions
        if isinstance(source, (IndexPermutation, WindowedShuffle)):
            return source(positions.ravel()).reshape(positions.shape)
        return source[positions]  # type: ignore[index]  # the legacy order, a numpy array

    def __iter__(self) -> Iterator[SeededBatch]:
        step = self.start_step
        stop = math.inf if self.stop_step is None else self.stop_step
        per_epoch = self.layout.steps_per_epoch
        cached_epoch, source = -1, None
        while step < stop:
            epoch, within = divmod(step, per_epoch)
            if epoch != cached_epoch:
                cached_epoch, source = epoch, self._epoch_source(epoch)
            steps = int(min(per_epoch - within, _BLOCK_STEPS, stop - step))
            block = self._block(epoch, within, steps, source)
            for offset in range(steps):
                for micro in range(self.layout.grad_accum):
                    batch = SeededBatch(block[offset, micro].tolist())
                    batch.seed = derive_seed(self.seed, "data", step + offset, self.layout.chunk(micro, self.rank))
                    yield batch
            step += steps

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
        fetch_many = getattr(self.dataset, "__getitems__", None)  # a batch read (ParquetShards: per row group)
        if fetch_many is not None:
            return list(fetch_many(list(batch)))
        return [self.dataset[i] for i in batch]


def shard_indices(dataset_len: int, rank: int, world_size: int) -> list[int]:
    """Evaluation split: every sample exactly once over all ranks, no padding."""
    return list(range(rank, dataset_len, world_size))
