"""The script worker and scaletrain.report()/should_stop() in this process (the distributed tests
run them as subprocesses): a script that succeeds, fails, or hangs; a script's reports."""

import importlib
import json
import os
import signal
import sys
from pathlib import Path

import pytest

import scaletrain
from scaletrain import script_hooks
from scaletrain.cli.launch import script_job
from scaletrain.config import parse_job
from scaletrain.errors import ConfigError
from scaletrain.launch import script_worker
from scaletrain.recovery.watchdog import HANG_DUMP_START, PEER_HANG_MARK
from scaletrain.rundir import PEER_HANG_REQUEST, RunSpec


def script_spec(tmp_path, body: str, **recovery) -> Path:
    script = tmp_path / "train.py"
    script.write_text(body)
    job = parse_job({"name": "s", "script": {"path": str(script), "args": ["--lr", "0.1"]},
                     "recovery": recovery, "tracking": {"enabled": False}, "run_dir": str(tmp_path / "runs")})
    spec = RunSpec.in_dir(job.model_dump(mode="json"), str(tmp_path / "runs"))
    spec.logs_dir.mkdir(parents=True, exist_ok=True)
    return spec.write()


@pytest.fixture
def rank0(monkeypatch):
    for name, value in {"RANK": "0", "LOCAL_RANK": "0", "WORLD_SIZE": "1"}.items():
        monkeypatch.setenv(name, value)


def records(spec_file, rank=0):
    spec = RunSpec.read(spec_file)
    return [json.loads(line) for line in spec.worker_log(rank).read_text().splitlines()]


def failure(spec_file) -> dict:
    """Runs the script worker on a script that fails: its exit code 1 and the rank's error file."""
    assert script_worker.main([str(spec_file)]) == 1
    return json.loads(RunSpec.read(spec_file).worker_error(0).read_text())


def test_a_script_that_succeeds_leaves_its_output_and_a_result(tmp_path, rank0):
    spec_file = script_spec(tmp_path, "import sys\nprint('hello', sys.argv[1:])\nprint('to stderr', file=sys.stderr)\n")
    assert script_worker.main([str(spec_file)]) == 0
    lines = sorted((r["stream"], r["message"]) for r in records(spec_file) if "stream" in r)  # two pipes: no order
    assert lines == [("stderr", "to stderr"), ("stdout", "hello ['--lr', '0.1']")]
    result = json.loads(RunSpec.read(spec_file).worker_result().read_text())
    assert result["strategy"] == "script" and result["preempted"] is None


def test_a_failing_script_leaves_its_exception(tmp_path, rank0):
    spec_file = script_spec(tmp_path, "raise KeyError('no such column')\n")
    error = failure(spec_file)
    assert (error["type"], error["message"], error["exit_code"]) == ("KeyError", "'no such column'", 1)


@pytest.mark.parametrize("ending, code", [("", 0), ("sys.exit(3)\n", 3)])
def test_a_scripts_cycles_are_collected_before_the_interpreters_teardown(tmp_path, rank0, ending, code):
    # A DDP model's cycles hold gloo's threads: freed at teardown they abort (SIGABRT) a script
    # that finished. Collected when the script ends, before the atexit handlers run.
    spec_file = script_spec(tmp_path, (
        "import atexit, sys\n"
        "atexit.register(lambda: print('teardown', flush=True))\n"
        "class Held:\n"
        "    def __del__(self):\n"
        "        print('collected', flush=True)\n"
        "def main():\n"
        "    held = Held()\n"
        "    held.me = held\n"
        "main()\n" + ending))
    assert script_worker.main([str(spec_file)]) == (0 if code == 0 else 1)
    lines = [r["message"] for r in records(spec_file) if r.get("stream") == "stdout"]
    assert lines == ["collected", "teardown"]
    if code:
        error = json.loads(RunSpec.read(spec_file).worker_error(0).read_text())
        assert error["exit_code"] == code


