"""Data loading: does reading from shards keep up with training? examples/shards/'s language
model (1 worker, a step of 20 ms or more on this CPU) trained from the same tokenized corpus held
in memory (the baseline: a list, read by index), from Parquet shards on local disk, from the same
shards on a local S3-compatible server (moto, on 127.0.0.1), and as a Hugging Face ``datasets``
stream of the local shards; each with ``data.loader_workers`` 0 and 2. Runs interleaved
(source by source, then again), each a whole `scaletrain run`.

Reported per variant: the data wait as a share of the step time (the time the training loop
waited for its next batch, from the run's own metrics, after the first 20 steps), samples/s, and
samples/s against the in-memory baseline with the same loader_workers. Target: data wait under
5% of the step time with prefetch (loader_workers 2) on shards.

    .venv/bin/python bench/data_loading.py                        # quick
    .venv/bin/python bench/data_loading.py --repeats 3 --steps 600
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import REPO, emit, run_scaletrain  # noqa: E402

sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "examples" / "shards"))
from corpus import write_corpus  # noqa: E402

from tests.helpers.servers import S3Server  # noqa: E402

SKIP = 20
TARGET = 0.05
BATCH = 32
CONTEXT = 64


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--repeats", type=int, default=1)
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--rows", type=int, default=32768, help="training sequences in the corpus")
    parser.add_argument("--dim", type=int, default=96, help="the model's width: about 30 ms a step here")
    parser.add_argument("--out", help="also write the JSON here")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="scaletrain-bench-data-") as tmp:
        root = Path(tmp)
        (root / "s3").mkdir()
        server = S3Server(root / "s3").start()
        try:
            server.make_bucket("corpus")
            os.environ.update(server.env())  # this process and the runs it starts talk to the server
            local = str(root / "corpus")
            for where in (local, "s3://corpus/c"):
                write_corpus(where, train_rows=args.rows, eval_rows=256, context=CONTEXT, rows_per_group=256)
            sources = {"memory": [f"task.args.location={local}", "task.args.in_memory=true"],
                       "disk": [f"task.args.location={local}"],
                       "s3": ["task.args.location=s3://corpus/c"]}
            if _has_datasets():
                sources["stream (HF datasets, disk)"] = [f"task.args.location={local}", "task.args.stream=true"]
            runs: dict[str, list[dict]] = {}
            for repeat in range(args.repeats):
                for workers in (0, 2):
                    for source, overrides in sources.items():
                        name = f"{source}, loader_workers {workers}"
                        print(f"[data] {name} ({repeat + 1}/{args.repeats})", file=sys.stderr, flush=True)
                        summary = run_scaletrain(
                            str(REPO / "examples" / "shards" / "job.yaml"),
                            [*overrides, f"data.loader_workers={workers}", "scale.workers=1", f"data.batch_size={BATCH}",
                             f"task.args.dim={args.dim}", f"train.max_steps={args.steps}", "train.log_every=10",
                             "train.eval_every=100000", "checkpoint.every_steps=null", "checkpoint.at_end=false",
                             "tracking.enabled=false", f"run_dir={root / 'runs'}"])
                        runs.setdefault(name, []).append(_figures(summary["run_dir"]))
        finally:
            server.stop()
    result = {"steps": args.steps, "repeats": args.repeats, "rows": args.rows, "batch": BATCH, "dim": args.dim,
              "context": CONTEXT, "target_data_wait_share": TARGET, "variants": {}}
    for name, figures in runs.items():
        result["variants"][name] = {
            "data_wait_share": statistics.median(f["data_wait_share"] for f in figures),
            "step_ms": statistics.median(f["step_ms"] for f in figures),
            "samples_per_s": statistics.median(f["samples_per_s"] for f in figures),
            "runs": figures,
        }
    for name, row in result["variants"].items():
        baseline = result["variants"].get("memory, loader_workers " + name.rsplit(" ", 1)[1])
        row["samples_per_s_vs_memory"] = row["samples_per_s"] / baseline["samples_per_s"] if baseline else None
    emit(result, args.out)


def _figures(run_dir: str) -> dict:
    """Data wait share, step time and samples/s after the first SKIP steps, from metrics.jsonl
    (each report row holds its window's mean step time and data wait)."""
    rows = [json.loads(line) for line in Path(run_dir, "metrics.jsonl").read_text().splitlines()]
    train = [r for r in rows if r["split"] == "train"]
    wait = step = 0.0
    steps = 0
    previous = None
    for row in train:
        if previous is not None and previous >= SKIP:
            n = row["step"] - previous
            wait += row["data_wait_s"] * n
            step += row["step_time_s"] * n
            steps += n
        previous = row["step"]
    return {"data_wait_share": wait / step, "step_ms": 1e3 * step / steps, "samples_per_s": BATCH * steps / step}


def _has_datasets() -> bool:
    try:
        import datasets  # noqa: F401
    except ImportError:
        return False
    return True


if __name__ == "__main__":
    main()
