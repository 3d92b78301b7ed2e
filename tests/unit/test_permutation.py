"""The epoch order without holding it: a seeded bijection of [0, n) evaluated by position, the
same global batches at any world size, a sampler whose memory does not grow with the dataset,
and checkpoints from before it resuming in the order they were trained with."""

import tracemalloc
from collections import Counter
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from scaletrain.data.permutation import IndexPermutation
from scaletrain.data.sampler import LEGACY_ORDER, ORDER, DataLayout, GlobalBatchSampler, derive_seed


@pytest.mark.parametrize("n", [1, 2, 3, 4, 5, 16, 17, 1000, 1797, 65536, 65537])
def test_every_position_maps_to_a_distinct_sample(n):
    out = IndexPermutation(n, [11, 22, 33, 44])(np.arange(n))
    assert sorted(out.tolist()) == list(range(n))


@pytest.mark.parametrize("n", [1, 2, 3, 17, 1437, 1797, 40_000, 65_536])
def test_a_small_domain_looked_up_whole_gives_the_order_computed_position_by_position(n):
    """Small domains keep their whole order (computed once, by lookup): the same samples, so
    checkpoints and runs from before resume and repeat exactly."""
    keys = [derive_seed(n, "round", r) for r in range(4)]
    looked_up = IndexPermutation(n, keys)
    assert looked_up._small
    computed = IndexPermutation(n, keys)
    computed._small = False  # the cycle-walking path every domain took before
    positions = np.random.default_rng(n).integers(0, n, size=min(n, 5000))
    assert np.array_equal(looked_up(positions), computed(positions))
    assert np.array_equal(looked_up(np.arange(n)), computed(np.arange(n)))
    assert not IndexPermutation(65_537, keys)._small  # larger ones hold nothing


def test_orders_differ_by_seed_and_look_uniform():
    n, seeds = 10, 4000
    firsts = Counter(int(IndexPermutation(n, [derive_seed(s, r) for r in range(4)])(np.arange(1))[0])
                     for s in range(seeds))
    assert sorted(firsts) == list(range(n))
    expected = seeds / n
    chi2 = sum((count - expected) ** 2 / expected for count in firsts.values())
    assert chi2 < 30, firsts  # 9 degrees of freedom: p < 0.001 above 27.9
    a, b = (GlobalBatchSampler(DataLayout(1000, 10, 1, 1), rank=0, seed=seed).epoch_order(0) for seed in (1, 2))
    assert (a != b).float().mean() > 0.95
    # displacement: a shuffle moves a sample a third of the way on average, as randperm does
    assert abs((a - torch.arange(1000)).abs().float().mean().item() / 1000 - 1 / 3) < 0.03


def test_a_billion_samples_cost_the_sampler_no_more_memory_than_a_thousand():
    def peak(samples):
        sampler = GlobalBatchSampler(DataLayout(samples, 32, 8, 2), rank=3, seed=0, start_step=5, stop_step=205)
        tracemalloc.start()
        read = sum(len(batch) for batch in sampler)
        _, top = tracemalloc.get_traced_memory()
        tracemalloc.stop()
        assert read == 200 * 2 * 32
        return top

    small, huge = peak(1_000_000), peak(1_000_000_000)
    # torch.randperm of the epoch would hold 8 GB; the sampler holds one block of indices.
    assert huge < 1_000_000 and huge < 1.2 * small, (small, huge)


def test_the_same_global_batches_at_any_world_size_at_a_billion_samples():
    def step_samples(world, accum, step):
        layout = DataLayout(1_000_000_000, 16, world, accum)
        return sorted(i for rank in range(world) for micro in range(accum)
                      for i in GlobalBatchSampler(layout, rank=rank, seed=9).indices(step, micro))

    assert step_samples(8, 1, 123_456) == step_samples(2, 4, 123_456) == step_samples(1, 8, 123_456)


def test_a_checkpoint_without_an_order_resumes_in_the_legacy_randperm_order():
    layout = DataLayout(100, 4, 2, 1)
    legacy = GlobalBatchSampler(layout, rank=1, seed=5, order=LEGACY_ORDER)
    epoch_2 = torch.randperm(100, generator=torch.Generator().manual_seed(derive_seed(5, "epoch", 2)))
    # 12 steps an epoch: step 27 is step 3 of epoch 2; rank 1 takes the second slice of 4
    assert legacy.indices(27, 0) == epoch_2[3 * 8 + 4: 3 * 8 + 8].tolist()
    assert [b for b in GlobalBatchSampler(layout, rank=1, seed=5, start_step=27, stop_step=28, order=LEGACY_ORDER)] \
        == [legacy.indices(27, 0)]
    assert GlobalBatchSampler(layout, rank=1, seed=5).indices(27, 0) != legacy.indices(27, 0)

    from scaletrain.engine.checkpointing import Checkpointer

    job = SimpleNamespace(checkpoint=SimpleNamespace(every_steps=10))
    state = {"step": 20, "global_batch": 8, "scheduler": {}}
    restored = SimpleNamespace(trainer_state=state, step=20, name="step-00000020")
    manager = SimpleNamespace(restore_latest=lambda _: restored, identity={})
    scheduler = SimpleNamespace(load_state_dict=lambda _: None)
    checkpointer = Checkpointer(manager, job, layout)
    assert checkpointer.data_order == ORDER and checkpointer.state(10, _Schedule())["data_order"] == ORDER
    assert checkpointer.restore(None, None, scheduler) == 20 and checkpointer.data_order == LEGACY_ORDER
    state["data_order"] = ORDER
    assert checkpointer.restore(None, None, scheduler) == 20 and checkpointer.data_order == ORDER


class _Schedule:
    def state_dict(self):
        return {"lr_lambdas": [None]}


def test_a_checkpoint_in_an_order_this_version_does_not_know_is_refused_naming_it():
    from scaletrain.checkpoint.manager import CheckpointError
    from scaletrain.engine.checkpointing import data_order_of

    assert data_order_of({}, "step-00000010") == LEGACY_ORDER
    assert data_order_of({"data_order": ORDER}, "step-00000010") == ORDER
    with pytest.raises(CheckpointError, match=r"checkpoint step-00000010 reads its data in order 'feistel-9', "
                                              r"which this version of scaletrain does not know"):
        data_order_of({"data_order": "feistel-9"}, "step-00000010")
