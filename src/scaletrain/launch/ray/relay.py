"""The run directory across machines on Ray: nothing assumes workers write to the driver's disk.

A Ray worker on another machine than the driver's writes the run's files into a directory of
its own machine (``RunSpec.local_dir``); this relay sends them through the run's mailbox actor
to the driver, which writes them into its run directory:
- rank 0's metrics file, metric journal (what the driver's tracking process sends to MLflow) and
  log, as they grow (every half second, and before every checkpoint commits);
- at the end, rank 0's final files: the weights, the MLflow model, the run card; every rank's log;
- a failed rank's error and log; a hung rank's stacks as soon as they are dumped;
- every rank's live figures (``logs/telemetry/rank-N.json``, for the driver's metrics endpoint and
  alerts) whole, at most once a second when they changed, and at the end.
Checkpoints never travel this way: they go to checkpoint storage every node reaches.
"""

from __future__ import annotations

import os
import re
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

from scaletrain.rundir import (
    LOGS_DIR,
    METRICS_FILE,
    NODE_DIR_ENV,
    RAY_NODE_LOCAL_ENV,
    RUN_CARD_FILE,
    TELEMETRY_DIR,
    TRACKING_DIR,
    WEIGHTS_FILE,
    worker_error_name,
    worker_log_name,
    worker_stacks_name,
)

__all__ = ["RunDirRelay", "write_relayed", "read_asked", "local_dir_for", "NODE_DIR_ENV", "FORCE_LOCAL_ENV"]

FORCE_LOCAL_ENV = RAY_NODE_LOCAL_ENV  # testing: every Ray worker writes locally and relays
CHUNK = 8 << 20  # bytes per mailbox call
BACKLOG = 256 << 20  # the sender waits while the driver has this much left to write
_RELAYED = re.compile(
    r"^(metrics\.jsonl|run_card\.json|model\.safetensors|tracking/metrics\.journal\.jsonl"
    r"|logs/worker-\d+\.(jsonl|error\.json|stacks\.txt)|logs/telemetry/rank-\d+\.json"
    r"|mlflow_model/[\w.-]+(/[\w.-]+)*)$"
)
_FIGURES = re.compile(r"^logs/telemetry/rank-\d+\.json$")  # figures, not records: no fsync
FIGURES_EVERY_S = 1.0


def local_dir_for(run_id: str, node_id: str) -> str:
    """This machine's stand-in for the run directory (one per Ray node: two nodes can share a
    machine, and its temp dir)."""
    root = os.environ.get(NODE_DIR_ENV) or os.path.join(tempfile.gettempdir(), "scaletrain")
    return os.path.join(root, run_id, node_id[:16])


