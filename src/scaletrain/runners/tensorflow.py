"""The TensorFlow runner: a Keras task (runners/tf/task.py) trained by scaletrain's loop under
tf.distribute, with the PyTorch runners' guardrails.

Every worker joins tf.distribute's MultiWorkerMirroredStrategy (TF_CONFIG built from the
workers' addresses, runners/tf/cluster.py), builds the model under its scope, and runs a custom
step: each replica's gradients of its share of the global batch are all-reduced, clipped by
their global norm (what train.clip_grad_norm means for a PyTorch job), and applied once. The
data is read by global position (runners/tf/data.py), so a resume reads what the
uninterrupted run would have; checkpoints are TF's own, committed through the same
CheckpointManager (hashes, manifest, retention, storage). Stopping, periodic saves, the hang
watchdog, the metrics' names and the MLflow run are the worker runtime's, as for PyTorch: its
control messages go over a small gloo group beside TF's collectives.

Why a custom step and not ``model.fit``: fit under MultiWorkerMirroredStrategy fails with Keras 3
(FIELD-NOTES), and it keeps no data position finer than an epoch, so neither exact resume nor a
stop at an agreed step would hold.
"""

from __future__ import annotations

import hashlib
import logging
import os
import threading
import time
from collections import deque
from typing import Any

import torch

from scaletrain.checkpoint.manager import CheckpointError, CheckpointManager
from scaletrain.data.sampler import derive_seed
from scaletrain.distributed import collectives
from scaletrain.engine.metrics import MetricsWindow, StepOutput, step_time_summary
from scaletrain.keras_task import LossAndMetrics, as_dataset, build_keras_model, build_keras_task, loss_and_metrics
from scaletrain.rundir import WEIGHTS_FILE
from scaletrain.runners.base import Runner
from scaletrain.runners.runtime import WorkerRuntime
from scaletrain.runners.tf.checkpoint import KerasState
from scaletrain.runners.tf.cluster import configure, import_tensorflow, make_strategy
from scaletrain.runners.tf.data import Position, TrainBatches, eval_shard
from scaletrain.runners.tf.export import save_keras_weights, save_mlflow_keras_model, weights_sha256
from scaletrain.runners.tf.optim import build_optimizer, lr_schedule
from scaletrain.tracking.logs import LOGGER_NAME
from scaletrain.tracking.mlflow_model import MLFLOW_MODEL_DIR

__all__ = ["TensorFlowRunner"]

log = logging.getLogger(f"{LOGGER_NAME}.worker")
_STEP_TIMES_KEPT = 1024
_FINGERPRINT_SAMPLES = 256


class TensorFlowRunner(Runner):
    kind = "tensorflow"
    uses_torch_device = False  # the worker's torch side (control messages) stays on the CPU

    def run(self, runtime: WorkerRuntime) -> dict[str, Any]:
        # Setting up takes seconds (TF's import alone ~5 s): each part done is progress to the
        # hang watchdog, which is armed from the worker's start.
        alive = runtime.control.watchdog.arm if runtime.control.watchdog is not None else (lambda: None)
        tf = import_tensorflow()
        alive()
        job, env, spec = runtime.job, runtime.env, runtime.spec
        assert job.task is not None  # noqa: S101  the runner of TensorFlow task jobs
        device = configure(tf, env, spec.threads, job.deterministic, job.train.precision)
        strategy = make_strategy(tf, env, job.scale.backend)  # first: TF's collectives start with it
        alive()
        task = build_keras_task(job.task.target, job.task.args, spec.python_path)
        train_set = as_dataset(task.train_dataset(), "train_dataset")
        raw_eval = task.eval_dataset() if callable(getattr(task, "eval_dataset", None)) else None
        eval_set = as_dataset(raw_eval, "eval_dataset") if raw_eval is not None else None
        batches = TrainBatches(train_set, job.data.batch_size, env.rank, env.world_size, job.seed, job.data.shuffle)
        total = job.train.max_steps or (job.train.epochs or 1) * batches.steps_per_epoch
        alive()
        return _Training(runtime, tf, strategy, task, train_set, eval_set, batches, total, device).fit()


