"""Recovery time: a worker SIGKILLed mid-run, restarted from the last checkpoint.

Digits on 2 local gloo workers, 300 steps, a checkpoint every 50, one restart allowed, rank 1
SIGKILLs itself after step 120 in the first attempt. Variants, interleaved (rotated per repeat):
  scaletrain       `scaletrain run examples/digits.yaml` with SCALETRAIN_FAULT
  torchrun         bench/baselines/ddp_digits_resumable.py under torchrun --max-restarts 1,
                   TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1 (a fresh rendezvous store per attempt)
  torchrun-shared  the same without it (torchrun's default: the store is shared across attempts)
Recovery = wall time from the last step before the kill (torchrun: its last step log line;
scaletrain: the killed rank's "injected fault" line, as its steps are logged in batches) to the
first step logged after the restart (rank 0's log lines); lost work = steps done twice. Phases, from the same
logs: until the new rank 0 is up, until it has resumed, until its first step. Only the total
compares like with like: "up" is scaletrain's "worker started" line (before the process group
and the task module, whose sklearn import is ~1 s) and the baseline's end of imports (after
its sklearn import). A run past --timeout is stopped (SIGTERM, then SIGKILL) and counts as hung.

    .venv/bin/python bench/recovery_time.py --repeats 3
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from datetime import datetime
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import BIN, REPO  # noqa: E402

STEPS, EVERY, KILL_STEP = 300, 50, 120


def run(args: list[str], env: dict, timeout: float) -> tuple[int | None, str, str]:
    """Run in a session of its own; past ``timeout``: SIGTERM, then SIGKILL to that session."""
    proc = subprocess.Popen(args, cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True, start_new_session=True)
    try:
        out, err = proc.communicate(timeout=timeout)
        return proc.returncode, out, err
    except subprocess.TimeoutExpired:
        proc.send_signal(signal.SIGTERM)  # torchrun/scaletrain stop their workers on SIGTERM
        try:
            out, err = proc.communicate(timeout=30)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            out, err = proc.communicate()
        return None, out, err  # None: timed out


def phases(steps: list[tuple[float, int]], up: float | None, resumed: float | None,
           resumed_step: int | None, wall: float, rc: int | None, done: bool,
           killed: tuple[float, int] | None = None) -> dict:
    """steps: (time, step) of rank 0 in log order; the restart is where the step goes back.
    ``killed``: (time, step) of the kill itself, where the run says it (scaletrain's steps are
    logged in batches, about 4 times a second: its last logged step is not its last step)."""
    row = {"wall_s": wall, "rc": rc, "completed": done}
    if killed is not None:  # the first step logged after it
        cut = next((i for i in range(len(steps)) if steps[i][0] > killed[0]), None)
    else:
        cut = next((i for i in range(1, len(steps)) if steps[i][1] <= steps[i - 1][1]), None)
    if cut is None:
        return row
    (t_last, last), (t_first, first) = killed or steps[cut - 1], steps[cut]
    row.update(recovery_s=t_first - t_last, last_before_kill=last, resumed_from=resumed_step,
               first_after=first, lost_steps=last - (first - 1))
    if up is not None and resumed is not None:
        row.update(to_up_s=up - t_last, up_to_resumed_s=resumed - up,
                   resumed_to_step_s=t_first - resumed)
    return row


def ts(text: str) -> float:
    return datetime.fromisoformat(text).timestamp()


def run_scaletrain(tmp: Path, timeout: float) -> dict:
    overrides = [f"train.max_steps={STEPS}", "train.epochs=null", f"checkpoint.every_steps={EVERY}",
                 "recovery.max_restarts=1", "tracking.enabled=false", "train.log_every=1",
                 f"run_dir={tmp / 'scaletrain'}"]
    env = {**os.environ, "SCALETRAIN_FAULT": f"sigkill:rank=1:step={KILL_STEP}"}
    started = time.time()
    rc, out, err = run([str(BIN / "scaletrain"), "run", "examples/digits.yaml", "--json",
                        *(x for o in overrides for x in ("--set", o))], env, timeout)
    wall = time.time() - started
    try:
        summary = json.loads(out)
    except ValueError:
        return {"wall_s": wall, "rc": rc, "completed": False, "error": err[-2000:]}
    run_dir = Path(summary["run_dir"])
    log = [json.loads(line) for line in (run_dir / "logs/worker-0.jsonl").read_text().splitlines()]
    steps = [(ts(r["timestamp"]), r["step"]) for r in log if r["message"] == "train metrics"]
    ups = [ts(r["timestamp"]) for r in log if r["message"] == "worker started"]
    resumed = [ts(r["timestamp"]) for r in log if r["message"] == "resumed"]
    killer = [json.loads(line) for line in (run_dir / "logs/worker-1.jsonl").read_text().splitlines()]
    killed = [(ts(r["timestamp"]), KILL_STEP) for r in killer if r["message"].startswith("injected fault")]
    metrics = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    train_steps = [m["step"] for m in metrics if m["split"] == "train"]
    row = phases(steps, ups[1] if len(ups) > 1 else None, resumed[0] if resumed else None,
                 summary.get("resumed_from_step"), wall, rc, summary.get("steps") == STEPS,
                 killed[0] if killed else None)
    # metrics.jsonl keeps one row per step (redone steps are not written again) and has no times.
    row["metrics_jsonl_steps_once_each"] = train_steps == list(range(1, STEPS + 1))
    return row


def run_torchrun(tmp: Path, timeout: float, fresh_store: bool) -> dict:
    folder = Path(tempfile.mkdtemp(dir=tmp))
    env = dict(os.environ)
    env.pop("TORCH_DISABLE_SHARE_RDZV_TCP_STORE", None)
    if fresh_store:
        env["TORCH_DISABLE_SHARE_RDZV_TCP_STORE"] = "1"
    started = time.time()
    rc, _, err = run([sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2",
                      "--max-restarts", "1", "--rdzv-backend", "c10d",
                      "--rdzv-endpoint", "127.0.0.1:0",
                      "bench/baselines/ddp_digits_resumable.py", "--steps", str(STEPS),
                      "--save-every", str(EVERY), "--kill-step", str(KILL_STEP),
                      "--ckpt", str(folder / "ckpt.pt"), "--log-file", str(folder / "log.jsonl")],
                     env, timeout)
    wall = time.time() - started
    log_file = folder / "log.jsonl"
    lines = log_file.read_text().splitlines() if log_file.exists() else []
    log = [json.loads(line) for line in lines]
    steps = [(r["t"], r["step"]) for r in log if r["event"] == "step"]
    ups = [r["imported"] for r in log if r["event"] == "start" and r["attempt"] == 1]
    resumed = [r for r in log if r["event"] == "resumed"]
    row = phases(steps, ups[0] if ups else None, resumed[0]["t"] if resumed else None,
                 resumed[0]["step"] if resumed else None, wall, rc,
                 any(r["event"] == "done" and r["step"] == STEPS for r in log))
    row["attempts_started"] = len({r["attempt"] for r in log if r["event"] == "start"})
    if rc != 0:
        tail = [ln for ln in err.splitlines() if "exitcode" in ln or "Error" in ln]
        row["stderr_tail"] = tail[-6:]
    return row


def stat(rows: list[dict], key: str) -> str:
    values = [r[key] for r in rows if r.get(key) is not None]
    if not values:
        return "-"
    fmt = "{:.0f}" if key == "lost_steps" else "{:.2f}"
    low, mid, high = (fmt.format(v) for v in (min(values), statistics.median(values), max(values)))
    return f"{mid} ({low}-{high})"


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--timeout", type=float, default=90,
                        help="seconds before a run counts as hung")
    parser.add_argument("--variants", default="scaletrain,torchrun,torchrun-shared")
    parser.add_argument("--out", default=str(REPO / "bench/results/latest/recovery.json"))
    args = parser.parse_args()
    variants = {
        "scaletrain": lambda tmp: run_scaletrain(tmp, args.timeout),
        "torchrun": lambda tmp: run_torchrun(tmp, args.timeout, fresh_store=True),
        "torchrun-shared": lambda tmp: run_torchrun(tmp, args.timeout, fresh_store=False),
    }
    variants = {name: variants[name] for name in args.variants.split(",")}
    results: dict[str, list[dict]] = {name: [] for name in variants}
    with tempfile.TemporaryDirectory(prefix="scaletrain-recovery-") as tmp:
        for repeat in range(args.repeats):
            names = list(variants)
            for name in names[repeat % len(names):] + names[:repeat % len(names)]:
                results[name].append(variants[name](Path(tmp)))
                row = results[name][-1]
                print(f"repeat {repeat + 1} {name}: " + json.dumps({k: v for k, v in row.items()
                      if k != "stderr_tail"}), file=sys.stderr, flush=True)

    print(f"\nseconds, median (min-max) over {args.repeats} interleaved repeats; kill after step "
          f"{KILL_STEP}, checkpoint every {EVERY}, {STEPS} steps\n")
    cols = ["recovery_s", "lost_steps", "to_up_s", "up_to_resumed_s", "resumed_to_step_s", "wall_s"]
    print("| variant | completed | exit 0 | hung | " + " | ".join(cols) + " |")
    print("|---" * (len(cols) + 4) + "|")
    for name, rows in results.items():
        completed = sum(r["completed"] for r in rows)
        clean = sum(r["rc"] == 0 for r in rows)
        hung = sum(r["rc"] is None for r in rows)
        print(f"| {name} | {completed}/{len(rows)} | {clean}/{len(rows)} | {hung}/{len(rows)} | "
              + " | ".join(stat(rows, c) for c in cols) + " |")

    def median(name: str) -> float | None:
        values = [r["recovery_s"] for r in results[name] if "recovery_s" in r]
        return statistics.median(values) if values else None

    both = all(n in results and median(n) for n in ("scaletrain", "torchrun"))
    ratio = median("scaletrain") / median("torchrun") if both else None
    print(f"\nrecovery ratio scaletrain / torchrun (medians): {ratio:.2f}" if ratio
          else "\nno ratio")
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps({"repeats": args.repeats, "steps": STEPS, "every": EVERY,
                                          "kill_step": KILL_STEP, "recovery_ratio": ratio,
                                          "runs": results}, indent=2))


if __name__ == "__main__":
    main()
