"""The process the torch elastic agent starts for a warm worker (launch/warm_workers.py):
``python -m scaletrain.launch.warm_client SOCKET MODULE ARGS...``.

It imports nothing heavy (the agent starts one per worker on every restart). It asks the warm
process to fork ``python -m MODULE ARGS`` on its own stdin, stdout and stderr, in its
environment and folder; passes on every signal the agent sends to the worker's process group;
and ends as the worker ended: its exit code, or killed by the same signal. With no warm process
to ask (or one that cannot fork now) it becomes the worker itself, as a plain start would.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import sys

# What the agent (or a user) may send a worker: passed on. SIGKILL cannot be caught: the warm
# process kills the worker when this process's socket closes.
FORWARDED = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP, signal.SIGQUIT, signal.SIGUSR1, signal.SIGUSR2)


def _ask(path: str, module: str, args: list[str]) -> tuple[socket.socket | None, int | None]:
    try:
        conn = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        conn.connect(path)
        request = {"module": module, "args": args, "env": dict(os.environ), "cwd": os.getcwd()}
        socket.send_fds(conn, [json.dumps(request).encode()], [0, 1, 2])
        reply = json.loads(conn.recv(1 << 16) or b"{}")
    except (OSError, ValueError):
        return None, None
    pid = reply.get("pid")
    return (conn, pid) if isinstance(pid, int) else (None, None)


def main(argv: list[str]) -> None:
    path, module, *args = argv
    conn, pid = _ask(path, module, args)
    if conn is None or pid is None:  # start it here instead
        os.execv(sys.executable, [sys.executable, "-m", module, *args])  # noqa: S606  this interpreter, the agent's argv

    def forward(signum: int, _frame: object) -> None:
        try:
            os.killpg(pid, signum)
        except ProcessLookupError:
            pass

    for signum in FORWARDED:
        signal.signal(signum, forward)
    try:
        ended = json.loads(conn.recv(1 << 16) or b"{}")  # when the worker ends
    except (OSError, ValueError):
        ended = {}
    code = ended.get("exit")
    if not isinstance(code, int):  # the warm process is gone: so is the worker
        try:
            os.killpg(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        sys.stderr.write("scaletrain: the warm workers' process ended before this worker did\n")
        sys.stderr.flush()
        os._exit(1)
    if code < 0:  # killed by a signal: end the same way, so the agent sees the same exit
        if -code in FORWARDED:
            signal.signal(-code, signal.SIG_DFL)
        os.kill(os.getpid(), -code)
        os._exit(128 - code)  # a signal whose default is not to end a process
    os._exit(code & 0xFF)


if __name__ == "__main__":
    main(sys.argv[1:])
