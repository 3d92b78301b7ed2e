"""Two nodes against one: the same job with the same two workers, on one launcher or on two
launchers that act as two machines (each its own working directory and run directory, meeting
through the driver's rendezvous on 127.0.0.1), interleaved A B B A; and losing a node for good
(`scale.nodes: 1:2`, node 1's launcher and worker SIGKILLed): the time from the kill to the first
step on the surviving node, which continues alone with twice the accumulation.

Digits, 2 workers of one thread each, tracking and checkpoints off for the speed rows; checkpoints every 50 steps
on local disk for the node loss (both "machines" are this one, so a local path is shared).

    .venv/bin/python bench/nodes.py --repeats 2 --steps 600
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import psutil
import yaml

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import REPO, emit, steady_steps_per_s  # noqa: E402


def free_port() -> int:
    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def job_file(root: Path, steps: int, nodes: str | int, **extra) -> Path:
    job = yaml.safe_load((REPO / "examples" / "digits.yaml").read_text())
    job["task"]["target"] = "digits:DigitsTask"
    job["train"] = {**job["train"], "max_steps": steps, "epochs": None, "eval_every": None}
    # One thread per worker on both sides: two "machines" here share these cores, and the
    # thread count changes a CPU kernel's summation order (so the weights' bits).
    job["scale"] = {"workers": 2, "nodes": nodes, "rdzv_endpoint": f"127.0.0.1:{free_port()}",
                    "threads_per_worker": 1}
    job["tracking"] = {"enabled": False}
    job["checkpoint"] = {"at_end": False}
    job["recovery"] = {"max_restarts": 0}
    for key, value in extra.items():
        job[key] = {**job.get(key, {}), **value}
    if nodes == 1:
        job["scale"].pop("rdzv_endpoint")
    path = root / "job.yaml"
    path.write_text(yaml.safe_dump(job))
    return path


def launcher(root: Path, job: Path, rank: int) -> subprocess.Popen:
    directory = root / f"node{rank}"
    directory.mkdir(parents=True, exist_ok=True)
    command = [sys.executable, "-m", "scaletrain", "run", str(job), "--json"]
    if rank:
        command += ["--node-rank", str(rank)]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO / "examples"), str(REPO)])}
    return subprocess.Popen(command, cwd=directory, env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)


def outcome(proc: subprocess.Popen, timeout: float = 600) -> dict:
    out, err = proc.communicate(timeout=timeout)
    if proc.returncode != 0:
        raise RuntimeError(f"scaletrain failed ({proc.returncode}): {err[-3000:]}")
    return json.loads(out.strip().splitlines()[-1])


def one_run(nodes: int, steps: int) -> dict:
    with tempfile.TemporaryDirectory(prefix="st-nodes-") as tmp:
        root = Path(tmp)
        job = job_file(root, steps, nodes)
        procs = [launcher(root, job, rank) for rank in range(nodes)]
        summaries = [outcome(proc) for proc in procs]
        driver = summaries[0]
        return {"first_step_s": driver["time_to_first_step_s"],
                "steps_per_s": steady_steps_per_s(driver["run_dir"], skip=50),
                "weights_sha256": driver["weights_sha256"]}


def node_loss(steps: int, kill_after: int) -> dict:
    with tempfile.TemporaryDirectory(prefix="st-node-loss-") as tmp:
        root = Path(tmp)
        job = job_file(root, steps, "1:2", checkpoint={"every_steps": 50, "dir": str(root / "ckpt")},
                       recovery={"max_restarts": 1, "node_wait_s": 5})
        driver, other = launcher(root, job, 0), launcher(root, job, 1)
        metrics = None
        while metrics is None or not _reached(metrics, kill_after):
            time.sleep(0.05)
            found = list((root / "node0" / "runs").glob("digits/*/metrics.jsonl"))
            metrics = found[0] if found else None
            if driver.poll() is not None:
                raise RuntimeError(driver.communicate()[1][-3000:])
        processes = [psutil.Process(other.pid), *psutil.Process(other.pid).children(recursive=True)]
        killed_at = time.time()
        for process in processes:
            process.kill()
        other.wait()
        summary = outcome(driver)
        first_step = summary["started_at"] + summary["time_to_first_step_s"]
        return {"kill_to_first_step_s": round(first_step - killed_at, 2), "node_wait_s": 5,
                "resumed_from_step": summary["resumed_from_step"], "steps": summary["steps"]}


def _reached(metrics: Path, step: int) -> bool:
    try:
        return any(json.loads(line)["step"] >= step for line in metrics.read_text().splitlines())
    except (OSError, ValueError):
        return False


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=600)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--out")
    args = parser.parse_args()
    runs: dict[str, list[dict]] = {"one node": [], "two nodes": []}
    for repeat in range(args.repeats):
        order = ["one node", "two nodes"] if repeat % 2 == 0 else ["two nodes", "one node"]
        for name in order:
            runs[name].append(one_run(1 if name == "one node" else 2, args.steps))
            print(f"{name}: {runs[name][-1]}", file=sys.stderr)
    rows = {name: {"first_step_s": statistics.median(r["first_step_s"] for r in found),
                   "steps_per_s": statistics.median(r["steps_per_s"] for r in found), "runs": found}
            for name, found in runs.items()}
    same = len({r["weights_sha256"] for found in runs.values() for r in found}) == 1
    loss = node_loss(max(300, args.steps // 2), kill_after=120)
    print(f"node loss: {loss}", file=sys.stderr)
    emit({"bench": "nodes", "steps": args.steps, "repeats": args.repeats, "rows": rows,
          "two_over_one_steps_per_s": rows["two nodes"]["steps_per_s"] / rows["one node"]["steps_per_s"],
          "two_over_one_first_step": rows["two nodes"]["first_step_s"] / rows["one node"]["first_step_s"],
          "same_weights": same, "node_loss": loss}, args.out)


if __name__ == "__main__":
    main()
