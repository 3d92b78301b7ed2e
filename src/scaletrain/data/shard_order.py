"""The epoch order of a dataset stored in row groups (data/shards.py): shuffled without reading
samples one by one from all over the store.

A per-sample shuffle of sharded data would make every batch touch a different row group for
each sample. Instead, each epoch (1) permutes the row groups (a seeded bijection over their
numbers), (2) cuts that sequence into windows of ``window`` row groups, and (3) shuffles the
samples inside each window (a seeded bijection over the window's rows). A window's rows are read
once and stay in the loader's cache while the window is consumed.

The trade-off, as every shard-aware shuffle (MosaicML Streaming's shuffle blocks, WebDataset's
shuffle buffer) makes it: two samples of the same row group are never further apart than a
window, and a batch holds samples of at most ``window`` row groups. A window of 16 row groups of
1024 rows mixes 16k samples; larger windows shuffle better and hold more in each rank's cache.

Like the per-sample order, the map position -> sample is a pure function of (seed, epoch,
position): the same global batches at any world size, resume needing nothing but the step. Memory
is O(row groups): the permuted row-group sequence and the windows' starts.
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

from scaletrain.data.permutation import IndexPermutation

__all__ = ["RowGroups", "WindowedShuffle"]


@dataclass(frozen=True)
class RowGroups:
    """How a dataset's samples are stored: row counts of its row groups, in storage order, and
    how many row groups one shuffle window mixes."""

    sizes: tuple[int, ...]
    window: int

    def __post_init__(self) -> None:
        if not self.sizes or min(self.sizes) < 1:
            raise ValueError("row groups need at least one row each")
        if self.window < 1:
            raise ValueError(f"a shuffle window of {self.window} row groups")

    @property
    def rows(self) -> int:
        return sum(self.sizes)

    @property
    def digest(self) -> str:
        """Names this layout in a checkpoint: the order depends on it, so a resume over shards
        written differently is refused instead of reading other batches."""
        text = f"{self.window}:" + ",".join(map(str, self.sizes))
        return hashlib.blake2b(text.encode(), digest_size=8).hexdigest()


class WindowedShuffle:
    """``order(positions)``: the samples (global row numbers) at these positions of an epoch."""

    def __init__(self, groups: RowGroups, keys_of: Callable[..., list[int]]):
        """``keys_of(*name)``: the round keys of a named bijection of this epoch."""
        self.groups = groups
        self._keys_of = keys_of
        sizes = np.asarray(groups.sizes, dtype=np.int64)
        self._group_start = np.concatenate([[0], np.cumsum(sizes)[:-1]])
        count = len(sizes)
        sequence = IndexPermutation(count, keys_of("row-groups"))(np.arange(count))
        self._sequence = sequence  # storage numbers of the row groups, in this epoch's order
        rows_in_order = sizes[sequence]
        self._cum_in_order = np.concatenate([[0], np.cumsum(rows_in_order)])
        window_firsts = np.arange(0, count, groups.window)
        self._window_start = self._cum_in_order[window_firsts]  # first position of each window
        self._windows: dict[int, IndexPermutation] = {}

    def __call__(self, positions: np.ndarray) -> np.ndarray:
        positions = np.asarray(positions, dtype=np.int64)
        if positions.size and (positions.min() < 0 or positions.max() >= self.groups.rows):
            raise IndexError(f"positions outside [0, {self.groups.rows})")
        window = np.searchsorted(self._window_start, positions, side="right") - 1
        out = np.empty_like(positions)
        for w in np.unique(window):
            chosen = window == w
            start = int(self._window_start[w])
            shuffled = self._window(int(w))(positions[chosen] - start) + start
            # The shuffled position falls in one of the window's row groups (in epoch order).
            slot = np.searchsorted(self._cum_in_order, shuffled, side="right") - 1
            group = self._sequence[slot]
            out[chosen] = self._group_start[group] + (shuffled - self._cum_in_order[slot])
        return out

    def _window(self, w: int) -> IndexPermutation:
        found = self._windows.get(w)
        if found is None:
            first = w * self.groups.window
            last = min(first + self.groups.window, len(self._sequence))
            rows = int(self._cum_in_order[last] - self._cum_in_order[first])
            if len(self._windows) > 64:  # positions move forward: older windows are done
                self._windows.clear()
            found = self._windows[w] = IndexPermutation(rows, self._keys_of("window", w))
        return found

