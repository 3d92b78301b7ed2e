"""The report as one self-contained HTML page: the PNGs inline (data: URIs), inline CSS, no
script (its Content-Security-Policy allows none), every value from the store escaped."""

from __future__ import annotations

import base64
import html
import time
from typing import Any

__all__ = ["render"]

_STYLE = """
body{font:14px/1.45 system-ui,-apple-system,'Segoe UI',sans-serif;margin:24px auto;max-width:1060px;color:#222;padding:0 16px}
h1{font-size:22px;margin:0 0 4px}h2{font-size:17px;margin:28px 0 8px;border-bottom:1px solid #ddd;padding-bottom:4px}
.sub{color:#666}.badge{display:inline-block;padding:1px 8px;border-radius:10px;font-size:12px;color:#fff;background:#888}
.FINISHED{background:#2ca02c}.FAILED{background:#d62728}.KILLED{background:#ff7f0e}.RUNNING{background:#1f77b4}
table{border-collapse:collapse;margin:6px 0;font-size:13px}td,th{border:1px solid #e3e3e3;padding:3px 8px;text-align:left;vertical-align:top}
th{background:#f6f6f6}td.num{text-align:right;font-variant-numeric:tabular-nums}
figure{margin:8px 0}figure img{max-width:100%;border:1px solid #eee}figcaption{color:#666;font-size:12px}
.kv td:first-child{color:#555;white-space:nowrap}.best{background:#fff4f4}.none{color:#888}
"""
_CSP = "default-src 'none'; img-src data:; style-src 'unsafe-inline'"


def _e(value: Any) -> str:
    return html.escape("" if value is None else str(value), quote=True)


def _number(value: Any) -> str:
    if isinstance(value, float):
        return f"{value:.4g}"
    return _e(value)


def _clock(unix: float | None) -> str:
    return time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime(unix)) if unix else "-"


def _duration(report: dict[str, Any]) -> str:
    if not report.get("start"):
        return "-"
    end = report.get("end")
    wall = (report.get("summary") or {}).get("wall_time_s")  # the launch's, start-up included
    seconds = wall if end and isinstance(wall, (int, float)) else (end or time.time()) - report["start"]
    text = f"{seconds:.1f} s" if seconds < 120 else f"{seconds / 60:.1f} min"
    return text if end else f"{text} so far (running)"


def _table(rows: list[dict[str, Any]], columns: list[str], highlight: str | None = None) -> str:
    head = "".join(f"<th>{_e(c)}</th>" for c in columns)
    body = []
    for row in rows:
        cells = "".join(
            f'<td class="num">{_number(row.get(c))}</td>' if isinstance(row.get(c), (int, float))
            else f"<td>{_e(row.get(c))}</td>" for c in columns)
        marked = ' class="best"' if highlight and row.get(highlight) else ""
        body.append(f"<tr{marked}>{cells}</tr>")
    return f"<table><tr>{head}</tr>{''.join(body)}</table>"


def _pairs(items: list[tuple[str, Any]]) -> str:
    rows = "".join(f"<tr><td>{_e(k)}</td><td>{_number(v)}</td></tr>" for k, v in items)
    return f'<table class="kv">{rows}</table>'


def _figure(images: dict[str, bytes], name: str, caption: str) -> str:
    data = images.get(name)
    if data is None:
        return ""
    encoded = base64.b64encode(data).decode("ascii")
    return (f'<figure id="{_e(name)}"><img alt="{_e(caption)}" src="data:image/png;base64,{encoded}">'
            f"<figcaption>{_e(caption)} ({_e(name)}.png)</figcaption></figure>")


def _head(report: dict[str, Any], title: str) -> str:
    status = report["status"]
    return (
        f'<!doctype html><html lang="en"><head><meta charset="utf-8">'
        f'<meta http-equiv="Content-Security-Policy" content="{_CSP}">'
        f'<meta name="viewport" content="width=device-width,initial-scale=1">'
        f"<title>{_e(title)}</title><style>{_STYLE}</style></head><body>"
        f'<h1>{_e(title)} <span class="badge {_e(status)}">{_e(status)}</span></h1>'
        f'<div class="sub">experiment {_e(report["experiment"])} &middot; MLflow run '
        f'{_e(report["mlflow_run_id"])} &middot; started {_e(_clock(report["start"]))} &middot; '
        f"{_e(_duration(report))}</div>"
    )


