"""The stop request: SIGTERM or SIGUSR1 asks this worker for a clean stop with a checkpoint.

The handler only notes the signal; the training loop's control check (engine/control.py) turns
every rank's note into one agreed stop step.
"""

from __future__ import annotations

import signal
import threading

__all__ = ["StopRequest", "STOP_SIGNALS"]

STOP_SIGNALS = (signal.SIGTERM, signal.SIGUSR1)


class StopRequest:
    """SIGTERM or SIGUSR1 to this process asks for a clean stop with a checkpoint."""

    def __init__(self) -> None:
        self.signal_name: str | None = None

    def install(self):
        """Install the handlers (main thread only); returns a function that restores the old ones."""
        if threading.current_thread() is not threading.main_thread():
            return lambda: None
        previous = {sig: signal.signal(sig, self._handle) for sig in STOP_SIGNALS}

        def restore() -> None:
            for sig, handler in previous.items():
                signal.signal(sig, handler)

        return restore

    def _handle(self, signum: int, frame: object) -> None:
        if self.signal_name is None:
            self.signal_name = signal.Signals(signum).name
