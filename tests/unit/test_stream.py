"""The stream reader on its own: the global batch laid out over ranks and micro-steps as the
sampler lays out positions; passes end by dropping their partial batch; a state that is not JSON
or a stream too short for one batch is one line."""

import pytest
import torch

from scaletrain.data.stream import StreamBatches, is_stream
from scaletrain.errors import TaskError


class Numbers:
    """0..n-1 in each pass, plus 1000 x the pass: which pass a sample came from is visible."""

    def __init__(self, n, state=None):
        self.n, self.epoch, self.passes, self.state = n, 0, [], state

    def set_epoch(self, epoch):
        self.epoch = epoch
        self.passes.append(epoch)

    def __iter__(self):
        return iter(range(1000 * self.epoch, 1000 * self.epoch + self.n))


def read(stream, steps, world=1, accum=1, rank=0, batch=2):
    batches = StreamBatches(stream, batch_size=batch, world_size=world, grad_accum=accum, rank=rank,
                            start_step=0, stop_step=steps, collate=None)
    try:
        return [next(batches).tolist() for _ in range(steps * accum)], batches
    finally:
        batches.close()


def test_ranks_and_micro_steps_take_their_chunks_and_passes_drop_their_partial_batch():
    # 10 samples, global batch 4 (2 ranks x 2 micro-steps x 1): 2 steps a pass, samples 8 and 9 dropped.
    rank0, _ = read(Numbers(10), 3, world=2, accum=2, batch=1)
    rank1, _ = read(Numbers(10), 3, world=2, accum=2, rank=1, batch=1)
    assert rank0 == [[0], [2], [4], [6], [1000], [1002]]  # chunks 0 and 2 of each step
    assert rank1 == [[1], [3], [5], [7], [1001], [1003]]
    alone, batches = read(Numbers(10), 3, batch=4)
    assert alone == [[0, 1, 2, 3], [4, 5, 6, 7], [1000, 1001, 1002, 1003]]
    assert batches.position == {"pass": 1, "samples_in_pass": 4, "state": None}
    assert is_stream(Numbers(3)) and not is_stream([1, 2]) and not is_stream(torch.zeros(3))


def test_a_resume_skips_what_the_pass_trained_on():
    batches = StreamBatches(Numbers(10), batch_size=4, world_size=1, grad_accum=1, rank=0, start_step=3,
                            stop_step=5, collate=None, resume_from={"pass": 1, "samples_in_pass": 4, "state": None})
    assert [next(batches).tolist() for _ in range(2)] == [[1004, 1005, 1006, 1007], [2000, 2001, 2002, 2003]]
    with pytest.raises(StopIteration):
        next(batches)


def test_problems_are_one_line():
    with pytest.raises(TaskError, match=r"yielded no complete global batch in a pass \(8 samples\)"):
        read(Numbers(5), 1, batch=8)

    class Odd(Numbers):
        def state_dict(self):
            return {"where": object()}

        def load_state_dict(self, state):
            pass

    with pytest.raises(TaskError, match=r"state_dict\(\) is not JSON .*never pickles it"):
        read(Odd(10), 1)
