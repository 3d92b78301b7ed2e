"""A job on two nodes with nothing shared but checkpoint storage: two launchers on this machine
act as two machines, each with its own working directory and run directory, checkpoints on the
local S3 server. The same job on one node with the same workers is the reference."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest
import yaml

from tests.helpers.run import REPO, stop_group
from tests.helpers.servers import free_port
from tests.helpers.tasks import toy_job

pytestmark = pytest.mark.distributed

STEPS = 40


def node_job(tmp_path: Path, nodes: str | int = 2, **sections) -> dict:
    """2 workers, one per node; checkpoints on the S3 server; each section given is merged."""
    job = toy_job(
        tmp_path, task={"args": {"step_sleep": 0.03}}, train={"max_steps": STEPS, "log_every": 5},
        scale={"workers": 2, "nodes": nodes, "rdzv_endpoint": f"127.0.0.1:{free_port()}"},
        checkpoint={"dir": "s3://ckpt/nodes", "every_steps": 5},
        recovery={"max_restarts": 1, "node_wait_s": 5},
    )
    for key, value in sections.items():
        job[key] = {**job[key], **value} if isinstance(value, dict) and key in job else value
    job["task"]["args"] = {"step_sleep": 0.03, **job["task"].get("args", {})}
    job.pop("run_dir")  # each node's own ./runs
    return job


class Node:
    """One launcher, as a user starts it on one machine: its own working directory. Every
    Node still running when its test ends is stopped with its workers (see _stop_nodes)."""

    started: list[subprocess.Popen] = []

    def __init__(self, root: Path, job: dict, rank: int, *args: str, env: dict | None = None):
        self.dir = root / f"node{rank}"
        self.dir.mkdir(parents=True, exist_ok=True)
        (self.dir / "job.yaml").write_text(yaml.safe_dump(job))
        self.rank = rank
        command = [sys.executable, "-m", "scaletrain", *(args or ("run", "job.yaml")), "--json"]
        if rank and not args:
            command += ["--node-rank", str(rank)]
        self.proc = subprocess.Popen(
            command, cwd=self.dir, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
            env={**os.environ, "PYTHONPATH": str(REPO), **(env or {})}, start_new_session=True,
        )
        Node.started.append(self.proc)

    def wait(self, timeout: float = 240) -> dict:
        out, self.err = self.proc.communicate(timeout=timeout)
        self.code = self.proc.returncode
        try:
            return json.loads(out.strip().splitlines()[-1])
        except (ValueError, IndexError):
            raise AssertionError(f"node {self.rank}: no JSON outcome; stderr:\n{self.err[-3000:]}") from None

    def run_dir(self) -> Path:
        return next((self.dir / "runs" / "toy").iterdir())

    def kill_tree(self) -> float:
        """The machine is gone: the launcher and its workers die at once."""
        launcher = psutil.Process(self.proc.pid)
        processes = [launcher, *launcher.children(recursive=True)]
        killed_at = time.time()
        for process in processes:
            try:
                process.kill()
            except psutil.NoSuchProcess:
                pass
        self.proc.wait(timeout=30)
        return killed_at


@pytest.fixture(autouse=True)
def _stop_nodes():
    yield
    while Node.started:
        stop_group(Node.started.pop())


def start_nodes(root: Path, job: dict, env1: dict | None = None) -> tuple[Node, Node]:
    """Node 1 first: it waits for the driver; torch's rendezvous would make it rank 0 (it
    orders nodes by address, then pid), scaletrain's puts the driver's workers first."""
    other = Node(root, job, 1, env=env1)
    time.sleep(0.5)
    driver = Node(root, job, 0)
    return driver, other


def steps_seen(node: Node, at_least: int, timeout: float = 120) -> None:
    """Wait until the driver's metrics file has reached ``at_least`` steps."""
    deadline = time.time() + timeout
    while time.time() < deadline:
        try:
            rows = (node.run_dir() / "metrics.jsonl").read_text().splitlines()
            if any(json.loads(r)["step"] >= at_least for r in rows if r.strip()):
                return
        except (OSError, StopIteration, ValueError):
            pass
        assert node.proc.poll() is None, node.proc.communicate()[1][-3000:]
        time.sleep(0.1)
    raise AssertionError(f"node {node.rank} did not reach step {at_least}")


@pytest.fixture(scope="module")
def reference(tmp_path_factory, s3_server) -> dict:
    """The same job on one node, 2 workers: its summary."""
    root = tmp_path_factory.mktemp("one-node")
    node = Node(root, {**node_job(root, nodes=1), "checkpoint": {"every_steps": 5}}, 0)
    summary = node.wait()
    assert node.code == 0, node.err[-3000:]
    return summary


