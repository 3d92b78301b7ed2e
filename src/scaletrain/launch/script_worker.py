"""The worker of a script job (``scaletrain launch train.py``): it runs the script, unchanged,
as its child, with torchrun's environment, and keeps the guardrails a script it did not write
can have.

- The child gets the env torch elastic gave this worker (RANK, LOCAL_RANK, WORLD_SIZE,
  MASTER_ADDR/PORT, TORCHELASTIC_*), as under torchrun; when the job is tracked and the script
  uses MLflow, also MLFLOW_TRACKING_URI and MLFLOW_RUN_ID (every rank: a rank that logs adds to
  the job's run instead of creating one), and SCALETRAIN_SPEC for scaletrain.report().
- Its stdout and stderr reach the console as they are and this rank's JSON log, a record per
  line with a timestamp (secrets masked in both).
- SIGTERM, SIGUSR1 and SIGINT are passed on: a script that never asked gets the default (it
  ends, like under torchrun) and the job stops as preempted; one that calls
  scaletrain.should_stop() stops at a step its ranks agree on.
- A hang is the absence of progress for recovery.hang_timeout_s: no scaletrain.report() or
  should_stop() call when the script makes them; otherwise no output line AND no CPU time used
  (over 5% of a core, its process and their children: a step that computes without printing is
  progress, a process blocked in a collective or a deadlock is not). The child's every thread's stack is
  dumped (faulthandler, registered for SIGUSR2 before the script runs), then it is killed, and
  the attempt fails as a hang: restarted when restarts are left. Before it is killed, its peers
  on this node are asked for their stacks: those waiting (silent a second or more) dump them,
  marked as a peer's (never a hang of their own), and the failure's line says what they waited
  in ("rank 0 waited for it in the gradients' all-reduce").
- A script that fails leaves this rank's error file (the exception its last traceback on
  stderr ends with): the launcher names the root cause as for tasks.

It imports no torch: a script pays for its own imports only (and this process's ~0.2 s).
"""

from __future__ import annotations

import json
import logging
import os
import re
import signal
import subprocess
import sys
import threading
import time
from collections import deque
from pathlib import Path
from typing import IO, Any

from scaletrain.recovery.attempts import restart_count
from scaletrain.recovery.watchdog import HANG_DUMP_START, PEER_HANG_MARK, grace_s
from scaletrain.rundir import HEARTBEAT_ENV, METRICS_FILE, PEER_HANG_REQUEST, SCRIPT_SPEC_ENV, RunSpec
from scaletrain.rundir.atomic import write_text_atomic
from scaletrain.tracking.logs import LogContext, setup_logging
from scaletrain.tracking.redact import Redactor

__all__ = ["main", "STACKS_SIGNAL"]

log = logging.getLogger("scaletrain.script")

STACKS_SIGNAL = signal.SIGUSR2  # the child dumps every thread's stack on it (faulthandler)
_FORWARDED = (signal.SIGTERM, signal.SIGUSR1, signal.SIGINT)
_POLL_S = 0.2
# A peer's hang asks this node's ranks for their stacks (PEER_HANG_REQUEST): a script silent this
# long then waits (for it, most likely) and is dumped; one busy computing is not.
_PEER_DUMP_AFTER_S = 1.0
_TAIL_LINES = 60
# CPU time is progress when the script used more than this share of a core since its last
# progress (and _MIN_CPU_S at least). A process blocked in gloo still ticks now and then (its
# threads: 10 ms every 3-5 s, 0.3% of a core); a tick, counted as progress, put off a hung rank's
# timeout past its waiting peer's.
_CPU_SHARE = 0.05
_MIN_CPU_S = 0.1

# Runs in the child before the script: python's own `python train.py ARGS`, plus faulthandler
# on STACKS_SIGNAL writing to this rank's stacks file. When the script ends (also by
# sys.exit), its objects are collected while the interpreter is whole: a DDP model's cycles
# hold gloo's threads, and freed at the interpreter's teardown they abort the process
# ("terminate called without an active exception", SIGABRT) after destroy_process_group, in
# ~30% of runs of a finished script (torch 2.13; plain torchrun the same; 0 of 14 collected).
_BOOT = (
    "import faulthandler, gc, os, runpy, signal, sys\n"
    "stacks = open(sys.argv[1], 'a')\n"
    f"faulthandler.register({int(STACKS_SIGNAL)}, file=stacks, all_threads=True)\n"
    "script = sys.argv[2]\n"
    "sys.argv = sys.argv[2:]\n"
    "sys.path[0] = os.path.dirname(os.path.abspath(script))\n"
    "try:\n"
    "    runpy.run_path(script, run_name='__main__')\n"
    "    code = None\n"
    "except SystemExit as stop:\n"
    "    code = stop.code\n"
    "gc.collect()\n"
    "sys.exit(code)\n"
)


