"""The report's figures as PNG bytes (matplotlib's Agg canvas: no display, no pyplot state).
Each function takes the collected data and returns None when the run has nothing to draw."""

from __future__ import annotations

import io
from typing import Any

__all__ = ["curves", "timeline", "speed", "ranks", "trials"]

_MARKS = {  # event kind -> (colour, line style, legend label)
    "start": ("#2ca02c", ":", "workers started"),
    "checkpoint": ("#7f7f7f", ":", "checkpoint"),
    "resume": ("#ff7f0e", "--", "resume"),
    "restart": ("#d62728", "-", "restart"),
    "alert": ("#9467bd", "-.", "alert"),
    "stop": ("#8c564b", "--", "stop"),
}
_WIDE, _TALL = 10.0, 3.6


def _figure(rows: int = 1, cols: int = 1, height: float = _TALL) -> tuple[Any, Any]:
    from matplotlib.figure import Figure

    figure = Figure(figsize=(_WIDE, height), dpi=100, layout="constrained")
    axes = figure.subplots(rows, cols, squeeze=False)
    return figure, [a for row in axes for a in row]


def _png(figure: Any) -> bytes:
    buffer = io.BytesIO()
    figure.savefig(buffer, format="png")
    return buffer.getvalue()


def _mark(axis: Any, events: list[Any], position: Any) -> None:
    """Vertical lines at events (position(event) -> x, or None to leave it out), one legend
    entry per kind."""
    labelled = set()
    for event in events:
        if event.kind not in _MARKS:
            continue
        x = position(event)
        if x is None:
            continue
        colour, style, label = _MARKS[event.kind]
        axis.axvline(x, color=colour, linestyle=style, linewidth=1.0, alpha=0.8,
                     label=None if event.kind in labelled else label)
        labelled.add(event.kind)


def curves(report: dict[str, Any]) -> bytes | None:
    """Training loss (and eval loss) by step; the other eval metrics beside it."""
    metrics = report["metrics"]
    loss, eval_loss = metrics.get("train/loss"), metrics.get("eval/loss")
    others = [k for k in metrics if k.startswith("eval/") and k != "eval/loss"]
    if not loss and not eval_loss:
        return None
    figure, axes = _figure(1, 2 if others else 1)
    axis = axes[0]
    if loss:
        axis.plot([p[0] for p in loss], [p[2] for p in loss], label="train/loss", linewidth=1.2)
    if eval_loss:
        axis.plot([p[0] for p in eval_loss], [p[2] for p in eval_loss], "o-", label="eval/loss", markersize=4)
    _mark(axis, [e for e in report["events"] if e.kind in ("checkpoint", "resume", "stop")], lambda e: e.step)
    axis.set_xlabel("step")
    axis.set_ylabel("loss")
    axis.set_title("loss")
    axis.grid(alpha=0.3)
    axis.legend(fontsize=8)
    if others:
        for key in others:
            axes[1].plot([p[0] for p in metrics[key]], [p[2] for p in metrics[key]], "o-", label=key, markersize=4)
        axes[1].set_xlabel("step")
        axes[1].set_title("evaluation")
        axes[1].grid(alpha=0.3)
        axes[1].legend(fontsize=8)
    return _png(figure)


def timeline(report: dict[str, Any]) -> bytes | None:
    """The step reached over wall time, with starts, checkpoints, restarts, alerts and stops."""
    points = report["metrics"].get("train/loss") or next(
        (v for k, v in report["metrics"].items() if k.startswith("train/")), None)
    start = report["start"]
    if not points or start is None:
        return None
    figure, (axis,) = _figure()
    by_time = sorted(points, key=lambda p: p[1])
    axis.plot([p[1] - start for p in by_time], [p[0] for p in by_time], ".-", markersize=3, linewidth=1,
              label="step reached")
    _mark(axis, report["events"], lambda e: e.time - start)
    axis.set_xlabel("seconds since the run started")
    axis.set_ylabel("step")
    axis.set_title("progress over time")
    axis.grid(alpha=0.3)
    axis.legend(fontsize=8, loc="lower right")
    return _png(figure)


