"""A worker's training batches by global position, and its share of the evaluation set.

Every epoch is one seeded shuffle of the whole dataset (the same on every worker), cut into
global batches of ``batch_size x workers``; worker r takes the r-th slice of each. The position
is (epoch, batch in the epoch): it goes into every checkpoint, and a resumed run skips to it,
so it reads exactly the batches the uninterrupted run would have."""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

from scaletrain.data.sampler import derive_seed
from scaletrain.errors import ScaletrainError

__all__ = ["TrainBatches", "Position", "eval_shard"]

_SHUFFLE_BUFFER_MAX = 1 << 20  # samples a shuffle holds; a larger dataset is shuffled in windows


@dataclass
class Position:
    epoch: int = 0
    batch: int = 0  # global batches of the epoch already trained


class TrainBatches:
    def __init__(self, dataset: Any, batch_size: int, rank: int, world_size: int, seed: int, shuffle: bool):
        import tensorflow as tf

        self.dataset, self.batch_size, self.rank = dataset, batch_size, rank
        self.global_batch = batch_size * world_size
        self.seed, self.shuffle = seed, shuffle
        samples = int(dataset.cardinality())
        if samples == tf.data.INFINITE_CARDINALITY:
            raise ScaletrainError("the training dataset repeats forever; give one pass over it "
                                  "(train.epochs and train.max_steps say how long to train)")
        if samples == tf.data.UNKNOWN_CARDINALITY:  # counted once: one pass, no training
            samples = int(dataset.reduce(0, lambda count, _: count + 1))
        self.samples = samples
        self.steps_per_epoch = samples // self.global_batch
        if self.steps_per_epoch == 0:
            raise ScaletrainError(f"the training set has {samples} samples, fewer than one global batch of "
                                  f"{self.global_batch} (data.batch_size {batch_size} x {world_size} workers); "
                                  "lower data.batch_size")

    def from_position(self, position: Position) -> Iterator[tuple[Position, Any]]:
        """(position after the batch, this worker's batch), from ``position`` on, forever."""
        epoch, skip = position.epoch, position.batch
        while True:
            for index, batch in enumerate(self._epoch(epoch, skip), start=skip + 1):
                yield Position(epoch, index), batch
            epoch, skip = epoch + 1, 0

    def _epoch(self, epoch: int, skip: int) -> Any:
        import tensorflow as tf

        ds = self.dataset
        if self.shuffle:
            ds = ds.shuffle(min(self.samples, _SHUFFLE_BUFFER_MAX), seed=derive_seed(self.seed, "tf-data", epoch) % (1 << 31),
                            reshuffle_each_iteration=False)
        lo, hi = self.rank * self.batch_size, (self.rank + 1) * self.batch_size
        ds = ds.batch(self.global_batch, drop_remainder=True).skip(skip)
        ds = ds.map(lambda x, y: (tf.nest.map_structure(lambda t: t[lo:hi], x), y[lo:hi]))
        return ds.prefetch(tf.data.AUTOTUNE)


def eval_shard(dataset: Any, batch_size: int, rank: int, world_size: int) -> Any:
    """This worker's share of the evaluation set: every sample exactly once over all workers."""
    import tensorflow as tf

    return dataset.shard(world_size, rank).batch(batch_size).prefetch(tf.data.AUTOTUNE)
