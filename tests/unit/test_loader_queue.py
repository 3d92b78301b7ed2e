"""The data loader's prefetch queue depth: batches its workers have ready ahead of the loop."""

import time

import torch
from torch.utils.data import TensorDataset

from scaletrain.data.loader import train_loader
from scaletrain.data.sampler import DataLayout


def batches(workers, **kw):
    data = TensorDataset(torch.arange(256, dtype=torch.float32).unsqueeze(1))
    layout = DataLayout(len(data), batch_size=8, world_size=1, grad_accum=1)
    return train_loader(data, layout, rank=0, seed=0, shuffle=True, start_step=0, stop_step=30,
                        loader_workers=workers, collate=None, **kw)


def test_workers_fill_the_queue_and_the_loop_drains_it():
    loader = batches(2)
    assert loader.ready() is None  # not started
    it = iter(loader)
    first = next(it)
    deadline = time.monotonic() + 20
    while loader.ready() != 4 and time.monotonic() < deadline:  # 2 workers x prefetch 2 (a taken one is refilled)
        time.sleep(0.05)
    assert loader.ready() == 4
    assert first[0].shape == (8, 1)
    taken = [next(it) for _ in range(3)]
    assert len(taken) == 3 and loader.ready() <= 4
    rest = list(it)
    assert len(rest) == 30 - 4 and loader.ready() == 0


def test_without_workers_there_is_no_queue():
    loader = batches(0)
    assert len(list(loader)) == 30 and loader.ready() is None
