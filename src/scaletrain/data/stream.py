"""Training from a stream: a task's ``train_dataset()`` may return an iterable dataset (a torch
``IterableDataset``, HF ``datasets`` streaming, a generator-backed one) instead of a map-style one.

The rule, the same at any world size: global batch ``s`` is the stream's samples
``[s*G, (s+1)*G)`` of the current pass, laid out over micro-steps and ranks as the map-style
sampler lays out its positions (chunk ``micro*W + rank``). Every rank reads the whole stream
and keeps its chunks, so the global batches do not depend on the number of workers, and a job
resumed on another number of workers reads exactly what it would have. The price: each rank
reads (and decodes) all of it; for data that is costly to read, Parquet shards
(data/shards.py) read only what each rank needs.

Resume: a stream with ``state_dict()`` / ``load_state_dict()`` (HF datasets' IterableDataset,
torchdata's stateful nodes) has its state after the last trained step saved in the checkpoint
(as JSON: nothing is pickled), and loaded again; one without state is read again from the start
of the pass and the samples already trained on are skipped (exact when the stream yields the same
samples in the same order each time; said once, as a warning, when the run starts).

The stream is read on one thread of the training process, ``prefetch`` global batches ahead;
the state kept for a checkpoint is the one after the last batch the loop took, not the reader's.
When a pass ends mid-batch, that partial batch is dropped (as the map-style sampler drops the
last partial global batch) and the next pass starts (``set_epoch(pass)`` first, when the
dataset has it, so a shuffling stream shuffles anew).
"""

from __future__ import annotations

import json
import logging
from collections.abc import Callable, Iterator
from typing import Any

from torch.utils.data import IterableDataset, default_collate

from scaletrain.data.prefetch import ThreadPrefetch
from scaletrain.errors import TaskError

__all__ = ["is_stream", "has_state", "StreamBatches", "StreamPosition"]

log = logging.getLogger("scaletrain.data")

StreamPosition = dict[str, Any]  # {"pass": int, "samples_in_pass": int, "state": dict | None}


def is_stream(dataset: Any) -> bool:
    """An iterable dataset: no len() and [i], or a torch IterableDataset."""
    if isinstance(dataset, IterableDataset):
        return True
    return hasattr(dataset, "__iter__") and not (hasattr(dataset, "__len__") and hasattr(dataset, "__getitem__"))


def has_state(dataset: Any) -> bool:
    return callable(getattr(dataset, "state_dict", None)) and callable(getattr(dataset, "load_state_dict", None))


def _json_state(dataset: Any) -> dict[str, Any]:
    """The stream's state as plain JSON (a copy: the reader goes on changing the original)."""
    state = dataset.state_dict()
    try:
        return dict(json.loads(json.dumps(state)))
    except (TypeError, ValueError) as exc:
        raise TaskError(
            f"the training stream's state_dict() is not JSON ({exc}); scaletrain saves it in the checkpoint as "
            "JSON and never pickles it: return ints, strings, lists and dicts"
        ) from None


class StreamBatches:
    """This rank's micro-batches of a stream, from ``start_step`` to ``stop_step``."""

    def __init__(self, dataset: Any, *, batch_size: int, world_size: int, grad_accum: int, rank: int,
                 start_step: int, stop_step: int, collate: Callable[[list[Any]], Any] | None,
                 resume_from: StreamPosition | None = None, prefetch: int = 4):
        self.dataset = dataset
        self.batch_size, self.world_size, self.grad_accum, self.rank = batch_size, world_size, grad_accum, rank
        self.global_batch = batch_size * world_size * grad_accum
        self.step, self.stop_step = start_step, stop_step
        self.collate = collate or default_collate
        self.stateful = has_state(dataset)
        start = dict(resume_from or {"pass": 0, "samples_in_pass": 0, "state": None})
        # What a checkpoint of the last step the loop took records.
        self.position: StreamPosition = start
        if resume_from is not None and rank == 0:
            how = "from its saved state" if self.stateful and start.get("state") is not None else "by skipping"
            log.info("resuming the training stream at sample %d of pass %d, %s; global batches of %d samples, "
                     "the same at any number of workers", start["samples_in_pass"], start["pass"], how,
                     self.global_batch)
        self._ahead = ThreadPrefetch(self._global_batches(start), prefetch, name="scaletrain-stream")
        self._pending: list[Any] = []

    # ------------------------------------------------------------------ the loop's side

    def __iter__(self) -> StreamBatches:
        return self

    def __next__(self) -> Any:
        if not self._pending:
            micro_batches, self.position = next(self._ahead)
            self._pending = list(micro_batches)
        return self._pending.pop(0)

    def ready(self) -> int:
        """Global batches read ahead of the loop (the prefetch queue's depth)."""
        return self._ahead.qsize()

    def close(self) -> None:
        self._ahead.close()

    # ------------------------------------------------------------------ the reader's side

    def _global_batches(self, start: StreamPosition) -> Iterator[tuple[list[Any], StreamPosition]]:
        epoch, skip = int(start["pass"]), int(start["samples_in_pass"])
        resumed_state = start.get("state")
        step = self.step
        while step < self.stop_step:
            samples = self._open_pass(epoch, skip, resumed_state)
            taken = skip
            skip, resumed_state = 0, None
            while step < self.stop_step:
                batch = _take(samples, self.global_batch)
                if len(batch) < self.global_batch:
                    break  # the pass ended: its last partial batch is dropped
                taken += self.global_batch
                state = _json_state(self.dataset) if self.stateful else None
                yield self._mine(batch), {"pass": epoch, "samples_in_pass": taken, "state": state}
                step += 1
            else:
                return
            if taken == 0:
                raise TaskError("the training stream yielded no complete global batch in a pass "
                                f"({self.global_batch} samples); lower data.batch_size or check the stream")
            epoch += 1

    def _open_pass(self, epoch: int, skip: int, state: dict[str, Any] | None) -> Iterator[Any]:
        set_epoch = getattr(self.dataset, "set_epoch", None)
        if callable(set_epoch):
            set_epoch(epoch)
        if state is not None and self.stateful:
            self.dataset.load_state_dict(state)
            return iter(self.dataset)
        samples = iter(self.dataset)
        if skip:
            skipped = len(_take(samples, skip))
            if skipped < skip:
                raise TaskError(f"the training stream has {skipped} samples in pass {epoch}, fewer than the "
                                f"{skip} the checkpoint trained on; resume on the same stream")
            log.info("skipped the %d samples of pass %d trained on before the checkpoint (a stream without "
                     "state_dict() is read again from the start of its pass)", skip, epoch)
        return samples

    def _mine(self, batch: list[Any]) -> list[Any]:
        """This rank's micro-batches of one global batch: chunk micro*W + rank of each micro-step."""
        mine = []
        for micro in range(self.grad_accum):
            chunk = micro * self.world_size + self.rank
            mine.append(self.collate(batch[chunk * self.batch_size:(chunk + 1) * self.batch_size]))
        return mine


def _take(samples: Iterator[Any], count: int) -> list[Any]:
    taken = []
    for sample in samples:
        taken.append(sample)
        if len(taken) == count:
            break
    return taken