def test_two_nodes_give_one_nodes_weights_and_survive_a_killed_worker(tmp_path, reference):
    job = node_job(tmp_path)
    # Rank 1 (node 1's worker) is killed after step 12: both nodes restart from step 10.
    driver, other = start_nodes(tmp_path, job, env1={"SCALETRAIN_FAULT": "sigkill:rank=1:step=12"})
    first, second = driver.wait(), other.wait()
    assert (driver.code, other.code) == (0, 0), driver.err[-2000:] + other.err[-2000:]
    assert first["run_id"] == second["run_id"] and first["status"] == second["status"] == "finished"
    assert first["weights_sha256"] == reference["weights_sha256"]
    assert first["restarts"] == second["restarts"] == 1
    assert first["resumed_from_step"] == 10
    # The driver's run directory has the job's outputs; node 1's has its own worker's log only.
    run0, run1 = driver.run_dir(), other.run_dir()
    assert {"metrics.jsonl", "model.safetensors", "summary.json"} <= {p.name for p in run0.iterdir()}
    assert not (run1 / "metrics.jsonl").exists() and not (run1 / "model.safetensors").exists()
    assert (run1 / "logs" / "worker-1.jsonl").exists() and not (run0 / "logs" / "worker-1.jsonl").exists()
    steps = [json.loads(line)["step"] for line in (run0 / "metrics.jsonl").read_text().splitlines()
             if json.loads(line)["split"] == "train"]
    assert steps == sorted(set(steps)) and steps[-1] == STEPS  # redone steps are not written twice
    # What node 1 wrote of each checkpoint was uploaded, then removed from its disk.
    assert not list(run1.glob(".staging-*"))


def test_sigterm_to_one_node_checkpoints_the_whole_job_and_both_resume(tmp_path, reference):
    job = node_job(tmp_path)
    driver, other = start_nodes(tmp_path, job)
    steps_seen(driver, 10)
    other.proc.send_signal(signal.SIGTERM)
    first, second = driver.wait(), other.wait()
    assert (driver.code, other.code) == (75, 75), driver.err[-2000:] + other.err[-2000:]
    assert first["status"] == second["status"] == "preempted"
    assert first["checkpoint_step"] == second["checkpoint_step"] == first["steps"] < STEPS
    # Each node resumes its own run directory; they meet again and finish the job.
    resumed = [Node(tmp_path, job, node.rank, "resume", str(node.run_dir().relative_to(node.dir)))
               for node in (driver, other)]
    outcomes = [node.wait() for node in resumed]
    assert [node.code for node in resumed] == [0, 0], resumed[0].err[-2000:] + resumed[1].err[-2000:]
    assert outcomes[0]["resumed_from_step"] == first["steps"]
    assert outcomes[0]["weights_sha256"] == reference["weights_sha256"]


def test_losing_a_node_for_good_continues_on_the_other(tmp_path, reference):
    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    job = node_job(tmp_path, nodes="1:2",
                   tracking={"enabled": True, "uri": uri, "log_model": False, "system_metrics_every_s": 0})
    driver, other = start_nodes(tmp_path, job)
    steps_seen(driver, 12)
    killed_at = other.kill_tree()
    summary = driver.wait()
    assert driver.code == 0, driver.err[-3000:]
    assert summary["status"] == "finished" and summary["steps"] == STEPS and summary["restarts"] == 1
    # The global batch is kept (2 accumulation steps on one worker), so the numbers are those
    # of the uninterrupted job, bit for bit.
    assert summary["weights_sha256"] == reference["weights_sha256"]
    log = (driver.run_dir() / "logs" / "worker-0.jsonl").read_text()
    assert ("running on 1 of the job's 2 workers (a node was lost, or has not joined): 2 "
            "accumulation steps per optimizer step") in log
    rows = [json.loads(line) for line in (driver.run_dir() / "metrics.jsonl").read_text().splitlines()]
    steps = [row["step"] for row in rows if row["split"] == "train"]
    assert steps == sorted(set(steps)) and steps[-1] == STEPS
    # One MLflow run, every reported step once: 1, 5, 10, ... 40, across the node's loss.
    from mlflow import MlflowClient

    client = MlflowClient(tracking_uri=uri)
    experiment = client.get_experiment_by_name("toy")
    assert [r.info.run_id for r in client.search_runs([experiment.experiment_id])] == [summary["mlflow_run_id"]]
    history = client.get_metric_history(summary["mlflow_run_id"], "train/loss")
    assert [m.step for m in history] == [1, *range(5, STEPS + 1, 5)]
    first_step = summary["started_at"] + summary["time_to_first_step_s"]  # of the last attempt
    print(f"node lost: SIGKILL to the first step on the surviving node {first_step - killed_at:.1f} s")


def test_a_worker_failing_on_another_node_is_named_by_the_driver(tmp_path, s3_server):
    job = node_job(tmp_path, task={"args": {"fail_rank": 1, "fail_at_step": 3}},
                   recovery={"max_restarts": 0}, checkpoint={"at_end": False})
    driver, other = start_nodes(tmp_path, job)
    first, _second = driver.wait(), other.wait()
    assert (driver.code, other.code) == (1, 1)
    # Not the driver's own ranks losing their peer: rank 1's error, from node 1.
    assert first["error"].startswith("worker rank 1 failed: RuntimeError: injected failure on rank 1")
    logs = driver.run_dir() / "logs"
    assert json.loads((logs / "worker-1.error.json").read_text())["type"] == "RuntimeError"
    assert "worker failed: RuntimeError: injected failure on rank 1" in (logs / "worker-1.jsonl").read_text()


def test_a_node_with_a_different_job_is_refused(tmp_path, s3_server):
    job = node_job(tmp_path)
    driver = Node(tmp_path, job, 0)
    other = Node(tmp_path / "other", {**job, "optim": {**job["optim"], "lr": 0.5}}, 1)
    outcome = other.wait(timeout=120)
    assert other.code == 2
    assert outcome["error"].startswith("node 1's job differs from the driver's (configuration hash ")
    assert outcome["error"].endswith("start every node with the same job file and --set options")
    driver.proc.send_signal(signal.SIGTERM)  # still waiting for node 1: stops before any worker
    assert driver.wait(timeout=60)["status"] == "failed" and driver.code == 143
