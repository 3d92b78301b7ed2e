"""Tracking overhead: throughput with MLflow logging every step, against tracking off.

Variants, interleaved (A B C D A B C D ...) so machine noise hits all alike:
  off/20     tracking off, train metrics reported every 20 steps (the default cadence)
  off/1      tracking off, reported every step (the cost of reporting itself)
  embedded/1 MLflow sqlite store in a scratch folder, every step
  server/1   a local `mlflow server` on 127.0.0.1, every step
The tracking cost is embedded/1 and server/1 against off/1 (same reporting cadence).

    .venv/bin/python bench/tracking_overhead.py --repeats 2 --steps 3000
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import REPO, run_scaletrain, steady_steps_per_s  # noqa: E402

sys.path.insert(0, str(REPO))
from tests.helpers.servers import MlflowServer  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--steps", type=int, default=3000)
    parser.add_argument("--job", default="examples/digits.yaml")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        server = MlflowServer(tmp).start()
        try:
            base = [f"train.max_steps={args.steps}", "train.epochs=null", "train.eval_every=null",
                    f"run_dir={tmp / 'runs'}"]
            variants = {
                "off/20": base + ["tracking.enabled=false", "train.log_every=20"],
                "off/1": base + ["tracking.enabled=false", "train.log_every=1"],
                "embedded/1": base + [f"tracking.uri=sqlite:///{tmp / 'embedded.db'}", "train.log_every=1"],
                "server/1": base + [f"tracking.uri={server.uri}", "train.log_every=1"],
            }
            results: dict[str, list[float]] = {name: [] for name in variants}
            delivered: dict[str, list[bool]] = {name: [] for name in variants}
            for _ in range(args.repeats):
                for name, overrides in variants.items():
                    summary = run_scaletrain(args.job, overrides)
                    # Steady state: one-time costs at the start (importing mlflow in the
                    # sender thread, the run card) are not per-step overhead.
                    skip = args.steps // 4
                    results[name].append(steady_steps_per_s(summary["run_dir"], skip=skip))
                    delivered[name].append(summary.get("mlflow_run_id") is not None)
        finally:
            server.stop()
    medians = {name: statistics.median(v) for name, v in results.items()}
    print(json.dumps({
        "job": args.job, "steps": args.steps, "repeats": args.repeats,
        "steps_per_s": {n: {"median": medians[n], "min": min(v), "max": max(v)} for n, v in results.items()},
        "tracking_cost_vs_off_same_cadence": {
            "embedded": 1 - medians["embedded/1"] / medians["off/1"],
            "server": 1 - medians["server/1"] / medians["off/1"],
        },
        "reporting_every_step_cost": 1 - medians["off/1"] / medians["off/20"],
        "tracked_runs_created": {n: all(v) for n, v in delivered.items()},
    }, indent=2))


if __name__ == "__main__":
    main()
