"""The metric shipper in a process of its own, at idle CPU priority.

MLflow's ingestion costs about a quarter of a millisecond of CPU per point (sqlite, or the
tracking client's HTTP work), so a run that logs every step sends thousands of points a second.
In a thread of the launcher that work would share the interpreter lock with a one-worker run
(which trains in the launcher's process) and the cores with every worker; here it runs under
SCHED_IDLE, only on cycles training leaves free, and catches up after the last step.

The launcher closes the shipper's stdin when the attempt ends (or dies, which closes it too);
the shipper then delivers what is left within its timeout and prints how many points remain.
"""

from __future__ import annotations

import json
import logging
import os
import subprocess
import sys
from pathlib import Path

__all__ = ["ShipperProcess", "main"]


class ShipperProcess:
    """The launcher's handle: start() the process, close() it and learn what was left."""

    def __init__(self, uri: str, run_id: str, journal_dir: Path, log_file: Path,
                 local_run_id: str, trace_id: str):
        self.args = [sys.executable, "-m", "scaletrain.tracking.ship", uri, run_id,
                     str(journal_dir), str(log_file), local_run_id, trace_id]
        self.proc: subprocess.Popen | None = None

    def start(self) -> ShipperProcess:
        self.proc = subprocess.Popen(
            self.args, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
            preexec_fn=_idle_priority,
        )
        return self

    def close(self, timeout_s: float) -> dict:
        """``{"left": points left undelivered after timeout_s (they stay in the journal; -1:
        unknown), "delivered": points sent, "cpu_s": the shipper's CPU time, "startup_cpu_s":
        of which before it could send (importing mlflow, opening the store)}``."""
        assert self.proc is not None
        unknown = {"left": -1, "delivered": None, "cpu_s": None, "startup_cpu_s": None}
        try:
            out, _ = self.proc.communicate(input=f"{timeout_s}\n", timeout=timeout_s + 30)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.communicate()
            return unknown
        try:
            report = json.loads(out.strip().splitlines()[-1])
            return {**unknown, **report, "left": int(report["left"])}
        except (ValueError, IndexError, KeyError, TypeError):
            return unknown


def _idle_priority() -> None:
    """In the child before exec: SCHED_IDLE, else nice 19 (threads inherit either)."""
    try:
        os.sched_setscheduler(0, os.SCHED_IDLE, os.sched_param(0))
    except (AttributeError, OSError):
        try:
            os.nice(19)
        except OSError:
            pass


def main(argv: list[str] | None = None) -> int:
    from scaletrain.tracking.logs import LAUNCHER_LOGGER_NAME, LogContext, setup_logging
    from scaletrain.tracking.sender import process_cpu_s
    from scaletrain.tracking.shipper import JournalShipper

    from scaletrain.tracking.redact import Redactor

    uri, run_id, journal_dir, log_file, local_run_id, trace_id = (argv or sys.argv[1:])[:6]
    try:  # the run's spec names its secret-looking config values
        job = json.loads((Path(journal_dir).parent / "spec.json").read_text(encoding="utf-8"))["job"]
        redactor = Redactor.for_config(job)
    except (OSError, ValueError, KeyError):
        redactor = Redactor()
    undo = setup_logging(LogContext(local_run_id, trace_id, rank=None), log_file,
                         redactor=redactor, logger_name=LAUNCHER_LOGGER_NAME)
    log = logging.getLogger(f"{LAUNCHER_LOGGER_NAME}.tracking")
    shipper = JournalShipper(uri, run_id, Path(journal_dir), log).start()
    line = sys.stdin.readline()  # blocks until the launcher says the attempt ended (or dies)
    try:
        timeout = float(line) if line.strip() else 30.0
    except ValueError:
        timeout = 30.0
    left = shipper.close(timeout)
    print(json.dumps({
        "left": left,
        "delivered": shipper.sender.delivered,
        "cpu_s": process_cpu_s(),
        "startup_cpu_s": shipper.sender.startup_cpu_s,  # importing mlflow, opening the store
    }), flush=True)
    undo()
    return 0


if __name__ == "__main__":
    from scaletrain.quick_exit import exit_quickly

    exit_quickly(main())
