"""The root cause of a failed attempt, from the files its workers left: the one line a user sees."""

import json
import os
import subprocess
import sys

import pytest

from scaletrain.observe.telemetry import StepMark
from scaletrain.recovery.root_cause import failure_files, holds_hang, worker_error
from scaletrain.recovery.watchdog import PEER_HANG_MARK
from scaletrain.rundir import RunSpec
from tests.helpers.tasks import toy_job


@pytest.fixture
def spec(tmp_path):
    spec = RunSpec.in_dir(toy_job(tmp_path, recovery={"hang_timeout_s": 8}), tmp_path / "runs")
    spec.logs_dir.mkdir(parents=True)
    return spec


def write_error(spec, rank, type_, message, timestamp, steps=None):
    """An error file as recovery/attempts.py write_error leaves it."""
    record = {"rank": rank, "steps": steps, "type": type_, "message": message,
              "traceback": f"Traceback (most recent call last):\n{type_}: {message}\n", "timestamp": timestamp}
    spec.worker_error(rank).write_text(json.dumps(record), encoding="utf-8")


def details(spec, rank):
    return f"(details: {spec.worker_log(rank)})"


ECHO = "[../third_party/gloo/gloo/transport/tcp/pair.cc:534] Connection closed by peer [127.0.0.1]:29500"


def test_the_real_error_wins_over_an_earlier_echo_of_it(spec):
    write_error(spec, 0, "DistBackendError", ECHO, timestamp=100.0, steps=4)
    write_error(spec, 1, "ValueError", "bad batch", timestamp=101.0, steps=5)
    err = worker_error(spec, [0, 1], {})
    assert str(err) == f"worker rank 1 failed: ValueError: bad batch {details(spec, 1)}"
    assert err.rank == 1
    assert err.log_path == str(spec.worker_log(1))
    assert err.exit_code == 1  # a failed run, not bad input
    assert err.steps == 5


def test_an_echo_by_message_alone_is_still_an_echo(spec):
    write_error(spec, 0, "RuntimeError", "remote process exited or there was a network error", timestamp=1.0)
    write_error(spec, 1, "ZeroDivisionError", "division by zero", timestamp=2.0)
    err = worker_error(spec, [0, 1], {})
    assert err.rank == 1
    assert str(err) == f"worker rank 1 failed: ZeroDivisionError: division by zero {details(spec, 1)}"


def test_among_real_errors_the_earliest_wins(spec):
    write_error(spec, 0, "KeyError", "'label'", timestamp=20.0)
    write_error(spec, 1, "ValueError", "bad batch", timestamp=10.0)
    assert worker_error(spec, [0, 1], {}).rank == 1


def test_an_nccl_cause_inside_a_dist_backend_error_is_the_cause(spec):
    nccl = ("NCCL error in: ProcessGroupNCCL.cpp:1970, invalid usage, NCCL version 2.20.5\n"
            "ncclInvalidUsage: Duplicate GPU detected")
    write_error(spec, 0, "DistBackendError", nccl, timestamp=50.0)
    write_error(spec, 1, "DistBackendError", ECHO, timestamp=10.0)
    err = worker_error(spec, [0, 1], {})
    assert err.rank == 0
    assert str(err) == f"worker rank 0 failed: DistBackendError: {nccl} {details(spec, 0)}"


def test_a_rank_killed_outright_beats_its_peers_echoes(spec):
    write_error(spec, 0, "DistBackendError", ECHO, timestamp=10.0, steps=3)
    killed = "exited with signal SIGKILL (out of memory?)"
    err = worker_error(spec, [0], {1: killed})
    assert err.rank == 1
    assert str(err) == f"worker rank 1 failed: {killed} {details(spec, 1)}"
    assert err.steps == 3  # still what the ranks that wrote a file had trained


def test_a_real_error_beats_a_rank_killed_outright(spec):
    write_error(spec, 0, "ValueError", "bad batch", timestamp=10.0)
    err = worker_error(spec, [0], {1: "exited with signal SIGKILL"})
    assert err.rank == 0
    assert str(err) == f"worker rank 0 failed: ValueError: bad batch {details(spec, 0)}"