class _Output:
    """Pumps one of the child's streams: the console as it is, the JSON log a record per line."""

    def __init__(self, source: IO[bytes], sink: IO[str], name: str, redactor: Redactor):
        self.source, self.sink, self.name, self.redactor = source, sink, name, redactor
        self.last_at = time.monotonic()
        self.tail: deque[str] = deque(maxlen=_TAIL_LINES)
        self.thread = threading.Thread(target=self._pump, daemon=True, name=f"scaletrain-{name}")
        self.thread.start()

    def _pump(self) -> None:
        level = logging.INFO if self.name == "stdout" else logging.WARNING
        for raw in iter(self.source.readline, b""):
            self.last_at = time.monotonic()
            line = self.redactor.text(raw.decode("utf-8", "replace").rstrip("\n"))
            self.tail.append(line)
            try:
                self.sink.write(line + "\n")
                self.sink.flush()
            except (OSError, ValueError):
                pass
            log.log(level, "%s", line, extra={"stream": self.name, "console": False})


class _Progress:
    """Whether the script made progress since the last look (see the module's docstring)."""

    def __init__(self, pid: int, heartbeat: Path, outputs: list[_Output]):
        import psutil

        self.process = psutil.Process(pid)
        self.heartbeat, self.outputs = heartbeat, outputs
        self.cpu = self._cpu()  # at the last progress
        self.beat = self._beat()
        self.at = time.monotonic()
        self.reports = False  # the script calls scaletrain.report/should_stop: only they count

    def _cpu(self) -> float:
        total = 0.0
        try:
            for process in [self.process, *self.process.children(recursive=True)]:
                times = process.cpu_times()
                total += times.user + times.system
        except Exception:  # noqa: S110  a process that just ended: no time to count
            pass
        return total

    def _beat(self) -> float:
        try:
            return self.heartbeat.stat().st_mtime
        except OSError:
            return 0.0

    def silent_for(self) -> float:
        now = time.monotonic()
        beat = self._beat()
        if beat != self.beat:
            self.beat, self.at, self.reports = beat, now, True
        elif not self.reports:
            cpu = self._cpu()
            latest_output = max(output.last_at for output in self.outputs)
            if latest_output > self.at or cpu - self.cpu > max(_MIN_CPU_S, _CPU_SHARE * (now - self.at)):
                self.at, self.cpu = now, cpu
        return now - self.at


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    spec_file = Path(args[0]).resolve()
    spec = RunSpec.read(spec_file)
    rank = int(os.environ.get("RANK", "0"))
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    job: dict[str, Any] = spec.job
    script = job["script"]
    redactor = Redactor.for_config(job)
    undo_logging = setup_logging(LogContext.for_spec(spec, rank), spec.worker_log(rank),
                                 redactor=redactor)
    attempt = restart_count()
    heartbeat = spec.logs_dir / f"worker-{rank}.heartbeat"
    heartbeat.unlink(missing_ok=True)
    stacks = spec.worker_stacks(rank)
    env = {**os.environ, SCRIPT_SPEC_ENV: str(spec_file), HEARTBEAT_ENV: str(heartbeat)}
    env.setdefault("PYTHONUNBUFFERED", "1")  # its lines reach the log as printed, not 8 KiB later
    # torchrun's default (one thread per worker when unset); ours is this worker's share of the
    # cores (scale.threads_per_worker), the same as for a task's workers.
    env.setdefault("OMP_NUM_THREADS", str(spec.threads or 1))
    env.update(_mlflow_env(spec, job, script))
    path = _script_path(script["path"])
    log.info("script started", extra={"script": str(path), "script_args": redactor.text(json.dumps(script["args"])),
                                      "attempt": attempt, "pid": os.getpid()})
    child = subprocess.Popen(  # noqa: S603  the user's own script, with the user's interpreter
        [sys.executable, "-c", _BOOT, str(stacks), str(path), *script["args"]],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=env,
    )
    stopped: list[str] = []

    def forward(signum: int, _frame: Any) -> None:
        stopped.append(signal.Signals(signum).name)
        try:
            child.send_signal(signum)
        except ProcessLookupError:
            pass

    assert child.stdout is not None and child.stderr is not None  # noqa: S101  both piped above
    outputs = [_Output(child.stdout, sys.stdout, "stdout", redactor),
               _Output(child.stderr, sys.stderr, "stderr", redactor)]
    previous = {sig: signal.signal(sig, forward) for sig in _FORWARDED}
    timeout = float(job.get("recovery", {}).get("hang_timeout_s", 900.0))
    hung = False
    request, started, dumped_for_peer = spec.logs_dir / PEER_HANG_REQUEST, time.time(), False
    try:
        progress = _Progress(child.pid, heartbeat, outputs)
        while child.poll() is None:
            time.sleep(_POLL_S)
            silent = progress.silent_for()
            # A peer's request first: a rank silent since a peer hung waits for that peer, also
            # once it is silent for the timeout itself (never a hang of its own).
            if not dumped_for_peer and silent >= _PEER_DUMP_AFTER_S and _requested(request, started):
                dumped_for_peer = True
                with open(stacks, "a", encoding="utf-8") as file:
                    file.write(f"{PEER_HANG_MARK} ({silent:.1f} s without progress)\n")
                _dump_stacks(child, stacks, wait_s=2.0)
            elif not stopped and not dumped_for_peer and silent > timeout:
                hung = True
                _end_hung(child, stacks, timeout, progress.reports, request, rank)
                break
        code = child.wait()
        for output in outputs:
            output.thread.join(timeout=5)
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
    try:
        return _outcome(spec, rank, local_rank, code, stopped, hung, outputs[1].tail, attempt, redactor)
    finally:
        undo_logging()


