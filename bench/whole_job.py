"""A whole job, wall time from the command's start to its exit: `scaletrain run` on an example
at its defaults (tracking to an embedded sqlite store, eval and a verified checkpoint every 100
steps, the final model exported and logged in MLflow) against the hand-written DDP loop under
torchrun (bench/baselines/ddp_loop.py: no tracking, eval or checkpoints), at a short and a long
length. What a short job (a tune trial, a CI job, a notebook's run) pays for the guardrails is
fixed cost: start-up, each checkpoint and eval, the end. Interleaved A B, B A, ... per length;
medians with the spread, and the ratio pair by pair (the gate: the median of the pairs).

    scaletrain  scaletrain run JOB --set train.max_steps=N (the job's own settings otherwise;
                the store is created before the first repeat, as a user's first run leaves it)
    torchrun    torchrun --standalone on the raw loop: same model, data, loss, batch, optimizer,
                schedule, clipping and seed

    .venv/bin/python bench/whole_job.py --steps 330,3000 --repeats 3 --repeats-for 3000=6   # make bench
    .venv/bin/python bench/whole_job.py --steps 3000 --set tracking.enabled=false \
        --set checkpoint.every_steps=null --set train.eval_every=null     # the guardrails' floor
"""

from __future__ import annotations

import argparse
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import BIN, REPO, emit  # noqa: E402


def children_cpu_s() -> float:
    """CPU-seconds of this process's ended and reaped descendants so far (every process of a
    job: the launcher reaps its agent, tracker and warm workers, they reap theirs)."""
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    return usage.ru_utime + usage.ru_stime


def scaletrain_job(job: str, steps: int, tmp: Path, store: Path, overrides: list[str] = ()) -> float:
    started = time.perf_counter()
    out = subprocess.run(
        [sys.executable, "-m", "scaletrain", "run", job, "--set", f"train.max_steps={steps}",
         "--set", "train.epochs=null", "--set", f"run_dir={tmp / 'runs'}",
         "--set", f"tracking.uri=sqlite:///{store / 'mlflow.db'}",
         *(arg for item in overrides for arg in ("--set", item))],
        cwd=REPO, capture_output=True, text=True,
    )
    elapsed = time.perf_counter() - started
    if out.returncode != 0:
        raise RuntimeError(f"scaletrain failed ({out.returncode}): {out.stderr[-3000:]}")
    return elapsed


class BaselineFailed(RuntimeError):
    """A raw run that failed: torchrun's workers abort at exit now and then (torch 2.13, gloo:
    "terminate called without an active exception"), after every step. Run again and counted in
    ``failed_runs``; a scaletrain run that fails stops the bench."""


def torchrun_job(job_path: str, steps: int, workers: int, config) -> float:
    o, t = config.optim, config.train
    started = time.perf_counter()
    out = subprocess.run(
        [str(BIN / "torchrun"), "--standalone", f"--nproc-per-node={workers}", "bench/baselines/ddp_loop.py",
         f"--example={Path(job_path).stem}", f"--steps={steps}", f"--batch-size={config.data.batch_size}",
         f"--lr={o.lr}", f"--weight-decay={o.weight_decay}", "--betas", str(o.betas[0]), str(o.betas[1]),
         f"--warmup-steps={o.warmup_steps}", f"--min-lr-ratio={o.min_lr_ratio}",
         f"--clip={t.clip_grad_norm or 1e9}", f"--log-every={t.log_every}", f"--seed={config.seed}"],
        cwd=REPO, capture_output=True, text=True,
    )
    elapsed = time.perf_counter() - started
    if out.returncode != 0:
        raise BaselineFailed(f"the baseline failed ({out.returncode}): {out.stderr[-3000:]}")
    return elapsed


def spread(values: list[float]) -> dict:
    return {"median": statistics.median(values), "min": min(values), "max": max(values), "values": values}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--job", default="examples/digits.yaml")
    parser.add_argument("--steps", default="330,3000", help="comma-separated job lengths")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--repeats-for", action="append", default=[], metavar="STEPS=N",
                        help="more pairs for one length, e.g. 3000=6: the long job's ratio moves by more "
                             "than its margin from pair to pair on a shared 2-core machine")
    parser.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                        help="a setting for scaletrain's runs, e.g. tracking.enabled=false (repeatable)")
    parser.add_argument("--out", help="also write the JSON here")
    args = parser.parse_args()
    from scaletrain.config.loading import load_job

    config = load_job(REPO / args.job, [])
    workers = config.scale.workers
    with tempfile.TemporaryDirectory(prefix="st-bench-job-") as tmp:
        store = Path(tmp) / "store"
        store.mkdir()
        from mlflow import MlflowClient

        MlflowClient(f"sqlite:///{store / 'mlflow.db'}").search_experiments()  # creates the tables
        lengths = {}
        failures: list[str] = []
        more = {int(k): int(v) for k, v in (item.split("=") for item in args.repeats_for)}
        for steps in (int(s) for s in args.steps.split(",")):
            runs: dict[str, list[float]] = {"scaletrain": [], "torchrun": []}
            cpu: dict[str, list[float]] = {"scaletrain": [], "torchrun": []}
            for repeat in range(more.get(steps, args.repeats)):
                order = ["scaletrain", "torchrun"] if repeat % 2 == 0 else ["torchrun", "scaletrain"]
                for name in order:
                    while True:
                        before = children_cpu_s()
                        try:
                            wall = (scaletrain_job(str(REPO / args.job), steps, Path(tmp), store, args.overrides)
                                    if name == "scaletrain" else torchrun_job(args.job, steps, workers, config))
                            break
                        except BaselineFailed as failed:
                            failures.append(f"{steps} steps: {str(failed).splitlines()[-1][-300:]}")
                            print(f"torchrun FAILED, run again: {failures[-1]}", file=sys.stderr, flush=True)
                            if len(failures) > args.repeats:
                                raise
                    runs[name].append(wall)
                    cpu[name].append(children_cpu_s() - before)
            paired = [s / r for s, r in zip(runs["scaletrain"], runs["torchrun"])]
            # CPU-seconds of every process of the job: steadier than wall on a shared machine,
            # and on one whose cores all train, what a side process (the tracker) costs in wall.
            lengths[str(steps)] = {"pairs": len(paired),
                                   "wall_s": {name: spread(values) for name, values in runs.items()},
                                   "ratio": statistics.median(runs["scaletrain"]) / statistics.median(runs["torchrun"]),
                                   "ratio_paired": spread(paired),
                                   "cpu_s": {name: spread(values) for name, values in cpu.items()},
                                   "cpu_ratio": statistics.median(cpu["scaletrain"]) / statistics.median(cpu["torchrun"])}
    emit({"job": args.job, "workers": workers, "repeats": args.repeats, "overrides": args.overrides,
          "lengths": lengths, "failed_runs": failures}, args.out)


if __name__ == "__main__":
    main()
