"""Warm workers: one process per machine imports torch and the worker's code once, and forks a
worker for every one the agent starts, instead of each starting a fresh interpreter.

A worker's interpreter start and imports (torch, torch._dynamo that the optimizer pulls in,
scaletrain) cost ~3 s of CPU each, paid again for every worker of every restart; torchrun pays
the same for a script. Here the torch elastic agent still starts, watches and signals one
process per worker, as it does for torchrun: ``python -m scaletrain.launch.warm_client`` (no
torch, a few milliseconds), which hands its command, environment and stdin/stdout/stderr to
this process over a Unix socket. This process forks the worker, which takes them over and runs
``python -m <module>``'s code as a fresh interpreter would; the client passes on every signal
the agent sends and ends as the worker ended (its exit code, or the same signal). If the client
dies (SIGKILL from the agent), its worker is killed with it.

A fork is safe here because this process does nothing but wait: one Python thread, CUDA never
initialized (checked before every fork; otherwise the client starts the worker itself, as
before), as a DataLoader's workers are forked from a process that imported torch. The socket is in a folder only this user can open. ``SCALETRAIN_WARM_WORKERS=0``
turns it off.
"""

from __future__ import annotations

import contextlib
import json
import os
import selectors
import signal
import socket
import subprocess
import sys
import tempfile
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Any

__all__ = ["WarmWorkers", "enabled", "SWITCH_ENV", "SOCKET_NAME"]

SWITCH_ENV = "SCALETRAIN_WARM_WORKERS"
SOCKET_NAME = "workers.sock"
# What a worker imports before its first step, imported here once (the user's own code is not:
# its module-level effects stay once per worker).
PRELOAD = ("torch", "torch._dynamo", "torch.nn.parallel", "scaletrain.launch.worker", "scaletrain.runners.task",
           "scaletrain.engine.trainer", "scaletrain.strategies.ddp", "scaletrain.strategies.single")
_MAX_MESSAGE = 1 << 20


def enabled() -> bool:
    return os.environ.get(SWITCH_ENV, "1") != "0" and sys.platform == "linux"


class WarmWorkers:
    """The launcher's handle: starts the process (it imports while the agent sets up), gives the
    agent its client's command, and stops it (closing its stdin ends it and any worker left)."""

    def __init__(self) -> None:
        self.folder = Path(tempfile.mkdtemp(prefix="scaletrain-workers-"))  # 0700
        self.socket = self.folder / SOCKET_NAME
        # Listening before the process starts: a client that comes first waits in the backlog
        # (one that found no socket would start its worker the slow way).
        listener = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        listener.bind(str(self.socket))
        listener.listen(64)
        try:
            self.process = subprocess.Popen(  # noqa: S603  our module, no shell
                [sys.executable, "-m", "scaletrain.launch.warm_workers", str(listener.fileno())],
                stdin=subprocess.PIPE, pass_fds=(listener.fileno(),),
            )
        finally:
            listener.close()  # the warm process holds it now

    def command(self, module: str, *args: str) -> tuple[str, ...]:
        """The arguments after ``python`` that start ``python -m module args`` through it."""
        return ("-m", "scaletrain.launch.warm_client", str(self.socket), module, *args)

    def close(self) -> None:
        if self.process.stdin is not None:
            with contextlib.suppress(OSError):
                self.process.stdin.close()
        try:
            self.process.wait(timeout=10)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait()
        for path in (self.socket, self.folder):
            with contextlib.suppress(OSError):
                path.unlink() if path.is_socket() else path.rmdir()


@dataclass
class _Request:
    """What a client asked for: ``python -m module args`` in its environment and folder, on its
    stdin, stdout and stderr (``fds``)."""

    module: str
    args: list[str]
    env: dict[str, str]
    cwd: str
    fds: list[int]


def _fork_safe() -> bool:
    import threading

    import torch

    return threading.active_count() == 1 and not torch.cuda.is_initialized()


