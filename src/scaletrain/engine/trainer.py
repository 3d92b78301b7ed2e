"""The training loop. It reads like the recipe: for each step, accumulate micro-batches,
clip, step the optimizer and the schedule, report, evaluate."""

from __future__ import annotations

import logging
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

from scaletrain.checkpoint.location import accumulation_for, global_batch
from scaletrain.checkpoint.manager import CheckpointManager
from scaletrain.config.schema import JobConfig
from scaletrain.data.loader import TrainBatches, eval_loader, train_loader
from scaletrain.data.sampler import DataLayout, derive_seed
from scaletrain.data.shard_order import RowGroups
from scaletrain.data.stream import StreamBatches, has_state, is_stream
from scaletrain.distributed import collectives
from scaletrain.distributed.device import Placement, autocast, seed_rng, to_device
from scaletrain.distributed.env import DistEnv
from scaletrain.engine.checkpointing import Checkpointer, new_run_order
from scaletrain.engine.control import Control, Decision
from scaletrain.engine.evaluate import eval_batches, evaluate
from scaletrain.engine.metrics import (
    MetricsWindow,
    StepOutput,
    TrainingDiverged,
    mean_loss,
    mean_metrics,
    step_time_summary,
)
from scaletrain.engine.optim import build_optimizer
from scaletrain.engine.schedule import LRSchedule, build_scheduler
from scaletrain.engine.state_bytes import measure_state_bytes
from scaletrain.engine.weights import state_dict_sha256
from scaletrain.errors import ScaletrainError, TaskError
from scaletrain.observe.telemetry import current as telemetry
from scaletrain.strategies import get_strategy
from scaletrain.strategies.activation_checkpoint import checkpoint_blocks
from scaletrain.strategies.blocks import find_blocks
from scaletrain.task import TaskProtocol, split_loss_output
from scaletrain.task import tokens_per_sample as task_tokens_per_sample
from scaletrain.tracking.reporter import Reporter

__all__ = ["Trainer", "TrainResult", "TrainingDiverged"]

log = logging.getLogger("scaletrain.engine")


@dataclass
class TrainResult:
    steps: int
    train: dict[str, float] = field(default_factory=dict)
    eval: dict[str, float] = field(default_factory=dict)
    weights_sha256: str = ""
    first_step_at: float | None = None  # wall clock when the first step of this attempt finished
    resumed_from_step: int | None = None
    preempted: str | None = None  # the signal that stopped training early, after a checkpoint
    last_checkpoint_step: int | None = None
    strategy: str = ""  # what ran (scale.strategy auto resolves in the workers)
    # This rank's time in train_step over its last steps (median, p90, how many): ranks that
    # wait for a slower one in a collective show it here (rank 0's reporting shows as the
    # others' wait). Host time: on GPUs, kernels still running at the step's end are not in it.
    step_time: dict[str, float] = field(default_factory=dict)


_STEP_TIMES_KEPT = 1024  # the steady state: the last steps, not the start-up


