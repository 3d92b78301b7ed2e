"""The loop's numbers between reports: each step's loss and metrics stay on the device until the
console cadence (or anything that shows them) is due, then one all-reduce and one host copy
report every pending step at once. A non-finite loss stops the run here, naming the step
(unless train.nonfinite: skip, where the trainer has already left that step's update out)."""

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
    metrics: dict[str, torch.Tensor]
    grad_norm: torch.Tensor | None
    lr: float
    data_wait: float
    report: bool


@dataclass
class _Pending:
    """A step whose values wait on the device to be reported."""

    step: int
    out: StepOutput
    ended: float  # perf_counter when the step ended
    wall_time: float  # time.time() then, for the tracker
    data_wait: float  # seconds waited for data since the loop started, up to this step


@dataclass
class MetricsWindow:
    """Timing since the last reported step (samples/s is averaged over it), and the steps whose
    values wait on the device to be reported."""

    started: float
    start_step: int
    data_wait: float = 0.0  # seconds waited for data since the loop started
    data_wait_at_start: float = 0.0
    pending: list[_Pending] = field(default_factory=list)
    stop_on_nonfinite: bool = True  # train.nonfinite: skip reports the step's NaN instead

    def add(self, out: StepOutput, step: int) -> None:
        self.data_wait += out.data_wait
        if out.report:
            self.pending.append(_Pending(step, out, time.perf_counter(), time.time(), self.data_wait))

    def report(self, reporter: Reporter, global_batch: int, tokens_per_sample: int | None = None) -> ReportWindow:
        """Report every pending step; returns them, oldest first. ``tokens_per_sample``: the
        task's (a sequence model's context), for tokens/s.

        One all-reduce packs the loss and every metric of every pending step: the mean over all
        ranks. Gradient norms are the same on every rank after the gradient all-reduce. The
        steps go to the sinks as columns (ReportWindow): no dict per step on this thread."""
        pending, self.pending = self.pending, []
        names = sorted(pending[0].out.metrics)
        width = 1 + len(names)
        rows = collectives.all_reduce(
            torch.stack([v for p in pending for v in (p.out.loss, *(p.out.metrics[n] for n in names))])  # type: ignore[misc]  # reported steps keep their loss
            .float()
            .view(len(pending), width),
            "mean",
        ).tolist()
        norms = None
        if pending[0].out.grad_norm is not None:
            norms = torch.stack([p.out.grad_norm for p in pending]).float().tolist()  # type: ignore[misc]  # checked on the first pending step: all or none
        columns = ["loss", *names, "lr", *(["grad_norm"] if norms is not None else []), "step_time_s",
                   "samples_per_s", *(["tokens_per_s"] if tokens_per_sample else []), "data_wait_s"]
        for index, p in enumerate(pending):
            row = rows[index]
            if not math.isfinite(row[0]) and self.stop_on_nonfinite:
                raise TrainingDiverged(
                    f"the loss became {row[0]} at step {p.step}; lower optim.lr, add warmup "
                    "(optim.warmup_steps) or set train.clip_grad_norm"
                )
            steps = p.step - self.start_step
            elapsed = p.ended - self.started
            rate = steps * global_batch / elapsed
            row.append(p.out.lr)
            if norms is not None:
                row.append(norms[index])
            row += (elapsed / steps, rate)
            if tokens_per_sample:
                row.append(rate * tokens_per_sample)
            row.append((p.data_wait - self.data_wait_at_start) / steps)
            self.started, self.start_step, self.data_wait_at_start = p.ended, p.step, p.data_wait
        window = ReportWindow([p.step for p in pending], columns, rows, [p.wall_time for p in pending])
        reporter.on_train_metrics(window)
        return window


def step_time_summary(times: deque[float]) -> dict[str, float]:
    if not times:
        return {}
    ordered = sorted(times)
    return {"median_s": statistics.median(ordered), "p90_s": ordered[int(0.9 * (len(ordered) - 1))],
            "steps": len(ordered)}


def mean_loss(losses: list[torch.Tensor]) -> torch.Tensor:
    """The loss of one step: the mean over its micro-steps (no extra op for just one)."""
    return losses[0] if len(losses) == 1 else torch.stack(losses).float().mean()


def mean_metrics(rows: list[dict[str, Any]], device: torch.device) -> dict[str, torch.Tensor]:
    """Per-metric mean over the micro-steps of one step."""
    if len(rows) == 1:  # no extra ops for a scalar tensor, the common case
        return {
            name: value.detach().to(device, non_blocking=True)
            if isinstance(value, torch.Tensor) and value.dim() == 0
            else torch.as_tensor(value, device=device).detach().float().mean()
            for name, value in rows[0].items()
        }
    return {
        name: torch.stack(
            [torch.as_tensor(row[name], device=device).detach().float() for row in rows]
        ).mean()
        for name in rows[0]
    }
