"""A seeded shuffle of ``[0, n)`` in O(1) memory: a bijection evaluated at any position on its
own, so a global batch of a billion-sample epoch costs what its own indices cost, and every rank
(at any world size) computes the same order without holding it.

A 4-round Feistel network over the smallest even-bit domain ``2^k >= n`` (Luby-Rackoff: a
pseudorandom permutation from a good round function; here splitmix64's finaliser keyed by the
seed), cycle-walked into ``[0, n)``: a value that lands outside is encrypted again until it
lands inside, which keeps the map a bijection of ``[0, n)``. The domain is under ``4n``, so a
position takes under 4 encryptions on average. Vectorised over numpy's uint64 (wrapping
arithmetic), about a microsecond per position amortised over a block of them.

A small domain (``2^k <= 65536``) is encrypted whole once and the order of ``[0, n)`` kept
(512 KiB at most): the same values, without cycle-walking's ~17 rounds of small-array numpy
calls per block (0.6 ms a block, ~28 us a step for an epoch of a few dozen steps).
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np

__all__ = ["IndexPermutation", "ROUNDS"]

ROUNDS = 4
_WHOLE_DOMAIN = 1 << 16  # domains up to this size: the whole order is computed once, then looked up
_GOLDEN, _MIX1, _MIX2 = np.uint64(0x9E3779B97F4A7C15), np.uint64(0xBF58476D1CE4E5B9), np.uint64(0x94D049BB133111EB)


class IndexPermutation:
    """``perm(positions)``: the samples at these positions of a seeded order of ``[0, n)``."""

    def __init__(self, n: int, keys: list[int]):
        if n < 1:
            raise ValueError(f"a permutation of {n} elements")
        if len(keys) != ROUNDS:
            raise ValueError(f"{ROUNDS} round keys, not {len(keys)}")
        bits = max(2, (n - 1).bit_length())
        bits += bits % 2
        self.n = n
        self.half = np.uint64(bits // 2)
        self.mask = np.uint64((1 << (bits // 2)) - 1)
        self.keys = [np.uint64(key & ((1 << 64) - 1)) for key in keys]
        self._order: np.ndarray | None = None  # the whole order, for a small domain
        self._small = 1 << bits <= _WHOLE_DOMAIN

    def __call__(self, positions: np.ndarray) -> np.ndarray:
        positions = np.asarray(positions, dtype=np.int64)
        if positions.size and (positions.min() < 0 or positions.max() >= self.n):
            raise IndexError(f"positions outside [0, {self.n})")
        if self._small:
            if self._order is None:
                self._order = self._whole_order()
            return self._order[positions]
        with np.errstate(over="ignore"):
            return self._walk(self._encrypt(positions.astype(np.uint64)), self._encrypt).astype(np.int64)

    def _whole_order(self) -> np.ndarray:
        """Every position's sample: the domain encrypted once, each cycle walked by lookup."""
        with np.errstate(over="ignore"):
            table = self._encrypt(np.arange(1 << (2 * int(self.half)), dtype=np.uint64)).astype(np.int64)
        return self._walk(table[: self.n].copy(), table.__getitem__)

    def _walk(self, out: np.ndarray, step: Callable[[np.ndarray], np.ndarray]) -> np.ndarray:
        """Cycle-walking: a value outside ``[0, n)`` takes ``step`` again until it lands inside."""
        outside = out >= self.n
        while outside.any():
            out[outside] = step(out[outside])
            outside = out >= self.n
        return out

    def _encrypt(self, x: np.ndarray) -> np.ndarray:
        left, right = x >> self.half, x & self.mask
        for key in self.keys:
            left, right = right, left ^ (_mix(right ^ key) & self.mask)
        return (left << self.half) | right


def _mix(z: np.ndarray) -> np.ndarray:
    """splitmix64's finaliser: every input bit moves every output bit."""
    z = (z + _GOLDEN) * _MIX1
    z = (z ^ (z >> np.uint64(30))) * _MIX1
    z = (z ^ (z >> np.uint64(27))) * _MIX2
    return z ^ (z >> np.uint64(31))
