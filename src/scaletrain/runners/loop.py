"""The loop runner: your own training function, ``train(ctx)``, on every worker, with the guardrails
that fit a loop scaletrain did not write.

``ctx`` (a LoopContext) is the whole interface, in the style of Ray Train's and Lightning
Fabric's: who and where (rank, world size, device), ``prepare(model)`` (the job's strategy),
``loader(dataset, batch_size)`` (the global-position sampler: resume stays exact),
``report(metrics)`` (the job's one MLflow run, JSON logs, progress bar), ``save(state)`` and
``restore(state)`` (verified DCP checkpoints), ``should_stop()`` (the end of a step: preemption,
periodic saves, the hang watchdog) and ``seed_everything()``.

A minimal loop::

    def train(ctx):
        ctx.seed_everything()
        model = ctx.prepare(Net())
        opt = torch.optim.AdamW(model.parameters(), lr=ctx.config["lr"])
        state = {"model": model, "optimizer": opt}
        ctx.restore(state)                    # no-op on a fresh start
        loader = ctx.loader(dataset, batch_size=32)
        while ctx.step < ctx.config["steps"]:
            for x, y in loader:
                loss = F.cross_entropy(model(x), y)
                opt.zero_grad(); loss.backward(); opt.step()
                ctx.report({"loss": loss.item()})
                if ctx.should_stop() or ctx.step == ctx.config["steps"]:
                    return
"""

from __future__ import annotations

import logging
import os
import random
import threading
import time
from collections import deque
from collections.abc import Callable
from typing import Any

import numpy as np
import torch
from torch import nn
from torch.utils.data import DataLoader, Dataset

from scaletrain.checkpoint.manager import CheckpointManager
from scaletrain.checkpoint.state import LoopObjects
from scaletrain.data.loader import eval_loader
from scaletrain.data.sampler import ORDER, derive_seed
from scaletrain.engine.checkpointing import data_order_of
from scaletrain.engine.metrics import step_time_summary
from scaletrain.engine.weights import save_state_weights, save_weights, state_dict_sha256
from scaletrain.errors import ScaletrainError
from scaletrain.rundir import WEIGHTS_FILE
from scaletrain.runners.base import Runner
from scaletrain.runners.loop_loader import LoopLoader
from scaletrain.runners.pickled_loop import MAIN_MODULE, read_loop
from scaletrain.runners.runtime import WorkerRuntime
from scaletrain.strategies import get_strategy
from scaletrain.strategies.activation_checkpoint import checkpoint_blocks
from scaletrain.strategies.base import Strategy
from scaletrain.strategies.blocks import find_blocks
from scaletrain.task import add_to_sys_path, resolve_task_factory
from scaletrain.tracking.logs import LOGGER_NAME
from scaletrain.tracking.reporter import StepReport, split_metrics

__all__ = ["LoopRunner", "LoopContext"]

log = logging.getLogger(f"{LOGGER_NAME}.worker")
_STEP_TIMES_KEPT = 1024


