"""Strategies side by side: steps/s of the same job under DDP, FSDP2 and FSDP2 with activation
checkpointing on the same workers, interleaved (A B C A B C ...), median and spread, each
rank's measured state bytes, and the planner's predicted step time next to the measured one,
with the fixed cost per collective call that the DDP/FSDP difference implies (what
plan/hardware.py's CPU_COLLECTIVE_S is fitted to).

    .venv/bin/python bench/strategies.py                      # tiny_gpt, 2 workers, 3 repeats
    .venv/bin/python bench/strategies.py --job examples/digits.yaml --steps 600
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import REPO, emit, profile_example, run_scaletrain, steady_steps_per_s  # noqa: E402

sys.path.insert(0, str(REPO))
from tests.helpers.run import state_bytes_by_rank  # noqa: E402

VARIANTS = {
    "ddp": ["scale.strategy=ddp"],
    "fsdp": ["scale.strategy=fsdp"],
    "fsdp +AC": ["scale.strategy=fsdp", "scale.activation_checkpointing=true"],
}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--job", default="examples/tiny_gpt.yaml")
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--out", help="also write the JSON here")
    args = parser.parse_args()
    tmp = Path(tempfile.mkdtemp(prefix="st-strategies-"))
    speeds: dict[str, list[float]] = {name: [] for name in VARIANTS}
    measured: dict[str, dict] = {}
    for _ in range(args.repeats):
        for name, extra in VARIANTS.items():
            summary = run_scaletrain(str(REPO / args.job), [
                f"train.max_steps={args.steps}", "train.epochs=null", "train.eval_every=null",
                "train.log_every=20", "tracking.enabled=false", "checkpoint.every_steps=null",
                "checkpoint.at_end=false",
                f"scale.workers={args.workers}", f"run_dir={tmp / 'runs'}", *extra,
            ])
            speeds[name].append(steady_steps_per_s(summary["run_dir"], skip=args.steps // 3))
            measured[name] = state_bytes_by_rank(summary["run_dir"])
    medians = {n: statistics.median(v) for n, v in speeds.items()}
    predicted, fitted = _planner(args.job, args.workers, medians)
    result = {
        "job": args.job, "steps": args.steps, "workers": args.workers, "repeats": args.repeats,
        "steps_per_s": {n: {"median": medians[n], "min": min(v), "max": max(v)} for n, v in speeds.items()},
        "vs_ddp": {n: medians[n] / medians["ddp"] for n in medians},
        "measured_state_bytes_per_rank": measured,
        "predicted": predicted,
        "fitted_collective_s": fitted,
    }
    emit(result, args.out)


def _planner(job_path: str, workers: int, steps_per_s: dict[str, float]) -> tuple[dict, float]:
    """The planner's step time per variant on these workers, and the per-call cost that makes
    its FSDP - DDP difference equal the measured one."""
    from dataclasses import replace

    from scaletrain.plan.estimate import make_plan
    from scaletrain.plan.hardware import detect_hardware

    job, _, profile = profile_example(job_path)
    hardware = replace(detect_hardware(), devices_per_node=workers)
    plan = make_plan(profile, hardware, job.data.batch_size, job.optim.name, job.optim.momentum,
                     job.train.precision, every_device=True)
    rows = {e.option.label: e for e in plan.estimates}
    predicted = {
        name: {"step_s": rows[name].step_s, "compute_s": rows[name].compute_s, "comm_s": rows[name].comm_s,
               "collectives": rows[name].collectives, "measured_step_s": 1 / steps_per_s[name],
               "predicted_over_measured": rows[name].step_s * steps_per_s[name]}
        for name in VARIANTS if name in rows
    }
    ddp, fsdp = rows["ddp"], rows["fsdp"]
    bytes_s = lambda e: e.comm_s - e.collectives * hardware.collective_s  # noqa: E731
    extra = 1 / steps_per_s["fsdp"] - 1 / steps_per_s["ddp"] - (bytes_s(fsdp) - bytes_s(ddp))
    return predicted, extra / (fsdp.collectives - ddp.collectives)


if __name__ == "__main__":
    main()