def test_an_exception_stays_the_cause_when_the_script_then_aborts_on_its_way_out(tmp_path, rank0):
    # torch 2.13's gloo, now and then: a line after the traceback, then SIGABRT at exit.
    spec_file = script_spec(tmp_path, (
        "import atexit, os, sys\n"
        "atexit.register(lambda: (print('terminate called without an active exception', file=sys.stderr,"
        " flush=True), os.abort()))\n"
        "raise ValueError('bad batch at step 2')\n"))
    error = failure(spec_file)
    assert (error["type"], error["message"], error["exit_code"]) == ("ValueError", "bad batch at step 2",
                                                                      -signal.SIGABRT)


def test_a_traceback_longer_than_the_tail_kept_still_names_its_exception(tmp_path, rank0):
    spec_file = script_spec(tmp_path, (
        "def a(n):\n    return b(n - 1) if n else int('x')\n"
        "def b(n):\n    return a(n - 1)\n"
        "a(60)\n"))
    error = failure(spec_file)
    assert "Traceback (most recent call last):" not in error["traceback"]  # beyond the tail kept
    assert (error["type"], error["message"]) == ("ValueError", "invalid literal for int() with base 10: 'x'")


def test_a_killed_script_is_named_killed_even_after_a_printed_traceback(tmp_path, rank0):
    # A traceback the script printed and went on from (logging.exception) is not why it ended.
    spec_file = script_spec(tmp_path, (
        "import os, signal, traceback\n"
        "try:\n    raise KeyError('handled')\nexcept KeyError:\n    traceback.print_exc()\n"
        "os.kill(os.getpid(), signal.SIGKILL)\n"))
    error = failure(spec_file)
    assert (error["type"], error["message"]) == ("Killed", "the script was killed by SIGKILL")


def test_a_silent_idle_script_is_dumped_and_ended(tmp_path, rank0):
    spec_file = script_spec(tmp_path, "import time\ndef wait():\n    time.sleep(60)\nwait()\n", hang_timeout_s=1)
    assert script_worker.main([str(spec_file)]) == 1
    stacks = RunSpec.read(spec_file).worker_stacks(0).read_text()
    assert "in wait" in stacks
    assert not RunSpec.read(spec_file).worker_error(0).exists()  # the stacks say it: a hang


def test_a_script_that_computes_without_output_is_not_hung(tmp_path, rank0):
    body = "import time\nend = time.monotonic() + 2.5\nwhile time.monotonic() < end:\n    pass\n"
    spec_file = script_spec(tmp_path, body, hang_timeout_s=1)
    assert script_worker.main([str(spec_file)]) == 0
    assert RunSpec.read(spec_file).worker_stacks(0).read_text() == ""  # never dumped


def test_a_blocked_script_whose_threads_tick_now_and_then_is_hung(tmp_path, rank0):
    # A process blocked in gloo still uses a little CPU (its threads); 3% of a core is no progress.
    body = ("import threading, time\n"
            "def tick():\n"
            "    while True:\n"
            "        start = time.thread_time()\n"
            "        while time.thread_time() - start < 0.03:\n"
            "            pass\n"
            "        time.sleep(1)\n"
            "threading.Thread(target=tick, daemon=True).start()\n"
            "def wait():\n    time.sleep(8)\nwait()\n")
    spec_file = script_spec(tmp_path, body, hang_timeout_s=1.5)
    assert script_worker.main([str(spec_file)]) == 1
    assert "in wait" in RunSpec.read(spec_file).worker_stacks(0).read_text()


def test_a_script_waiting_for_a_hung_peer_dumps_for_it_and_is_never_hung_itself(tmp_path, rank0):
    # The peer's request comes first (as a hung peer's worker writes it); then this script stays
    # silent for longer than its own timeout and goes on: dumped once, as a peer's, not ended.
    spec_file = script_spec(tmp_path, "", hang_timeout_s=1)
    spec = RunSpec.read(spec_file)
    request = spec.logs_dir / PEER_HANG_REQUEST
    (tmp_path / "train.py").write_text(f"import time\nopen({str(request)!r}, 'w').close()\n"
                                       "def wait():\n    time.sleep(2.5)\nwait()\n")
    assert script_worker.main([str(spec_file)]) == 0
    stacks = spec.worker_stacks(0).read_text()
    assert stacks.startswith(PEER_HANG_MARK) and "in wait" in stacks and HANG_DUMP_START not in stacks


