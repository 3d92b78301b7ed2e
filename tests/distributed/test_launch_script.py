"""`scaletrain launch`: a torchrun script that knows nothing of scaletrain (tests/helpers/
torchrun_ddp.py: DDP on gloo, plain mlflow.log_metric) runs unchanged on 2 workers, is
restarted after a SIGKILL, logs into the job's one MLflow run, has its failures and hangs named,
and still runs under torchrun itself."""

import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest

from scaletrain.recovery.watchdog import PEER_HANG_MARK
from tests.helpers.run import REPO

pytestmark = pytest.mark.distributed

mlflow = pytest.importorskip("mlflow")
from mlflow import MlflowClient  # noqa: E402

SCRIPT = REPO / "tests" / "helpers" / "torchrun_ddp.py"


def launch(tmp_path, *args, script_args=(), wait=True):
    command = [sys.executable, "-m", "scaletrain", "launch", "--workers", "2", *args, str(SCRIPT), "--",
               *script_args]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO / "src"), str(REPO)])}
    env.pop("MLFLOW_TRACKING_URI", None)
    process = subprocess.Popen(command, cwd=tmp_path, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                               text=True, env=env)
    if not wait:
        return process
    out, err = process.communicate(timeout=240)
    return process.returncode, out, err


def script_child(process, rank):
    """The script's own process for ``rank`` (a child of that rank's script worker)."""
    for child in psutil.Process(process.pid).children(recursive=True):
        try:
            if "-c" in child.cmdline() and str(SCRIPT) in child.cmdline() and child.environ().get("RANK") == str(rank):
                return child
        except psutil.Error:
            continue
    return None


def log_lines(run_dir, rank):
    return [json.loads(line) for line in (Path(run_dir) / "logs" / f"worker-{rank}.jsonl").read_text().splitlines()]


def test_a_killed_rank_restarts_both_and_the_script_logs_into_the_one_mlflow_run(tmp_path):
    process = launch(tmp_path, "--max-restarts", "1", "--json", script_args=["--steps", "30", "--sleep", "0.1"],
                     wait=False)
    deadline, killed = time.monotonic() + 120, False
    while not killed and time.monotonic() < deadline and process.poll() is None:
        child = script_child(process, 1)
        runs = list((tmp_path / "runs" / "torchrun_ddp").glob("*/logs/worker-1.jsonl"))
        if child is not None and runs and "rank 1 step 3 " in runs[0].read_text():
            child.send_signal(signal.SIGKILL)
            killed = True
        time.sleep(0.1)
    out, err = process.communicate(timeout=240)
    assert killed and process.returncode == 0, err[-3000:]
    summary = json.loads(out.strip().splitlines()[-1])  # the outcome: the last line, after the script's own
    assert summary["status"] == "finished" and summary["restarts"] == 1 and summary["strategy"] == "script"
    assert "weights" not in summary or summary["weights"] is None
    # One MLflow run: the script's own mlflow.log_metric calls (rank 0) landed in it.
    client = MlflowClient(f"sqlite:///{tmp_path / 'mlflow.db'}")
    runs = [run for e in client.search_experiments() for run in client.search_runs([e.experiment_id])]
    assert len(runs) == 1 and runs[0].info.run_id == summary["mlflow_run_id"]
    run = runs[0]
    assert run.info.status == "FINISHED" and run.data.tags["scaletrain.restarts"] == "1"
    assert {m.step for m in client.get_metric_history(run.info.run_id, "loss")} == set(range(30))
    assert run.data.params["script.args.steps"] == "30" and run.data.params["script.args.sleep"] == "0.1"
    assert "logs" in [a.path for a in client.list_artifacts(run.info.run_id)]
    # Each rank's output, a timestamped JSON record per line, both attempts.
    lines = [entry for entry in log_lines(summary["run_dir"], 1) if entry.get("stream") == "stdout"]
    assert lines[0]["message"] == "rank 1 step 0 loss " + lines[0]["message"].split("loss ")[1]
    assert lines[0]["timestamp"] and lines[0]["rank"] == 1
    assert any(e["message"].endswith("restarts 1") for e in lines) and any(e["message"].endswith("restarts 0") for e in lines)
    assert "restarting the workers after worker rank 1 failed: Killed: the script was killed by SIGKILL" in err