def serve(listening_fd: int) -> _Request | None:
    """This process's loop on the launcher's listening socket; returns in a forked worker (its
    request), None when the launcher is gone (its stdin closed)."""
    listener = socket.socket(fileno=listening_fd)
    for module in PRELOAD:  # clients queue on the socket meanwhile
        __import__(module)
    wake_r, wake_w = socket.socketpair()
    wake_w.setblocking(False)
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is the launcher's to handle (a clean stop)
    signal.signal(signal.SIGCHLD, lambda *_: None)
    signal.set_wakeup_fd(wake_w.fileno())
    selector = selectors.DefaultSelector()
    selector.register(listener, selectors.EVENT_READ, "accept")
    selector.register(sys.stdin, selectors.EVENT_READ, "launcher")
    selector.register(wake_r, selectors.EVENT_READ, "child")
    workers: dict[int, socket.socket] = {}  # pid -> its client's connection
    served: set[socket.socket] = set()  # one worker per client
    try:
        while True:
            for key, _ in selector.select():
                if key.data == "accept":
                    conn, _ = listener.accept()
                    selector.register(conn, selectors.EVENT_READ, "client")
                elif key.data == "launcher":
                    if not os.read(sys.stdin.fileno(), 4096):
                        return None
                elif key.data == "child":
                    with contextlib.suppress(BlockingIOError):
                        wake_r.recv(4096)
                    _reap(workers, selector)
                else:
                    conn = key.fileobj  # type: ignore[assignment]  # a client's socket, registered above
                    request = _read_request(conn)
                    if request is None or conn in served:  # the client is gone: so is its worker
                        if request is not None:
                            _close_fds(request.fds)
                        selector.unregister(conn)
                        for pid, owner in list(workers.items()):
                            if owner is conn:
                                with contextlib.suppress(ProcessLookupError):
                                    os.killpg(pid, signal.SIGKILL)
                        served.discard(conn)
                        conn.close()
                        continue
                    if not _fork_safe():
                        _send(conn, {"fallback": "this process is no longer safe to fork"})
                        _close_fds(request.fds)
                        continue
                    sys.stdout.flush()
                    sys.stderr.flush()
                    with warnings.catch_warnings():  # 3.12: a native pool thread (OpenBLAS) exists
                        warnings.simplefilter("ignore", DeprecationWarning)
                        pid = os.fork()
                    if pid == 0:  # the worker
                        workers.clear()  # its siblings are not its own
                        signal.set_wakeup_fd(-1)
                        signal.signal(signal.SIGCHLD, signal.SIG_DFL)
                        signal.signal(signal.SIGINT, signal.default_int_handler)
                        for other in [listener, wake_r, wake_w, *(k.fileobj for k in selector.get_map().values()
                                                                  if isinstance(k.fileobj, socket.socket))]:
                            other.close()
                        selector.close()
                        return request
                    _close_fds(request.fds)
                    workers[pid] = conn
                    served.add(conn)
                    _send(conn, {"pid": pid})
            _reap(workers, selector)
    finally:  # the launcher is gone (in a worker: nothing here)
        for pid in workers:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(pid, signal.SIGKILL)


def _reap(workers: dict[int, socket.socket], selector: selectors.BaseSelector) -> None:
    while workers:
        try:
            pid, status = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            return
        if pid == 0:
            return
        conn = workers.pop(pid, None)
        if conn is not None:
            with contextlib.suppress(OSError):
                _send(conn, {"exit": os.waitstatus_to_exitcode(status)})
            with contextlib.suppress(KeyError, ValueError):
                selector.unregister(conn)
            conn.close()


def _read_request(conn: socket.socket) -> _Request | None:
    try:
        data, fds, _flags, _addr = socket.recv_fds(conn, _MAX_MESSAGE, 3)
    except OSError:
        return None
    if not data:
        _close_fds(fds)
        return None
    try:
        message = json.loads(data)
        return _Request(str(message["module"]), [str(a) for a in message["args"]],
                        {str(k): str(v) for k, v in message["env"].items()}, str(message["cwd"]), list(fds))
    except (ValueError, KeyError, TypeError, AttributeError):
        _close_fds(fds)
        return None


def _send(conn: socket.socket, message: dict[str, Any]) -> None:
    conn.send(json.dumps(message).encode())


def _close_fds(fds: list[int]) -> None:
    for fd in fds:
        with contextlib.suppress(OSError):
            os.close(fd)


def become(request: _Request) -> None:
    """In the forked worker: take over the client's stdin/stdout/stderr, environment, folder and
    command line, and run its ``-m module`` as ``__main__`` (the interpreter then exits as a
    fresh one would: threads joined, atexit handlers, finalizers)."""
    import runpy

    os.setsid()  # its own process group: the client signals it, and its children, there
    for target, fd in enumerate(request.fds):
        os.dup2(fd, target)
        if fd > 2:
            os.close(fd)
    os.environ.clear()
    os.environ.update(request.env)
    os.chdir(request.cwd)
    unbuffered = bool(request.env.get("PYTHONUNBUFFERED"))
    sys.stdin = open(0, encoding=sys.stdin.encoding, closefd=False)  # noqa: SIM115  the interpreter's own
    sys.stdout = open(1, "w", buffering=1 if unbuffered or os.isatty(1) else -1, encoding=sys.stdout.encoding,  # noqa: SIM115
                      errors=sys.stdout.errors, closefd=False)
    sys.stderr = open(2, "w", buffering=1, encoding=sys.stderr.encoding, errors="backslashreplace", closefd=False)  # noqa: SIM115
    sys.argv = [request.module, *request.args]  # argv[0] becomes the module's file, as with -m
    runpy.run_module(request.module, run_name="__main__", alter_sys=True)


def main() -> None:
    # Should anything imported here ask whether CUDA is there, NVML answers: the CUDA runtime
    # must not start in a process that forks (a worker takes the client's environment).
    os.environ["PYTORCH_NVML_BASED_CUDA_CHECK"] = "1"
    request = serve(int(sys.argv[1]))
    if request is None:  # the launcher is done: nothing here to flush or finalize (the
        os._exit(0)  # interpreter's teardown of torch's modules took 0.5-0.9 s of the job's end)
    become(request)


if __name__ == "__main__":
    main()
