"""The planner against reality, per memory component: digits and tiny_gpt under each strategy
on 2 CPU workers. Predicted bytes come from `scaletrain plan`'s code (meta-device shapes);
measured bytes from each rank's log after a real step (parameters, gradients and optimizer
state as the rank holds them), and activations from an independent count of the tensors
autograd saves, at the job's batch size.

    .venv/bin/python bench/planner_accuracy.py --out bench/results/latest/planner_accuracy.json
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import REPO, emit, profile_example, run_scaletrain  # noqa: E402

sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "examples"))
from scaletrain.plan.estimate import state_bytes_per_rank  # noqa: E402
from scaletrain.plan.model_profile import profile_task  # noqa: E402
from tests.helpers.measure import saved_tensor_bytes  # noqa: E402
from tests.helpers.run import state_bytes_by_rank  # noqa: E402

JOBS = {"digits": "examples/digits.yaml", "tiny_gpt": "examples/tiny_gpt.yaml"}
# name: (overrides, workers, ranks a parameter is split over)
STRATEGIES = {
    "single": (["scale.strategy=single"], 1, 1),
    "ddp": (["scale.strategy=ddp"], 2, 1),
    "fsdp": (["scale.strategy=fsdp"], 2, 2),
    "hsdp (2 x 1)": (["scale.strategy=hsdp", "scale.fsdp.shard_size=1"], 2, 1),
    "fsdp +offload": (["scale.strategy=fsdp", "scale.fsdp.cpu_offload=true"], 2, 2),
}
STATE = ("params", "grads", "optimizer")


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", help="also write the JSON here")
    args = parser.parse_args()
    tmp = Path(tempfile.mkdtemp(prefix="st-planner-"))
    rows = []
    for model, job_path in JOBS.items():
        job, task, profile = profile_example(job_path)
        torch.manual_seed(0)
        measured_activations = saved_tensor_bytes(task, task.build_model(), job.data.batch_size)
        predicted_activations = profile.activations.bytes(job.data.batch_size)
        # What a model too large for a real CPU pass gets: the meta-device pass.
        meta = profile_task(task, job.name, job.train.precision, real_pass=False, count_flops=False)
        meta_activations = meta.activations.bytes(job.data.batch_size)
        for name, (overrides, workers, shard) in STRATEGIES.items():
            summary = run_scaletrain(str(REPO / job_path), [
                *overrides, f"scale.workers={workers}", "train.max_steps=2", "train.epochs=null",
                "train.eval_every=null", "tracking.enabled=false", "checkpoint.every_steps=null",
                "checkpoint.at_end=false", f"run_dir={tmp / model / name.split()[0]}",
            ])
            for rank, sizes in sorted(state_bytes_by_rank(summary["run_dir"]).items()):
                predicted = state_bytes_per_rank(profile, shard, rank % shard, job.optim.name, job.optim.momentum)
                rows.append({
                    "model": model, "strategy": name, "rank": rank,
                    **{f"{k}_predicted": predicted[k] for k in STATE},
                    **{f"{k}_measured": sizes[k] for k in STATE},
                    "buffers_predicted": profile.buffer_bytes, "buffers_measured": sizes["buffers"],
                    "activations_predicted": predicted_activations,
                    "activations_measured": measured_activations,
                    "activations_predicted_meta": meta_activations, "batch": job.data.batch_size,
                })
    table = ["| model | strategy | rank | params | grads | optimizer | buffers "
             "| activations: real pass, meta pass vs saved tensors (batch) |",
             "|---|---|---|---|---|---|---|---|"]
    for r in rows:
        cells = []
        for k in (*STATE, "buffers"):
            p, m = r[f"{k}_predicted"], r[f"{k}_measured"]
            cells.append(f"{p:,} = {m:,}" if p == m else f"{p:,} vs {m:,}")
        p, q, m = r["activations_predicted"], r["activations_predicted_meta"], r["activations_measured"]
        cells.append(f"{p / 1024:,.0f} ({(p - m) / m:+.1%}), {q / 1024:,.0f} ({(q - m) / m:+.1%}) "
                     f"vs {m / 1024:,.0f} KiB ({r['batch']})")
        table.append(f"| {r['model']} | {r['strategy']} | {r['rank']} | " + " | ".join(cells) + " |")
    print("\n".join(table), file=sys.stderr)
    emit({"rows": rows, "exact_state": all(r[f"{k}_predicted"] == r[f"{k}_measured"]
                                           for r in rows for k in (*STATE, "buffers")),
          "markdown": "\n".join(table)}, args.out)


if __name__ == "__main__":
    main()
