"""Tracking overhead: throughput with MLflow logging every step, against tracking off.

Variants, interleaved (A B C D A B C D ...) so machine noise hits all alike; the console
reports every 20 steps in all of them (train.log_every=20):
  off         tracking off
  embedded/1  MLflow sqlite store in a scratch folder, tracking.log_every_steps=1
  server/1    a local `mlflow server` on 127.0.0.1, tracking.log_every_steps=1
  off/1       tracking off, console every step (what reporting every step costs by itself)
The tracking cost is embedded/1 and server/1 against off. Each run's points are counted in
MLflow afterwards: every step of train/loss must be there.

    .venv/bin/python bench/tracking_overhead.py --repeats 4 --steps 2000
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
                "off": base + ["tracking.enabled=false", "train.log_every=20"],
                "embedded/1": base + [f"tracking.uri=sqlite:///{tmp / 'embedded.db'}",
                                      "train.log_every=20", "tracking.log_every_steps=1"],
                "server/1": base + [f"tracking.uri={server.uri}", "train.log_every=20",
                                    "tracking.log_every_steps=1"],
                "off/1": base + ["tracking.enabled=false", "train.log_every=1"],
            }
            results: dict[str, list[float]] = {name: [] for name in variants}
            delivered: dict[str, list[int]] = {name: [] for name in variants}
            for _ in range(args.repeats):
                for name, overrides in variants.items():
                    summary = run_scaletrain(args.job, overrides)
                    # Steady state: one-time costs at the start (importing mlflow, the run
                    # card) are not per-step overhead.
                    results[name].append(steady_steps_per_s(summary["run_dir"], skip=args.steps // 4))
                    delivered[name].append(_points(summary))
        finally:
            server.stop()
    medians = {name: statistics.median(v) for name, v in results.items()}
    print(json.dumps({
        "job": args.job, "steps": args.steps, "repeats": args.repeats,
        "steps_per_s": {n: {"median": medians[n], "min": min(v), "max": max(v)} for n, v in results.items()},
        "tracking_cost_vs_off": {
            "embedded": 1 - medians["embedded/1"] / medians["off"],
            "server": 1 - medians["server/1"] / medians["off"],
        },
        "console_every_step_cost": 1 - medians["off/1"] / medians["off"],
        "train_loss_points_delivered": delivered,
    }, indent=2))


def _points(summary: dict) -> int:
    """How many train/loss points reached MLflow (0 when tracking was off)."""
    if not summary.get("mlflow_run_id"):
        return 0
    from mlflow import MlflowClient

    uri = json.loads(Path(summary["run_dir"], "tracking", "mlflow_run.json").read_text())["uri"]
    return len(MlflowClient(uri).get_metric_history(summary["mlflow_run_id"], "train/loss"))


if __name__ == "__main__":
    main()