def _script_path(name: str) -> Path:
    path = Path(name).expanduser()
    return path if path.is_absolute() else Path.cwd() / path


def _mlflow_env(spec: RunSpec, job: dict[str, Any], script: dict[str, Any]) -> dict[str, str]:
    """The job's MLflow run for a script that logs to MLflow itself (waits for it to open)."""
    if not job.get("tracking", {}).get("enabled", True) or script.get("mlflow_run", "auto") == "never":
        return {}
    if script.get("mlflow_run", "auto") == "auto":
        try:
            if "mlflow" not in _script_path(script["path"]).read_text(encoding="utf-8", errors="replace"):
                return {}
        except OSError:
            return {}
    from scaletrain.tracking.tracker_handle import recorded_run

    deadline = time.monotonic() + 120
    while (recorded := recorded_run(spec.run_dir)) is None and time.monotonic() < deadline:
        time.sleep(0.05)
    if recorded is None:
        log.warning("the job's MLflow run did not open in 120 s: the script's own MLflow calls "
                    "go where its environment says")
        return {}
    uri = os.environ.get("MLFLOW_TRACKING_URI") or recorded.get("uri", "")
    return {"MLFLOW_TRACKING_URI": uri, "MLFLOW_RUN_ID": recorded["run_id"]}


def _requested(request: Path, since: float) -> bool:
    """Whether a peer on this node asked for every rank's stacks during this attempt."""
    try:
        return request.stat().st_mtime >= since
    except OSError:
        return False


def _end_hung(child: subprocess.Popen, stacks: Path, timeout: float, reports: bool, request: Path,
              rank: int) -> None:
    import psutil

    why = "no scaletrain.report() or should_stop() call" if reports else "no output and no CPU time used"
    log.error("the script made no progress for %g s (%s); dumping its stacks to %s and ending it",
              timeout, why, stacks, extra={"console": False})
    # Its peers dump meanwhile: those on this node are asked at once (the request file; no fsync:
    # it tells live processes, and a peer that waited for this rank since it hung is only seconds
    # from its own timeout), and dump once silent for a second (waiting for this rank in a
    # collective). Ended at once, this script would have its peers fail (a connection closed
    # under their collective) and be stopped before their stacks say what they waited in.
    request.write_text(f"rank {rank}\n", encoding="utf-8")
    # A header shaped like the watchdog's: where this dump starts, for the root cause, after an
    # earlier attempt's in the same file.
    with open(stacks, "a", encoding="utf-8") as file:
        file.write(f"{HANG_DUMP_START}{timeout:g} s without progress)!\n")
    if not _dump_stacks(child, stacks, wait_s=5.0):
        return
    time.sleep(grace_s(timeout))
    try:
        family = [psutil.Process(child.pid), *psutil.Process(child.pid).children(recursive=True)]
    except psutil.NoSuchProcess:
        return
    for process in family:
        try:
            process.kill()
        except psutil.NoSuchProcess:
            pass


