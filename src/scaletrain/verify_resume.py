"""`scaletrain verify-resume job.yaml`: does this task resume exactly?

Trains the job for a few steps without interruption, then again with the last rank SIGKILLed
between two checkpoints and one restart allowed, and compares the final weights bit for bit.
A task with hidden state (an iterator, its own RNG, a counter) fails here, with the first
tensor that differs, before it costs a real run.
"""

from __future__ import annotations

import os
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

from scaletrain.api import resolve_job, run
from scaletrain.recovery.faults import FAULT_ENV

__all__ = ["verify_resume"]


def verify_resume(
    job: str, overrides: list[str], steps: int, announce: Callable[[str], None] = lambda _: None
) -> dict[str, Any]:
    config, _ = resolve_job(job, overrides)
    steps = max(4, steps)
    save_every = steps // 2
    kill_at = save_every + max(1, steps // 4)
    with tempfile.TemporaryDirectory(prefix="scaletrain-verify-resume-") as scratch:
        common = [
            *overrides,
            f"train.max_steps={steps}", "train.epochs=null",
            f"checkpoint.every_steps={save_every}", "checkpoint.dir=null",
            "checkpoint.async_save=false", "tracking.enabled=false", f"run_dir={scratch}",
        ]
        if not config.deterministic and _cuda():
            # GPU kernels with atomics differ from run to run; the comparison is bit for bit.
            common.append("deterministic=true")
            announce("on CUDA: deterministic=true (bit-exact comparison needs deterministic kernels)")
        announce(f"1/2 training {steps} steps without interruption")
        clean = run(job, common)
        victim = config.scale.workers - 1
        announce(f"2/2 training again; rank {victim} is killed at step {kill_at}, after the checkpoint of step {save_every}")
        previous = os.environ.get(FAULT_ENV)
        os.environ[FAULT_ENV] = f"sigkill:rank={victim}:step={kill_at}"
        try:
            resumed = run(job, [*common, "recovery.max_restarts=1"])
        finally:
            if previous is None:
                os.environ.pop(FAULT_ENV, None)
            else:
                os.environ[FAULT_ENV] = previous
        match = clean["weights_sha256"] == resumed["weights_sha256"]
        first_diff = None if match else _first_difference(Path(clean["weights"]), Path(resumed["weights"]))
    # What the restarted workers did, not what was planned: a run trained again from step 0
    # also ends with the same weights, and proves nothing about resuming.
    restarts, observed = resumed.get("restarts", 0), resumed.get("resumed_from_step")
    if restarts != 1:
        problem = f"the killed worker was restarted {restarts} times, not once"
    elif observed is None:
        problem = (f"the restarted workers found no checkpoint (one was due at step {save_every}) and "
                   "trained from step 0, which tests nothing about resuming")
    elif not match:
        problem = first_diff or "the weights differ"
    else:
        problem = None
    return {
        "passed": problem is None,
        "problem": problem,
        "steps": steps,
        "killed_at_step": kill_at,
        "resumed_from_step": observed,
        "restarts": restarts,
        "uninterrupted_sha256": clean["weights_sha256"],
        "resumed_sha256": resumed["weights_sha256"],
        "first_difference": first_diff,
    }


def _cuda() -> bool:
    import torch

    return torch.cuda.is_available()


def _first_difference(a: Path, b: Path) -> str:
    import torch
    from safetensors.torch import load_file

    left, right = load_file(a), load_file(b)
    for name in sorted(set(left) | set(right)):
        if name not in left or name not in right:
            return f"{name}: present in only one model"
        if not torch.equal(left[name], right[name]):
            delta = (left[name].float() - right[name].float()).abs().max().item()
            return f"{name}: max abs difference {delta:.3g}"
    return "weights are equal but their fingerprints differ"
