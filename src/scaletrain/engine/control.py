"""Decisions every rank must take together: stop (preemption), save (by time), commit an async save.

A signal reaches one rank, clocks differ between ranks, an async save finishes at different times
on each: so about four times a second of training, one tiny all-reduce (MAX) turns the local views into
one decision that is the same on every rank. The check interval (in steps) is itself agreed in that
all-reduce, so all ranks run the collective at the same steps; the loop reports its kept steps
at those steps too (one rank: the same pace, decided alone).

Where the stop request and the watchdog come from (signals, an engine's relay) is recovery's
business (scaletrain/recovery/); the loop only reads them through the two small protocols below.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any, Protocol

import torch

from scaletrain.distributed import collectives

__all__ = ["Control", "Decision", "StopSource", "ProgressWatch"]


class StopSource(Protocol):
    """Names the signal that asked this rank to stop, or None (recovery.signals.StopRequest)."""

    signal_name: str | None


class ProgressWatch(Protocol):
    """Told that this rank made progress (recovery.watchdog.Watchdog)."""

    def arm(self) -> None: ...

    def pet(self) -> None: ...


class _NoStop:
    signal_name: str | None = None


@dataclass(frozen=True)
class Decision:
    stop: str | None = None  # the signal that asked for it
    save: bool = False  # a time-based checkpoint is due
    commit: bool = False  # every rank finished writing its part of an async save
    report: bool = False  # a check step (about interval_s apart, the same on every rank): report now


_NOTHING = Decision()


class Control:
    def __init__(
        self,
        distributed: bool,
        stop: StopSource | None,
        watchdog: ProgressWatch | None,
        save_every_s: float | None,
        interval_s: float = 0.25,
        group: Any = None,
    ):
        self.distributed = distributed
        self.group = group  # the process group agreeing (None: the default one)
        self.stop = stop if stop is not None else _NoStop()
        self.watchdog = watchdog
        self.save_every_s = save_every_s
        self.interval_s = interval_s
        self._next_check = 1
        self._checked_at = time.monotonic()
        self._checked_step = 0
        self.last_save_at = time.monotonic()

    def start(self, step: int) -> None:
        """Training's clock starts at ``step`` (a Control made in the loop): the first agreement
        comes after the next step, its interval from that step's time, not from no time at all."""
        self._checked_at, self._checked_step, self._next_check = time.monotonic(), step, step + 1

    def saved(self) -> None:
        self.last_save_at = time.monotonic()

    def check(self, step: int, async_ready: bool, async_pending: bool) -> Decision:
        """Call after every step; cheap when no check is due. A check step says ``report``:
        the loop reports what it kept then (about every interval_s, not every log_every steps:
        a report has a fixed cost, 0.2 ms on a CPU, and a collective)."""
        if not self.distributed:  # one rank: stop and save are decided every step
            if self.watchdog is not None:
                self.watchdog.pet()
            report = step >= self._next_check
            if report:
                self._scheduled(step, self._proposal(step))
            return self._decide(self.stop.signal_name, self._save_due(), async_pending and async_ready, report)
        if step < self._next_check:
            return _NOTHING
        local = torch.tensor(
            [
                1.0 if self.stop.signal_name else 0.0,
                1.0 if self._save_due() else 0.0,
                0.0 if async_ready else 1.0,
                float(self._proposal(step)),
                float(_SIGNAL_CODES.get(self.stop.signal_name or "", 0)),
            ]
        )
        collectives.all_reduce(local, "max", self.group)  # on gloo: no GPU sync for a control message
        stop, save, not_ready, interval, code = local.tolist()
        self._scheduled(step, int(interval))
        if self.watchdog is not None:
            self.watchdog.arm()
        signal_name = _SIGNAL_NAMES.get(int(code), "SIGTERM") if stop else None
        return self._decide(signal_name, bool(save), async_pending and not not_ready, True)

    def _proposal(self, step: int) -> int:
        """Steps until the next check: about interval_s of them, at this rank's pace."""
        per_step = (time.monotonic() - self._checked_at) / max(1, step - self._checked_step)
        return max(1, min(1000, int(self.interval_s / per_step) if per_step > 0 else 1))

    def _scheduled(self, step: int, interval: int) -> None:
        self._next_check = step + interval
        self._checked_at, self._checked_step = time.monotonic(), step

    def _save_due(self) -> bool:
        return self.save_every_s is not None and time.monotonic() - self.last_save_at >= self.save_every_s

    @staticmethod
    def _decide(stop: str | None, save: bool, commit: bool, report: bool) -> Decision:
        if not (stop or save or commit or report):
            return _NOTHING
        return Decision(stop=stop, save=save, commit=commit, report=report)


_SIGNAL_CODES = {"SIGTERM": 1, "SIGUSR1": 2}
_SIGNAL_NAMES = {code: name for name, code in _SIGNAL_CODES.items()}
