"""The hang watchdog in a real process: it dumps at the timeout, then ends the process only after
a grace period (the peers of a hung rank dump meanwhile), even with the GIL held."""

from __future__ import annotations

import signal
import subprocess
import sys
import textwrap
import time

from scaletrain.recovery.root_cause import holds_hang
from scaletrain.recovery.watchdog import RESUMED_MARK, grace_s

HANGS = textwrap.dedent(
    """
    import sys, time
    from scaletrain.recovery.watchdog import Watchdog
    Watchdog(1.0, sys.argv[1]).arm()
    {hang}
    """
)


def _watch(tmp_path, hang: str) -> tuple[float, float, int]:
    """(seconds to the dump, seconds to the end, return code)."""
    stacks = tmp_path / "worker-0.stacks.txt"
    started = time.monotonic()
    proc = subprocess.Popen([sys.executable, "-c", HANGS.format(hang=hang), str(stacks)])
    dumped = None
    try:
        while proc.poll() is None and time.monotonic() - started < 30:
            if dumped is None and stacks.exists() and "Timeout (0:00:01)!" in stacks.read_text():
                dumped = time.monotonic() - started
            time.sleep(0.05)
    finally:
        if proc.poll() is None:
            proc.kill()
    ended = time.monotonic() - started
    assert dumped is not None, "no dump while the process lived"
    return dumped, ended, proc.wait()


def test_a_hung_process_dumps_then_ends_after_the_grace(tmp_path):
    dumped, ended, code = _watch(tmp_path, "time.sleep(60)")
    assert code == -signal.SIGALRM
    assert ended - dumped >= grace_s(1.0) - 0.5, (dumped, ended)  # alive a while after its dump
    assert ended < 1.0 + grace_s(1.0) + 5


def test_a_process_holding_the_gil_is_ended_too(tmp_path):
    # A C call that never releases the GIL: no Python thread could end this process.
    dumped, ended, code = _watch(tmp_path, "import re; re.match(r'(a+)+$', 'a' * 40 + 'b')")
    assert code == -signal.SIGALRM and ended < 1.0 + grace_s(1.0) + 5, (dumped, ended)


def test_a_slow_rank_that_goes_on_is_not_a_hang(tmp_path):
    # Dumped at 1 s, re-armed at 1.6 s (inside the 2 s grace): it lives, and its dump is marked.
    stacks = tmp_path / "worker-0.stacks.txt"
    slow = textwrap.dedent(
        """
        import logging, sys, time
        from scaletrain.recovery.watchdog import Watchdog
        logging.basicConfig()
        watchdog = Watchdog(1.0, sys.argv[1])
        watchdog.arm()
        time.sleep(1.6)
        watchdog.arm()
        watchdog.close()
        """
    )
    done = subprocess.run([sys.executable, "-c", slow, str(stacks)], capture_output=True, text=True, timeout=30)
    assert done.returncode == 0, done.stderr
    text = stacks.read_text()
    assert "Timeout (0:00:01)!" in text and RESUMED_MARK in text.rsplit("Timeout (", 1)[-1]
    assert "then this rank went on" in done.stderr
    assert not holds_hang(stacks, {})
    # A dump with no resumption after it is a hang.
    _watch(tmp_path, "time.sleep(60)")
    assert holds_hang(stacks, {})


def test_a_collective_outlasts_the_watchdog_and_its_grace():
    """The process group's timeout is the backstop: were it the hang timeout, the hung rank's
    peers would fail in their collective as it dumps, and its stacks be lost (CI's Ray hang test)."""
    from scaletrain.config.schema import MAX_SECONDS, MIN_HANG_TIMEOUT_S
    from scaletrain.recovery.watchdog import collective_timeout_s, grace_s

    for hang in (MIN_HANG_TIMEOUT_S, 8.0, 900.0, float(MAX_SECONDS)):
        assert collective_timeout_s(hang) >= hang + grace_s(hang) + 60
