"""The data loader's prefetch queue depth: batches its workers have ready ahead of the loop."""

import time

import pytest
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
    # 2 workers x prefetch 2 (a taken one is refilled), and 2 received ahead on the loader's thread.
    while loader.ready() != 6 and time.monotonic() < deadline:
        time.sleep(0.05)
    assert loader.ready() == 6
    assert first[0].shape == (8, 1)
    taken = [next(it) for _ in range(3)]
    assert len(taken) == 3 and loader.ready() <= 6
    rest = list(it)
    assert len(rest) == 30 - 4 and loader.ready() == 0


def test_batches_received_ahead_keep_their_order_and_errors():
    in_order = [batch[0].flatten().tolist() for batch in batches(0)]
    assert [batch[0].flatten().tolist() for batch in batches(2)] == in_order
    stopped = batches(2)
    assert next(iter(stopped))[0].flatten().tolist() == in_order[0]
    stopped.close()  # the loop stops early: the thread stops reading

    class Broken(torch.utils.data.Dataset):
        def __len__(self):
            return 64

        def __getitem__(self, index):
            if index == 5:
                raise ValueError("corrupt record 5")
            return torch.zeros(1)

    layout = DataLayout(64, batch_size=8, world_size=1, grad_accum=1)
    loader = train_loader(Broken(), layout, rank=0, seed=0, shuffle=False, start_step=0, stop_step=8,
                          loader_workers=2, collate=None)
    with pytest.raises(ValueError, match="corrupt record 5"):
        next(iter(loader))
    workers = list(loader._source._workers)
    started = time.monotonic()
    loader.close()  # as the trainer does after an error: its workers end now, not 5 s each at a gc
    assert not any(worker.is_alive() for worker in workers) and time.monotonic() - started < 4


def test_without_workers_there_is_no_queue():
    loader = batches(0)
    assert len(list(loader)) == 30 and loader.ready() is None
