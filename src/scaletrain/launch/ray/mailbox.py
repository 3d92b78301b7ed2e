"""The mailbox: a small actor that carries what Ray Train does not between the driver and the
workers: each rank's attempt number, rank 0's result, a stop the launcher asks for, rank 0's
console events, and the run's files from workers on other machines (relay.py)."""

from __future__ import annotations

from typing import Any

__all__ = ["mailbox_actor"]

_MAILBOX = None


def mailbox_actor(ray: Any):
    """The actor class, made with ``ray.remote`` once (Ray is imported lazily)."""
    global _MAILBOX
    if _MAILBOX is None:

        class Mailbox:
            def __init__(self) -> None:
                self.starts: dict[int, int] = {}
                self.stop: str | None = None
                self._result: dict[str, Any] | None = None
                self.events: list[tuple[str, Any]] = []  # rank 0 -> the launcher's console
                self.files: list[tuple[str, int, bytes, bool, bool]] = []  # -> the run directory
                self.file_bytes = 0
                self.asked: list[str] = []  # files rank 0 continues, asked of the driver
                self.provided: dict[str, bytes] | None = None
                self.mlflow_run_id: str | None = None

            def register(self, rank: int) -> int:
                """This rank's attempt number (all ranks restart together)."""
                attempt = self.starts.get(rank, 0)
                self.starts[rank] = attempt + 1
                return attempt

            def attempts(self) -> int:
                """How many times the worker group has started (a restart: one more)."""
                return max(self.starts.values(), default=0)

            def put_result(self, result: dict[str, Any]) -> None:
                self._result = result

            def result(self) -> dict[str, Any] | None:
                return self._result

            def push(self, kind: str, data: Any) -> None:
                self.events.append((kind, data))

            def drain(self) -> list[tuple[str, Any]]:
                events, self.events = self.events, []
                return events

            def write(self, path: str, offset: int, data: bytes, whole: bool, last: bool) -> None:
                """A piece of a file for the driver's run directory (relay.py)."""
                self.files.append((path, offset, data, whole, last))
                self.file_bytes += len(data)

            def drain_files(self) -> list[tuple[str, int, bytes, bool, bool]]:
                files, self.files, self.file_bytes = self.files, [], 0
                return files

            def backlog(self) -> int:
                return self.file_bytes

            def ask_files(self, paths: list[str]) -> None:
                """Rank 0 on another machine asks for the driver's copies (relay.py)."""
                self.asked, self.provided = list(paths), None

            def asked_files(self) -> list[str]:
                asked, self.asked = self.asked, []
                return asked

            def provide_files(self, files: dict[str, bytes]) -> None:
                self.provided = files

            def provided_files(self) -> dict[str, bytes] | None:
                return self.provided

            def set_mlflow_run(self, run_id: str) -> None:
                self.mlflow_run_id = run_id

            def mlflow_run(self) -> str | None:
                return self.mlflow_run_id

            def request_stop(self, signal_name: str) -> None:
                self.stop = signal_name

            def stop_requested(self) -> str | None:
                return self.stop

        _MAILBOX = ray.remote(Mailbox)
    return _MAILBOX
