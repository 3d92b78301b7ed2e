"""On a CUDA machine: the planner's predicted peak memory per device against
``torch.cuda.max_memory_allocated`` after the first step, for single, DDP and FSDP (with and
without resharding) on every GPU of the node. A tiny_gpt of about 100M parameters.

    .venv/bin/python bench/gpu_memory_check.py --out bench/results/gpu_memory.json

Each rank logs its first step's peak (`peak_allocated_bytes` on its "model state bytes" line).
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import REPO, emit, profile_example, run_scaletrain  # noqa: E402

SHAPE = ["task.args.layers=8", "task.args.dim=1024", "task.args.heads=16", "task.args.context=512",
         "task.args.vocab=256", "data.batch_size=8"]
VARIANTS = {  # name: (overrides, strategy, sharded, reshard_after_forward)
    "single": (["scale.strategy=single"], "single", False, True),
    "ddp": (["scale.strategy=ddp"], "ddp", False, True),
    "fsdp": (["scale.strategy=fsdp"], "fsdp", True, True),
    "fsdp (no reshard)": (["scale.strategy=fsdp", "scale.fsdp.reshard_after_forward=false"], "fsdp", True, False),
}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--out", help="also write the JSON here")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("error: this check needs a CUDA device; on CPU the tests compare state bytes exactly")
    from dataclasses import replace

    from scaletrain.plan.estimate import Option, estimate
    from scaletrain.plan.hardware import detect_hardware

    gpus = torch.cuda.device_count()  # NCCL takes one rank per GPU: on a 1-GPU machine, world 1
    job_file = str(REPO / "examples" / "tiny_gpt.yaml")
    tmp = Path(tempfile.mkdtemp(prefix="st-gpu-memory-"))
    rows = []
    for label, (overrides, strategy, sharded, reshard) in VARIANTS.items():
        workers = 1 if strategy == "single" else gpus
        common = [*SHAPE, *overrides, f"scale.workers={workers}", f"train.max_steps={args.steps}",
                  "train.epochs=null", "train.eval_every=null", "tracking.enabled=false",
                  "checkpoint.every_steps=null", "checkpoint.at_end=false", f"run_dir={tmp / label.split()[0]}"]
        job, _, profile = profile_example(job_file, common)
        hardware = replace(detect_hardware(), devices_per_node=workers)
        option = Option(strategy, workers, workers if sharded else 1, reshard_after_forward=reshard)
        predicted = estimate(option, profile, hardware, job.data.batch_size, job.optim.name,
                             job.optim.momentum, job.train.precision)
        summary = run_scaletrain(job_file, common)
        peaks = {}
        for log in Path(summary["run_dir"], "logs").glob("worker-*.jsonl"):
            for line in log.read_text().splitlines():
                entry = json.loads(line)
                if entry.get("message") == "model state bytes" and "peak_allocated_bytes" in entry:
                    peaks[entry["rank"]] = entry["peak_allocated_bytes"]
        measured = max(peaks.values())
        rows.append({
            "strategy": label, "workers": workers, "predicted_bytes": predicted.memory["total"],
            "predicted": predicted.memory, "measured_peak_bytes": measured, "peaks_by_rank": peaks,
            "error": (predicted.memory["total"] - measured) / measured,
        })
        print(f"{label:18s} predicted {predicted.memory['total'] / 2**30:6.2f} GiB  measured "
              f"{measured / 2**30:6.2f} GiB  error {rows[-1]['error']:+.1%}", file=sys.stderr)
    emit({"gpu": torch.cuda.get_device_name(0), "gpus": gpus, "shape": SHAPE, "rows": rows}, args.out)


if __name__ == "__main__":
    main()