@pytest.mark.parametrize("stop", ["SIGTERM", "SIGUSR1"])
def test_a_stopped_script_is_preempted(tmp_path, rank0, stop):
    body = ("import os, signal, time\n"
            f"os.kill(os.getppid(), signal.{stop})\n"  # the launcher's stop reaching its worker
            "time.sleep(30)\n")
    spec_file = script_spec(tmp_path, body)
    previous = signal.getsignal(getattr(signal, stop))
    assert script_worker.main([str(spec_file)]) == 0  # passed on: the script ended on it
    assert signal.getsignal(getattr(signal, stop)) == previous
    result = json.loads(RunSpec.read(spec_file).worker_result().read_text())
    assert result["preempted"] == stop


def test_report_and_should_stop_under_launch(tmp_path, monkeypatch, rank0):
    spec_file = script_spec(tmp_path, "")
    heartbeat = tmp_path / "beat"
    monkeypatch.setenv("SCALETRAIN_SPEC", str(spec_file))
    monkeypatch.setenv("SCALETRAIN_HEARTBEAT", str(heartbeat))
    monkeypatch.setattr(script_hooks, "_session", None)
    previous = signal.getsignal(signal.SIGTERM)
    try:
        scaletrain.report({"loss": 2.0})
        scaletrain.report({"loss": 1.0, "eval/accuracy": 0.5})
        assert heartbeat.exists()
        assert scaletrain.should_stop() is False  # the first call starts the clock
        os.kill(os.getpid(), signal.SIGUSR1)
        assert scaletrain.should_stop() is True
    finally:
        signal.signal(signal.SIGTERM, previous)
        signal.signal(signal.SIGUSR1, signal.SIG_DFL)
        script_hooks._session.reporter.on_end()
        monkeypatch.setattr(script_hooks, "_session", None)
    rows = [json.loads(line) for line in (RunSpec.read(spec_file).out_dir / "metrics.jsonl").read_text().splitlines()]
    assert rows == [{"split": "train", "step": 1, "loss": 2.0}, {"split": "train", "step": 2, "loss": 1.0},
                    {"split": "eval", "step": 2, "accuracy": 0.5}]


def test_script_job_settings(tmp_path, monkeypatch):
    (tmp_path / "t.py").write_text("")
    monkeypatch.chdir(tmp_path)
    settings = script_job("t.py", ["--", "--lr", "1"], None)
    assert settings == {"name": "t", "script": {"path": "t.py", "args": ["--lr", "1"]}}
    with pytest.raises(ConfigError, match="script 'missing.py' not found"):
        script_job("missing.py", [], None)


def test_launch_runs_a_module_loop_and_a_main_loop_in_process(tmp_path, monkeypatch):
    from tests.helpers.loops import loop_job, train_loop

    job = {k: v for k, v in loop_job(tmp_path).items() if k not in ("loop", "scale")}
    job["recovery"] = {"max_restarts": 0}
    importlib.import_module("scaletrain.launch")  # loaded in this process already: run_loop is no module name
    by_name = scaletrain.run_loop(train_loop, workers=1, config={"steps": 12}, job=job)
    assert by_name["steps"] == 12 and by_name["engine"] == "in-process"

    def train(ctx):
        train_loop(ctx)

    monkeypatch.setattr(train, "__module__", "__main__")  # as a notebook's own function
    by_value = scaletrain.run_loop(train, workers=1, config={"steps": 12}, job=job)
    assert by_value["weights_sha256"] == by_name["weights_sha256"]
    assert "SCALETRAIN_LOOP_KEY" not in os.environ  # the key was the call's alone
    importlib.import_module("scaletrain.launch")  # the engines' package must not hide the function
    assert callable(scaletrain.run_loop) and not isinstance(scaletrain.run_loop, type(sys))
