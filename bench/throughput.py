"""Training throughput and time to first step: scaletrain against a hand-written DDP loop under
torchrun (bench/baselines/ddp_loop.py) on the same example job, and scaletrain on 1 worker
against 2 (scaling). Interleaved (A B C, C B A, ...), so machine noise and position hit every
variant alike; median and spread over the repeats.

  scaletrain    `scaletrain run` with tracking and checkpointing at their defaults: metrics every
                train.log_every steps to an embedded sqlite store, a verified checkpoint at the end (after the
                timed steps; bench/checkpoint_io.py measures saves); evaluation off (the raw loop
                has none). The store is created before the first repeat, as a user's first run
                leaves it (a new store's tables cost ~2 s of CPU once, on the first run only)
  torchrun      torchrun --standalone on the raw loop: same model, data, loss and metrics,
                batch, optimizer, schedule, clipping and seed; no tracking, no checkpoints
  scaletrain-1  scaletrain on one worker (one process, no DDP), same per-worker batch
  untracked     (--with-tracking-off) scaletrain with tracking off: tells tracking's share of a
                gap from the rest of scaletrain's

Steps/s are wall-clock over the last two thirds of the steps (checkpoints, tracking and reports
included; the first third is left out on both sides: start-up); time to first step is from the
command's start to the first finished step. Per-rank step time: each rank's median time in its
step (batch to scheduler step) over its last 1024 steps, from the workers' "worker finished"
log records and the raw loop's per-rank line; the spread is (slowest - fastest) / fastest
rank: in synchronous data parallel the ranks wait for each other, so a rank with extra work
between steps (rank 0 reporting) shows up as the others' longer steps.

    .venv/bin/python bench/throughput.py --job examples/tiny_gpt.yaml --repeats 3 --steps 300
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import BIN, REPO, emit, run_scaletrain, steady_steps_per_s  # noqa: E402


def timed_from(steps: int, log_every: int) -> int:
    """The first step of the steady state, on a report step (scaletrain times windows between them)."""
    return max(log_every, steps // 3 // log_every * log_every)


def scaletrain_variant(job: str, steps: int, workers: int, tmp: Path, log_every: int, store: Path,
                       tracking: bool = True) -> dict:
    started = time.time()
    summary = run_scaletrain(job, [
        f"train.max_steps={steps}", "train.epochs=null", "train.eval_every=null",
        f"scale.workers={workers}", f"run_dir={tmp / 'runs'}",
        f"tracking.enabled={str(tracking).lower()}", f"tracking.uri=sqlite:///{store / 'mlflow.db'}",
        "checkpoint.every_steps=null", "checkpoint.keep_best=null",
    ])
    first_step_at = summary["started_at"] + summary["time_to_first_step_s"]
    ranks = []
    for log in sorted(Path(summary["run_dir"], "logs").glob("worker-*.jsonl")):
        for line in log.read_text().splitlines():
            record = json.loads(line)
            if record.get("message") == "worker finished":
                ranks.append(record["step_time"]["median_s"])
    return {"first_step_s": first_step_at - started,
            "steps_per_s": steady_steps_per_s(summary["run_dir"], skip=timed_from(steps, log_every)),
            "rank_step_spread": max(ranks) / min(ranks) - 1}


def torchrun_variant(job_path: str, steps: int, workers: int, job) -> dict:
    example = Path(job_path).stem
    o, t = job.optim, job.train
    started = time.time()
    out = subprocess.run(
        [str(BIN / "torchrun"), "--standalone", f"--nproc-per-node={workers}", "bench/baselines/ddp_loop.py",
         f"--example={example}", f"--steps={steps}", f"--batch-size={job.data.batch_size}", f"--lr={o.lr}",
         f"--weight-decay={o.weight_decay}", "--betas", str(o.betas[0]), str(o.betas[1]),
         f"--warmup-steps={o.warmup_steps}", f"--min-lr-ratio={o.min_lr_ratio}",
         f"--clip={t.clip_grad_norm or 1e9}", f"--log-every={t.log_every}", f"--seed={job.seed}",
         f"--timed-from={timed_from(steps, t.log_every)}"],
        cwd=REPO, capture_output=True, text=True,
    )
    lines = _json_objects(out.stdout)
    result = next((line for line in lines if "steps_per_s" in line), None)
    if result is None:
        raise RuntimeError(f"the baseline failed before reporting:\n{out.stderr[-3000:]}")
    ranks = [line["step_time_median_s"] for line in lines if "rank" in line]
    return {"first_step_s": result["first_step_at"] - started, "steps_per_s": result["steps_per_s"],
            "rank_step_spread": max(ranks) / min(ranks) - 1}


def _json_objects(text: str) -> list[dict]:
    """Every JSON object printed (two ranks' lines can still share one line of a pipe)."""
    decoder, found, index = json.JSONDecoder(), [], 0
    while (index := text.find("{", index)) >= 0:
        try:
            obj, index = decoder.raw_decode(text, index)
            found.append(obj)
        except ValueError:
            index += 1
    return found


def summarize(rows: list[dict]) -> dict:
    return {key: {"median": statistics.median(r[key] for r in rows), "min": min(r[key] for r in rows),
                  "max": max(r[key] for r in rows), "values": [r[key] for r in rows]}
            for key in rows[0]}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--job", default="examples/digits.yaml")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--steps", type=int, default=600)
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--no-scaling", action="store_true", help="skip the 1-worker runs")
    parser.add_argument("--with-tracking-off", action="store_true", help="also scaletrain with tracking off")
    parser.add_argument("--out", help="also write the JSON here")
    args = parser.parse_args()
    from scaletrain.config.loading import load_job

    config = load_job(REPO / args.job, [])
    job, every = str(REPO / args.job), config.train.log_every
    store = Path(tempfile.mkdtemp(prefix="st-bench-store-"))
    from mlflow import MlflowClient

    MlflowClient(f"sqlite:///{store / 'mlflow.db'}").search_experiments()  # creates the tables
    runs: dict[str, list[dict]] = {"torchrun": [], "scaletrain": []}
    if args.with_tracking_off:
        runs["untracked"] = []
    if not args.no_scaling:
        runs["scaletrain-1"] = []
    for repeat in range(args.repeats):
        with tempfile.TemporaryDirectory() as tmp:
            variants = {
                "torchrun": lambda: torchrun_variant(args.job, args.steps, args.workers, config),
                "scaletrain": lambda: scaletrain_variant(job, args.steps, args.workers, Path(tmp), every, store),
                "untracked": lambda: scaletrain_variant(job, args.steps, args.workers, Path(tmp), every, store,
                                                        tracking=False),
                "scaletrain-1": lambda: scaletrain_variant(job, args.steps, 1, Path(tmp), every, store),
            }
            order = [name for name in variants if name in runs]
            for name in order if repeat % 2 == 0 else reversed(order):  # A B C, then C B A
                runs[name].append(variants[name]())
    shutil.rmtree(store, ignore_errors=True)
    table = {name: summarize(rows) for name, rows in runs.items()}
    med = {name: t["steps_per_s"]["median"] for name, t in table.items()}
    paired = [s["steps_per_s"] / r["steps_per_s"] for s, r in zip(runs["scaletrain"], runs["torchrun"])]
    emit({
        "job": args.job, "steps": args.steps, "workers": args.workers, "repeats": args.repeats,
        "results": table,
        "steps_per_s_ratio": med["scaletrain"] / med["torchrun"],
        "steps_per_s_ratio_paired": {"median": statistics.median(paired), "min": min(paired), "max": max(paired)},
        "untracked_steps_per_s_ratio": med["untracked"] / med["torchrun"] if "untracked" in med else None,
        "first_step_ratio": table["scaletrain"]["first_step_s"]["median"] / table["torchrun"]["first_step_s"]["median"],
        # samples/s with N workers over N x samples/s with one: 1.0 is linear scaling
        "scaling_efficiency": med["scaletrain"] / (args.workers * med["scaletrain-1"]) if "scaletrain-1" in med else None,
    }, args.out)


if __name__ == "__main__":
    main()