def test_of_ranks_killed_without_a_word_the_first_to_fall_silent_is_named(spec):
    for rank, mtime in ((0, 300), (1, 100), (2, 200)):
        spec.worker_log(rank).write_text("{}\n", encoding="utf-8")
        os.utime(spec.worker_log(rank), (mtime, mtime))
    fallback = {0: "exited with signal SIGKILL", 1: "exited with code -9", 2: "exited with signal SIGKILL"}
    err = worker_error(spec, [0, 1, 2], fallback)
    assert err.rank == 1
    assert str(err) == f"worker rank 1 failed: exited with code -9 {details(spec, 1)}"
    assert err.steps is None


def test_a_rank_with_no_log_at_all_was_never_heard_so_it_is_not_first(spec):
    spec.worker_log(1).write_text("{}\n", encoding="utf-8")
    err = worker_error(spec, [0, 1], {0: "exited with code 1", 1: "exited with code 1"})
    assert err.rank == 1


def test_nothing_known_is_an_unknown_failure_of_the_first_rank(spec):
    err = worker_error(spec, [2, 3], {})
    assert str(err) == f"worker rank 2 failed: unknown failure {details(spec, 2)}"


@pytest.mark.parametrize("type_", ["ConfigError", "TaskError", "PlacementError", "PreflightError"])
def test_a_bad_input_error_exits_as_bad_input(spec, type_):
    write_error(spec, 0, type_, "task.target 'x:y' cannot be imported", timestamp=1.0)
    err = worker_error(spec, [0], {})
    assert err.exit_code == 2
    assert str(err) == f"worker rank 0 failed: {type_}: task.target 'x:y' cannot be imported {details(spec, 0)}"


def test_an_error_without_a_message_shows_its_type(spec):
    write_error(spec, 0, "KeyboardInterrupt", "", timestamp=1.0)
    assert str(worker_error(spec, [0], {})) == f"worker rank 0 failed: KeyboardInterrupt {details(spec, 0)}"


def test_steps_are_the_most_any_rank_trained(spec):
    write_error(spec, 0, "DistBackendError", ECHO, timestamp=2.0, steps=7)
    write_error(spec, 1, "ValueError", "bad batch", timestamp=1.0, steps=6)
    write_error(spec, 2, "DistBackendError", ECHO, timestamp=3.0, steps=None)
    assert worker_error(spec, [0, 1, 2], {}).steps == 7


def test_an_unreadable_error_file_is_no_error(spec):
    spec.worker_error(0).write_text('{"type": "ValueErr', encoding="utf-8")  # torn
    spec.worker_error(1).write_text('["not", "a", "record"]', encoding="utf-8")
    err = worker_error(spec, [0, 1], {1: "exited with code 1"})
    assert str(err) == f"worker rank 1 failed: exited with code 1 {details(spec, 1)}"


def test_an_earlier_attempts_error_file_is_ignored(spec):
    write_error(spec, 0, "ValueError", "the last attempt's error", timestamp=1.0, steps=9)
    earlier = failure_files(spec)
    assert list(earlier) == [str(spec.worker_error(0))]
    err = worker_error(spec, [0, 1], {1: "exited with signal SIGKILL"}, earlier)
    assert str(err) == f"worker rank 1 failed: exited with signal SIGKILL {details(spec, 1)}"
    assert err.steps is None


def test_an_error_file_rewritten_since_is_this_attempts(spec):
    write_error(spec, 0, "ValueError", "the last attempt's error", timestamp=1.0)
    earlier = failure_files(spec)
    replacement = spec.logs_dir / "tmp.json"  # written whole and renamed over, as write_error does
    write_error(spec, 0, "KeyError", "'label'", timestamp=2.0)
    os.replace(spec.worker_error(0), replacement)
    os.replace(replacement, spec.worker_error(0))
    err = worker_error(spec, [0], {}, earlier)
    assert str(err) == f"worker rank 0 failed: KeyError: 'label' {details(spec, 0)}"


# Hangs. What faulthandler writes when the watchdog's timer fires (dump_traceback_later: a
# "Timeout (...)!" header, then every thread innermost frame first, threads apart by a blank line).

TRACKING_THREAD = """\
Thread 0x00007f1e2a7fc6c0 (most recent call first):
  File "/usr/lib/python3.11/threading.py", line 331 in wait
  File "/usr/lib/python3.11/queue.py", line 180 in get
  File "/opt/venv/lib/python3.11/site-packages/scaletrain/tracking/journal.py", line 88 in _drain
  File "/usr/lib/python3.11/threading.py", line 982 in run
  File "/usr/lib/python3.11/threading.py", line 1045 in _bootstrap_inner
  File "/usr/lib/python3.11/threading.py", line 1002 in _bootstrap
"""