def _foot() -> str:
    return (f'<p class="sub">Made by <code>scaletrain report</code> on {_e(_clock(time.time()))} from the '
            "tracking store.</p></body></html>")


def render(report: dict[str, Any], images: dict[str, bytes]) -> str:
    return _render_search(report, images) if report["kind"] == "search" else _render_run(report, images)


def _render_run(report: dict[str, Any], images: dict[str, bytes]) -> str:
    summary = report.get("summary") or {}
    final = report["final"]
    events = report["events"]
    title = f"{report['job']}: {report['run_id']}" if report.get("job") else str(report["run_id"])
    parts = [_head(report, title)]
    facts = [
        ("scaletrain run", report["run_id"]),
        ("trace id", report["tags"].get("scaletrain.trace_id") or summary.get("trace_id")),
        ("steps", report["tags"].get("scaletrain.steps") or summary.get("steps")),
        ("train loss (last)", final.get("train/loss")),
        *[(k, v) for k, v in final.items() if k.startswith("eval/")],
        ("samples/s (last window)", final.get("train/samples_per_s")),
        ("tokens/s (last window)", final.get("train/tokens_per_s")),
        ("goodput (last launch)", _goodput(summary.get("goodput"))),
        ("step time, ms (last window)", final["train/step_time_s"] * 1000 if "train/step_time_s" in final else None),
        ("checkpoints saved", sum(e.kind == "checkpoint" for e in events)),
        ("restarts", report["tags"].get("scaletrain.restarts") or sum(e.kind == "restart" for e in events)),
        ("workers", report["tags"].get("scaletrain.world_size")),
        ("strategy", report["tags"].get("scaletrain.strategy")),
        ("alerts", report["tags"].get("scaletrain.alerts") or "none"),
        ("stopped by", report["tags"].get("scaletrain.stopped_by")),
        ("error", summary.get("error")),
        ("git commit", report["tags"].get("mlflow.source.git.commit")),
    ]
    parts.append("<h2>Summary</h2>" + _pairs([(k, v) for k, v in facts if v is not None]))
    parts.append("<h2>Loss and evaluation</h2>" + (
        _figure(images, "curves", "loss by step; dotted: checkpoints, dashed: resumes")
        or '<p class="none">no loss or evaluation metrics recorded</p>'))
    parts.append("<h2>Progress, restarts and checkpoints over time</h2>" + (
        _figure(images, "timeline", "the step reached over wall time; workers started (dotted green), checkpoints "
                "(dotted grey), resumes (dashed orange), restarts (red), alerts (purple)")
        or '<p class="none">no training metrics recorded</p>'))
    parts.append("<h2>Speed</h2>" + (
        _figure(images, "speed", "rank 0's step time and data wait per reporting window, and the job's samples/s")
        or '<p class="none">no step-time metrics recorded</p>'))
    parts.append("<h2>Per rank</h2>")
    if report["ranks"]:
        parts.append(_figure(images, "ranks", "each rank's step time, throughput and data-wait share "
                                              "(from its telemetry)"))
        parts.append(_table([{
            "rank": r["rank"], "steps": r["steps"], "samples": r["samples"],
            "step mean ms": r["step_mean_s"] * 1000,
            "step p50 ms": (r["step_p50_s"] or 0) * 1000, "step p90 ms": (r["step_p90_s"] or 0) * 1000,
            "samples/s": r["samples_per_s"],
            "data wait %": 100 * r["data_wait_share"] if r["data_wait_share"] is not None else None,
        } for r in report["ranks"]], ["rank", "steps", "samples", "step mean ms", "step p50 ms", "step p90 ms",
                                      "samples/s", "data wait %"]))
    else:
        parts.append('<p class="none">no per-rank telemetry in the run\'s logs artifact</p>')
    parts.append("<h2>Alerts</h2>")
    if report["alerts"]:
        parts.append(_table([{"at": _clock(a.get("at")), "alert": a.get("alert"), "severity": a.get("severity"),
                              "action": a.get("action"), "what": a.get("description")}
                             for a in report["alerts"]], ["at", "alert", "severity", "action", "what"]))
    else:
        parts.append('<p class="none">no alert fired</p>')
    parts.append("<h2>Events</h2>")
    if events:
        start = report["start"] or events[0].time
        parts.append(_table([{"t (s)": round(e.time - start, 1), "event": e.kind, "step": e.step, "what": e.text}
                             for e in events], ["t (s)", "event", "step", "what"]))
    else:
        parts.append('<p class="none">no events: the run has no logs artifact</p>')
    parts.append("<h2>Run card</h2>" + _run_card(report.get("run_card")))
    parts.append("<h2>Parameters</h2>" + _pairs(list(report["params"].items())))
    parts.append(_foot())
    return "".join(parts)


