"""Decisions every rank must take together: stop (preemption), save (by time), commit an async save.

A signal reaches one rank, clocks differ between ranks, an async save finishes at different times
on each: so about four times a second of training, one tiny all-reduce (MAX) turns the local views into
one decision that is the same on every rank. The check interval (in steps) is itself agreed in that
all-reduce, so all ranks run the collective at the same steps.

The hang watchdog is faulthandler's C thread: if this rank stops re-arming it for
``hang_timeout_s``, it writes every thread's Python stack to a file, even when the interpreter is
stuck in a collective or holds the GIL in C code. The process ends a grace period later, by the
kernel's SIGALRM (no GIL needed either): a hang in one rank leaves its peers waiting in a
collective, all armed at the same check; were the first to time out to exit at once, the
launcher would stop the others before they dump, and half the time the hung rank's stacks, the
ones that matter, would be lost.
"""

from __future__ import annotations

import faulthandler
import signal
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import IO

import torch

from scaletrain.distributed import collectives

__all__ = ["StopRequest", "Watchdog", "Control", "Decision", "grace_s"]

_STOP_SIGNALS = (signal.SIGTERM, signal.SIGUSR1)


class StopRequest:
    """SIGTERM or SIGUSR1 to this process asks for a clean stop with a checkpoint."""

    def __init__(self) -> None:
        self.signal_name: str | None = None

    def install(self):
        """Install the handlers (main thread only); returns a function that restores the old ones."""
        if threading.current_thread() is not threading.main_thread():
            return lambda: None
        previous = {sig: signal.signal(sig, self._handle) for sig in _STOP_SIGNALS}

        def restore() -> None:
            for sig, handler in previous.items():
                signal.signal(sig, handler)

        return restore

    def _handle(self, signum: int, frame: object) -> None:
        if self.signal_name is None:
            self.signal_name = signal.Signals(signum).name


class Watchdog:
    """Dumps every thread's stack to ``stacks_path`` if not re-armed in time, then ends the
    process ``grace_s(timeout_s)`` later (its peers dump meanwhile)."""

    def __init__(self, timeout_s: float, stacks_path: Path, rearm_every_s: float = 0.5):
        self.timeout_s = timeout_s
        self.stacks_path = Path(stacks_path)
        self._rearm_every = rearm_every_s
        self._file: IO[str] | None = None
        self._armed_at = 0.0
        self._alarm = False

    def arm(self) -> None:
        if self._file is None:
            self.stacks_path.parent.mkdir(parents=True, exist_ok=True)
            self._file = open(self.stacks_path, "a", encoding="utf-8")
            # SIGALRM's default action ends the process; a handler someone installed (Python's
            # would need the GIL) means it might not, so then faulthandler ends it, at once.
            self._alarm = signal.getsignal(signal.SIGALRM) == signal.SIG_DFL
        faulthandler.dump_traceback_later(self.timeout_s, exit=not self._alarm, file=self._file)
        if self._alarm:
            signal.setitimer(signal.ITIMER_REAL, self.timeout_s + grace_s(self.timeout_s))
        self._armed_at = time.monotonic()

    def pet(self) -> None:
        """Re-arm, at most every ``rearm_every_s`` (re-arming starts a C thread)."""
        if time.monotonic() - self._armed_at >= self._rearm_every:
            self.arm()

    def close(self) -> None:
        faulthandler.cancel_dump_traceback_later()
        if self._alarm:
            signal.setitimer(signal.ITIMER_REAL, 0)
        if self._file is not None:
            self._file.close()
            self._file = None
            if self.stacks_path.exists() and self.stacks_path.stat().st_size == 0:
                self.stacks_path.unlink()


def grace_s(timeout_s: float) -> float:
    """From a rank's stack dump to its end: enough for every peer armed at the same check (a
    collective apart) to dump too."""
    return min(10.0, max(2.0, 0.25 * timeout_s))


@dataclass(frozen=True)
class Decision:
    stop: str | None = None  # the signal that asked for it
    save: bool = False  # a time-based checkpoint is due
    commit: bool = False  # every rank finished writing its part of an async save


_NOTHING = Decision()


class Control:
    def __init__(
        self,
        distributed: bool,
        stop: StopRequest,
        watchdog: Watchdog | None,
        save_every_s: float | None,
        interval_s: float = 0.25,
    ):
        self.distributed = distributed
        self.stop = stop
        self.watchdog = watchdog
        self.save_every_s = save_every_s
        self.interval_s = interval_s
        self._next_check = 1
        self._checked_at = time.monotonic()
        self._checked_step = 0
        self.last_save_at = time.monotonic()

    def saved(self) -> None:
        self.last_save_at = time.monotonic()

    def check(self, step: int, async_ready: bool, async_pending: bool) -> Decision:
        """Call after every step; cheap when no check is due."""
        if not self.distributed:
            if self.watchdog is not None:
                self.watchdog.pet()
            return self._decide(self.stop.signal_name, self._save_due(), async_pending and async_ready)
        if step < self._next_check:
            return _NOTHING
        now = time.monotonic()
        per_step = (now - self._checked_at) / max(1, step - self._checked_step)
        proposal = max(1, min(1000, int(self.interval_s / per_step) if per_step > 0 else 1))
        local = torch.tensor(
            [
                1.0 if self.stop.signal_name else 0.0,
                1.0 if self._save_due() else 0.0,
                0.0 if async_ready else 1.0,
                float(proposal),
                float(_SIGNAL_CODES.get(self.stop.signal_name, 0)),
            ]
        )
        collectives.all_reduce(local, "max")  # on gloo: no GPU sync for a control message
        stop, save, not_ready, interval, code = local.tolist()
        self._next_check = step + int(interval)
        self._checked_at, self._checked_step = time.monotonic(), step
        if self.watchdog is not None:
            self.watchdog.arm()
        signal_name = _SIGNAL_NAMES.get(int(code), "SIGTERM") if stop else None
        return self._decide(signal_name, bool(save), async_pending and not not_ready)

    def _save_due(self) -> bool:
        return self.save_every_s is not None and time.monotonic() - self.last_save_at >= self.save_every_s

    @staticmethod
    def _decide(stop: str | None, save: bool, commit: bool) -> Decision:
        if not (stop or save or commit):
            return _NOTHING
        return Decision(stop=stop, save=save, commit=commit)


_SIGNAL_CODES = {"SIGTERM": 1, "SIGUSR1": 2}
_SIGNAL_NAMES = {code: name for name, code in _SIGNAL_CODES.items()}