IN_COLLECTIVE = """\
Thread 0x00007f1e3b1a4b80 (most recent call first):
  File "/opt/venv/lib/python3.11/site-packages/torch/distributed/distributed_c10d.py", line 2288 in all_reduce
  File "/opt/venv/lib/python3.11/site-packages/torch/distributed/c10d_logger.py", line 83 in wrapper
  File "/opt/venv/lib/python3.11/site-packages/scaletrain/distributed/collectives.py", line 62 in all_reduce
  File "/opt/venv/lib/python3.11/site-packages/scaletrain/engine/control.py", line 96 in check
  File "/opt/venv/lib/python3.11/site-packages/scaletrain/engine/trainer.py", line 301 in _between_steps
  File "/opt/venv/lib/python3.11/site-packages/scaletrain/engine/trainer.py", line 240 in fit
  File "/opt/venv/lib/python3.11/site-packages/scaletrain/runners/task.py", line 41 in run
  File "/opt/venv/lib/python3.11/site-packages/scaletrain/launch/worker.py", line 120 in main
  File "<frozen runpy>", line 88 in _run_code
"""

IN_USER_CODE = """\
Thread 0x00007f1e3b1a4b80 (most recent call first):
  File "/home/me/project/tasks.py", line 77 in loss
  File "/opt/venv/lib/python3.11/site-packages/scaletrain/engine/trainer.py", line 265 in _micro_step
  File "/opt/venv/lib/python3.11/site-packages/scaletrain/engine/trainer.py", line 240 in fit
  File "/opt/venv/lib/python3.11/site-packages/scaletrain/runners/task.py", line 41 in run
  File "/opt/venv/lib/python3.11/site-packages/scaletrain/launch/worker.py", line 120 in main
  File "<frozen runpy>", line 88 in _run_code
"""


def dump(training_thread, elapsed="0:00:08"):
    return f"Timeout ({elapsed})!\n{TRACKING_THREAD}\n{training_thread}"


def write_stacks(spec, rank, text):
    spec.worker_stacks(rank).write_text(text, encoding="utf-8")


def test_fixture_dumps_have_faulthandlers_shape(tmp_path):
    """The dumps above are shaped like a real one (header, blank line between threads, frames)."""
    script = (
        "import faulthandler, sys, threading, time\n"
        "threading.Thread(target=time.sleep, args=(5,), daemon=True).start()\n"
        "faulthandler.dump_traceback_later(0.1, file=sys.stdout)\n"
        "time.sleep(1)\n"
    )
    real = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=30).stdout
    ours = dump(IN_USER_CODE)
    assert real.startswith("Timeout (") and ours.startswith("Timeout (")
    for text in (real, ours):
        threads = text.split("\n", 1)[1].split("\n\n")
        assert len(threads) == 2
        assert all(t.startswith("Thread 0x") and "(most recent call first):\n  File \"" in t for t in threads)


def test_a_hung_rank_is_named_and_its_waiting_peer_said_to_wait_for_it(spec):
    write_stacks(spec, 0, dump(IN_COLLECTIVE))
    write_stacks(spec, 1, dump(IN_USER_CODE))
    StepMark(spec.worker_step(1)).set(44)  # the last step rank 1 finished, as its loop marked it
    err = worker_error(spec, [0, 1], {0: "exited with signal SIGALRM", 1: "exited with signal SIGALRM"})
    assert str(err) == (
        "worker rank 1 failed: made no progress for 8 s after step 44, in tasks.py:77 loss (hang watchdog; "
        f"rank 0 waited for it in all_reduce); every thread's stack is in {spec.worker_stacks(1)} {details(spec, 1)}"
    )
    assert err.rank == 1
    assert err.exit_code == 1


def test_a_hung_rank_with_several_waiting_peers_names_them_all(spec):
    for rank in (0, 2, 3):
        write_stacks(spec, rank, dump(IN_COLLECTIVE))
    write_stacks(spec, 1, dump(IN_USER_CODE))
    err = worker_error(spec, range(4), {})
    assert err.rank == 1
    assert ", in tasks.py:77 loss (hang watchdog; ranks 0, 2, 3 waited for it in all_reduce)" in str(err)