def speed(report: dict[str, Any]) -> bytes | None:
    """Rank 0's step time and data wait, and the job's samples/s, over wall time."""
    metrics, start = report["metrics"], report["start"]
    step_time, wait = metrics.get("train/step_time_s"), metrics.get("train/data_wait_s")
    rate = metrics.get("train/samples_per_s")
    if not (step_time or rate) or start is None:
        return None
    figure, axes = _figure(1, 2)
    if step_time:
        axes[0].plot([p[1] - start for p in step_time], [p[2] * 1000 for p in step_time], ".-", markersize=3,
                     label="step time")
    if wait:
        axes[0].plot([p[1] - start for p in wait], [p[2] * 1000 for p in wait], ".-", markersize=3,
                     label="data wait")
    axes[0].set_ylabel("ms per step (rank 0)")
    axes[0].set_title("step time and data wait")
    if rate:
        axes[1].plot([p[1] - start for p in rate], [p[2] for p in rate], ".-", markersize=3, color="#2ca02c")
    axes[1].set_ylabel("samples/s")
    axes[1].set_title("throughput")
    for axis in axes:
        _mark(axis, [e for e in report["events"] if e.kind in ("restart", "resume")], lambda e: e.time - start)
        axis.set_xlabel("seconds since the run started")
        axis.grid(alpha=0.3)
        if axis.get_legend_handles_labels()[0]:
            axis.legend(fontsize=8)
    return _png(figure)


def ranks(report: dict[str, Any]) -> bytes | None:
    """Per rank: step time (mean, p50..p90), samples/s and the data-wait share: a straggler shows."""
    rows = report["ranks"]
    if not rows:
        return None
    figure, axes = _figure(1, 3)
    names = [str(r["rank"]) for r in rows]
    means = [r["step_mean_s"] * 1000 for r in rows]
    low = [max(0.0, m - (r["step_p50_s"] or 0) * 1000) for m, r in zip(means, rows)]
    high = [max(0.0, (r["step_p90_s"] or 0) * 1000 - m) for m, r in zip(means, rows)]
    axes[0].bar(names, means, yerr=[low, high], capsize=4, color="#1f77b4")
    axes[0].set_title("step time, ms (mean; bar: p50 to p90)")
    axes[1].bar(names, [r["samples_per_s"] or 0 for r in rows], color="#2ca02c")
    axes[1].set_title("samples/s while stepping")
    axes[2].bar(names, [100 * (r["data_wait_share"] or 0) for r in rows], color="#ff7f0e")
    axes[2].set_title("data wait, % of step time")
    for axis in axes:
        axis.set_xlabel("rank")
        axis.grid(alpha=0.3, axis="y")
    return _png(figure)


def trials(report: dict[str, Any]) -> bytes | None:
    """A search's trials side by side: the searched metric by step, and each trial's final value."""
    metric, rows = report["metric"], report["trials"]
    if not rows:
        return None
    figure, axes = _figure(1, 2, height=4.2)
    for trial in rows:
        points = trial["metrics"].get(metric) or []
        if points:
            axes[0].plot([p[0] for p in points], [p[2] for p in points], "o-" if len(points) < 30 else "-",
                         markersize=3, linewidth=2.2 if trial["best"] else 1.0, label=str(trial["trial"])[-12:])
    axes[0].set_xlabel("step")
    axes[0].set_title(metric)
    axes[0].grid(alpha=0.3)
    if len(rows) <= 12 and axes[0].get_legend_handles_labels()[0]:
        axes[0].legend(fontsize=7)
    finals = [(str(t["trial"])[-12:], t["final"].get(metric), t["best"]) for t in rows]
    shown = [f for f in finals if f[1] is not None]
    axes[1].barh([f[0] for f in shown], [f[1] for f in shown],
                 color=["#d62728" if f[2] else "#1f77b4" for f in shown])
    axes[1].set_title(f"final {metric} per trial (best in red)")
    axes[1].grid(alpha=0.3, axis="x")
    axes[1].tick_params(axis="y", labelsize=7)
    return _png(figure)