def _goodput(spent: Any) -> str | None:
    if not isinstance(spent, dict) or "ratio" not in spent:
        return None
    parts = [f"{name} {spent[key]:.1f} s" for name, key in (
        ("training", "productive_s"), ("start-up", "startup_s"), ("checkpoints", "checkpoint_stall_s"),
        ("redone", "redone_s"), ("other", "other_s")) if isinstance(spent.get(key), (int, float))]
    return f"{spent['ratio']:.0%} ({', '.join(parts)})"


def _run_card(card: dict[str, Any] | None) -> str:
    if not card:
        return '<p class="none">no run card artifact</p>'
    hardware = card.get("hardware") or {}
    git = card.get("git") or {}
    torch = card.get("torch") or {}
    items = [
        ("python", card.get("python")), ("torch", torch.get("version") if isinstance(torch, dict) else torch),
        ("host", hardware.get("host")), ("cpu", hardware.get("cpu")), ("gpus", hardware.get("gpus")),
        ("git commit", git.get("commit")), ("git dirty", git.get("dirty")),
        ("data fingerprint", card.get("data_fingerprint")), ("packages", len(card.get("packages") or [])),
    ]
    return _pairs([(k, v) for k, v in items if v not in (None, "", [])])


def _render_search(report: dict[str, Any], images: dict[str, bytes]) -> str:
    metric, space = report["metric"], report["space"]
    parts = [_head(report, f"tune search {report['name']}")]
    rows = report["trials"]
    best = next((t for t in rows if t["best"]), None)
    counts = {s: sum(t["status"] == s for t in rows) for s in sorted({t["status"] for t in rows})}
    parts.append("<h2>Summary</h2>" + _pairs([
        ("metric", f"{metric} ({report['mode']})"), ("searched", ", ".join(space) or "-"),
        ("trials", len(rows)), *[(f"trials {s.lower()}", n) for s, n in counts.items()],
        ("best trial", best["trial"] if best else None),
        (f"best {metric}", best["final"].get(metric) if best else None),
    ]))
    parts.append("<h2>Trials side by side</h2>" + (
        _figure(images, "trials", f"{metric} of each trial by step (best: thicker line, red bar)")
        or '<p class="none">no trials recorded under this search</p>'))
    table = [{"trial": t["trial"], "status": t["status"], **{k: t["values"].get(k) for k in space},
              metric: t["final"].get(metric), "train/loss": t["final"].get("train/loss"),
              "steps": t["tags"].get("scaletrain.steps"), "MLflow run": t["mlflow_run_id"], "best": t["best"]}
             for t in rows]
    parts.append(_table(table, ["trial", "status", *space, metric, "train/loss", "steps", "MLflow run"],
                        highlight="best"))
    parts.append("<h2>Search settings</h2>" + _pairs(list(report["params"].items())))
    parts.append(_foot())
    return "".join(parts)
