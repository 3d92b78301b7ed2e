"""``data.on_error: skip``: a sample whose dataset raises is left out of its batch, counted and
said, never silently. The count travels with the batch (a DataLoader worker process fills it),
and the loader's consumer adds it to the job's error figures (``errors_total{kind="sample"}``).

Which samples raise depends only on the data, so a resumed run skips the same ones: exact resume
holds. A batch whose every sample raised cannot be trained on: that stops the run.
"""

from __future__ import annotations

import logging
import time
import traceback
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from typing import Any, NamedTuple

from torch.utils.data import Dataset

from scaletrain.errors import ScaletrainError
from scaletrain.observe.telemetry import current as telemetry

__all__ = ["SkippingDataset", "skipping_collate", "counted_batches"]

log = logging.getLogger("scaletrain.data")
_WARN_EVERY_S = 30.0


@dataclass(frozen=True)
class _Skipped:
    index: int
    error: str  # "ValueError: ..., in file.py:12"


class SkippingDataset(Dataset):
    def __init__(self, dataset: Dataset):
        self.dataset = dataset

    def __len__(self) -> int:
        return len(self.dataset)  # type: ignore[arg-type]  # map-style datasets have a length

    def __getitem__(self, index: int) -> Any:
        try:
            return self.dataset[index]
        except Exception as exc:  # the policy: any error of the user's dataset, counted
            frame = traceback.extract_tb(exc.__traceback__)[-1] if exc.__traceback__ else None
            where = f", in {frame.filename.rsplit('/', 1)[-1]}:{frame.lineno}" if frame else ""
            return _Skipped(index, f"{type(exc).__name__}: {exc}"[:300] + where)


class CountedBatch(NamedTuple):  # a tuple: the DataLoader's pin_memory pins the batch inside
    batch: Any
    read: int
    skipped: list[_Skipped]


def skipping_collate(collate: Callable[[list[Any]], Any]) -> Callable[[list[Any]], CountedBatch]:
    def collate_kept(samples: list[Any]) -> CountedBatch:
        skipped = [s for s in samples if isinstance(s, _Skipped)]
        kept = [s for s in samples if not isinstance(s, _Skipped)]
        if not kept:
            raise ScaletrainError(
                f"every sample of a batch raised (data.on_error: skip), e.g. sample {skipped[0].index}: "
                f"{skipped[0].error}; fix the dataset"
            )
        return CountedBatch(collate(kept), len(samples), skipped)

    return collate_kept


def counted_batches(loader: Iterable[CountedBatch]) -> Iterator[Any]:
    """The batches, the samples read and skipped counted as they come (and said: the first at
    once, then at most one warning every 30 s)."""
    figures = telemetry()
    skipped_total, said_at = 0, -_WARN_EVERY_S
    for counted in loader:
        skipped = len(counted.skipped)
        figures.work("sample", counted.read, errors=skipped)
        if skipped:
            skipped_total += skipped
            now = time.monotonic()
            if now - said_at >= _WARN_EVERY_S:
                said_at = now
                first = counted.skipped[0]
                log.warning("skipped %d sample(s) whose dataset raised (data.on_error: skip; %d so far), "
                            "e.g. sample %d: %s", skipped, skipped_total, first.index, first.error,
                            extra={"skipped": skipped, "skipped_total": skipped_total})
        yield counted.batch