class RunDirRelay:
    """Worker side: sends files of ``local_dir`` to the driver through ``mailbox``."""

    def __init__(self, mailbox: Any, local_dir: str | Path, rank: int):
        self.mailbox, self.local_dir, self.rank = mailbox, Path(local_dir), rank
        # Rank 0 writes the run's metrics; another rank only its log (a metrics file on its
        # machine is an earlier attempt's, from when rank 0 ran there: never sent).
        own = [f"{LOGS_DIR}/{worker_log_name(rank)}"]
        self.tailed = [METRICS_FILE, f"{TRACKING_DIR}/metrics.journal.jsonl", *own] if rank == 0 else own
        self._sent: dict[str, int] = {}
        self._lock = threading.Lock()
        self._done = threading.Event()
        self._thread: threading.Thread | None = None

    def start(self) -> RunDirRelay:
        """Rank 0: relay its growing files every half second until finish(), after taking the
        driver's copies of them (an earlier attempt's rows, written on whichever machine rank 0
        was then): its reporters then skip redone steps, and what it sends continues them."""
        self._seed()
        self._thread = threading.Thread(target=self._tail_loop, name="scaletrain-relay", daemon=True)
        self._thread.start()
        return self

    def watch_stacks(self) -> RunDirRelay:
        """Every rank: a hang's stack dump, sent whole as soon as the watchdog writes it. The
        watchdog ends the process a grace period later, never running ``failed()``; while the
        rank waits (in a collective, asleep) this thread has the GIL."""
        threading.Thread(target=self._stacks_loop, name="scaletrain-relay-stacks", daemon=True).start()
        return self

    def _stacks_loop(self) -> None:
        relpath = f"{LOGS_DIR}/{worker_stacks_name(self.rank)}"
        path = self.local_dir / relpath
        figures_sent_at, figures_changed = 0.0, None

        def size() -> int:
            try:
                return path.stat().st_size
            except OSError:
                return 0

        sent = last = size()  # an earlier attempt's dumps on this machine: already told
        while not self._done.wait(0.25):
            now = size()
            if now > sent and now == last:  # a new dump, whole (faulthandler writes it at once)
                try:
                    with self._lock:
                        self._send_from(relpath, 0, whole=True)
                    sent = now
                except Exception:  # noqa: S110  the driver may be gone; its error says so
                    pass
            last = now
            if time.monotonic() - figures_sent_at >= FIGURES_EVERY_S:
                figures_sent_at = time.monotonic()
                figures_changed = self._send_figures(figures_changed)

    def _figures_path(self) -> str:
        return f"{LOGS_DIR}/{TELEMETRY_DIR}/rank-{self.rank}.json"

    def _send_figures(self, sent: int | None) -> int | None:
        """This rank's telemetry file, whole, when it changed since ``sent`` (its mtime)."""
        try:
            changed = (self.local_dir / self._figures_path()).stat().st_mtime_ns
        except OSError:
            return sent
        if changed != sent:
            try:
                with self._lock:
                    self._send_from(self._figures_path(), 0, whole=True)
            except Exception:  # noqa: S110  the driver may be gone; figures are best effort
                return sent
        return changed

    def _call(self, method: str, *args: Any) -> Any:
        """One mailbox call, waited for (the order of a rank's calls is the order it made them)."""
        import ray

        return ray.get(getattr(self.mailbox, method).remote(*args))

    def _seed(self, timeout_s: float = 60.0) -> None:
        self._call("ask_files", self.tailed)
        deadline = time.monotonic() + timeout_s
        while (files := self._call("provided_files")) is None:
            if time.monotonic() > deadline:
                raise RuntimeError(f"the driver sent no copy of {self.tailed} within {timeout_s:g} s")
            time.sleep(0.1)
        for relpath, data in files.items():
            path = self.local_dir / relpath
            path.parent.mkdir(parents=True, exist_ok=True)
            try:
                local = path.read_bytes()
            except FileNotFoundError:
                local = b""
            if not (local.startswith(data) and len(local) > len(data)):  # else: this machine's is newer
                path.write_bytes(data)
            self._sent[relpath] = len(data)

    def flush(self) -> None:
        """Rank 0, before a checkpoint commits: what it wrote up to that step reaches the driver
        (a restart from the checkpoint redoes only the steps after it)."""
        self._send_tails()

    def _tail_loop(self) -> None:
        while not self._done.wait(0.5):
            try:
                self._send_tails()
            except Exception:  # noqa: S110  the driver may be gone; the end says so
                pass

    def _send_tails(self) -> None:
        with self._lock:
            for relpath in self.tailed:
                self._send_from(relpath, self._sent.get(relpath, 0), whole=False)

    def _send_from(self, relpath: str, offset: int, whole: bool) -> None:
        """Bytes of ``relpath`` from ``offset``: a growing file's new part, or a whole file (its
        last chunk says so, and the driver then puts it in place)."""
        path = self.local_dir / relpath
        try:
            size = path.stat().st_size
        except FileNotFoundError:
            return
        with open(path, "rb") as handle:
            handle.seek(offset)
            while True:
                data = handle.read(min(CHUNK, size - offset))
                last = offset + len(data) >= size
                if data or (whole and last):
                    self._wait_for_room()
                    self._call("write", relpath, offset, data, whole, whole and last)
                offset += len(data)
                if last:
                    break
        self._sent[relpath] = offset

    def _wait_for_room(self) -> None:
        while self._call("backlog") > BACKLOG:
            time.sleep(0.2)

    def finish(self) -> None:
        """At the end: the growing files to their end (another rank: its log), then rank 0's
        final files, whole."""
        files = (WEIGHTS_FILE, RUN_CARD_FILE, "mlflow_model") if self.rank == 0 else ()
        self._done.set()
        if self._thread is not None:
            self._thread.join()
        with self._lock:
            for relpath in self.tailed:
                self._send_from(relpath, self._sent.get(relpath, 0), whole=False)
            self._send_from(self._figures_path(), 0, whole=True)
            for relpath in files:
                path = self.local_dir / relpath
                targets = sorted(p for p in path.rglob("*") if p.is_file()) if path.is_dir() else [path]
                for target in targets:
                    if target.exists():
                        self._send_from(target.relative_to(self.local_dir).as_posix(), 0, whole=True)

    def failed(self) -> None:
        """Any rank that failed: its error, log and hang stacks, whole (best effort)."""
        self._done.set()
        names = [f"{LOGS_DIR}/{worker_error_name(self.rank)}", f"{LOGS_DIR}/{worker_stacks_name(self.rank)}",
                 self._figures_path()]
        try:
            with self._lock:
                for relpath in names:
                    self._send_from(relpath, 0, whole=True)
                log = f"{LOGS_DIR}/{worker_log_name(self.rank)}"
                self._send_from(log, self._sent.get(log, 0), whole=False)
        except Exception:  # noqa: S110  best effort while failing: the worker's own error goes on
            pass


def read_asked(run_dir: str | Path, paths: list[str]) -> dict[str, bytes]:
    """Driver side: its copies of the files rank 0 continues (empty when there are none yet)."""
    found = {}
    for relpath in paths:
        if _RELAYED.match(relpath) and ".." not in relpath.split("/"):
            try:
                found[relpath] = (Path(run_dir) / relpath).read_bytes()
            except FileNotFoundError:
                found[relpath] = b""
    return found


def write_relayed(run_dir: str | Path, items: list[tuple[str, int, bytes, bool, bool]]) -> list[str]:
    """Driver side: write what workers relayed into the run directory; returns the paths
    refused (not a file the relay carries: nothing from the cluster picks where we write).
    Growing files are written in place; a whole file goes to ``<name>.relay`` and is renamed
    into place with its last chunk."""
    refused = []
    root = Path(run_dir)
    for relpath, offset, data, whole, last in items:
        if not _RELAYED.match(relpath) or ".." in relpath.split("/"):
            refused.append(relpath)
            continue
        target = root / relpath
        written = target.with_name(target.name + ".relay") if whole else target
        written.parent.mkdir(parents=True, exist_ok=True)
        with open(written, "r+b" if offset and written.exists() else "wb") as handle:
            handle.seek(offset)
            handle.write(data)
            if last and not _FIGURES.match(relpath):
                handle.flush()
                os.fsync(handle.fileno())
        if last:
            os.replace(written, target)
    return refused
