"""A TensorFlow job under scaletrain against a hand-written MultiWorkerMirroredStrategy script of
the same model (bench/baselines/mwms_digits.py, its processes started with TF_CONFIG by hand):
time to the first step (from the command's start) and the steady step time, 2 workers on this
machine, interleaved (the order rotated every repeat).

  mwms        2 x python bench/baselines/mwms_digits.py, TF_CONFIG on loopback ports
  scaletrain  scaletrain run examples/digits_keras.yaml --set train.max_steps=N (tracked in the
              embedded MLflow store, checkpoints every 100 steps, JSON logs, the hang watchdog)

    .venv/bin/python bench/tf_first_step.py --repeats 3 --steps 600
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import yaml

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import REPO  # noqa: E402

SCRIPT = REPO / "bench" / "baselines" / "mwms_digits.py"


def free_ports(n: int) -> list[int]:
    sockets = [socket.socket() for _ in range(n)]
    for s in sockets:
        s.bind(("127.0.0.1", 0))
    ports = [s.getsockname()[1] for s in sockets]
    for s in sockets:
        s.close()
    return ports


def measure_mwms(steps: int, cwd: Path) -> dict:
    ports = free_ports(2)
    cluster = {"worker": [f"127.0.0.1:{p}" for p in ports]}
    started = time.time()
    procs = []
    for index in range(2):
        env = {**os.environ, "TF_CONFIG": json.dumps({"cluster": cluster, "task": {"type": "worker", "index": index}})}
        procs.append(subprocess.Popen([sys.executable, str(SCRIPT), "--steps", str(steps)], cwd=cwd, env=env,
                                      stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True))
    outs = [p.communicate(timeout=600)[0] for p in procs]
    wall = time.time() - started
    if any(p.returncode for p in procs):
        return {"failed": f"exit {[p.returncode for p in procs]}", "wall_s": wall}
    found = json.loads([line for line in outs[0].splitlines() if line.startswith("{")][-1])
    return {"first_step_s": found["first_step_at"] - started, "step_time_s": found["step_time_s"], "wall_s": wall}


def measure_scaletrain(steps: int, cwd: Path) -> dict:
    job = yaml.safe_load((REPO / "examples" / "digits_keras.yaml").read_text())
    job["train"] = {**{k: v for k, v in job["train"].items() if k != "epochs"}, "max_steps": steps}
    job["task"]["target"] = "examples.digits_keras:DigitsKeras"
    job_file = cwd / "digits_keras.yaml"
    job_file.write_text(yaml.safe_dump(job))
    env = {k: v for k, v in os.environ.items() if k != "MLFLOW_TRACKING_URI"}
    env["PYTHONPATH"] = str(REPO)
    started = time.time()
    result = subprocess.run([sys.executable, "-m", "scaletrain", "run", str(job_file), "--json"], cwd=cwd, env=env,
                            capture_output=True, text=True, timeout=600)
    wall = time.time() - started
    if result.returncode != 0:
        return {"failed": f"exit {result.returncode}: {result.stderr.strip().splitlines()[-1:]}", "wall_s": wall}
    summary = json.loads(result.stdout)
    rows = [json.loads(line) for line in (Path(summary["run_dir"]) / "metrics.jsonl").read_text().splitlines()]
    windows = [row["step_time_s"] for row in rows if row["split"] == "train" and row["step"] > 100
               and row["step"] % 20 == 0]
    first = summary["started_at"] + summary["time_to_first_step_s"]
    return {"first_step_s": first - started, "step_time_s": statistics.median(windows), "wall_s": wall}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--steps", type=int, default=600)
    parser.add_argument("--out", type=Path, default=REPO / "bench" / "results" / "latest" / "tf_first_step.json")
    args = parser.parse_args()
    measures = {"mwms": measure_mwms, "scaletrain": measure_scaletrain}
    variants = list(measures)
    rows: dict[str, list[dict]] = {v: [] for v in variants}
    failures: dict[str, list[str]] = {v: [] for v in variants}
    with tempfile.TemporaryDirectory(prefix="bench-tf-") as scratch:
        for repeat in range(args.repeats):
            for variant in variants[repeat % 2:] + variants[: repeat % 2]:
                row = measures[variant](args.steps, Path(scratch))
                while "failed" in row and len(failures[variant]) < args.repeats:
                    failures[variant].append(row["failed"])
                    print(f"{variant:10s} FAILED: {row['failed']}", flush=True)
                    row = measures[variant](args.steps, Path(scratch))
                if "failed" in row:
                    raise RuntimeError(f"{variant} failed {len(failures[variant]) + 1} times: {row['failed']}")
                rows[variant].append(row)
                print(f"{variant:10s} first step {row['first_step_s']:.2f} s  step {row['step_time_s'] * 1e3:.2f} ms  "
                      f"wall {row['wall_s']:.1f} s", flush=True)
    median = {v: {k: statistics.median(r[k] for r in rows[v]) for k in ("first_step_s", "step_time_s", "wall_s")}
              for v in variants}
    result = {
        "bench": "tf_first_step", "steps": args.steps, "repeats": args.repeats, "workers": 2,
        "median": median, "runs": rows, "failed_runs": failures,
        "ratio_first_step": median["scaletrain"]["first_step_s"] / median["mwms"]["first_step_s"],
        "ratio_step_time": median["scaletrain"]["step_time_s"] / median["mwms"]["step_time_s"],
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2))
    print(json.dumps({k: v for k, v in result.items() if k.startswith("ratio") or k == "median"}, indent=2))


if __name__ == "__main__":
    main()
