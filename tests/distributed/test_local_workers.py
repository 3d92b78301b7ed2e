"""Real worker processes: 2 gloo ranks started by the local (torch elastic) engine."""

import json
import os
import time
from pathlib import Path

import pytest

import scaletrain
from scaletrain.errors import WorkerFailedError
from tests.helpers.run import assert_weights_close, pid_alive, read_metrics, scaletrain_cli
from tests.helpers.tasks import toy_job

pytestmark = pytest.mark.distributed


def losses(summary):
    return [row["loss"] for row in read_metrics(summary["run_dir"])]


@pytest.mark.parametrize("grad_accum", [1, 2])
def test_two_workers_match_one_worker_with_twice_the_batch(tmp_path, grad_accum):
    train = {"max_steps": 20, "log_every": 1, "grad_accum": grad_accum}
    one = scaletrain.run(toy_job(tmp_path, data={"batch_size": 16}, train=train))
    two = scaletrain.run(
        toy_job(tmp_path, data={"batch_size": 8}, train=train, scale={"workers": 2})
    )
    assert two["engine"] == "local" and two["strategy"] == "ddp" and two["world_size"] == 2
    assert len(losses(two)) == 20
    assert losses(two) == pytest.approx(losses(one), abs=1e-5)
    assert two["eval"]["accuracy"] == pytest.approx(one["eval"]["accuracy"], abs=1e-6)
    # The same weights within float32 rounding (gradients summed in another order), not bitwise.
    assert_weights_close(one, two)


def test_same_seed_gives_bit_identical_weights(tmp_path):
    job = toy_job(tmp_path, task={"args": {"dropout": 0.1}}, scale={"workers": 2})
    first = scaletrain.run(job)
    second = scaletrain.run(job)
    assert first["weights_sha256"] == second["weights_sha256"]
    assert len(first["weights_sha256"]) == 64


def test_a_failing_worker_fails_the_job_and_leaves_no_process(tmp_path):
    pid_dir = tmp_path / "pids"
    pid_dir.mkdir()
    job = toy_job(
        tmp_path,
        task={"args": {"fail_rank": 1, "fail_at_step": 5, "pid_dir": str(pid_dir)}},
        scale={"workers": 2},
    )
    with pytest.raises(WorkerFailedError) as info:
        scaletrain.run(job)
    message = str(info.value)
    assert message.startswith("worker rank 1 failed: RuntimeError: injected failure on rank 1")
    assert "worker-1.jsonl" in message
    assert info.value.rank == 1
    pids = [int(p.read_text()) for p in pid_dir.iterdir()]
    assert len(pids) == 2
    deadline = time.time() + 10
    while any(pid_alive(pid) for pid in pids) and time.time() < deadline:
        time.sleep(0.1)
    assert not any(pid_alive(pid) for pid in pids), "a worker outlived the failed job"
    log_lines = [json.loads(line) for line in Path(info.value.log_path).read_text().splitlines()]
    failure = [line for line in log_lines if line["level"] == "error"]
    assert failure and "Traceback" in failure[0]["exception"]


