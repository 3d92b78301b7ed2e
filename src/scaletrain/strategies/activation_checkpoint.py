"""Activation checkpointing per block: keep only the block's input, recompute the rest in
backward. The block's ``forward`` is wrapped in place (no wrapper module), so parameter names,
and with them checkpoints, stay the same with it on or off."""

from __future__ import annotations

import functools

from torch import nn
from torch.utils.checkpoint import checkpoint

__all__ = ["checkpoint_blocks"]


def checkpoint_blocks(blocks: list[nn.Module]) -> int:
    """Returns how many blocks recompute their activations."""
    for block in blocks:
        forward = block.forward

        @functools.wraps(forward)
        def recomputed(*args, _forward=forward, **kwargs):
            # Non-reentrant: works with keyword arguments and inputs that need no grad;
            # the RNG state is replayed, so dropout masks match the first pass.
            return checkpoint(_forward, *args, use_reentrant=False, **kwargs)

        block.forward = recomputed
    return len(blocks)
