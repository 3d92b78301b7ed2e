"""Evaluation: every rank scores its shard, sums are all-reduced, so metrics are exact means
over the whole eval set whatever the world size."""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any

import torch
from torch import nn
from torch.utils._pytree import tree_leaves

from scaletrain.distributed import collectives
from scaletrain.task import split_loss_output

__all__ = ["evaluate", "eval_batches", "batch_length"]


def batch_length(batch: Any) -> int:
    for leaf in tree_leaves(batch):
        if isinstance(leaf, torch.Tensor) and leaf.dim() > 0:
            return int(leaf.shape[0])
    raise ValueError("cannot tell the batch size: the batch holds no tensor with a batch dimension")


@torch.no_grad()
def evaluate(
    model: nn.Module,
    loss_fn: Callable[[nn.Module, Any], Any],
    batches: Iterable[Any],
    to_device: Callable[[Any], Any],
    autocast: Callable[[], Any],
    forwards: int | None = None,
) -> dict[str, float]:
    """Sample-weighted means of the loss and of every metric the task returns.

    ``forwards``: run the model exactly this many times (sharded models gather parameters in
    each forward, so every rank must run as many); a rank whose shard is a batch short runs
    its last batch again, uncounted."""
    was_training = model.training
    model.eval()
    names: list[str] = []
    sums: torch.Tensor | None = None  # on the loss's device: no host sync per batch
    count = 0
    done = 0
    batch = None
    try:
        for batch in batches:
            batch = to_device(batch)
            n = batch_length(batch)
            with autocast():
                loss, metrics = split_loss_output(loss_fn(model, batch))
            done += 1
            values = {"loss": loss, **metrics}
            if sums is None:
                names = sorted(values)
                sums = torch.zeros(len(names), dtype=torch.float64, device=loss.device)
            row = torch.stack([torch.as_tensor(values[k], device=sums.device).detach().double()
                               .reshape(()) for k in names])
            sums += row * n
            count += n
        while forwards is not None and done < forwards and batch is not None:
            with autocast():
                loss_fn(model, batch)
            done += 1
    finally:
        model.train(was_training)
    if sums is None:
        raise ValueError("this rank's share of the eval set is empty")
    packed = torch.cat([sums, torch.tensor([float(count)], dtype=torch.float64, device=sums.device)])
    totals = collectives.all_reduce(packed, "sum").cpu()
    return {name: float(totals[i] / totals[-1]) for i, name in enumerate(names)}


def eval_batches(dataset_len: int, batch_size: int, world_size: int) -> int:
    """The most batches any rank's eval shard has (rank 0's: shards differ by one sample)."""
    per_rank = -(-dataset_len // world_size)
    return -(-per_rank // batch_size)
