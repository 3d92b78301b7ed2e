"""Quick side-by-side: scaletrain (local engine, 2 workers) vs a hand-written DDP loop under
torchrun, on the digits MLP with the same batch, optimizer, schedule and clipping.

Runs A B A B ... so machine noise hits both alike, and prints medians:
time from command start to the first finished step, and steady-state steps/s (from step
`log_every` to the end, eval off, tracking off: bench/tracking_overhead.py measures that). The full benchmark suite will live beside this file.

    .venv/bin/python bench/quick_ddp_compare.py --repeats 3 --steps 600
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import BIN, REPO, run_scaletrain, steady_steps_per_s  # noqa: E402


def run_scaletrain_digits(steps: int, workers: int, run_dir: str) -> dict:
    started = time.time()
    summary = run_scaletrain("examples/digits.yaml", [
        f"train.max_steps={steps}", "train.epochs=null", "train.eval_every=null",
        f"scale.workers={workers}", f"run_dir={run_dir}", "tracking.enabled=false",
    ])
    first_step_at = summary["started_at"] + summary["time_to_first_step_s"]
    return {"first_step_s": first_step_at - started,
            "steps_per_s": steady_steps_per_s(summary["run_dir"])}


def run_torchrun(steps: int, workers: int) -> dict:
    started = time.time()
    out = subprocess.run(
        [str(BIN / "torchrun"), "--standalone", f"--nproc-per-node={workers}",
         "bench/baselines/ddp_digits.py", f"--steps={steps}"],
        cwd=REPO, capture_output=True, text=True,
    )
    lines = [l for l in out.stdout.splitlines() if l.startswith("{")]
    if not lines:
        raise RuntimeError(f"the baseline failed before reporting:\n{out.stderr[-3000:]}")
    result = json.loads(lines[-1])
    # Raw DDP scripts sometimes die at exit (SIGABRT in destroy_process_group); count it.
    return {"first_step_s": result["first_step_at"] - started, "steps_per_s": result["steps_per_s"],
            "unclean_exit": out.returncode != 0}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--steps", type=int, default=600)
    parser.add_argument("--workers", type=int, default=2)
    args = parser.parse_args()
    results: dict[str, list[dict]] = {"scaletrain": [], "torchrun": []}
    with tempfile.TemporaryDirectory() as run_dir:
        for _ in range(args.repeats):
            results["torchrun"].append(run_torchrun(args.steps, args.workers))
            results["scaletrain"].append(run_scaletrain_digits(args.steps, args.workers, run_dir))
    table = {}
    for name, rows in results.items():
        table[name] = {
            key: {
                "median": statistics.median(r[key] for r in rows),
                "min": min(r[key] for r in rows),
                "max": max(r[key] for r in rows),
            }
            for key in ("first_step_s", "steps_per_s")
        }
    ratio = table["scaletrain"]["steps_per_s"]["median"] / table["torchrun"]["steps_per_s"]["median"]
    unclean = sum(r.get("unclean_exit", False) for r in results["torchrun"])
    print(json.dumps({"workers": args.workers, "steps": args.steps, "repeats": args.repeats,
                      "results": table, "steps_per_s_ratio": ratio,
                      "torchrun_unclean_exits": unclean}, indent=2))


if __name__ == "__main__":
    main()