def test_when_every_rank_waits_in_a_collective_the_first_to_fall_silent_is_named(spec):
    """The collective itself hung: no rank is blamed on another; the message says they all waited."""
    write_stacks(spec, 0, dump(IN_COLLECTIVE))
    write_stacks(spec, 1, dump(IN_COLLECTIVE))
    for rank, mtime in ((0, 200), (1, 100)):
        spec.worker_log(rank).write_text("{}\n", encoding="utf-8")
        os.utime(spec.worker_log(rank), (mtime, mtime))
    err = worker_error(spec, [0, 1], {0: "exited with signal SIGALRM", 1: "exited with signal SIGALRM"})
    assert str(err) == (
        "worker rank 1 failed: made no progress for 8 s (hang watchdog; ranks 0, 1 all waited in "
        f"all_reduce); every thread's stack is in "
        f"{spec.worker_stacks(1)} {details(spec, 1)}"
    )


def test_only_the_last_dump_in_a_stacks_file_counts(spec):
    """Rank 0 waited in a collective in an earlier dump; in its last one it is stuck itself."""
    write_stacks(spec, 0, dump(IN_COLLECTIVE, "0:00:05") + "\n" + dump(IN_USER_CODE))
    write_stacks(spec, 1, dump(IN_COLLECTIVE))
    err = worker_error(spec, [0, 1], {})
    assert err.rank == 0
    assert "(hang watchdog; rank 1 waited for it in all_reduce)" in str(err)


def test_an_error_file_outranks_the_hang_story(spec):
    write_stacks(spec, 0, dump(IN_COLLECTIVE))
    write_stacks(spec, 1, dump(IN_USER_CODE))
    write_error(spec, 0, "ValueError", "bad batch", timestamp=1.0)
    err = worker_error(spec, [0, 1], {})
    assert str(err) == f"worker rank 0 failed: ValueError: bad batch {details(spec, 0)}"


def test_an_earlier_attempts_stacks_are_no_hang(spec):
    write_stacks(spec, 1, dump(IN_USER_CODE))
    spec.worker_stacks(0).write_text("", encoding="utf-8")  # armed, never fired: no dump
    earlier = failure_files(spec)
    err = worker_error(spec, [0, 1], {1: "exited with code 1"}, earlier)
    assert str(err) == f"worker rank 1 failed: exited with code 1 {details(spec, 1)}"


def test_a_dump_appended_to_an_earlier_attempts_stacks_is_this_attempts_hang(spec):
    write_stacks(spec, 1, dump(IN_COLLECTIVE))
    earlier = failure_files(spec)
    with open(spec.worker_stacks(1), "a", encoding="utf-8") as stacks:
        stacks.write(dump(IN_USER_CODE))
    err = worker_error(spec, [1], {1: "exited with signal SIGALRM"}, earlier)
    assert str(err) == (
        "worker rank 1 failed: made no progress for 8 s, in tasks.py:77 loss (hang watchdog); every thread's "
        f"stack is in {spec.worker_stacks(1)} {details(spec, 1)}"
    )


# A TensorFlow job: its collectives run inside the compiled step; a lost peer is UnavailableError.
IN_TF_STEP = """\
Thread 0x00007f1e3b1a4b80 (most recent call first):
  File "/opt/venv/lib/python3.11/site-packages/tensorflow/python/eager/execute.py", line 53 in quick_execute
  File "/opt/venv/lib/python3.11/site-packages/tensorflow/python/eager/polymorphic_function/concrete_function.py", line 1322 in _call_flat
  File "/opt/venv/lib/python3.11/site-packages/scaletrain/runners/tensorflow.py", line 185 in _loop
  File "/opt/venv/lib/python3.11/site-packages/scaletrain/launch/worker.py", line 120 in main
  File "<frozen runpy>", line 88 in _run_code
"""


def test_a_tensorflow_rank_waiting_in_its_step_waits_for_the_hung_one(spec):
    write_stacks(spec, 0, dump(IN_USER_CODE))
    write_stacks(spec, 1, dump(IN_TF_STEP))
    err = worker_error(spec, [0, 1], {0: "exited with signal SIGALRM", 1: "exited with signal SIGALRM"})
    assert str(err) == (
        "worker rank 0 failed: made no progress for 8 s, in tasks.py:77 loss (hang watchdog; rank 1 waited for "
        f"it in TensorFlow's compiled step); every thread's stack is in {spec.worker_stacks(0)} {details(spec, 0)}"
    )