def test_cli_run_json_clean_exit_and_worker_logs(tmp_path):
    job_file = tmp_path / "toy.yaml"
    job_file.write_text(json.dumps(toy_job(tmp_path, scale={"workers": 2}, train={"max_steps": 6, "log_every": 2},
                                           tracking={"enabled": True, "uri": f"sqlite:///{tmp_path / 'mlflow.db'}",
                                                     "log_model": False})))
    result = scaletrain_cli("run", str(job_file), "--json")
    assert result.returncode == 0, result.stderr
    assert "terminate called" not in result.stderr
    assert "Traceback" not in result.stderr
    summary = json.loads(result.stdout)
    run_dir = Path(summary["run_dir"])
    assert summary == json.loads((run_dir / "summary.json").read_text())
    assert summary["status"] == "finished" and summary["steps"] == 6
    for key in ("run_id", "train", "eval", "wall_time_s", "weights_sha256", "time_to_first_step_s"):
        assert summary[key] is not None
    for rank in (0, 1):
        records = [json.loads(l) for l in (run_dir / "logs" / f"worker-{rank}.jsonl").read_text().splitlines()]
        assert records, f"rank {rank} wrote no log"
        for record in records:
            assert {"timestamp", "level", "message", "run_id", "trace_id", "rank", "step"} <= set(record)
            assert record["rank"] == rank and record["run_id"] == summary["run_id"]
        assert len({r["trace_id"] for r in records}) == 1
        started = next(r for r in records if r["message"] == "worker started")
        # Cores are split between the workers, as torchrun would, not oversubscribed.
        assert started["threads"] == max(1, len(os.sched_getaffinity(0)) // 2)
        assert started["backend"] == "gloo" and started["world_size"] == 2
        # Every rank reports its own step times (the bench's per-rank spread reads them).
        finished = next(r for r in records if r["message"] == "worker finished")
        assert finished["steps"] == 6 and finished["step_time"]["steps"] == 6
        assert 0 < finished["step_time"]["median_s"] <= finished["step_time"]["p90_s"]
    # Every line of every log of the run (workers, launcher, tracking process, torch elastic's
    # agent routed into launcher.jsonl) carries the run's trace id and this invocation's request id.
    lines = [json.loads(line) for path in (run_dir / "logs").glob("*.jsonl") for line in path.read_text().splitlines()]
    assert {r["logger"].split(".")[0] for r in lines} >= {"scaletrain", "scaletrain_launcher", "torch"}
    assert {(r["trace_id"], r["request_id"]) for r in lines} == {(records[0]["trace_id"], records[0]["request_id"])}
    assert records[0]["request_id"] and all({"timestamp", "level", "message"} <= set(r) for r in lines)
    assert not [r for r in lines if any(key.startswith("_") for key in r)]  # no library's private extras
    # stderr is not a terminal here, so the workers' JSON lines reach it too.
    stderr_records = [json.loads(l) for l in result.stderr.splitlines() if l.startswith("{")]
    assert {r["rank"] for r in stderr_records if r["logger"].startswith("scaletrain.")} == {0, 1}


def test_cli_worker_failure_exit_code_and_message(tmp_path):
    job_file = tmp_path / "toy.yaml"
    job = toy_job(tmp_path, task={"args": {"fail_rank": 1, "fail_at_step": 2}}, scale={"workers": 2})
    job_file.write_text(json.dumps(job))
    result = scaletrain_cli("run", str(job_file))
    assert result.returncode == 1
    errors = [l for l in result.stderr.splitlines() if l.startswith("error:")]
    assert errors == [
        errors[0]
    ] and errors[0].startswith("error: worker rank 1 failed: RuntimeError: injected failure on rank 1")
    assert "Traceback" not in result.stderr.replace('"exception": "Traceback', "")


def test_a_killed_worker_is_named_with_its_signal(tmp_path):
    job = toy_job(
        tmp_path,
        task={"args": {"fail_rank": 1, "fail_at_step": 3, "fail_kind": "sigkill"}},
        scale={"workers": 2},
    )
    with pytest.raises(WorkerFailedError) as info:
        scaletrain.run(job)
    assert str(info.value).startswith(
        "worker rank 1 failed: the process was killed by SIGKILL (out of memory?)"
    )


def test_ctrl_c_stops_the_workers_and_exits_cleanly(tmp_path, processes):
    import signal
    import subprocess
    import sys

    pid_dir = tmp_path / "pids"
    pid_dir.mkdir()
    job = toy_job(
        tmp_path,
        task={"args": {"pid_dir": str(pid_dir), "samples": 4096}},
        train={"max_steps": 100000, "log_every": 50},
        scale={"workers": 2},
    )
    job_file = tmp_path / "long.yaml"
    job_file.write_text(json.dumps(job))
    proc = processes(
        [sys.executable, "-m", "scaletrain", "run", str(job_file)],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
    )
    deadline = time.time() + 60
    while len(list(pid_dir.iterdir())) < 2 and time.time() < deadline:
        time.sleep(0.2)
    time.sleep(1.0)
    proc.send_signal(signal.SIGINT)
    _, stderr = proc.communicate(timeout=60)
    assert proc.returncode == 130
    assert stderr.strip().splitlines()[-1] == "error: interrupted by SIGINT; the workers were stopped"
    assert "Traceback" not in stderr
    pids = [int(p.read_text()) for p in pid_dir.iterdir()]
    deadline = time.time() + 10
    while any(pid_alive(pid) for pid in pids) and time.time() < deadline:
        time.sleep(0.1)
    assert not any(pid_alive(pid) for pid in pids)
    summaries = list((tmp_path / "runs").rglob("summary.json"))
    assert [json.loads(s.read_text())["status"] for s in summaries] == ["interrupted"]
