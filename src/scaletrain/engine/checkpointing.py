"""The Trainer's side of checkpoints: what one holds beside the model and optimizer (step, data
position, LR schedule), when one is due by steps, and a restore that refuses a checkpoint
trained with another global batch (the resumed run would read other batches).

Writing, verifying, retention and storage are the CheckpointManager's (checkpoint/)."""

from __future__ import annotations

import logging
from typing import Any

import torch

from scaletrain.checkpoint.manager import CheckpointError, CheckpointManager
from scaletrain.checkpoint.state import ModelAndOptimizer
from scaletrain.config.schema import JobConfig
from scaletrain.data.sampler import LEGACY_ORDER, ORDER, ORDERS, SHARD_ORDER, DataLayout
from scaletrain.data.shard_order import RowGroups
from scaletrain.data.stream import StreamBatches, StreamPosition

__all__ = ["Checkpointer", "data_order_of", "new_run_order"]

log = logging.getLogger("scaletrain.engine")


class Checkpointer:
    def __init__(self, manager: CheckpointManager, job: JobConfig, layout: DataLayout,
                 row_groups: RowGroups | None = None, stream: bool = False):
        self.manager = manager
        self.layout = layout
        self.row_groups = row_groups  # a dataset in row groups (Parquet shards)
        self.stream = stream  # a training stream: its position is saved, not derived from the step
        self.stream_batches: StreamBatches | None = None  # the stream's reader, while fit() runs
        self.stream_resume: StreamPosition | None = None  # where a restored checkpoint left the stream
        self.every_steps = job.checkpoint.every_steps
        # The epoch order the run reads in: a new run's, or the one its checkpoint was trained with.
        self.data_order = new_run_order(row_groups)

    def due(self, step: int) -> bool:
        return bool(self.every_steps and step % self.every_steps == 0)

    def state(self, step: int, scheduler: Any) -> dict[str, Any]:
        """trainer.json: what a resume needs beside the model and optimizer (the data position
        is the step: the sampler is a pure function of it)."""
        schedule = scheduler.state_dict()
        schedule["lr_lambdas"] = [None] * len(schedule["lr_lambdas"])  # rebuilt from the job
        stream = self.stream_batches.position if self.stream_batches is not None else self.stream_resume
        return {
            "step": step,
            "epoch": (stream or {}).get("pass", 0) if self.stream else step // self.layout.steps_per_epoch,
            "samples": step * self.layout.global_batch,
            **({"stream": stream or {"pass": 0, "samples_in_pass": 0, "state": None}} if self.stream else {}),
            "global_batch": self.layout.global_batch,
            "data_order": self.data_order,
            **({"data_row_groups": self.row_groups.digest} if self.data_order == SHARD_ORDER and self.row_groups else {}),
            "scheduler": schedule,
        }

    def save(self, step: int, model: torch.nn.Module, optimizer: torch.optim.Optimizer, scheduler: Any,
             metrics: dict[str, float]) -> None:
        self.manager.save(step, ModelAndOptimizer(model, optimizer), self.state(step, scheduler), metrics)

    def restore(self, model: torch.nn.Module, optimizer: torch.optim.Optimizer, scheduler: Any) -> int | None:
        """Load the newest verified checkpoint into these; its step, or None when there is none."""
        restored = self.manager.restore_latest(ModelAndOptimizer(model, optimizer))
        if restored is None:
            return None
        state = restored.trainer_state
        if state.get("global_batch") != self.layout.global_batch:
            raise CheckpointError(
                f"checkpoint {restored.name} was trained with a global batch of "
                f"{state.get('global_batch')} samples, this job has {self.layout.global_batch}; "
                "set data.batch_size x scale.workers x train.grad_accum to match, so the resumed "
                "run reads the same batches"
            )
        expected = self.manager.identity.get("config_hash")
        if state.get("config_hash") and state["config_hash"] != expected:
            log.warning(
                "checkpoint %s was written by a different job configuration (config hash %s, "
                "this job %s): resuming anyway", restored.name, state["config_hash"], expected,
            )
        self.data_order = data_order_of(state, restored.name)
        self._check_row_groups(state, restored.name)
        self.stream_resume = self._stream_position(state, restored.name)
        scheduler.load_state_dict(state["scheduler"])
        return restored.step


    def _check_row_groups(self, state: dict[str, Any], checkpoint: str) -> None:
        """A checkpoint trained on shards resumes on the same row groups: the order is made of them."""
        if self.data_order != SHARD_ORDER:
            if self.row_groups is not None:
                log.warning("checkpoint %s was trained on a dataset read sample by sample (%s); its resume "
                            "keeps that order, exact but slower on shards", checkpoint, self.data_order)
            return
        here = self.row_groups.digest if self.row_groups is not None else None
        if state.get("data_row_groups") != here:
            what = ("a dataset that is not in row groups" if here is None
                    else f"row groups laid out differently (digest {here})")
            raise CheckpointError(
                f"checkpoint {checkpoint} was trained on Parquet shards whose row groups have digest "
                f"{state.get('data_row_groups')}, this job's training set has {what}; resume on the "
                "same shards and shuffle_window, so the resumed run reads the same batches")


    def _stream_position(self, state: dict[str, Any], checkpoint: str) -> StreamPosition | None:
        """Where the stream was at the checkpoint; a checkpoint of the other kind of dataset is refused."""
        position = state.get("stream")
        if self.stream == (position is None):
            trained, this = ("a stream", "a map-style dataset") if position is not None else ("a map-style dataset", "a stream")
            raise CheckpointError(
                f"checkpoint {checkpoint} was trained on {trained}, this job's training set is {this}; "
                "resume with the task's dataset of the run that wrote it")
        if position is not None and not (isinstance(position, dict) and isinstance(position.get("pass"), int)
                                         and isinstance(position.get("samples_in_pass"), int)):
            raise CheckpointError(f"checkpoint {checkpoint} has no readable stream position; resume from another one")
        return position


def new_run_order(row_groups: RowGroups | None) -> str:
    """The epoch order a new run reads in: by row groups for shards, sample by sample otherwise."""
    return SHARD_ORDER if row_groups is not None else ORDER


def data_order_of(state: dict[str, Any], checkpoint: str) -> str:
    """The epoch order a checkpoint's run read its data in (one that names none: the former
    randperm); one this version does not know is refused, naming it."""
    order = state.get("data_order", LEGACY_ORDER)
    if order not in ORDERS:
        raise CheckpointError(
            f"checkpoint {checkpoint} reads its data in order {order!r}, which this version of scaletrain "
            f"does not know ({', '.join(ORDERS)}); resume it with the version that wrote it"
        )
    return str(order)
