"""The hang watchdog: faulthandler's C thread dumps every stack when a rank stops making progress.

If this rank stops re-arming it for ``hang_timeout_s``, it writes every thread's Python stack to a
file, even when the interpreter is stuck in a collective or holds the GIL in C code. The process
ends a grace period later, by the kernel's SIGALRM (no GIL needed either): a hang in one rank
leaves its peers waiting in a collective, all armed at the same check; were the first to time out
to exit at once, the launcher would stop the others before they dump, and half the time the hung
rank's stacks, the ones that matter, would be lost.

A rank that was only slow (a set-up phase on a loaded machine) re-arms after its dump but before
the grace period ends: it goes on, and the dump is marked as resumed (``RESUMED_MARK``) and said
in its log, so that a later failure is never blamed on a hang that did not happen.
"""

from __future__ import annotations

import faulthandler
import logging
import os
import signal
import time
from pathlib import Path
from typing import IO

__all__ = ["Watchdog", "grace_s", "collective_timeout_s", "HANG_DUMP_START", "RESUMED_MARK", "PEER_HANG_MARK"]

log = logging.getLogger(__name__)

# How a hang's dump starts: faulthandler's header for a timed-out dump ("Timeout (0:00:04)!"); a
# script's worker writes the same before its script's (recovery/root_cause.py reads both).
HANG_DUMP_START = "Timeout ("
# Appended after a dump when the rank went on (see holds_hang in recovery/root_cause.py).
RESUMED_MARK = "Resumed: this rank made progress again after the dump above (slow, not hung)."
# Written before a dump a rank took because a peer hung (a script's, asked by the hung rank's
# worker): where it waited, for the root cause; never a hang of its own.
PEER_HANG_MARK = "Peer hung: a peer made no progress; this rank's stacks while it waited:"


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
        self._size = 0  # of the stacks file when last armed: a dump since makes it grow

    def arm(self) -> None:
        if self._file is None:
            self.stacks_path.parent.mkdir(parents=True, exist_ok=True)
            self._file = open(self.stacks_path, "a", encoding="utf-8")
            # SIGALRM's default action ends the process; a handler someone installed (Python's
            # would need the GIL) means it might not, so then faulthandler ends it, at once.
            self._alarm = signal.getsignal(signal.SIGALRM) == signal.SIG_DFL
        elif time.monotonic() - self._armed_at > self.timeout_s:
            self._went_on()
        faulthandler.dump_traceback_later(self.timeout_s, exit=not self._alarm, file=self._file)
        if self._alarm:
            signal.setitimer(signal.ITIMER_REAL, self.timeout_s + grace_s(self.timeout_s))
        self._armed_at = time.monotonic()
        self._size = os.fstat(self._file.fileno()).st_size

    def _went_on(self) -> None:
        """Re-armed after the deadline: if the dump was written, this rank was slow, not hung."""
        assert self._file is not None  # noqa: S101
        if os.fstat(self._file.fileno()).st_size <= self._size:
            return  # faulthandler's thread had not fired yet
        late = time.monotonic() - self._armed_at
        self._file.write(f"{RESUMED_MARK} ({late:.1f} s without progress)\n\n")
        self._file.flush()
        log.warning("no progress for %.1f s (over hang_timeout_s, %g s), then this rank went on; the stacks "
                    "dumped meanwhile show where it was slow: %s", late, self.timeout_s, self.stacks_path)

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


def collective_timeout_s(hang_timeout_s: float) -> float:
    """The process group's timeout: a backstop the watchdog always beats. A collective that timed
    out at ``hang_timeout_s`` would fail the waiting peers as the hung rank dumps its stacks, and
    the attempt would end before those stacks were kept (or, on another Ray node, relayed): the
    hang would read as a communication error. So: the dump, the grace for peers to dump, a minute."""
    return hang_timeout_s + grace_s(hang_timeout_s) + 60.0