def _dump_stacks(child: subprocess.Popen, stacks: Path, wait_s: float) -> bool:
    """Has the child's faulthandler append every thread's stack to ``stacks``; waits until it
    did (up to ``wait_s``). False when the child is gone."""
    size = stacks.stat().st_size if stacks.exists() else 0
    try:
        child.send_signal(STACKS_SIGNAL)
    except ProcessLookupError:
        return False
    deadline = time.monotonic() + wait_s
    while time.monotonic() < deadline and (not stacks.exists() or stacks.stat().st_size == size):
        time.sleep(0.05)
    return True


def _outcome(spec: RunSpec, rank: int, local_rank: int, code: int, stopped: list[str], hung: bool,
             stderr_tail: deque[str], attempt: int, redactor: Redactor) -> int:
    """This rank's exit code; its error file, or (the node's first worker) the result."""
    if hung:
        return 1  # the stacks file tells the launcher it was a hang
    if code != 0 and not stopped:
        _write_error(spec, rank, code, stderr_tail, redactor)
        log.error("the script failed with exit code %d", code, extra={"console": False})
        return 1
    if local_rank == 0:
        steps = _last_step(spec)
        result = {
            "steps": steps or 0, "preempted": stopped[0] if stopped else None, "last_checkpoint_step": None,
            "weights_sha256": "", "train": _last_metrics(spec), "eval": {}, "first_step_at": None,
            "resumed_from_step": None, "strategy": "script", "step_time": {}, "restarts": attempt,
        }
        write_text_atomic(spec.worker_result(), json.dumps(result))
    log.info("script finished", extra={"exit_code": code, "stopped_on": stopped[0] if stopped else None})
    return 0


_RANK_PREFIX = re.compile(r"^\[rank\d+\]: ")
_EXCEPTION_LINE = re.compile(r"^([A-Za-z_][\w.]*(?:Error|Exception|Interrupt|Exit|Warning|Failure)|[A-Z]\w+):? ?(.*)$")


def _write_error(spec: RunSpec, rank: int, code: int, tail: deque[str], redactor: Redactor) -> None:
    # torch.distributed prefixes an uncaught exception's lines with "[rankN]: ".
    lines = [_RANK_PREFIX.sub("", line) for line in tail if line.strip()]
    kind, message = "ScriptFailed", f"the script exited with code {code}"
    exception = _uncaught_exception(lines)
    # An uncaught exception is the cause also when the process then aborts on its way out (torch
    # 2.13's gloo now and then: "terminate called without an active exception", SIGABRT).
    if exception is not None and (code > 0 or code == -signal.SIGABRT):
        kind, message = exception[0], exception[1] or message
    elif code < 0:
        kind, message = "Killed", f"the script was killed by {signal.Signals(-code).name}"
    error = {"rank": rank, "steps": _last_step(spec), "type": kind, "message": redactor.text(message),
             "traceback": redactor.text("\n".join(tail)), "timestamp": time.time(), "exit_code": code}
    try:
        write_text_atomic(spec.worker_error(rank), json.dumps(error))
    except OSError:
        log.warning("could not write the error file for rank %s", rank, exc_info=True)


def _uncaught_exception(lines: list[str]) -> tuple[str, str] | None:
    """The type and message of the last traceback's exception: the first unindented line after
    its frames (lines printed after it, at exit, are not the exception). A traceback longer than
    the tail kept has lost its header: then after the last frame."""
    starts = [i for i, line in enumerate(lines) if line.strip() == "Traceback (most recent call last):"]
    frames = [i for i, line in enumerate(lines) if line.startswith('  File "')]
    if not starts and not frames:
        return None
    for line in lines[starts[-1] + 1 if starts else frames[-1]:]:
        if not line.startswith((" ", "\t")):
            found = _EXCEPTION_LINE.match(line.strip())
            return (found.group(1).rsplit(".", 1)[-1], found.group(2)) if found else None
    return None


def _last_rows(spec: RunSpec) -> list[dict[str, Any]]:
    try:
        lines = (spec.out_dir / METRICS_FILE).read_text(encoding="utf-8").splitlines()[-50:]
    except OSError:
        return []
    rows = []
    for line in lines:
        try:
            rows.append(json.loads(line))
        except ValueError:
            continue
    return [row for row in rows if isinstance(row, dict) and row.get("split") == "train"]


def _last_step(spec: RunSpec) -> int | None:
    rows = _last_rows(spec)
    return int(rows[-1]["step"]) if rows else None


def _last_metrics(spec: RunSpec) -> dict[str, float]:
    rows = _last_rows(spec)
    return {k: v for k, v in rows[-1].items() if k not in ("split", "step")} if rows else {}


if __name__ == "__main__":
    sys.exit(main())