class Trainer:
    def __init__(
        self,
        job: JobConfig,
        task: TaskProtocol,
        env: DistEnv,
        placement: Placement,
        reporter: Reporter,
        checkpoints: CheckpointManager | None = None,
        control: Control | None = None,
        after_step: Callable[[int], None] | None = None,
    ):
        self.job, self.task, self.env, self.placement, self.reporter = (
            job, task, env, placement, reporter
        )
        self.checkpoints = checkpoints
        self.tokens_per_sample = task_tokens_per_sample(task)
        self.batches: TrainBatches | StreamBatches | None = None  # this rank's, while fit() runs
        self.after_step = after_step  # the worker's hook (fault injection in tests)
        self.control = control or Control(collectives.active(), None, None, None)
        self.device = placement.device
        self.strategy = get_strategy(job.scale.resolved_strategy, job.scale)

        # Same seed on every rank, so every replica is built identically.
        seed_rng(derive_seed(job.seed, "init"), self.device)
        model = task.build_model()
        blocks = find_blocks(model, task)
        if job.scale.activation_checkpointing:
            checkpoint_blocks(blocks)
        self.model = self.strategy.wrap(model, placement, blocks)
        self.final_state: dict[str, torch.Tensor] | None = None  # rank 0, once fit ends
        self._state_logged = False
        self._steps_run = 0  # by this process (a resumed run counts from its restore)
        self._skipped_updates, self._skip_said_at = 0, -30.0  # train.nonfinite: skip
        self.optimizer = build_optimizer(self.strategy.unwrap(self.model), job.optim, self.strategy)

        train_set = task.train_dataset()
        self.stream = is_stream(train_set)  # read in order, the same at any world size (data/stream.py)
        self.train_set = _stream_checked(train_set, job, env) if self.stream else _map_style(train_set, "train_dataset")
        self.eval_set = task.eval_dataset() if callable(getattr(task, "eval_dataset", None)) else None  # type: ignore[attr-defined]  # an optional part of the Task protocol, checked
        if self.eval_set is not None:
            self.eval_set = _map_style(self.eval_set, "eval_dataset")
        if self.eval_set is not None and len(self.eval_set) < env.world_size:
            raise ScaletrainError(
                f"the eval set has {len(self.eval_set)} samples, fewer than the "
                f"{env.world_size} workers; use a larger eval set or fewer workers"
            )
        self.collate = getattr(task, "collate", None)
        self.accum = _accumulation(job, env)
        self.layout = DataLayout(
            dataset_len=None if self.stream else len(self.train_set),  # map-style: checked by _map_style
            batch_size=job.data.batch_size,
            world_size=env.world_size,
            grad_accum=self.accum,
        )
        if not self.stream and self.layout.steps_per_epoch < 1:
            raise ScaletrainError(
                f"the training set has {self.layout.dataset_len} samples but one step needs "
                f"{self.layout.global_batch} (data.batch_size x workers x train.grad_accum); "
                "lower data.batch_size or train.grad_accum"
            )
        self.max_steps = job.train.max_steps or job.train.epochs * self.layout.steps_per_epoch  # type: ignore[operator]  # the config requires max_steps or epochs
        rows = getattr(self.train_set, "row_groups", None)
        self.row_groups = rows if isinstance(rows, RowGroups) and rows.rows == self.layout.dataset_len else None
        self.checkpointer = (Checkpointer(checkpoints, job, self.layout, self.row_groups, stream=self.stream)
                             if checkpoints is not None else None)
        self.scheduler = build_scheduler(
            self.optimizer,
            LRSchedule(
                kind=job.optim.schedule,
                warmup_steps=job.optim.warmup_steps,
                total_steps=self.max_steps,
                min_ratio=job.optim.min_lr_ratio,
            ),
        )
        self.step = 0  # optimizer steps completed
        self.resumed_from_step: int | None = None
        self.last_metrics: dict[str, tuple[int, float]] = {}  # train/*, eval/*: (step, value)
        tracking_every = job.tracking.log_every_steps if job.tracking.enabled else None
        self.report_every = min(job.train.log_every, tracking_every or job.train.log_every)

    # ------------------------------------------------------------------ the loop

    def fit(self) -> TrainResult:
        train = self.job.train
        loader: TrainBatches | StreamBatches
        if self.stream:
            loader = StreamBatches(
                self.train_set, batch_size=self.job.data.batch_size, world_size=self.env.world_size,
                grad_accum=self.accum, rank=self.env.rank, start_step=self.step, stop_step=self.max_steps,
                collate=self.collate, resume_from=self.checkpointer.stream_resume if self.checkpointer else None,
            )
            if self.checkpointer is not None:
                self.checkpointer.stream_batches = loader
        else:
            loader = train_loader(
                self.train_set,
                self.layout,
                rank=self.env.rank,
                seed=self.job.seed,
                shuffle=self.job.data.shuffle,
                start_step=self.step,
                stop_step=self.max_steps,
                loader_workers=self.job.data.loader_workers,
                collate=self.collate,
                pin_memory=self.device.type == "cuda",
                skip_errors=self.job.data.on_error == "skip",
                order=self.checkpointer.data_order if self.checkpointer is not None else new_run_order(self.row_groups),
                row_groups=self.row_groups,
            )
        iter(loader)  # starts the loader's workers (each loader is its own iterator)
        self.batches = batches = loader
        result = TrainResult(steps=self.step, resumed_from_step=self.resumed_from_step,
                             strategy=self.job.scale.resolved_strategy)
        self.reporter.on_start(total_steps=self.max_steps, start_step=self.step)
        window = MetricsWindow(time.perf_counter(), self.step, stop_on_nonfinite=train.nonfinite == "stop")
        self.control.start(self.step)  # (its first check, and report, after the first step)
        recent: deque[float] = deque(maxlen=_STEP_TIMES_KEPT)
        self.model.train()
        if self.device.type == "cuda":  # training's peak, not building or restoring's
            torch.cuda.reset_peak_memory_stats(self.device)
        try:
            while self.step < self.max_steps:
                started = time.perf_counter()
                step_out = self.train_step(batches, report=self._due(self.report_every))
                recent.append(time.perf_counter() - started)
                self.step += 1
                window.add(step_out, self.step)
                if result.first_step_at is None:
                    result.first_step_at = time.time()
                if self._between_steps(window, result).stop:
                    break
        except BaseException:
            loader.close()  # its workers end now, not at a garbage collection after the error
            raise
        if window.pending:
            result.train = self._report_train(window)
        loader.close()
        if result.preempted is None and self.eval_set is not None and (
            not train.eval_every or self.step % train.eval_every
        ):
            result.eval = self.run_eval()
        if self.checkpoints is not None:
            self.checkpoints.wait_pending()
            due = result.preempted or self.job.checkpoint.at_end or self._save_due()
            if due and self.checkpoints.last_saved_step != self.step:
                self.save_checkpoint()
            self.checkpoints.close()
            result.last_checkpoint_step = self.checkpoints.last_saved_step
        result.steps = self.step
        result.step_time = step_time_summary(recent)
        # Collective for sharded strategies: every rank takes part, rank 0 gets the weights.
        self.final_state = self.strategy.full_state_dict(self.model)
        result.weights_sha256 = state_dict_sha256(self.final_state) if self.env.is_main else ""
        self.reporter.on_end()
        return result

    def _between_steps(self, window: MetricsWindow, result: TrainResult) -> Decision:
        """Report, evaluate, agree with the other ranks on stopping or saving, checkpoint.
        Returns what the ranks agreed (``stop``: every rank stops here, preemption)."""
        every_eval = self.job.train.eval_every
        eval_due = self.eval_set is not None and every_eval and self.step % every_eval == 0
        # Values of kept steps stay on the device; one all-reduce and one host copy report
        # them all at the control's check steps (about 4 times a second, the first step
        # included), and before anything that shows them.
        if window.pending and (eval_due or self._save_due()):
            result.train = self._report_train(window)
        if eval_due:
            result.eval = self.run_eval()
        self.reporter.on_step(self.step)
        if self.after_step is not None:  # the step is done: counted as trained
            self.after_step(self.step)
        decision = self.control.check(
            self.step,
            async_ready=self.checkpoints is None or self.checkpoints.pending_ready,
            async_pending=self.checkpoints is not None and self.checkpoints.has_pending,
        )
        if decision.commit and self.checkpoints is not None:
            self.checkpoints.wait_pending()
        if window.pending and (decision.report or decision.stop or decision.save):
            result.train = self._report_train(window)
        if decision.stop:
            result.preempted = decision.stop
            if self.env.is_main:
                log.warning("stopping at step %d on %s; saving a checkpoint", self.step, decision.stop)
            return decision
        # The last step's checkpoint is written after the final evaluation.
        if self.checkpoints and self.step < self.max_steps and (decision.save or self._save_due()):
            self.save_checkpoint()
        return decision

    def _save_due(self) -> bool:
        return self.checkpointer is not None and self.checkpointer.due(self.step)

    # ------------------------------------------------------------------ checkpoints

    def _pet_watchdog(self) -> None:
        if self.control.watchdog is not None:
            self.control.watchdog.arm()

    def save_checkpoint(self) -> None:
        if self.checkpointer is None:
            return
        self._pet_watchdog()
        # The manifest records the metrics of this very step (for keep_best), nothing older.
        metrics = {k: v for k, (step, v) in self.last_metrics.items() if step == self.step}
        self.checkpointer.save(self.step, self.model, self.optimizer, self.scheduler, metrics)
        self.control.saved()

    def restore(self) -> int | None:
        """Resume from the newest verified checkpoint; the step, or None when there is none."""
        if self.checkpointer is None:
            return None
        restored = self.checkpointer.restore(self.model, self.optimizer, self.scheduler)
        if restored is not None:
            self.step = self.resumed_from_step = restored
        return restored

    def train_step(self, batches: Any, report: bool) -> StepOutput:
        accum = self.accum
        # Losses and metrics are kept only on reporting steps: no extra tensor ops otherwise.
        losses: list[torch.Tensor] = []
        metric_rows: list[dict[str, Any]] = []
        data_wait = 0.0
        for micro in range(accum):
            waited = time.perf_counter()
            batch = self._to_device(next(batches))
            data_wait += time.perf_counter() - waited
            # Randomness in the forward pass (dropout...) depends only on where we are.
            chunk = self.layout.chunk(micro, self.env.rank)
            seed_rng(derive_seed(self.job.seed, "step", self.step, chunk), self.device)
            with self.strategy.sync_gradients(self.model, sync=micro == accum - 1):
                with autocast(self.device, self.job.train.precision):
                    loss, metrics = split_loss_output(self.task.loss(self.model, batch))
                (loss / accum if accum > 1 else loss).backward()
            if report:  # (a metric with a graph is detached as the loop's window keeps it)
                losses.append(loss.detach())  # here: the step's graph is freed as this returns
                metric_rows.append(metrics)
        grad_norm = None
        if self.job.train.clip_grad_norm:
            grad_norm = self.strategy.clip_grad_norm(self.model, self.job.train.clip_grad_norm)
        elif report:
            grad_norm = self.strategy.grad_norm(self.model)
        lr = self.optimizer.param_groups[0]["lr"]
        if self.job.train.nonfinite == "skip":
            grad_norm = grad_norm if grad_norm is not None else self.strategy.grad_norm(self.model)
            # The gradients' norm is the same on every rank (after their all-reduce), and a
            # non-finite loss makes it non-finite too: every rank decides alike, no collective.
            if not torch.isfinite(grad_norm).item():
                self._skip_update()
            else:
                self.optimizer.step()
        else:
            self.optimizer.step()
        self.scheduler.step()
        self._steps_run += 1
        # Once, after the second step (or the last, if sooner): what this rank holds and its
        # peak, the planner's check. The first step's peak is not a training step's: the
        # optimizer's state only appears at its end, while every later forward runs beside it
        # (seen on an H200: the first step's peak was 20-38% under a steady step's).
        if not self._state_logged and (self._steps_run >= 2 or self.step + 1 >= self.max_steps):
            self._state_logged = True
            extra: dict[str, Any] = {"state_bytes": measure_state_bytes(self.model, self.optimizer),
                                     "after_steps": self._steps_run}
            if self.device.type == "cuda":
                extra["peak_allocated_bytes"] = torch.cuda.max_memory_allocated(self.device)
                extra["peak_reserved_bytes"] = torch.cuda.max_memory_reserved(self.device)
            log.info("model state bytes", extra=extra)
        self.optimizer.zero_grad(set_to_none=True)
        return StepOutput(
            loss=(losses[0] if accum == 1 else mean_loss(losses)) if report else None,
            metrics=(metric_rows[0] if accum == 1 else mean_metrics(metric_rows, self.device)) if report else {},
            grad_norm=grad_norm,
            lr=lr,
            data_wait=data_wait,
            report=report,
        )

    def _skip_update(self) -> None:
        """train.nonfinite: skip: no update from this step's gradients (dropped with zero_grad),
        counted for the error rate and said (the first, then at most every 30 s)."""
        self._skipped_updates += 1
        if self.env.is_main:
            telemetry().add("errors_total", 1, "step")
        now = time.monotonic()
        if now - self._skip_said_at >= 30.0:
            self._skip_said_at = now
            log.warning("step %d: non-finite loss or gradient, update skipped (train.nonfinite: skip; %d so far)",
                        self.step + 1, self._skipped_updates, extra={"skipped_updates": self._skipped_updates})

    def run_eval(self) -> dict[str, float]:
        self._pet_watchdog()
        loader = eval_loader(
            self.eval_set,  # type: ignore[arg-type]  # run_eval runs only with an eval set
            batch_size=self.job.data.batch_size,
            rank=self.env.rank,
            world_size=self.env.world_size,
            loader_workers=self.job.data.loader_workers,
            collate=self.collate,
            pin_memory=self.device.type == "cuda",
        )
        metrics = evaluate(
            self.strategy.unwrap(self.model),
            self.task.loss,
            loader,
            self._to_device,
            lambda: autocast(self.device, self.job.train.precision),
            # Sharded parameters are gathered in every forward: all ranks run as many.
            forwards=eval_batches(len(self.eval_set), self.job.data.batch_size, self.env.world_size)  # type: ignore[arg-type]  # run_eval runs only with an eval set
            if self.strategy.sharded else None,
        )
        self.last_metrics.update({f"eval/{k}": (self.step, v) for k, v in metrics.items()})
        self.reporter.on_eval_metrics(self.step, metrics)
        return metrics

    # ------------------------------------------------------------------ helpers

    def _due(self, every: int) -> bool:
        next_step = self.step + 1
        return next_step % every == 0 or next_step == self.max_steps or next_step == 1

    def _report_train(self, window: MetricsWindow) -> dict[str, float]:
        """Report every pending step; returns the last one's metrics."""
        ready = self.batches.ready() if self.batches is not None else None
        if ready is not None:  # the prefetch queue's depth, seen at each report
            telemetry().set("data_ready_batches", ready)
        last = window.report(self.reporter, self.layout.global_batch, self.tokens_per_sample)[-1]
        self.last_metrics.update({f"train/{k}": (last.step, v) for k, v in last.metrics.items()})
        return last.metrics

    def _to_device(self, batch: Any) -> Any:
        return to_device(batch, self.device)


