"""Where a run's checkpoints go, and the hash that says whether a checkpoint fits a job."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import Any

from scaletrain.config.schema import JobConfig
from scaletrain.rundir import CHECKPOINTS_DIR

__all__ = ["checkpoint_location", "config_hash", "global_batch", "accumulation_for"]


def checkpoint_location(job: JobConfig, run_id: str, run_dir: str | Path) -> str:
    """``checkpoint.dir/<job>/<run id>``, or ``<run dir>/checkpoints`` when no dir is set."""
    if job.checkpoint.dir is None:
        return str(Path(run_dir) / CHECKPOINTS_DIR)
    base = job.checkpoint.dir.rstrip("/")
    if "://" not in base:
        base = str(Path(base).expanduser().resolve())
    return f"{base}/{job.name}/{run_id}"


def global_batch(job: JobConfig) -> int:
    """Samples per optimizer step: what training computes, whatever the number of workers."""
    return job.data.batch_size * job.scale.workers * job.train.grad_accum


def accumulation_for(job: JobConfig, world_size: int) -> int | None:
    """Micro-steps per optimizer step that keep the job's global batch on ``world_size``
    workers (more when a node was lost), or None when no whole number does."""
    per_pass = job.data.batch_size * world_size
    target = global_batch(job)
    return target // per_pass if target % per_pass == 0 else None


def config_hash(job: JobConfig) -> str:
    """What decides the numbers of training: task, optimizer, schedule length, seed, global batch.
    Not how many workers share it, where files go or how often anything is logged."""
    data = job.model_dump(mode="json")
    if job.task is None:  # a loop or a script: it decides the rest
        return _digest({job.kind: data[job.kind], "max_steps": data["train"]["max_steps"], "seed": data["seed"]})
    # grad_accum is how the global batch is split, like the number of workers: not in the hash.
    train = {k: v for k, v in data["train"].items() if k not in ("log_every", "eval_every", "grad_accum")}
    relevant: dict[str, Any] = {
        "task": data["task"],
        "optim": data["optim"],
        "train": train,
        "seed": data["seed"],
        "shuffle": data["data"]["shuffle"],
        "global_batch": global_batch(job),
    }
    return _digest(relevant)


def _digest(relevant: dict[str, Any]) -> str:
    text = json.dumps(relevant, sort_keys=True)
    return hashlib.sha256(text.encode()).hexdigest()[:16]
