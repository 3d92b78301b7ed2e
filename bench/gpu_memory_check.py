"""On a CUDA machine: the planner's predicted peak memory per device against
``torch.cuda.max_memory_allocated`` over the first two steps, for single, DDP and FSDP (with and
without resharding) on every GPU of the node. A tiny_gpt of about 100M parameters.

    .venv/bin/python bench/gpu_memory_check.py --out bench/results/latest/gpu_memory.json

Each rank logs what it holds after its second step (its "model state bytes" line): the state
bytes it measured (parameters, gradients, optimizer state) and, on CUDA, the peak it allocated
since training began. The second step is the first whose forward runs beside the optimizer's
state; the first step's peak lacks it (on an H200, 2026-12-04, the prediction stood 20-38%
over the first step's peak). The planner predicts both: the state bytes exactly, the peak as
its memory total. bench/gpu_check.py runs the same comparison (``compare``) as its memory check,
and on the CPU compares the state bytes, since a CPU has no allocator peak to read.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from dataclasses import replace
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import REPO, emit, profile_example, run_scaletrain  # noqa: E402

JOB = str(REPO / "examples" / "tiny_gpt.yaml")
SHAPE = ["task.args.layers=8", "task.args.dim=1024", "task.args.heads=16", "task.args.context=512",
         "task.args.vocab=256", "data.batch_size=8"]
VARIANTS = {  # name: (overrides, strategy, sharded, reshard_after_forward)
    "single": (["scale.strategy=single"], "single", False, True),
    "ddp": (["scale.strategy=ddp"], "ddp", False, True),
    "fsdp": (["scale.strategy=fsdp"], "fsdp", True, True),
    "fsdp (no reshard)": (["scale.strategy=fsdp", "scale.fsdp.reshard_after_forward=false"], "fsdp", True, False),
}
TOLERANCE = 0.10  # predicted peak within 10% of the measured one


def workers_for(label: str, gpus: int) -> int:
    """NCCL takes one rank per GPU: on a 1-GPU machine every variant is a world of 1."""
    return 1 if VARIANTS[label][1] == "single" else max(1, gpus)


def variant_overrides(label: str, shape: list[str], workers: int, steps: int) -> list[str]:
    """A short run of the variant: nothing but training (no eval, checkpoint or tracking)."""
    return [*shape, *VARIANTS[label][0], f"scale.workers={workers}", f"train.max_steps={steps}",
            "train.epochs=null", "train.eval_every=null", "tracking.enabled=false",
            "checkpoint.every_steps=null", "checkpoint.at_end=false"]


def planner_profile(shape: list[str]):
    """The job at this shape and the planner's profile of its model (the same for every variant).

    Profiled at a batch of 1: besides the activation bytes per sample (which the estimate scales
    to the job's batch), profiling times forward and backward on one CPU thread for CPU step-time
    estimates, which a GPU's memory does not use; at the job's batch of 8 that alone takes
    minutes for this model."""
    job, _, profile = profile_example(JOB, shape, batch=1)
    return job, profile


def predicted(label: str, job, profile, workers: int) -> dict:
    """The planner's memory per device for the variant, and the state bytes it predicts per rank."""
    from scaletrain.plan.estimate import Option, estimate, state_bytes_per_rank
    from scaletrain.plan.hardware import detect_hardware

    _, strategy, sharded, reshard = VARIANTS[label]
    shard = workers if sharded else 1
    hardware = replace(detect_hardware(), devices_per_node=workers)
    option = Option(strategy, workers, shard, reshard_after_forward=reshard)
    memory = estimate(option, profile, hardware, job.data.batch_size, job.optim.name,
                      job.optim.momentum, job.train.precision).memory
    state = {rank: state_bytes_per_rank(profile, shard, rank % shard, job.optim.name, job.optim.momentum)
             for rank in range(workers)}
    return {"memory": memory, "state": state}


def logged_memory(run_dir: str | Path) -> dict[int, dict]:
    """Each rank's "model state bytes" line (its last, if it restarted)."""
    found = {}
    for log in Path(run_dir, "logs").glob("worker-*.jsonl"):
        for line in log.read_text().splitlines():
            entry = json.loads(line)
            if entry.get("message") == "model state bytes":
                found[entry["rank"]] = entry
    return found


def compare(label: str, job, profile, workers: int, run_dir: str | Path, device: str) -> dict:
    """One variant's row: predicted against measured. On CUDA the figure is the peak (within
    TOLERANCE); on the CPU the state bytes (exact), the state bytes being reported either way."""
    expected = predicted(label, job, profile, workers)
    logged = logged_memory(run_dir)
    state_exact = sorted(logged) == list(range(workers)) and all(
        {k: entry["state_bytes"][k] for k in expected["state"][rank]} == expected["state"][rank]
        for rank, entry in logged.items())
    row = {"strategy": label, "workers": workers, "predicted_bytes": expected["memory"]["total"],
           "predicted": expected["memory"], "state_bytes_exact": state_exact,
           "state_bytes_by_rank": {rank: entry["state_bytes"] for rank, entry in sorted(logged.items())}}
    if device == "cuda":
        peaks = {rank: entry["peak_allocated_bytes"] for rank, entry in sorted(logged.items())
                 if "peak_allocated_bytes" in entry}
        measured = max(peaks.values()) if peaks else None
        error = (expected["memory"]["total"] - measured) / measured if measured else None
        row.update(measured_peak_bytes=measured, peaks_by_rank=peaks, relative_error=error,
                   ok=error is not None and abs(error) <= TOLERANCE)
    else:
        row["ok"] = state_exact
    return row


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--out", help="also write the JSON here")
    args = parser.parse_args()
    import torch

    if not torch.cuda.is_available():
        raise SystemExit("error: this check needs a CUDA device; on CPU the tests compare state bytes exactly")
    gpus = torch.cuda.device_count()
    tmp = Path(tempfile.mkdtemp(prefix="st-gpu-memory-"))
    job, profile = planner_profile(SHAPE)
    rows = []
    for label in VARIANTS:
        workers = workers_for(label, gpus)
        run_dir = tmp / label.split()[0]
        summary = run_scaletrain(JOB, [*variant_overrides(label, SHAPE, workers, args.steps), f"run_dir={run_dir}"])
        rows.append(compare(label, job, profile, workers, summary["run_dir"], "cuda"))
        print(f"{label:18s} predicted {rows[-1]['predicted_bytes'] / 2**30:6.2f} GiB  measured "
              f"{rows[-1]['measured_peak_bytes'] / 2**30:6.2f} GiB  error {rows[-1]['relative_error']:+.1%}", file=sys.stderr)
    emit({"gpu": torch.cuda.get_device_name(0), "gpus": gpus, "shape": SHAPE, "rows": rows}, args.out)


if __name__ == "__main__":
    main()
