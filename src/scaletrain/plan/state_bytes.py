"""Bytes of training state a rank holds, predicted from shapes (engine/state_bytes.py measures
them on the live tensors).

Both sides count the same things: parameters, their gradients and the optimizer's state as
this rank stores them (FSDP shards each parameter along dim 0 in ``torch.chunk`` pieces, so
rank r holds rows [r*c, (r+1)*c) with c = ceil(rows / world)). The planner's tests compare
the two exactly."""

from __future__ import annotations

from dataclasses import dataclass

import torch

__all__ = ["ParamShape", "shard_rows", "local_bytes", "optimizer_bytes", "zero_partition"]

STEP_BYTES = 4  # AdamW keeps a float32 scalar step counter per parameter (on the CPU path)


@dataclass(frozen=True)
class ParamShape:
    rows: int  # size of dim 0 (1 for a scalar)
    row_numel: int  # elements per row
    itemsize: int
    ndim: int = 2  # matrices (>= 2) get weight decay, vectors not: two optimizer groups

    @classmethod
    def of(cls, tensor: torch.Tensor) -> ParamShape:
        shape = tuple(tensor.shape)
        rows = shape[0] if shape else 1
        numel = 1
        for size in shape:
            numel *= size
        return cls(rows, numel // rows if rows else 0, tensor.element_size(), len(shape))

    @property
    def numel(self) -> int:
        return self.rows * self.row_numel

    @property
    def nbytes(self) -> int:
        return self.rows * self.row_numel * self.itemsize


def shard_rows(rows: int, world: int, rank: int) -> int:
    chunk = -(-rows // world)
    return max(0, min(chunk, rows - rank * chunk))


def local_bytes(shapes: list[ParamShape], world: int = 1, rank: int = 0) -> int:
    """Bytes of these parameters on ``rank`` when sharded over ``world`` (1: whole)."""
    return sum(shard_rows(s.rows, world, rank) * s.row_numel * s.itemsize for s in shapes)


def optimizer_bytes(shapes: list[ParamShape], optimizer: str, momentum: float, world: int = 1, rank: int = 0) -> int:
    """AdamW: exp_avg and exp_avg_sq like the parameter, plus its step. SGD: a momentum buffer
    when momentum is on, else nothing."""
    weights = local_bytes(shapes, world, rank)
    if optimizer == "sgd":
        return weights if momentum else 0
    return 2 * weights + STEP_BYTES * len(shapes)


def zero_partition(shapes: list[ParamShape], world: int) -> list[list[ParamShape]]:
    """Which whole parameters each rank's optimizer holds under ZeRO-1: torch's
    ZeroRedundancyOptimizer, per optimizer group (matrices, then vectors: engine/optim.py),
    largest first, each to the rank with the fewest elements so far."""
    sizes = [0] * world
    ranks: list[list[ParamShape]] = [[] for _ in range(world)]
    for group in ([s for s in shapes if s.ndim >= 2], [s for s in shapes if s.ndim < 2]):
        for shape in sorted(group, key=lambda s: s.numel, reverse=True):
            rank = sizes.index(min(sizes))
            ranks[rank].append(shape)
            sizes[rank] += shape.numel
    return ranks
