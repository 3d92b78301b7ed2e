"""The shard-aware epoch order: a bijection of the epoch's samples, windows that hold exactly their
row groups, the same global batches at any world size, memory in row groups not samples."""

import tracemalloc

import numpy as np
import pytest

from scaletrain.data.sampler import SHARD_ORDER, DataLayout, GlobalBatchSampler, derive_seed
from scaletrain.data.shard_order import RowGroups, WindowedShuffle

SIZES = (7, 10, 10, 3, 10, 9, 10, 1, 10, 10, 8)  # uneven, as the last group of each file is


def order(groups: RowGroups, seed: int = 0, epoch: int = 0) -> WindowedShuffle:
    return WindowedShuffle(groups, lambda *name: [derive_seed(seed, epoch, *name, r) for r in range(4)])


def test_an_epoch_is_a_permutation_and_each_window_holds_its_own_row_groups():
    groups = RowGroups(SIZES, window=3)
    n = groups.rows
    samples = order(groups)(np.arange(n))
    assert sorted(samples.tolist()) == list(range(n))
    starts = np.concatenate([[0], np.cumsum(SIZES)])
    group_of = np.searchsorted(starts, samples, side="right") - 1
    # Consecutive positions come a window at a time: each window is the rows of 3 whole row groups
    # (the last window, of 2), and a group is never split over two windows.
    seen, at = [], 0
    while at < n:
        window: list[int] = []
        end = at
        while True:
            if group_of[end] not in window:
                window.append(int(group_of[end]))
            end += 1
            assert len(window) <= 3, (at, window)
            if end - at == sum(SIZES[g] for g in window) and (len(window) == 3 or end == n):
                break
        seen.append(window)
        at = end
    assert len(seen) == 4 and sorted(g for w in seen for g in w) == list(range(len(SIZES)))
    # Not the storage order, and a new one each epoch and seed.
    assert samples.tolist() != list(range(n))
    assert order(groups, epoch=1)(np.arange(n)).tolist() != samples.tolist()
    assert order(groups, seed=1)(np.arange(n)).tolist() != samples.tolist()
    assert order(groups)(np.arange(n)).tolist() == samples.tolist()


def test_positions_are_evaluated_on_their_own():
    groups = RowGroups(SIZES, window=4)
    whole = order(groups)(np.arange(groups.rows))
    picked = np.array([50, 3, 77, 0, 12, 12])
    assert order(groups)(picked).tolist() == whole[picked].tolist()
    with pytest.raises(IndexError):
        order(groups)(np.array([groups.rows]))


@pytest.mark.parametrize("world", [2, 4])
def test_the_same_global_batches_at_any_world_size(world):
    groups = RowGroups(tuple([64] * 30 + [17]), window=4)
    n, b = groups.rows, 8

    def global_batches(world_size, accum, batch):
        layout = DataLayout(n, batch, world_size, accum)
        ranks = [iter(GlobalBatchSampler(layout, rank=r, seed=5, stop_step=40, order=SHARD_ORDER, row_groups=groups))
                 for r in range(world_size)]
        steps = []
        for _ in range(40):
            step = []
            for _micro in range(accum):
                for rank in ranks:
                    step.extend(next(rank))
            steps.append(sorted(step))
        return steps

    one = global_batches(1, world, b)  # one worker accumulating what `world` workers read
    assert global_batches(world, 1, b) == one
    assert global_batches(1, 1, b * world) == one
    # 40 steps of 32 samples cross epoch 0's end (62 steps per epoch at 32): still distinct within it.
    assert len({i for step in one for i in step}) == 40 * b * world


def test_the_sampler_refuses_the_shard_order_without_row_groups():
    layout = DataLayout(100, 10, 1, 1)
    with pytest.raises(ValueError, match="needs the dataset's row groups"):
        GlobalBatchSampler(layout, rank=0, seed=0, order=SHARD_ORDER)
    with pytest.raises(ValueError, match="needs the dataset's row groups"):
        GlobalBatchSampler(layout, rank=0, seed=0, order=SHARD_ORDER, row_groups=RowGroups((50, 49), 1))


def test_the_digest_names_the_layout():
    assert RowGroups((10, 10), 2).digest == RowGroups((10, 10), 2).digest
    assert len({RowGroups((10, 10), 2).digest, RowGroups((10, 10), 1).digest, RowGroups((10, 11), 2).digest}) == 3
    with pytest.raises(ValueError):
        RowGroups((10, 0), 1)


def peak_bytes(groups: RowGroups, steps: int = 50) -> int:
    layout = DataLayout(groups.rows, 32, 8, 1)
    sampler = GlobalBatchSampler(layout, rank=3, seed=0, start_step=12_345, stop_step=12_345 + steps,
                                 order=SHARD_ORDER, row_groups=groups)
    tracemalloc.start()
    try:
        batches = list(sampler)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert len(batches) == steps and all(len(b) == 32 for b in batches)
    # A batch's samples come from one window (two where it crosses one): at most 32 row groups.
    rows = groups.sizes[0]
    assert max(len({i // rows for i in b}) for b in batches) <= 32
    return peak


def test_memory_grows_with_row_groups_not_samples():
    """The order holds a few numbers per row group (about 64 bytes at its peak, while it is made),
    none per sample: 1e9 samples in 1e6 row groups take 64 MB, where holding the epoch's order
    would take 8 GB; ten times the samples in as many row groups take the same."""
    small = peak_bytes(RowGroups(tuple([1000] * 100_000), window=16))
    large = peak_bytes(RowGroups(tuple([10_000] * 100_000), window=16))
    assert large < small * 1.1, (small, large)
    billion = peak_bytes(RowGroups(tuple([1000] * 1_000_000), window=16))
    assert billion < 100e6, f"{billion / 1e6:.0f} MB"