class _Training:
    """One attempt of a TensorFlow job on this worker."""

    def __init__(self, runtime: WorkerRuntime, tf: Any, strategy: Any, task: Any, train_set: Any,
                 eval_set: Any, batches: TrainBatches, total: int, device: str):
        import keras

        self.runtime, self.tf, self.strategy, self.task = runtime, tf, strategy, task
        self.job, self.env = runtime.job, runtime.env
        self.train_set, self.eval_set, self.batches, self.total, self.device = (
            train_set, eval_set, batches, total, device)
        # Keras' global state (its global seed generator, layer names) starts afresh: a second
        # job in this process (in-process engine, a notebook) builds what the first built.
        keras.utils.clear_session()
        keras.utils.set_random_seed(derive_seed(self.job.seed, "init") % (1 << 32))  # same init everywhere
        features = train_set.element_spec[0]
        with strategy.scope():
            self.model, output = build_keras_model(task, features)
            self.schedule = lr_schedule(self.job, total)
            self.optimizer = build_optimizer(self.job, self.schedule)
            self.optimizer.build(self.model.trainable_variables)
        self.losses: LossAndMetrics = loss_and_metrics(task, train_set.element_spec[1], output.shape)
        self.eval_metrics = [m.__class__.from_config(m.get_config()) for m in self.losses.metrics]
        self.state = KerasState(self.model, self.optimizer, self.env.rank)
        self.checkpoints: CheckpointManager | None = runtime.checkpoints(self.job.scale.resolved_strategy)
        self.step = 0
        self.position = Position()
        self.resumed_from_step: int | None = None
        self.last_metrics: dict[str, tuple[int, float]] = {}
        tracking_every = self.job.tracking.log_every_steps if self.job.tracking.enabled else None
        self.report_every = min(self.job.train.log_every, tracking_every or self.job.train.log_every)
        self._steps = {report: self._train_step(report) for report in (False, True)}
        self._eval_step: Any = None

    # ------------------------------------------------------------------ the step

    def _train_step(self, report: bool) -> Any:
        tf, strategy, model, optimizer = self.tf, self.strategy, self.model, self.optimizer
        per_sample, metrics = self.losses.per_sample, self.losses.metrics
        global_batch, clip = self.batches.global_batch, self.job.train.clip_grad_norm
        used: list[int] = []  # the variables with a gradient, found while tracing

        def replica_step(x: Any, y: Any) -> Any:
            with tf.GradientTape() as tape:
                pred = _float32(tf, model(x, training=True))
                loss = tf.nn.compute_average_loss(_per_sample(tf, per_sample(y, pred)), global_batch_size=global_batch)
                if model.losses:  # the layers' regularizers, once over all replicas
                    loss += tf.nn.scale_regularization_loss(tf.add_n(model.losses))
            variables = model.trainable_variables
            grads = tape.gradient(loss, variables)
            used[:] = [i for i, g in enumerate(grads) if g is not None]
            reduced = tf.distribute.get_replica_context().all_reduce(tf.distribute.ReduceOp.SUM, [grads[i] for i in used])
            values = []
            if report:  # this replica's batch; the report averages them over the workers
                for metric in metrics:
                    metric.reset_state()
                    metric.update_state(y, pred)
                    values.append(metric.result())
            return loss, reduced, values

        @tf.function
        def step(x: Any, y: Any) -> Any:
            loss, reduced, values = strategy.run(replica_step, args=(x, y))
            local = strategy.experimental_local_results
            grads = [local(g)[0] for g in reduced]
            norm = tf.linalg.global_norm(grads)
            if clip:
                grads, _ = tf.clip_by_global_norm(grads, clip, use_norm=norm)
            variables = model.trainable_variables
            optimizer.apply_gradients(zip(grads, [variables[i] for i in used]))
            return local(loss)[0], norm, [local(v)[0] for v in values]

        return step

    # ------------------------------------------------------------------ the loop

    def fit(self) -> dict[str, Any]:
        runtime = self.runtime
        try:
            self._restore()
            if runtime.control.watchdog is not None:
                runtime.control.watchdog.arm()
            card = None
            if self.env.is_main:  # off the critical path
                card = threading.Thread(target=self._write_run_card, daemon=True, name="scaletrain-card")
                card.start()
            result = self._loop()
            if card is not None:
                card.join()
        except BaseException:
            if self.checkpoints is not None:
                self.checkpoints.abandon()
            raise
        if self.env.is_main and result["preempted"] is None:
            result["weights_sha256"] = self._export()
        elif self.env.is_main:
            result["weights_sha256"] = weights_sha256(self.model)
        runtime.reporter.on_end()
        return result

    def _loop(self) -> dict[str, Any]:
        runtime, job = self.runtime, self.job
        result: dict[str, Any] = {"steps": self.step, "preempted": None, "last_checkpoint_step": None,
                                  "weights_sha256": "", "train": {}, "eval": {}, "first_step_at": None,
                                  "resumed_from_step": self.resumed_from_step,
                                  "strategy": job.scale.resolved_strategy, "step_time": {}}
        runtime.reporter.on_start(total_steps=self.total, start_step=self.step)
        runtime.control.start(self.step)
        window = MetricsWindow(time.perf_counter(), self.step)
        recent: deque[float] = deque(maxlen=_STEP_TIMES_KEPT)
        batches = self.batches.from_position(self.position)
        while self.step < self.total:
            started = time.perf_counter()
            report = self._due(self.step + 1, self.report_every)
            self.position, (x, y) = next(batches)
            data_wait = time.perf_counter() - started
            loss, norm, values = self._steps[report](x, y)
            self.step += 1
            window.add(self._output(report, loss, norm, values, data_wait), self.step)
            recent.append(time.perf_counter() - started)
            if result["first_step_at"] is None:
                result["first_step_at"] = time.time()
            if self._between_steps(window, result):
                break
        if window.pending:
            result["train"] = self._report_train(window)
        every_eval = job.train.eval_every
        if result["preempted"] is None and self.eval_set is not None and (not every_eval or self.step % every_eval):
            result["eval"] = self._evaluate()
        if self.checkpoints is not None:
            due = result["preempted"] or job.checkpoint.at_end or self._save_due()
            if due and self.checkpoints.last_saved_step != self.step:
                self._save()
            self.checkpoints.close()
            result["last_checkpoint_step"] = self.checkpoints.last_saved_step
        result["steps"] = self.step
        result["step_time"] = step_time_summary(recent)
        return result

    def _between_steps(self, window: MetricsWindow, result: dict[str, Any]) -> bool:
        """Report, evaluate, agree on stopping or saving, checkpoint; True: every rank stops here."""
        job, runtime = self.job, self.runtime
        every_eval = job.train.eval_every
        eval_due = self.eval_set is not None and every_eval and self.step % every_eval == 0
        if window.pending and (eval_due or self._save_due()):  # before what shows them
            result["train"] = self._report_train(window)
        if eval_due:
            result["eval"] = self._evaluate()
        runtime.reporter.on_step(self.step)
        if runtime.after_step is not None:  # fault injection in tests
            runtime.after_step(self.step)
        decision = runtime.control.check(self.step, async_ready=True, async_pending=False)
        if window.pending and (decision.report or decision.stop or decision.save):  # (as the Trainer)
            result["train"] = self._report_train(window)
        if decision.stop:
            result["preempted"] = decision.stop
            if self.env.is_main:
                log.warning("stopping at step %d on %s; saving a checkpoint", self.step, decision.stop)
            return True
        if self.checkpoints is not None and self.step < self.total and (decision.save or self._save_due()):
            self._save()
        return False

    def _output(self, report: bool, loss: Any, norm: Any, values: list[Any], data_wait: float) -> StepOutput:
        if not report:
            return StepOutput(None, {}, None, 0.0, data_wait, False)
        world = self.env.world_size
        metrics = {m.name: torch.tensor(float(v)) for m, v in zip(self.losses.metrics, values)}
        return StepOutput(
            # this worker's part of the global mean, as its own mean: the report averages the workers
            loss=torch.tensor(float(loss) * world), metrics=metrics,
            grad_norm=torch.tensor(float(norm)) if self.job.train.clip_grad_norm else None,
            lr=float(self.schedule(self.step - 1)), data_wait=data_wait, report=True,  # this step's lr
        )

    def _report_train(self, window: MetricsWindow) -> dict[str, float]:
        last = window.report(self.runtime.reporter, self.batches.global_batch)[-1]
        self.last_metrics.update({f"train/{k}": (last.step, v) for k, v in last.metrics.items()})
        return last.metrics

    def _due(self, step: int, every: int) -> bool:
        return step % every == 0 or step == self.total or step == 1

    def _save_due(self) -> bool:
        every = self.job.checkpoint.every_steps
        return self.checkpoints is not None and bool(every and self.step % every == 0)

    # ------------------------------------------------------------------ evaluation

    def _evaluate(self) -> dict[str, float]:
        """The loss and metrics over the whole evaluation set: every worker its shard, the sums
        combined (exact for means such as accuracy)."""
        tf, model, per_sample = self.tf, self.model, self.losses.per_sample
        watchdog = self.runtime.control.watchdog
        if watchdog is not None:
            watchdog.arm()
        for metric in self.eval_metrics:
            metric.reset_state()
        metrics = self.eval_metrics
        if self._eval_step is None:

            @tf.function(reduce_retracing=True)  # the last batch may be smaller
            def batch_sums(x: Any, y: Any) -> Any:
                pred = _float32(tf, model(x, training=False))
                losses = _per_sample(tf, per_sample(y, pred))
                for metric in metrics:
                    metric.update_state(y, pred)
                return tf.reduce_sum(tf.cast(losses, tf.float64)), tf.shape(losses)[0]

            self._eval_step = batch_sums
        loss_sum, count = 0.0, 0
        for x, y in eval_shard(self.eval_set, self.job.data.batch_size, self.env.rank, self.env.world_size):
            total, n = self._eval_step(x, y)
            loss_sum, count = loss_sum + float(total), count + int(n)
        sums = torch.tensor([loss_sum, float(count), *(float(m.result()) * count for m in metrics)], dtype=torch.float64)
        collectives.all_reduce(sums, "sum")
        samples = max(1.0, float(sums[1]))
        result = {"loss": float(sums[0]) / samples,
                  **{m.name: float(sums[2 + i]) / samples for i, m in enumerate(metrics)}}
        self.last_metrics.update({f"eval/{k}": (self.step, v) for k, v in result.items()})
        self.runtime.reporter.on_eval_metrics(self.step, result)
        return result

    # ------------------------------------------------------------------ checkpoints

    def _save(self) -> None:
        assert self.checkpoints is not None  # noqa: S101  callers check it
        watchdog = self.runtime.control.watchdog
        if watchdog is not None:
            watchdog.arm()
        metrics = {k: v for k, (step, v) in self.last_metrics.items() if step == self.step}
        kept = {"kind": "tensorflow", "step": self.step, "epoch": self.position.epoch,
                "batch_in_epoch": self.position.batch, "samples": self.step * self.batches.global_batch,
                "global_batch": self.batches.global_batch}
        self.checkpoints.save(self.step, self.state, kept, metrics)
        self.runtime.control.saved()

    def _restore(self) -> None:
        if self.checkpoints is None:
            return
        restored = self.checkpoints.restore_latest(self.state)
        if restored is None:
            if self.runtime.restart_count and self.env.is_main:
                log.warning("restart %d of %d after a worker failure (its exit is in %s); no checkpoint yet: "
                            "from step 0", self.runtime.restart_count, self.job.recovery.max_restarts,
                            self.runtime.spec.launcher_log)
            return
        kept = restored.trainer_state
        if kept.get("kind") != "tensorflow":
            raise CheckpointError(f"checkpoint {restored.name} was written by a PyTorch job; a TensorFlow job "
                                  "resumes only from its own checkpoints")
        if kept.get("global_batch") != self.batches.global_batch:
            raise CheckpointError(
                f"checkpoint {restored.name} was trained with a global batch of {kept.get('global_batch')} "
                f"samples, this job has {self.batches.global_batch}; set data.batch_size x scale.workers to "
                "match, so the resumed run reads the same batches")
        self.step = self.resumed_from_step = restored.step
        self.position = Position(int(kept["epoch"]), int(kept["batch_in_epoch"]))
        if self.env.is_main:
            if self.runtime.restart_count:
                log.warning("restart %d of %d after a worker failure (its exit is in %s); resumed from step %d",
                            self.runtime.restart_count, self.job.recovery.max_restarts,
                            self.runtime.spec.launcher_log, restored.step)
            else:
                log.info("resumed", extra={"step": restored.step})

    # ------------------------------------------------------------------ the end

    def _export(self) -> str:
        """Rank 0: model.safetensors and its sha256, and the MLflow model."""
        spec = self.runtime.spec
        sha = save_keras_weights(self.model, os.path.join(spec.out_dir, WEIGHTS_FILE),
                                 {"run_id": spec.run_id, "step": str(self.step), "framework": "tensorflow"})
        if self.job.tracking.enabled and self.job.tracking.log_model:
            example = next(iter(self.train_set.batch(2).take(1)))[0]
            # A model built under MultiWorkerMirroredStrategy predicts only with every worker
            # (MLflow checks the model by predicting): a plain copy is saved.
            plain = self.task.build_model()
            plain(example, training=False)
            plain.set_weights(self.model.get_weights())
            example = self.tf.nest.map_structure(lambda t: t.numpy(), example)
            save_mlflow_keras_model(plain, os.path.join(spec.out_dir, MLFLOW_MODEL_DIR), example)
        return sha

    def _write_run_card(self) -> None:
        import keras

        tf = self.tf
        extra = {"tensorflow": {
            "version": tf.__version__, "keras": keras.__version__,
            "devices": [d.name for d in tf.config.list_logical_devices()], "device": self.device,
            "op_determinism": self.job.deterministic,
        }}
        self.runtime.write_run_card(None, fingerprint=self._fingerprint(), extra=extra)

    def _fingerprint(self) -> str:
        """The task's own data_fingerprint(), else a sha256 over the sample count and the first
        samples' bytes (a tf.data pipeline cannot be sampled at random cheaply)."""
        if callable(getattr(self.task, "data_fingerprint", None)):
            return str(self.task.data_fingerprint())
        digest = hashlib.sha256(str(self.batches.samples).encode())
        for element in self.train_set.take(_FINGERPRINT_SAMPLES):
            for part in self.tf.nest.flatten(element):
                digest.update(str(part.dtype).encode() + str(tuple(part.shape)).encode())
                digest.update(part.numpy().tobytes())
        return "sha256:" + digest.hexdigest()


def _float32(tf: Any, value: Any) -> Any:
    """Mixed precision computes in bf16; the loss and metrics are taken in fp32."""
    return tf.nest.map_structure(lambda t: tf.cast(t, tf.float32) if t.dtype in (tf.bfloat16, tf.float16) else t, value)


def _per_sample(tf: Any, losses: Any) -> Any:
    """One loss per sample: a loss with more dimensions (per token, per pixel) is averaged."""
    rank = losses.shape.rank
    return tf.reduce_mean(losses, axis=list(range(1, rank))) if rank and rank > 1 else losses

