"""Fault injection, a testing facility: make a chosen rank fail at a chosen step.

Set ``SCALETRAIN_FAULT`` to one or more faults separated by ``;``::

    SCALETRAIN_FAULT="sigkill:rank=1:step=30"                 # first attempt only (attempt=0)
    SCALETRAIN_FAULT="sigkill:rank=1:step=30;sigkill:rank=0:step=60:attempt=1"

Kinds: ``raise`` (RuntimeError), ``sigkill``, ``sigterm``, ``sigusr1`` (to the rank itself),
``hang`` (sleeps forever), ``checkpoint_crash`` (SIGKILL after the checkpoint files of step >= S are
written and before the manifest), ``checkpoint_stall`` (sleeps forever there instead: a save that
outlasts the grace period). A fault fires after optimizer step S, in the attempt numbered
``attempt`` (torch elastic's restart count; default 0), once.
"""

from __future__ import annotations

import logging
import os
import signal
import time
from dataclasses import dataclass

from scaletrain.errors import ConfigError
from scaletrain.rundir import DENY_WRITES_ENV, FAULT_ENV

log = logging.getLogger(__name__)

# DENY_WRITES_ENV: a worker may not write under this folder (the driver's run directory, which
# a worker on another machine cannot reach): any attempt raises PermissionError.

__all__ = ["Fault", "FaultPlan", "FAULT_ENV", "parse_faults", "DENY_WRITES_ENV", "deny_writes"]

KINDS = ("raise", "sigkill", "sigterm", "sigusr1", "hang", "checkpoint_crash", "checkpoint_stall")
_DURING_CHECKPOINT = ("checkpoint_crash", "checkpoint_stall")


@dataclass
class Fault:
    kind: str
    rank: int
    step: int
    attempt: int = 0
    fired: bool = False


def parse_faults(text: str) -> list[Fault]:
    faults = []
    for item in filter(None, (part.strip() for part in text.split(";"))):
        kind, *fields = item.split(":")
        if kind not in KINDS:
            raise ConfigError(f"{FAULT_ENV}: unknown fault kind {kind!r}; use one of {', '.join(KINDS)}")
        try:
            values = {k: int(v) for k, v in (f.split("=", 1) for f in fields)}
            faults.append(Fault(kind, values.pop("rank"), values.pop("step"), values.pop("attempt", 0)))
        except (ValueError, KeyError):
            raise ConfigError(
                f"{FAULT_ENV}: cannot read {item!r}; expected KIND:rank=R:step=S[:attempt=A]"
            ) from None
        if values:
            raise ConfigError(f"{FAULT_ENV}: unknown field(s) {', '.join(values)} in {item!r}")
    return faults


class FaultPlan:
    """The faults for this rank and attempt; cheap to call every step when there are none."""

    def __init__(self, rank: int, attempt: int, environ: dict[str, str] | None = None):
        text = (os.environ if environ is None else environ).get(FAULT_ENV, "")
        self.faults = [f for f in parse_faults(text) if f.rank == rank and f.attempt == attempt]
        self.active = bool(self.faults)

    def after_step(self, step: int) -> None:
        for fault in self.faults:
            if not fault.fired and fault.kind not in _DURING_CHECKPOINT and step == fault.step:
                fault.fired = True
                # Said first: when it struck (a bench's recovery time starts here), whatever it does.
                log.warning("injected fault: %s after step %d (%s)", fault.kind, step, FAULT_ENV,
                            extra={"fault": fault.kind})
                _fire(fault)

    def during_checkpoint(self, step: int) -> None:
        for fault in self.faults:
            if not fault.fired and fault.kind in _DURING_CHECKPOINT and step >= fault.step:
                fault.fired = True
                if fault.kind == "checkpoint_stall":
                    while True:
                        time.sleep(3600)
                os.kill(os.getpid(), signal.SIGKILL)


def _fire(fault: Fault) -> None:
    if fault.kind == "raise":
        raise RuntimeError(f"injected fault at step {fault.step} on rank {fault.rank}")
    if fault.kind == "hang":
        while True:
            time.sleep(3600)
    sig = {"sigkill": signal.SIGKILL, "sigterm": signal.SIGTERM, "sigusr1": signal.SIGUSR1}[fault.kind]
    os.kill(os.getpid(), sig)


_WRITE_FLAGS = os.O_WRONLY | os.O_RDWR | os.O_CREAT | os.O_APPEND | os.O_TRUNC
_WRITE_EVENTS = {"os.mkdir", "os.rename", "os.replace", "os.remove", "os.rmdir", "os.truncate",
                 "os.symlink", "os.link", "shutil.rmtree", "shutil.move", "os.chmod"}


def deny_writes(root: str | None = None) -> bool:
    """Install the write guard of DENY_WRITES_ENV (or ``root``) in this process: an audit hook
    (it cannot be removed) that refuses Python-level writes under the folder. True if set."""
    import sys

    root = root or os.environ.get(DENY_WRITES_ENV)
    if not root:
        return False
    guarded = os.path.realpath(root)

    def hook(event: str, args: tuple) -> None:
        if event == "open":
            path, mode, flags = args
            writing = (isinstance(mode, str) and any(c in mode for c in "wax+")) or (
                isinstance(flags, int) and flags & _WRITE_FLAGS)
        elif event in _WRITE_EVENTS:
            path, writing = args[0], True
        else:
            return
        if writing and isinstance(path, (str, bytes, os.PathLike)):
            target = os.path.realpath(os.fsdecode(path))
            if target == guarded or target.startswith(guarded + os.sep):
                raise PermissionError(f"{DENY_WRITES_ENV}: this worker may not write {target}")

    sys.addaudithook(hook)
    return True