def test_a_failing_script_names_the_rank_and_its_exception(tmp_path):
    code, out, err = launch(tmp_path, script_args=["--steps", "10", "--fail-at", "2"])
    assert code == 1
    assert "error: worker rank 1 failed: ValueError: bad batch at step 2 (details: " in err


def test_a_hung_script_is_dumped_and_named(tmp_path):
    # Rank 1 sleeps; rank 0 computes 3.5 s more, then waits for it in DDP's all-reduce: when rank 1
    # times out (4 s) rank 0 has been silent too short to time out itself; asked by rank 1's
    # worker, it dumps where it waits. The stacks tell them apart.
    code, out, err = launch(tmp_path, "--set", "recovery.hang_timeout_s=4",
                            script_args=["--steps", "10", "--hang-at", "2", "--busy-at-hang", "3.5"])
    assert code == 1
    assert re.search(r"error: worker rank 1 failed: made no progress for 4 s, in torchrun_ddp\.py:\d+ main "
                     r"\(hang watchdog; rank 0 waited for it in the gradients' all-reduce \(backward\)\)", err), err[-2000:]
    stacks = next((tmp_path / "runs" / "torchrun_ddp").glob("*/logs/worker-1.stacks.txt")).read_text()
    assert "torchrun_ddp.py" in stacks and "in main" in stacks
    peer = next((tmp_path / "runs" / "torchrun_ddp").glob("*/logs/worker-0.stacks.txt")).read_text()
    assert peer.startswith(PEER_HANG_MARK) and "in backward" in peer, peer[:500]


def test_the_same_script_runs_under_torchrun(tmp_path):
    env = {**os.environ, "MLFLOW_TRACKING_URI": f"sqlite:///{tmp_path / 'plain.db'}"}
    result = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2", str(SCRIPT),
         "--steps", "3"], cwd=tmp_path, capture_output=True, text=True, timeout=240, env=env)
    assert result.returncode == 0, result.stderr[-2000:]
    assert "rank 1 step 2 loss" in result.stdout


def test_a_script_that_asks_stops_where_its_ranks_agree_and_reports_its_metrics(tmp_path):
    reporting = REPO / "tests" / "helpers" / "torchrun_reporting.py"
    command = [sys.executable, "-m", "scaletrain", "launch", "--workers", "2", str(reporting), "--",
               "--steps", "400", "--sleep", "0.05"]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO / "src"), str(REPO)])}
    env.pop("MLFLOW_TRACKING_URI", None)
    process = subprocess.Popen(command, cwd=tmp_path, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                               env=env)
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline and process.poll() is None:
        metrics = list((tmp_path / "runs" / "torchrun_reporting").glob("*/metrics.jsonl"))
        if metrics and len(metrics[0].read_text().splitlines()) >= 5:
            break
        time.sleep(0.1)
    process.send_signal(signal.SIGTERM)
    out, err = process.communicate(timeout=120)
    assert process.returncode == 75, err[-3000:]  # preempted: resumable
    stopped_at = int(out.split("stopping at step ")[1].split()[0])
    [run_dir] = (tmp_path / "runs" / "torchrun_reporting").iterdir()
    steps = [json.loads(line)["step"] for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert steps == list(range(1, stopped_at + 1)) and 5 <= stopped_at < 400
    client = MlflowClient(f"sqlite:///{tmp_path / 'mlflow.db'}")
    [run] = [run for e in client.search_experiments() for run in client.search_runs([e.experiment_id])]
    assert run.info.status == "KILLED"
    assert [m.step for m in client.get_metric_history(run.info.run_id, "train/loss")] == steps