def _accumulation(job: JobConfig, env: DistEnv) -> int:
    """The job's grad_accum, or more when fewer workers than the job's run it (an elastic job
    that lost a node): the global batch, and with it the data order and the numbers, stay."""
    if env.world_size == job.scale.workers:
        return job.train.grad_accum
    accum = accumulation_for(job, env.world_size)
    if accum is None:
        raise ScaletrainError(
            f"{env.world_size} workers cannot make up the job's global batch of "
            f"{global_batch(job)} samples with whole accumulation steps (data.batch_size "
            f"{job.data.batch_size}); run on a number of workers that divides "
            f"{global_batch(job) // job.data.batch_size}"
        )
    if env.is_main:
        log.warning(
            "running on %d of the job's %d workers (a node was lost, or has not joined): %d "
            "accumulation steps per optimizer step (train.grad_accum %d) keep the global batch of "
            "%d samples", env.world_size, job.scale.workers, accum,
            job.train.grad_accum, global_batch(job),
        )
    return accum


def _stream_checked(dataset: Any, job: JobConfig, env: DistEnv) -> Any:
    """A training stream, if the job can train on it: steps, not epochs, say how long."""
    if not job.train.max_steps:
        raise TaskError(
            f"the task's train_dataset() returned a stream ({type(dataset).__name__}), whose length is not known: "
            "set train.max_steps instead of train.epochs"
        )
    if env.is_main and not has_state(dataset):
        log.warning(
            "the training stream (%s) has no state_dict()/load_state_dict(): a resume reads it again from the "
            "start of its pass and skips the samples already trained on (exact only if it yields the same "
            "samples in the same order every time)", type(dataset).__name__,
        )
    return dataset


def _map_style(dataset: Any, method: str) -> Any:
    """The dataset, if the sampler can index it (len() and [i]); else one line saying what to return."""
    if hasattr(dataset, "__len__") and hasattr(dataset, "__getitem__"):
        return dataset
    kind = type(dataset).__name__
    raise TaskError(
        f"the task's {method}() returned a {kind}, which has no len() and [i]: every rank evaluates its own "
        "share of the eval set by position, so it is map-style (a torch Dataset, a list, ParquetShards); "
        "load a streamed eval set into one (it is read once per evaluation)"
    )