def test_tensorflows_lost_peer_is_an_echo_of_the_rank_killed_outright(spec):
    write_error(spec, 0, "UnavailableError", "Graph execution error: ... CollectiveReduceV2 ... failed to connect",
                timestamp=10.0, steps=25)
    killed = "exited with signal SIGKILL (out of memory?)"
    err = worker_error(spec, [0], {1: killed})
    assert (err.rank, str(err)) == (1, f"worker rank 1 failed: {killed} {details(spec, 1)}")


# A script's (scaletrain launch): faulthandler.register dumps on a signal, after a header the script
# worker writes (a hang's is shaped like the watchdog's; a peer that waited, asked for its stacks by
# the hung rank's worker, gets the peer mark: script_worker._end_hung and main).
SCRIPT_HUNG = """\
Timeout (4 s without progress)!
Current thread 0x00007f1e3b1a4b80 (most recent call first):
  File "/home/me/project/train.py", line 43 in main
  File "/home/me/project/train.py", line 53 in <module>
  File "<frozen runpy>", line 88 in _run_code
"""

SCRIPT_IN_BACKWARD = """\
Current thread 0x00007f1e3b1a4b80 (most recent call first):
  File "/opt/venv/lib/python3.11/site-packages/torch/autograd/graph.py", line 979 in _engine_run_backward
  File "/opt/venv/lib/python3.11/site-packages/torch/autograd/__init__.py", line 395 in backward
  File "/opt/venv/lib/python3.11/site-packages/torch/_tensor.py", line 623 in backward
  File "/home/me/project/train.py", line 38 in main
  File "<frozen runpy>", line 88 in _run_code
"""


def asked(frames):
    return f"{PEER_HANG_MARK} (3.1 s without progress)\n{frames}"


def test_a_peer_asked_for_its_stacks_is_said_to_wait_for_the_hung_rank(spec):
    """Rank 1's script hung; rank 0, silent too short for its own hang check, dumped its stacks
    when rank 1's worker asked: its wait is in the line, and it is not blamed."""
    earlier = failure_files(spec)
    write_stacks(spec, 1, SCRIPT_HUNG)
    write_stacks(spec, 0, asked(SCRIPT_IN_BACKWARD))
    err = worker_error(spec, [0, 1], {0: "exited with code 1", 1: "exited with code 1"}, earlier)
    assert str(err) == (
        "worker rank 1 failed: made no progress for 8 s, in train.py:43 main (hang watchdog; rank 0 waited for "
        f"it in the gradients' all-reduce (backward)); every thread's stack is in {spec.worker_stacks(1)} "
        f"{details(spec, 1)}"
    )
    assert not holds_hang(spec.worker_stacks(0), earlier) and holds_hang(spec.worker_stacks(1), earlier)


def test_a_peers_dump_is_no_hang_of_its_own(spec):
    """Rank 1 was killed outright; rank 0's stacks, dumped for a peer, change nothing."""
    write_stacks(spec, 0, SCRIPT_HUNG)  # an earlier attempt's hang
    earlier = failure_files(spec)
    with open(spec.worker_stacks(0), "a", encoding="utf-8") as stacks:
        stacks.write(asked(SCRIPT_IN_BACKWARD))
    for rank, mtime in ((0, 200), (1, 100)):  # rank 1 fell silent first
        spec.worker_log(rank).write_text("{}\n", encoding="utf-8")
        os.utime(spec.worker_log(rank), (mtime, mtime))
    killed = "exited with signal SIGKILL (out of memory?)"
    assert not holds_hang(spec.worker_stacks(0), earlier)
    err = worker_error(spec, [0, 1], {0: "exited with code 1", 1: killed}, earlier)
    assert (err.rank, str(err)) == (1, f"worker rank 1 failed: {killed} {details(spec, 1)}")


def test_a_hang_after_an_earlier_attempts_peer_dump_is_this_attempts_hang(spec):
    write_stacks(spec, 1, asked(SCRIPT_IN_BACKWARD))
    earlier = failure_files(spec)
    with open(spec.worker_stacks(1), "a", encoding="utf-8") as stacks:
        stacks.write(SCRIPT_HUNG)
    assert holds_hang(spec.worker_stacks(1), earlier)
    err = worker_error(spec, [1], {1: "exited with code 1"}, earlier)
    assert "worker rank 1 failed: made no progress for 8 s, in train.py:43 main (hang watchdog);" in str(err)
