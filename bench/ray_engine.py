"""The Ray engine against the local engine and against a plain Ray Train script.

Same job (digits MLP, 2 workers, 1 thread each, tracking and eval off), interleaved
(A B C A B C ...): time from the command's start to the first finished step, steady-state
steps/s. scaletrain's two engines run the same worker code; the plain script
(bench/baselines/ray_train_digits.py) is the raw-tool reference for the Ray engine.

    .venv/bin/python bench/ray_engine.py --repeats 3 --steps 600
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
from common import REPO, emit, run_scaletrain, steady_steps_per_s  # noqa: E402


def scaletrain_run(engine: str, steps: int, workers: int, run_dir: str) -> dict:
    started = time.time()
    summary = run_scaletrain("examples/digits.yaml", [
        f"train.max_steps={steps}", "train.epochs=null", "train.eval_every=null",
        f"scale.workers={workers}", f"scale.engine={engine}", "scale.threads_per_worker=1",
        f"run_dir={run_dir}", "tracking.enabled=false", "recovery.max_restarts=0",
    ])
    first_step_at = summary["started_at"] + summary["time_to_first_step_s"]
    return {"first_step_s": first_step_at - started, "steps_per_s": steady_steps_per_s(summary["run_dir"]),
            "wall_s": time.time() - started}


def plain_ray_train(steps: int, workers: int) -> dict:
    started = time.time()
    out = subprocess.run(
        [sys.executable, "bench/baselines/ray_train_digits.py", f"--steps={steps}", f"--workers={workers}"],
        cwd=REPO, capture_output=True, text=True,
    )
    lines = [line for line in out.stdout.splitlines() if line.startswith("{")]
    if not lines:
        raise RuntimeError(f"the Ray Train baseline failed:\n{out.stderr[-3000:]}")
    result = json.loads(lines[-1])
    return {"first_step_s": result["first_step_at"] - started, "steps_per_s": result["steps_per_s"],
            "wall_s": time.time() - started}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--steps", type=int, default=600)
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--out", help="also write the JSON here")
    args = parser.parse_args()
    rows: dict[str, list[dict]] = {"scaletrain local": [], "scaletrain ray": [], "plain Ray Train": []}
    with tempfile.TemporaryDirectory() as run_dir:
        for _ in range(args.repeats):
            rows["scaletrain local"].append(scaletrain_run("local", args.steps, args.workers, run_dir))
            rows["scaletrain ray"].append(scaletrain_run("ray", args.steps, args.workers, run_dir))
            rows["plain Ray Train"].append(plain_ray_train(args.steps, args.workers))
    table = {
        name: {key: {"median": statistics.median(r[key] for r in rs), "min": min(r[key] for r in rs),
                     "max": max(r[key] for r in rs)} for key in ("first_step_s", "steps_per_s", "wall_s")}
        for name, rs in rows.items()
    }

    def med(name: str, key: str) -> float:
        return table[name][key]["median"]

    result = {
        "workers": args.workers, "steps": args.steps, "repeats": args.repeats, "results": table,
        "ray_engine_vs_plain_ray_train": {
            "steps_per_s_ratio": med("scaletrain ray", "steps_per_s") / med("plain Ray Train", "steps_per_s"),
            "first_step_ratio": med("scaletrain ray", "first_step_s") / med("plain Ray Train", "first_step_s"),
        },
        "ray_engine_vs_local_engine": {
            "steps_per_s_ratio": med("scaletrain ray", "steps_per_s") / med("scaletrain local", "steps_per_s"),
            "first_step_extra_s": med("scaletrain ray", "first_step_s") - med("scaletrain local", "first_step_s"),
        },
    }
    emit(result, args.out)


if __name__ == "__main__":
    main()
