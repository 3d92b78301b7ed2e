"""The root cause of a failed attempt, for the one line the user sees.

When one rank dies the others fail in a collective; a hung rank's peers wait for it. Each worker
writes its own error file (recovery/attempts.py) and the watchdog its stacks: from those, this
module names the rank and the error that started it, never an echo and never a file an earlier
attempt left behind.
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterable
from typing import Any

from scaletrain.errors import WorkerFailedError
from scaletrain.observe.telemetry import read_step_mark
from scaletrain.recovery.watchdog import HANG_DUMP_START, PEER_HANG_MARK, RESUMED_MARK
from scaletrain.rundir import RunSpec

__all__ = ["worker_error", "failure_files", "FileState", "holds_hang"]

# A file's identity: a rewrite (atomic rename: a new inode) or an append changes it.
FileState = tuple[int, int, int]


# When one rank dies the others fail inside a collective; those errors are echoes, not causes.
# TensorFlow's collectives (a TensorFlow job) raise UnavailableError when a peer is gone.
_ECHO_TYPES = {"DistBackendError", "DistNetworkError", "DistStoreError", "UnavailableError"}
_BAD_INPUT_TYPES = {"TaskError", "ConfigError", "PlacementError", "PreflightError"}
_ECHO_TEXT = ("Connection closed by peer", "Connection reset by peer", "gloo/transport",
              "ncclRemoteError", "remote process exited")
# NCCL failures that are causes, not echoes: bad usage (two ranks on one GPU), CUDA errors,
# version mismatches. They arrive as DistBackendError too.
_CAUSE_TEXT = ("ncclInvalidUsage", "ncclUnhandledCudaError", "ncclSystemError", "ncclInternalError",
               "ncclInvalidArgument", "Duplicate GPU", "CUDA error", "out of memory")


def failure_files(spec: RunSpec) -> dict[str, FileState]:
    """The error and stack files in this node's logs now. Taken when workers start (a launch, a
    restart): those still unchanged at the end are an earlier attempt's, never this one's cause."""
    found = {}
    for pattern in ("worker-*.error.json", "worker-*.stacks.txt"):
        for path in spec.logs_dir.glob(pattern):
            if (state := _state(path)) is not None:
                found[str(path)] = state
    return found


def _state(path: Any) -> FileState | None:
    try:
        stat = path.stat()
    except OSError:
        return None
    return stat.st_ino, stat.st_mtime_ns, stat.st_size


def _earlier(path: Any, earlier: dict[str, FileState]) -> bool:
    return str(path) in earlier and earlier[str(path)] == _state(path)


def _read_error(spec: RunSpec, rank: int, earlier: dict[str, FileState]) -> dict[str, Any] | None:
    if _earlier(spec.worker_error(rank), earlier):
        return None
    try:
        data = json.loads(spec.worker_error(rank).read_text(encoding="utf-8"))
        return data if isinstance(data, dict) and "type" in data else None
    except (OSError, ValueError):
        return None


def _is_echo(error: dict[str, Any]) -> bool:
    message = str(error.get("message", ""))
    if any(text in message for text in _CAUSE_TEXT):
        return False
    return error["type"] in _ECHO_TYPES or any(text in message for text in _ECHO_TEXT)


def worker_error(spec: RunSpec, ranks: Iterable[int], fallback: dict[int, str],
                 earlier: dict[str, FileState] | None = None) -> WorkerFailedError:
    """The user-facing error for a failed attempt: the root cause among the failed ranks.

    Each worker writes its own error file; the earliest error that is not a peer's
    connection dropping wins. A rank that died without writing one (SIGKILL, OOM) is
    described by ``fallback``. ``earlier``: the error and stack files there were when this
    attempt's workers started (failure_files); those unchanged since are not its story.
    """
    earlier = earlier or {}
    ranks = sorted(set(ranks) | set(fallback))
    errors = {rank: e for rank in ranks if (e := _read_error(spec, rank, earlier)) is not None}
    hung = _hung_ranks(spec, ranks, earlier)
    if hung and not errors:  # the watchdog ended them: that is the story, not their exit code
        fallback = _hang_story(spec, hung, _asked_ranks(spec, ranks, earlier))
    bad_input = False
    if errors:
        rank = min(errors, key=lambda r: (_is_echo(errors[r]), errors[r].get("timestamp", 0)))
        error = errors[rank]
        bad_input = error["type"] in _BAD_INPUT_TYPES
        what = f"{error['type']}: {error['message']}" if error.get("message") else error["type"]
        # A rank killed outright is the cause when all the others merely lost their peer.
        silent = [r for r in fallback if r not in errors]
        if _is_echo(error) and silent:
            rank, what = silent[0], fallback[silent[0]]
    else:
        # Several ranks killed outright (the agent SIGKILLs the ones left waiting on a dead
        # peer): the first to fall silent is the cause.
        rank = min(fallback, key=lambda r: (_last_heard(spec, r), r)) if fallback else (ranks[0] if ranks else 0)
        what = fallback.get(rank, "unknown failure")
    log_path = str(spec.worker_log(rank))
    steps = [e["steps"] for e in errors.values() if isinstance(e.get("steps"), int)]
    return WorkerFailedError(
        f"worker rank {rank} failed: {what} (details: {log_path})",
        rank=rank,
        log_path=log_path,
        bad_input=bad_input,
        steps=max(steps) if steps else None,
    )


def _hang_story(spec: RunSpec, hung: list[int], asked: list[int]) -> dict[int, str]:
    """What each blamed rank's line says: no progress for how long, after which step and where
    (the innermost frame of its training thread), and what its peers waited in (a peer's stacks
    are from its own watchdog, or, ``asked``, dumped when a hung peer asked for them)."""
    timeout = spec.job.get("recovery", {}).get("hang_timeout_s")
    frames = {r: _training_frames(spec.worker_stacks(r)) for r in [*hung, *asked]}
    waiting = sorted(r for r in frames if _waiting(frames[r]))
    # An asked rank that was not waiting in a collective is the hang its peers waited for (a
    # script's peers can time out first: a script's silence is measured, not marked).
    stuck = sorted(r for r in frames if r not in waiting)
    waits = sorted({_wait_name(frames[r]) for r in waiting})
    what = waits[0] if len(waits) == 1 else "a collective"
    ranks = ("rank " if len(waiting) == 1 else "ranks ") + ", ".join(map(str, waiting))
    if stuck:
        peers = f"; {ranks} waited for it in {what}" if waiting else ""
    else:  # every rank waiting: the collective itself hung, no rank is blamed on another
        peers = f"; {ranks} all waited in {what}"
    story = {}
    for r in stuck or hung:
        step = read_step_mark(spec.worker_step(r))
        after = "" if step is None else " before its first step" if step == 0 else f" after step {step}"
        where = f", in {_frame_name(frames[r][0])}" if frames[r] and r in stuck else ""
        story[r] = (f"made no progress for {timeout:g} s{after}{where} (hang watchdog{peers}); every thread's "
                    f"stack is in {spec.worker_stacks(r)}")
    return story


def _last_heard(spec: RunSpec, rank: int) -> float:
    try:
        return spec.worker_log(rank).stat().st_mtime
    except OSError:
        return float("inf")


def _written_since(path: Any, earlier: dict[str, FileState]) -> str:
    """What a stacks file gained since ``earlier`` (the whole file if it was replaced)."""
    state = _state(path)
    if state is None or state[2] == 0 or _earlier(path, earlier):
        return ""
    before = earlier.get(str(path))
    start = before[2] if before is not None and before[0] == state[0] and before[2] <= state[2] else 0
    try:
        with open(path, "rb") as file:
            file.seek(start)
            return file.read().decode("utf-8", errors="replace")
    except OSError:
        return ""


def holds_hang(path: Any, earlier: dict[str, FileState]) -> bool:
    """Whether a stacks file holds a hang of this attempt: a dump written since ``earlier`` that
    its rank did not go on from (a slow rank's dump is marked resumed by the watchdog), and not
    one it took because a hung peer asked (marked by PEER_HANG_MARK)."""
    written = _written_since(path, earlier)
    return bool(written) and PEER_HANG_MARK not in written and RESUMED_MARK not in _last_dump(written)


def _hung_ranks(spec: RunSpec, ranks: Iterable[int], earlier: dict[str, FileState]) -> list[int]:
    return [rank for rank in ranks if holds_hang(spec.worker_stacks(rank), earlier)]


def _asked_ranks(spec: RunSpec, ranks: Iterable[int], earlier: dict[str, FileState]) -> list[int]:
    """The ranks that dumped their stacks because a hung peer asked (this attempt)."""
    return [rank for rank in ranks if PEER_HANG_MARK in _written_since(spec.worker_stacks(rank), earlier)]


def _last_dump(text: str) -> str:
    """The last dump in a stacks file's text: from the last hang header or peer mark on."""
    at = max(text.rfind(HANG_DUMP_START), text.rfind(PEER_HANG_MARK))
    return text if at < 0 else text[at:]


# A thread that trains: the loop, or a runner (the rest are helpers: tracking, checkpoint writers).
_TRAINING_IN = ("/scaletrain/engine/", "/scaletrain/runners/")
# Where the training thread of a rank that only waits for a peer is: in a collective (ours, or
# DDP's and FSDP's inside autograd; a TensorFlow job's are inside its compiled step, which a
# rank enters only when the others have agreed to go on).
_WAITING_IN = ("/torch/distributed/", "/torch/autograd/", "/scaletrain/distributed/", "/tensorflow/python/eager/")


def _training_frames(path: Any) -> list[str]:
    """The training thread's frames in the last dump of a stacks file, innermost first (a
    script's: the thread the dump was taken on)."""
    try:
        dump = _last_dump(path.read_text(encoding="utf-8", errors="replace"))
    except OSError:
        return []
    blocks = dump.split("\n\n")
    threads = [[line.strip() for line in thread.splitlines() if line.strip().startswith("File ")]
               for thread in blocks]
    for frames in threads:
        if any(room in frame for frame in frames for room in _TRAINING_IN):
            return frames
    # A script's (scaletrain launch): its main thread, the one the dump was taken on, first.
    return next((frames for block, frames in zip(blocks, threads) if "Current thread" in block and frames),
                next((frames for frames in threads if frames), []))


def _waiting(frames: list[str]) -> bool:
    """Whether the training thread waits in a collective (then this rank waited for a peer;
    the peer is the hang)."""
    return bool(frames) and any(part in frames[0] for part in _WAITING_IN)


def _frame_name(frame: str) -> str:
    """``File "/a/b/faults.py", line 82 in _fire`` -> ``faults.py:82 _fire``."""
    match = re.match(r'File "(?P<file>[^"]*)", line (?P<line>\d+) in (?P<name>.+)', frame)
    if match is None:
        return frame
    return f"{match['file'].rsplit('/', 1)[-1]}:{match['line']} {match['name']}"


def _wait_name(frames: list[str]) -> str:
    """What a waiting rank waits in: the collective's name (all_reduce, broadcast...), or a
    TensorFlow job's compiled step, whose collectives run inside it."""
    if "/tensorflow/" in frames[0]:
        return "TensorFlow's compiled step"
    if "/torch/autograd/" in frames[0]:  # DDP's and FSDP's collectives run inside backward
        return "the gradients' all-reduce (backward)"
    return _frame_name(frames[0]).rsplit(" ", 1)[-1]
