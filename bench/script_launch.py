"""A torchrun script under `scaletrain launch` against the same script under torchrun: time to
the first step (from the command's start) and steady steps/s, 2 gloo workers on this machine.

Variants, interleaved (the order rotated every repeat), the script unchanged
(bench/baselines/timed_ddp_script.py):
  torchrun     python -m torch.distributed.run --standalone --nproc-per-node 2 SCRIPT --steps N
  scaletrain   scaletrain launch --workers 2 SCRIPT -- --steps N   (tracked: the embedded MLflow
               store, per-rank JSON logs, the hang check; the script does not use mlflow, so no
               rank waits for the run to open)

    .venv/bin/python bench/script_launch.py --repeats 3 --steps 2000
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

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import REPO  # noqa: E402

SCRIPT = REPO / "bench" / "baselines" / "timed_ddp_script.py"


def command(variant: str, steps: int) -> list[str]:
    if variant == "torchrun":
        return [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
                str(SCRIPT), "--steps", str(steps)]
    return [sys.executable, "-m", "scaletrain", "launch", "--workers", "2", str(SCRIPT), "--", "--steps", str(steps)]


def measure(variant: str, steps: int, cwd: Path) -> dict:
    env = {k: v for k, v in os.environ.items() if k != "MLFLOW_TRACKING_URI"}
    started = time.time()
    result = subprocess.run(command(variant, steps), cwd=cwd, env=env, capture_output=True, text=True,
                            timeout=600)
    wall = time.time() - started
    if result.returncode != 0:  # counted, shown, and measured again (--repeats stays the sample size)
        lines = [line for line in result.stderr.splitlines() if line.strip() and not line.startswith("{")]
        return {"failed": f"exit {result.returncode}: {lines[-1] if lines else ''}", "wall_s": wall}
    found: dict = {}
    for line in result.stdout.splitlines():
        if line.startswith("{") and ("first_step_at" in line or "steps_per_s" in line):
            found.update(json.loads(line))
    return {"first_step_s": found["first_step_at"] - started, "steps_per_s": found["steps_per_s"], "wall_s": wall}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--steps", type=int, default=2000)
    parser.add_argument("--out", type=Path, default=REPO / "bench" / "results" / "latest" / "script_launch.json")
    args = parser.parse_args()
    variants = ["torchrun", "scaletrain"]
    rows: dict[str, list[dict]] = {v: [] for v in variants}
    failures: dict[str, list[str]] = {v: [] for v in variants}
    with tempfile.TemporaryDirectory(prefix="bench-launch-") as scratch:
        for repeat in range(args.repeats):
            order = variants[repeat % 2:] + variants[: repeat % 2]
            for variant in order:
                row = measure(variant, args.steps, Path(scratch))
                while "failed" in row and len(failures[variant]) < args.repeats:
                    failures[variant].append(row["failed"])
                    print(f"{variant:10s} FAILED: {row['failed']}", flush=True)
                    row = measure(variant, args.steps, Path(scratch))
                if "failed" in row:
                    raise RuntimeError(f"{variant} failed {len(failures[variant]) + 1} times: {row['failed']}")
                rows[variant].append(row)
                print(f"{variant:10s} first step {row['first_step_s']:.2f} s  {row['steps_per_s']:.0f} steps/s  "
                      f"wall {row['wall_s']:.1f} s", flush=True)
    median = {v: {k: statistics.median(r[k] for r in rows[v]) for k in ("first_step_s", "steps_per_s", "wall_s")}
              for v in variants}
    result = {
        "bench": "script_launch", "steps": args.steps, "repeats": args.repeats, "workers": 2,
        "median": median, "runs": rows, "failed_runs": failures,
        "ratio_first_step": median["scaletrain"]["first_step_s"] / median["torchrun"]["first_step_s"],
        "ratio_steps_per_s": median["scaletrain"]["steps_per_s"] / median["torchrun"]["steps_per_s"],
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2))
    print(json.dumps({k: v for k, v in result.items() if k.startswith("ratio") or k == "median"}, indent=2))


if __name__ == "__main__":
    main()
