"""The loop's numbers between reports: each kept step's loss and metrics stay on the device until
a report is due (the control's check steps, about 4 times a second, or anything that shows
them), then one stack, one all-reduce and one host copy report every pending step at once. A
non-finite loss stops the run here, naming the step (unless train.nonfinite: skip, where the
trainer has already left that step's update out)."""

from __future__ import annotations

import math
import statistics
import time
from collections import deque
from dataclasses import dataclass, field
from typing import Any

import torch

from scaletrain.distributed import collectives
from scaletrain.errors import ScaletrainError
from scaletrain.tracking.reporter import Reporter, ReportWindow

__all__ = ["StepOutput", "MetricsWindow", "TrainingDiverged", "step_time_summary", "mean_loss", "mean_metrics"]


class TrainingDiverged(ScaletrainError):
    """The loss became NaN or infinite."""

    code = "ST-DIVERGED"


@dataclass
class StepOutput:
    loss: torch.Tensor | None
    metrics: dict[str, Any]  # as the task returned them (one micro-step), or their means
    grad_norm: torch.Tensor | None
    lr: float
    data_wait: float
    report: bool


@dataclass
class MetricsWindow:
    """Timing since the last reported step (samples/s is averaged over it), and the steps whose
    values wait on the device to be reported."""

    started: float
    start_step: int
    data_wait: float = 0.0  # seconds waited for data since the loop started
    data_wait_at_start: float = 0.0
    # Steps whose values wait on the device to be reported, as plain tuples (made every step):
    # (step, its output, perf_counter at its end, seconds waited for data up to it)
    pending: list[tuple[int, StepOutput, float, float]] = field(default_factory=list)
    stop_on_nonfinite: bool = True  # train.nonfinite: skip reports the step's NaN instead

    def add(self, out: StepOutput, step: int) -> None:
        """Count the step; keep a reported one's values (a metric with a graph detached: kept,
        the graph's tensors would live on until the report; the loop detaches the loss). The
        loop's per-step reporting work is here and in ``report``: right after a step each op
        or check costs 2-4 us, so there is little."""
        self.data_wait += out.data_wait
        if out.report:
            for value in out.metrics.values():
                if getattr(value, "requires_grad", False):
                    out.metrics = {name: value.detach() if getattr(value, "requires_grad", False) else value
                                   for name, value in out.metrics.items()}
                    break
            self.pending.append((step, out, time.perf_counter(), self.data_wait))

    def report(self, reporter: Reporter, global_batch: int, tokens_per_sample: int | None = None) -> ReportWindow:
        """Report every pending step; returns them, oldest first. ``tokens_per_sample``: the
        task's (a sequence model's context), for tokens/s.

        One stack and one host copy take the loss, every metric and the gradient norm of every
        pending step, column by column; one all-reduce of the loss and metrics makes them the
        mean over all ranks (gradient norms are the same on every rank after the gradient
        all-reduce). The steps go to the sinks as these columns (ReportWindow): no dict per
        step on this thread."""
        pending, self.pending = self.pending, []
        count = len(pending)
        outs = [p[1] for p in pending]
        first = outs[0]
        names = sorted(first.metrics)
        norms = first.grad_norm is not None  # all or none
        # Column by column: the loss, each metric, then the gradient norms (not reduced).
        values: list[Any] = [out.loss for out in outs]
        for name in names:
            values += [out.metrics[name] for out in outs]
        if norms:
            values += [out.grad_norm for out in outs]
        try:  # the usual window: scalar tensors on the loss's device, stacked as they are
            stacked = torch.stack(values).float()
        except (TypeError, RuntimeError):  # a float, a 1-element tensor, another device...
            device = first.loss.device  # type: ignore[union-attr]  # reported steps keep their loss
            stacked = torch.stack([_scalar(v, device) for v in values]).float()
        collectives.all_reduce(stacked[:count * (1 + len(names))], "mean")  # in place
        flat = stacked.tolist()
        columns = [flat[start:start + count] for start in range(0, len(flat), count)]
        steps = [p[0] for p in pending]
        if self.stop_on_nonfinite and not math.isfinite(sum(columns[0])):
            for step, loss in zip(steps, columns[0]):
                if not math.isfinite(loss):
                    raise TrainingDiverged(
                        f"the loss became {loss} at step {step}; lower optim.lr, add warmup "
                        "(optim.warmup_steps) or set train.clip_grad_norm"
                    )
        lrs, times, rates, waits = [], [], [], []
        started, start_step, wait_at_start = self.started, self.start_step, self.data_wait_at_start
        for step, out, ended, data_wait in pending:
            between, elapsed = step - start_step, ended - started
            lrs.append(out.lr)
            times.append(elapsed / between)
            rates.append(between * global_batch / elapsed)
            waits.append((data_wait - wait_at_start) / between)
            started, start_step, wait_at_start = ended, step, data_wait
        self.started, self.start_step, self.data_wait_at_start = started, start_step, wait_at_start
        columns.insert(1 + len(names), lrs)  # after the metrics, before the norms
        columns += [times, rates, *([[rate * tokens_per_sample for rate in rates]] if tokens_per_sample else []),
                    waits]
        names = ["loss", *names, "lr", *(["grad_norm"] if norms else []), "step_time_s", "samples_per_s",
                 *(["tokens_per_s"] if tokens_per_sample else []), "data_wait_s"]
        to_wall = time.time() - time.perf_counter()  # the steps' wall times, for the tracker
        window = ReportWindow(steps, names, columns, [p[2] + to_wall for p in pending])
        reporter.on_train_metrics(window)
        return window


def step_time_summary(times: deque[float]) -> dict[str, float]:
    if not times:
        return {}
    ordered = sorted(times)
    return {"median_s": statistics.median(ordered), "p90_s": ordered[int(0.9 * (len(ordered) - 1))],
            "steps": len(ordered)}


def mean_loss(losses: list[torch.Tensor]) -> torch.Tensor:
    """The loss of one step: the mean over its micro-steps (the loop keeps a single one as it is)."""
    return torch.stack(losses).float().mean()


def mean_metrics(rows: list[dict[str, Any]], device: torch.device) -> dict[str, Any]:
    """Per-metric mean over the micro-steps of one step (the loop keeps a single one's metrics
    as the task gave them: MetricsWindow.add detaches one with a graph)."""
    return {
        name: torch.stack(
            [torch.as_tensor(row[name], device=device).detach().float() for row in rows]
        ).mean()
        for name in rows[0]
    }


def _scalar(value: Any, device: torch.device) -> torch.Tensor:
    """A step's metric as a 0-dim tensor on ``device``, for a window whose values are not all
    scalar tensors on one device already (those are stacked as they are, at the report: right
    after a step each op and check costs 2-4 us of the step's time)."""
    if isinstance(value, torch.Tensor) and value.dim() == 0:  # (detached as it was kept)
        return value if value.device == device else value.to(device, non_blocking=True)
    return torch.as_tensor(value, device=device).detach().float().mean()
