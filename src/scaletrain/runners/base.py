"""A runner is what a worker runs for one kind of job: the Task runner trains a scaletrain Task
with the engine's loop; later kinds run a user's loop, a script, a TensorFlow model. Everything
around the loop is the worker runtime's (runners/runtime.py), the same for every runner."""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import Any

from scaletrain.runners.runtime import WorkerRuntime

__all__ = ["Runner", "RESULT_KEYS"]

# What every runner returns, the same on every rank; engines pass rank 0's back to the launcher.
RESULT_KEYS = (
    "steps",  # optimizer steps completed by the end of this attempt
    "preempted",  # the signal that stopped training early (after a checkpoint), or None
    "last_checkpoint_step",  # the newest checkpoint this attempt committed, or None
    "weights_sha256",  # rank 0: the final weights' hash ("" elsewhere)
    "train", "eval",  # the last metrics reported
    "first_step_at", "resumed_from_step", "strategy", "step_time",
)


class Runner(ABC):
    kind: str = ""  # the job file's section that names the code to run
    # False: the model is another framework's (TensorFlow), which picks its own device; torch
    # stays on the CPU, for the control messages.
    uses_torch_device: bool = True

    @abstractmethod
    def run(self, runtime: WorkerRuntime) -> dict[str, Any]:
        """Train this rank's share of the job; returns the result (RESULT_KEYS).

        Raise to fail the rank: the runtime writes its error file and the launcher names it."""