class LoopContext:
    """What a user's loop gets. Every rank runs the loop; calls marked collective must be made
    by every rank, in the same order."""

    def __init__(self, runtime: WorkerRuntime, config: dict[str, Any]):
        self._runtime = runtime
        job = runtime.job
        self.config = config  # loop.args (or scaletrain.run_loop's config)
        self.rank, self.world_size, self.local_rank = runtime.env.rank, runtime.env.world_size, runtime.env.local_rank
        self.device: torch.device = runtime.placement.device
        self.is_main = runtime.is_main
        self.restart_count = runtime.restart_count  # 0 on the first start of the job
        self.run_dir = runtime.spec.run_dir
        self.max_steps: int | None = job.train.max_steps
        self.step = 0  # steps completed (should_stop() counts them; restore() sets them)
        self.resumed_from_step: int | None = None
        self.stopped_on: str | None = None  # the signal every rank stopped on
        self.strategy_name = job.scale.resolved_strategy
        self._strategy: Strategy | None = None
        self._model: nn.Module | None = None
        self._loaders: list[LoopLoader] = []
        self._restored_positions: list[int] = []  # loaders made after restore() start there
        self._data_order = ORDER  # a new run's epoch order, or the one its checkpoint was trained with
        self._card: threading.Thread | None = None
        self._state: LoopObjects | None = None
        self._checkpoints: CheckpointManager | None = None
        self._checkpoints_made = False
        self._metrics: dict[str, float] = {}
        self._started = False  # the reporter told the total and the step it starts from
        self._last_step_at: float | None = None
        self.first_step_at: float | None = None
        self.step_times: deque[float] = deque(maxlen=_STEP_TIMES_KEPT)

    # ------------------------------------------------------------------ setup

    def seed_everything(self, seed: int | None = None) -> int:
        """Seed torch (every device), ``random`` and numpy alike on every rank (the job's seed
        by default), so every replica of a model is built identically; returns the seed."""
        seed = derive_seed(self._runtime.job.seed, "init") % (1 << 32) if seed is None else seed
        torch.manual_seed(seed)
        random.seed(seed)
        np.random.seed(seed % (1 << 32))
        return seed

    def prepare(self, model: nn.Module) -> nn.Module:
        """The model on this worker's device, wrapped for the job's strategy (DDP, FSDP...).
        Build the optimizer after this, from the returned module's parameters. Collective."""
        if self._model is not None:
            raise ScaletrainError("ctx.prepare is called once, with the model to train")
        job = self._runtime.job
        if job.scale.strategy == "auto":
            from scaletrain.plan.auto import auto_strategy_for_model

            job = auto_strategy_for_model(job, model, self.world_size, self.device, self.is_main)
            self.strategy_name = job.scale.resolved_strategy
        self._strategy = get_strategy(self.strategy_name, job.scale)
        blocks = find_blocks(model)
        if job.scale.activation_checkpointing:
            checkpoint_blocks(blocks)
        self._model = self._strategy.wrap(model, self._runtime.placement, blocks)
        return self._model

    def unwrap(self, model: nn.Module) -> nn.Module:
        """Your module, without the strategy's wrapper (DDP's ``.module``)."""
        return self._strategy.unwrap(model) if self._strategy is not None else model

    def loader(self, dataset: Dataset, batch_size: int, *, shuffle: bool = True,
               collate_fn: Callable[[list[Any]], Any] | None = None, num_workers: int = 0) -> LoopLoader:
        """This rank's batches of ``dataset`` (``batch_size`` per rank), on its device. Every
        epoch is a seeded permutation split over the ranks; checkpoints keep the position, so a
        resumed loop reads exactly the batches it would have read. One ``for`` is one epoch."""
        loader = LoopLoader(
            dataset, batch_size, rank=self.rank, world_size=self.world_size, seed=self._runtime.job.seed,
            device=self.device, shuffle=shuffle, collate_fn=collate_fn, num_workers=num_workers,
            on_batch=self._progress, order=self._data_order,
        )
        if self._restored_positions and len(self._loaders) < len(self._restored_positions):
            loader.position = self._restored_positions[len(self._loaders)]
        self._loaders.append(loader)
        if self.is_main and self._card is None:  # the run card, with this data's fingerprint, beside training
            self._card = threading.Thread(target=self._runtime.write_run_card, args=(dataset,), daemon=True,
                                          name="scaletrain-card")
            self._card.start()
        return loader

    def eval_loader(self, dataset: Dataset, batch_size: int,
                    collate_fn: Callable[[list[Any]], Any] | None = None) -> DataLoader:
        """This rank's share of an evaluation set: every sample exactly once over all ranks."""
        return eval_loader(dataset, batch_size=batch_size, rank=self.rank, world_size=self.world_size,
                           loader_workers=0, collate=collate_fn, pin_memory=self.device.type == "cuda")

    # ------------------------------------------------------------------ during training

    def report(self, metrics: dict[str, Any], step: int | None = None) -> None:
        """Metrics of a step (the one in progress by default): rank 0's go to the job's MLflow
        run (as train/<name>; names starting eval/ as they are), metrics.jsonl, the JSON logs and
        the progress bar. Tensors are read with .item(); every rank may call it."""
        step = self.step + 1 if step is None else int(step)
        train, evaluation = split_metrics(metrics)
        if not self._started:
            self._start()
        reporter = self._runtime.reporter
        reporter.on_step(step)
        if self.is_main:
            if train:
                reporter.on_train_metrics([StepReport(step, train, time.time())])
            if evaluation:
                reporter.on_eval_metrics(step, evaluation)
        self._metrics.update({f"train/{k}": v for k, v in train.items()})
        self._metrics.update({f"eval/{k}": v for k, v in evaluation.items()})
        self._progress()

    def should_stop(self, step: int | None = None) -> bool:
        """The end of a step (the next one by default): call it after every optimizer step, on
        every rank. True when the ranks agreed to stop (SIGTERM/SIGUSR1, preemption); the state
        given to ``save``/``restore`` is then already in a checkpoint of this step. It also
        writes the job's periodic checkpoints (checkpoint.every_steps / every_minutes). A
        collective at the steps the ranks agree on; cheap otherwise."""
        now = time.perf_counter()
        if not self._started:
            self._start()
        self.step = self.step + 1 if step is None else int(step)
        if self._last_step_at is not None:
            self.step_times.append(now - self._last_step_at)
        self._last_step_at = now
        if self.first_step_at is None:
            self.first_step_at = time.time()
        runtime = self._runtime
        if runtime.after_step is not None:  # fault injection in tests
            runtime.after_step(self.step)
        checkpoints = self._checkpoint_manager()
        decision = runtime.control.check(
            self.step,
            async_ready=checkpoints is None or checkpoints.pending_ready,
            async_pending=checkpoints is not None and checkpoints.has_pending,
        )
        if decision.commit and checkpoints is not None:
            checkpoints.wait_pending()
        every = runtime.job.checkpoint.every_steps
        periodic = decision.save or bool(every and self.step % every == 0)
        if self._state is not None and (decision.stop or periodic):
            if checkpoints is not None and checkpoints.last_saved_step != self.step:
                self._save(self._state, self.step, self._metrics)
        if decision.stop:
            self.stopped_on = decision.stop
            if self.is_main:
                log.warning("stopping at step %d on %s%s", self.step, decision.stop,
                            "; checkpoint saved" if self._state is not None and checkpoints else "")
            return True
        return False

    def save(self, state: dict[str, Any], step: int | None = None, metrics: dict[str, float] | None = None) -> None:
        """A verified checkpoint of ``state`` (modules, optimizers, objects with state_dict(),
        tensors, plain values) at ``step`` (the last step completed by default), with every
        loader's position. The state is also what preemption and periodic saves keep from then
        on. Collective. Without checkpoints in the job (checkpoint.enabled false) it does nothing."""
        self._state = LoopObjects(state)
        self._state.values()  # a value JSON cannot keep fails here, on every rank, before any writes
        step = self.step if step is None else int(step)
        if self._checkpoint_manager() is not None:
            named = {k if "/" in k else f"train/{k}": float(v) for k, v in (metrics or {}).items()}
            self._save(self._state, step, named if metrics is not None else self._metrics)

    def restore(self, state: dict[str, Any]) -> int | None:
        """Load the newest verified checkpoint into ``state`` in place (modules, optimizers,
        objects with state_dict(), tensors; plain values are replaced in the dict) and put
        every loader back at its position. Returns the step it was saved at (also ``ctx.step``),
        or None on a fresh start. The state is what preemption and periodic saves keep from
        then on. Collective."""
        self._state = LoopObjects(state)
        checkpoints = self._checkpoint_manager()
        if checkpoints is None:
            return None
        restored = checkpoints.restore_latest(self._state)
        if restored is None:
            return None
        kept = restored.trainer_state
        self._state.set_values(kept.get("values", {}))
        self._restored_positions = [int(p) for p in kept.get("loaders", [])]
        self._data_order = data_order_of(kept, restored.name)
        for loader, position in zip(self._loaders, self._restored_positions, strict=False):
            loader.position, loader.order = position, self._data_order
        self.step = self.resumed_from_step = restored.step
        if self.is_main:
            log.info("resumed", extra={"step": restored.step})
        return restored.step

    # ------------------------------------------------------------------ helpers

    def _start(self) -> None:
        self._started = True
        self._runtime.start(self.max_steps, self.step)

    def _progress(self) -> None:
        watchdog = self._runtime.control.watchdog
        if watchdog is not None:
            watchdog.pet()

    def _checkpoint_manager(self) -> CheckpointManager | None:
        if not self._checkpoints_made:
            self._checkpoints_made = True
            self._checkpoints = self._runtime.checkpoints(self.strategy_name)
        return self._checkpoints

    def _save(self, state: LoopObjects, step: int, metrics: dict[str, float]) -> None:
        checkpoints = self._checkpoint_manager()
        assert checkpoints is not None  # noqa: S101  callers check it
        watchdog = self._runtime.control.watchdog
        if watchdog is not None:
            watchdog.arm()
        kept = {"kind": "loop", "loaders": [loader.position for loader in self._loaders],
                "values": state.values(), "data_order": self._data_order}
        checkpoints.save(step, state, kept, metrics)
        self._runtime.control.saved()

    def _finish(self) -> dict[str, Any]:
        """After the loop returned: the last checkpoint, the final weights and their hash."""
        checkpoints = self._checkpoints
        if checkpoints is not None:
            checkpoints.wait_pending()
            due = self.stopped_on or self._runtime.job.checkpoint.at_end
            if due and self._state is not None and checkpoints.last_saved_step != self.step and self.step:
                self._save(self._state, self.step, self._metrics)
            checkpoints.close()
        if self.is_main:
            if self._card is None:  # no ctx.loader: the card without a data fingerprint
                self._runtime.write_run_card(None)
            else:
                self._card.join()
        sha = ""
        if self._model is not None and self._strategy is not None:
            state = self._strategy.full_state_dict(self._model)  # collective for sharded models
            if self.is_main:
                sha = state_dict_sha256(state)
                path = os.path.join(self._runtime.spec.out_dir, WEIGHTS_FILE)
                meta = {"run_id": self._runtime.spec.run_id, "step": str(self.step)}
                if self._strategy.sharded:
                    save_state_weights(state, path, meta)
                else:
                    save_weights(self._strategy.unwrap(self._model), path, meta)
        self._runtime.reporter.on_end()
        return {
            "steps": self.step,
            "preempted": self.stopped_on,
            "last_checkpoint_step": checkpoints.last_saved_step if checkpoints is not None else None,
            "weights_sha256": sha,
            "train": {k.removeprefix("train/"): v for k, v in self._metrics.items() if k.startswith("train/")},
            "eval": {k.removeprefix("eval/"): v for k, v in self._metrics.items() if k.startswith("eval/")},
            "first_step_at": self.first_step_at,
            "resumed_from_step": self.resumed_from_step,
            "strategy": self.strategy_name,
            "step_time": step_time_summary(self.step_times),
        }

    def _abandon(self) -> None:
        if self._checkpoints is not None:
            self._checkpoints.abandon()


class LoopRunner(Runner):
    kind = "loop"

    def run(self, runtime: WorkerRuntime) -> dict[str, Any]:
        job = runtime.job
        assert job.loop is not None  # noqa: S101  the runner of loop jobs
        function = resolve_loop(job.loop.target, runtime.spec.python_path)
        ctx = LoopContext(runtime, dict(job.loop.args))
        if runtime.restart_count and runtime.is_main:
            log.warning("restart %d of %d after a worker failure (its exit is in %s)",
                        runtime.restart_count, job.recovery.max_restarts, runtime.spec.launcher_log)
        try:
            function(ctx)
        except BaseException:
            ctx._abandon()
            raise
        return ctx._finish()


def resolve_loop(target: str, search_path: list[str] | None) -> Callable[[LoopContext], Any]:
    """The loop function ``target`` names (``module:function``), imported as a Task factory is;
    ``__main__:name``: the function scaletrain.run_loop handed over (runners/pickled_loop.py)."""
    module, _, name = target.partition(":")
    if module == MAIN_MODULE:  # what it refers to by name is imported from the job's folders
        add_to_sys_path(search_path or ())
        return read_loop(name)
    return resolve_task_factory(target, search_path or (), section="loop")
