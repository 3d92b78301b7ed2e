"""The GPU check: what must hold on one NVIDIA GPU, as one prepared command that fits in minutes.

    bash bench/gpu_check.sh --out bench/results/latest/gpu.json          # on the GPU machine (make gpu-check)
    python bench/gpu_check.py --results bench/results/latest/gpu.json    # then here: its table in docs/benchmarks.md
    python bench/gpu_check.py --device cpu                        # the same checks, small (the test suite's)

Every run is `python -m scaletrain run JOB --json --set ...`, as a user would start it, with
tracking off and a run directory of its own. The checks (``--only`` picks some):

  determinism     digits and tiny_gpt in one process with bf16: the loss falls, and two runs with
                  deterministic: true end with the same weights (sha256)
  one_rank        a 1-worker ddp, fsdp and fsdp+cpu_offload job under the local engine
                  (recovery.max_restarts: 1) gets a real 1-rank process group, NCCL for CUDA tensors:
                  NCCL's own log counts the collectives it ran. A run whose worker is SIGKILLed after
                  a checkpoint restarts, resumes and ends with the uninterrupted run's weights
  two_ranks_gloo  2 ranks sharing the GPU over gloo (scale.backend: gloo; the default refuses in one
                  line) for ddp and fsdp+cpu_offload with async checkpoints, one rank killed and the
                  job resumed as above. First bench/gloo_collectives.py finds which collectives gloo
                  runs on CUDA tensors; a variant that needs one gloo lacks runs on 2 CPU ranks
                  instead (gloo's CPU path; its CUDA collectives are one_rank's, on NCCL), and the
                  row names what was missing
  memory          the planner's predicted peak against torch.cuda.max_memory_allocated for single,
                  ddp, fsdp and fsdp (no reshard) on a 101M-parameter GPT (bench/gpu_memory_check.py):
                  within 10%
  throughput      steps/s of scaletrain (single, bf16) and of a hand-written loop
                  (bench/baselines/single_loop.py) on that GPT, side by side (A B A B)

--device cpu runs the same functions on the smallest jobs that still take every path (SIZES), so
the script cannot rot unnoticed: gloo world-1 groups where the GPU has NCCL, two CPU ranks, state
bytes instead of the allocator's peak (exact), a few throughput steps.

Every run has a timeout and the whole a budget (--budget-s): a check that no longer fits is
recorded as skipped with the reason, and the results file is rewritten after every check, so a
run cut short still leaves what it found. Exit code 0 when every check that ran passed, 1 if one
failed, 2 for bad usage, 128 + N when signal N (SIGTERM, Ctrl-C) stopped it.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import re
import signal
import statistics
import subprocess
import sys
import threading
import time
import traceback
from collections import Counter
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

sys.path.insert(0, str(Path(__file__).resolve().parent))
import gpu_memory_check as memory  # noqa: E402
from common import GPU_SECTION, REPO, gpu_section, steady_steps_per_s  # noqa: E402

EXAMPLES = REPO / "examples"
TINY_GPT = str(EXAMPLES / "tiny_gpt.yaml")
FAULT_ENV = "SCALETRAIN_FAULT"  # scaletrain/recovery/faults.py
RESERVE_S = 5  # of the budget, kept for writing the results
LOSS_FALLS = 0.9  # the last reported loss below this fraction of the first

QUIET = ["tracking.enabled=false", "train.eval_every=null", "train.epochs=null", "checkpoint.keep_best=null"]
ONE_PROCESS = ["scale.workers=1", "scale.strategy=single", "recovery.max_restarts=0",
               "checkpoint.every_steps=null", "checkpoint.at_end=false"]
STRATEGIES = {"ddp": ["scale.strategy=ddp"], "fsdp": ["scale.strategy=fsdp"],
              "fsdp_offload": ["scale.strategy=fsdp", "scale.fsdp.cpu_offload=true"]}
# What each strategy asks of gloo on the device's tensors (bench/gloo_collectives.py's names).
_FSDP_NEEDS = ("all_gather_into_tensor", "reduce_scatter_tensor", "reduce_scatter_tensor(avg)", "all_reduce")
NEEDS = {"ddp": ("all_reduce", "broadcast"), "fsdp": _FSDP_NEEDS, "fsdp_offload": _FSDP_NEEDS}


@dataclass(frozen=True)
class Sizes:
    """How much each check does: the full set on a GPU; on the CPU the least that still takes
    every path, fast enough for the test suite."""

    determinism_examples: tuple[str, ...]
    determinism_steps: int
    one_rank_variants: tuple[str, ...]
    two_rank_variants: tuple[str, ...]
    resume_steps: int  # a job of this many steps,
    checkpoint_every: int  # checkpointed this often,
    kill_step: int  # loses a rank after this step
    memory_shape: tuple[str, ...]
    memory_variants: tuple[str, ...]
    memory_steps: int
    throughput_shape: tuple[str, ...]
    throughput_steps: int
    throughput_log_every: int
    throughput_timed_from: int
    throughput_repeats: int
    run_timeout_s: float
    parallel: int  # runs at once within a check (never for throughput)
    least_s: dict[str, float] = field(default_factory=dict)  # a check starts only with this much left


SIZES = {
    "cuda": Sizes(
        determinism_examples=("digits", "tiny_gpt"), determinism_steps=200,
        one_rank_variants=("ddp", "fsdp", "fsdp_offload"), two_rank_variants=("ddp", "fsdp_offload"),
        resume_steps=60, checkpoint_every=20, kill_step=45,
        memory_shape=tuple(memory.SHAPE), memory_variants=tuple(memory.VARIANTS), memory_steps=3,
        throughput_shape=tuple(memory.SHAPE), throughput_steps=300, throughput_log_every=20,
        throughput_timed_from=100, throughput_repeats=2, run_timeout_s=240, parallel=4,
        least_s={"determinism": 30, "one_rank": 45, "two_ranks_gloo": 45, "memory": 60, "throughput": 60},
    ),
    "cpu": Sizes(
        determinism_examples=("tiny_gpt",), determinism_steps=12,
        one_rank_variants=("fsdp_offload",), two_rank_variants=("ddp",),
        resume_steps=12, checkpoint_every=4, kill_step=10,
        memory_shape=(), memory_variants=("single",), memory_steps=2,
        throughput_shape=(), throughput_steps=30, throughput_log_every=5,
        throughput_timed_from=10, throughput_repeats=1, run_timeout_s=150, parallel=2,
        least_s={"determinism": 10, "one_rank": 10, "two_ranks_gloo": 10, "memory": 10, "throughput": 10},
    ),
}


@dataclass
class Run:
    label: str  # also its folder under the session's scratch directory
    argv: list[str]
    env: dict[str, str] = field(default_factory=dict)


class Session:
    """What the checks share: the device, its sizes, a scratch folder, the deadline, and the
    processes in flight (so an interrupted check leaves none behind)."""

    def __init__(self, device: str, root: Path, deadline: float):
        self.device, self.sizes, self.root, self.deadline = device, SIZES[device], root, deadline
        self.env = {k: v for k, v in os.environ.items() if k != FAULT_ENV}
        if device == "cpu":  # the CPU path stays on the CPU on a GPU machine too
            self.env["CUDA_VISIBLE_DEVICES"] = ""
        self._live: set[subprocess.Popen] = set()
        self._lock = threading.Lock()
        self.memory_profile: Callable[[float], Any] | None = None

    def prepare(self, names: list[str]) -> None:
        """Start what can run ahead of its check: the memory check's planner profile, which
        times passes of the 101M GPT on one CPU core for about a minute, overlaps the checks
        before it."""
        if "memory" in names:
            self.memory_profile = in_background(memory.planner_profile, list(self.sizes.memory_shape))

    def left(self) -> float:
        return self.deadline - time.monotonic()

    def scaletrain(self, label: str, job: str, overrides: list[str], env: dict | None = None) -> Run:
        argv = [sys.executable, "-m", "scaletrain", "run", job, "--json"]
        for item in [*QUIET, *overrides, f"run_dir={self.root / label / 'runs'}"]:
            argv += ["--set", item]
        return Run(label, argv, env or {})

    def run_all(self, runs: list[Run], parallel: int | None = None) -> list[dict]:
        """Run these (``parallel`` at a time), each within its timeout and the budget."""
        with ThreadPoolExecutor(max_workers=parallel or self.sizes.parallel) as pool:
            return list(pool.map(self._execute, runs))

    def _execute(self, run: Run) -> dict:
        folder = self.root / run.label
        folder.mkdir(parents=True, exist_ok=True)
        timeout = min(self.sizes.run_timeout_s, self.left() - RESERVE_S)
        if timeout <= 0:
            return {"label": run.label, "rc": None, "seconds": 0.0, "stdout": "", "folder": str(folder),
                    "error": "not started: the budget is spent"}
        started = time.monotonic()
        with open(folder / "stdout", "w") as out, open(folder / "stderr", "w") as err:
            proc = subprocess.Popen(run.argv, cwd=REPO, env={**self.env, **run.env}, stdout=out, stderr=err,
                                    start_new_session=True)
            with self._lock:
                self._live.add(proc)
            try:
                rc = proc.wait(timeout=timeout)
            except subprocess.TimeoutExpired:
                kill_tree(proc.pid)
                proc.wait()
                rc = None
            finally:
                with self._lock:
                    self._live.discard(proc)
        return outcome(run.label, folder, rc, time.monotonic() - started, timeout)

    def stop(self) -> None:
        """Kill every run in flight, with its workers."""
        with self._lock:
            live = list(self._live)
        for proc in live:
            kill_tree(proc.pid)


def kill_tree(pid: int) -> None:
    """SIGKILL a run and everything it started (torch elastic puts workers in sessions of
    their own, so its process group is not enough)."""
    import psutil

    try:
        parent = psutil.Process(pid)
        family = [*parent.children(recursive=True), parent]
    except psutil.NoSuchProcess:
        return
    for proc in family:
        try:
            proc.kill()
        except psutil.NoSuchProcess:
            pass


def outcome(label: str, folder: Path, rc: int | None, seconds: float, timeout: float) -> dict:
    result = {"label": label, "rc": rc, "seconds": round(seconds, 1), "folder": str(folder),
              "stdout": (folder / "stdout").read_text(errors="replace")}
    if rc is None:
        result["error"] = f"timed out after {timeout:.0f} s"
    elif rc != 0:
        result["error"] = last_error((folder / "stderr").read_text(errors="replace"), rc)
    return result


def last_error(stderr: str, rc: int) -> str:
    """scaletrain's one ``error:`` line, else the last line written (exit code included)."""
    lines = [line for line in stderr.splitlines() if line.strip()]
    errors = [line for line in lines if line.startswith("error:")]
    return f"exit {rc}: " + (errors[-1] if errors else lines[-1] if lines else "no output")[:600]


def summary(result: dict) -> dict | None:
    """The run's JSON summary, or None when it failed."""
    if result["rc"] != 0:
        return None
    try:
        return json.loads(result["stdout"])
    except ValueError:
        result["error"] = "exit 0 but no JSON summary on stdout"
        return None


def json_lines(text: str) -> list[dict]:
    rows = []
    for line in text.splitlines():
        try:
            rows.append(json.loads(line))
        except ValueError:
            continue
    return [row for row in rows if isinstance(row, dict)]


def run_row(result: dict) -> dict:
    """What the results file keeps of a run."""
    done = summary(result)
    row = {"label": result["label"], "seconds": result["seconds"]}
    if done:
        row.update(sha256=done["weights_sha256"], engine=done["engine"], world_size=done["world_size"],
                   restarts=done["restarts"], resumed_from_step=done["resumed_from_step"],
                   wall_time_s=done["wall_time_s"])
    else:
        row["error"] = result.get("error")
    return row


def worker_records(run_dir: str | Path, message: str) -> dict[int, dict]:
    """Each rank's last log record with this message (the last attempt's, after a restart)."""
    found = {}
    for log in Path(run_dir, "logs").glob("worker-*.jsonl"):
        for line in log.read_text().splitlines():
            record = json.loads(line)
            if record.get("message") == message:
                found[record["rank"]] = record
    return dict(sorted(found.items()))


def train_losses(run_dir: str | Path) -> list[float]:
    rows = [json.loads(line) for line in Path(run_dir, "metrics.jsonl").read_text().splitlines()]
    return [row["loss"] for row in rows if row["split"] == "train"]


def nccl_env(folder: Path) -> dict[str, str]:
    """NCCL logs each collective it runs (NCCL_DEBUG_SUBSYS=COLL) to a file per process."""
    return {"NCCL_DEBUG": "INFO", "NCCL_DEBUG_SUBSYS": "COLL", "NCCL_DEBUG_FILE": str(folder / "nccl.%h.%p.log")}


def nccl_collectives(folder: str | Path) -> dict[str, int]:
    """Collectives NCCL ran, by kind, from its log lines (``NCCL INFO AllReduce: opCount ...``)."""
    pattern = re.compile(r"NCCL INFO (\w+): opCount")
    counts: Counter[str] = Counter()
    for log in Path(folder).glob("nccl.*.log"):
        counts.update(pattern.findall(log.read_text(errors="replace")))
    return dict(counts)


def in_background(fn: Callable, *args: Any) -> Callable[[float], Any]:
    """Start ``fn(*args)`` in a daemon thread (one that never holds up exit); returns a function
    that waits up to N seconds for its result and raises what it raised."""
    box: dict[str, Any] = {}

    def target() -> None:
        try:
            box["value"] = fn(*args)
        except BaseException as exc:  # handed to the caller
            box["error"] = exc

    thread = threading.Thread(target=target, daemon=True)
    thread.start()

    def result(timeout: float) -> Any:
        thread.join(max(0.0, timeout))
        if thread.is_alive():
            raise TimeoutError(f"{getattr(fn, '__name__', fn)} did not finish in time")
        if "error" in box:
            raise box["error"]
        return box["value"]

    return result


# ---------------------------------------------------------------------------------------------
# 1. bf16 in one process: the loss falls, and deterministic runs repeat bit for bit


def check_determinism(s: Session) -> dict:
    steps = s.sizes.determinism_steps
    overrides = [*ONE_PROCESS, "train.precision=bf16", "deterministic=true", f"train.max_steps={steps}",
                 f"train.log_every={max(1, steps // 10)}"]
    names = s.sizes.determinism_examples
    runs = [s.scaletrain(f"determinism/{name}-{n}", str(EXAMPLES / f"{name}.yaml"), overrides)
            for name in names for n in (1, 2)]
    results = s.run_all(runs)
    examples = [judge_determinism(s, name, first, second)
                for name, first, second in zip(names, results[::2], results[1::2])]
    text = "; ".join(
        f"{e['example']}: loss {e['first_loss']:.2f} -> {e['last_loss']:.2f}, "
        f"sha256 {'equal' if e['same_sha256'] else 'DIFFERENT'} ({e['device']}, {e['engine']})"
        if "same_sha256" in e else f"{e['example']}: {failure(e['runs'])}" for e in examples)
    return {"ok": all(e["ok"] for e in examples), "summary": "bf16, 2 runs each: " + text, "examples": examples}


def judge_determinism(s: Session, name: str, first: dict, second: dict) -> dict:
    row = {"example": name, "runs": [run_row(first), run_row(second)], "ok": False}
    a, b = summary(first), summary(second)
    if not (a and b):
        return row
    losses = train_losses(a["run_dir"])
    device = worker_records(a["run_dir"], "worker started")[0]["device"]
    row.update(first_loss=losses[0], last_loss=losses[-1], loss_falls=losses[-1] < LOSS_FALLS * losses[0],
               same_sha256=a["weights_sha256"] == b["weights_sha256"], engine=a["engine"], device=device)
    row["ok"] = (row["loss_falls"] and row["same_sha256"] and a["engine"] == "in-process"
                 and device.startswith(s.device))
    return row


def failure(runs: list[dict]) -> str:
    errors = [f"{r['label']}: {r['error']}" for r in runs if r.get("error")]
    return "; ".join(errors) or "no run failed, but a check did"


# ---------------------------------------------------------------------------------------------
# 2 and 3: a rank SIGKILLed after a checkpoint, the job restarted: the uninterrupted run's weights


def resume_runs(s: Session, label: str, overrides: list[str], kill_rank: int, env: dict | None = None,
                log_nccl: bool = False) -> list[Run]:
    """The same job twice under the local engine (recovery.max_restarts=1): uninterrupted, and
    with rank ``kill_rank`` SIGKILLed after step kill_step of its first attempt."""
    z = s.sizes
    job = [*overrides, f"train.max_steps={z.resume_steps}", f"checkpoint.every_steps={z.checkpoint_every}",
           "recovery.max_restarts=1", "deterministic=true"]
    runs = []
    for name, fault in (("uninterrupted", {}), ("killed", {FAULT_ENV: f"sigkill:rank={kill_rank}:step={z.kill_step}"})):
        run_env = {**(env or {}), **fault}
        if log_nccl:
            run_env.update(nccl_env(s.root / label / name))
        runs.append(s.scaletrain(f"{label}/{name}", TINY_GPT, job, run_env))
    return runs


def judge_resume(variant: str, clean: dict, killed: dict, world: int, backend: str, device: str,
                 log_nccl: bool = False) -> dict:
    """ok: one restart, resumed from a checkpoint, the same sha256, every rank on the expected
    device and backend (and, on NCCL, collectives in NCCL's own log)."""
    row = {"variant": variant, "runs": [run_row(clean), run_row(killed)], "ok": False}
    a, b = summary(clean), summary(killed)
    if not (a and b):
        return row
    workers = worker_records(b["run_dir"], "worker started")
    row.update(restarts=b["restarts"], resumed_from_step=b["resumed_from_step"],
               same_sha256=a["weights_sha256"] == b["weights_sha256"],
               workers={rank: {"device": w["device"], "backend": w["backend"]} for rank, w in workers.items()})
    checks = [b["restarts"] == 1, b["resumed_from_step"] is not None, row["same_sha256"],
              list(workers) == list(range(world)),
              all(w["device"] == device and w["backend"] == backend for w in workers.values())]
    if log_nccl:
        row["nccl_collectives"] = {name: nccl_collectives(r["folder"]) for name, r in
                                   (("uninterrupted", clean), ("killed", killed))}
        checks.append(all(row["nccl_collectives"].values()))
    row["ok"] = all(checks)
    return row


def describe_resume(row: dict) -> str:
    if "same_sha256" not in row:
        return f"{row['variant']}: {failure(row['runs'])}"
    ranks = ", ".join(f"{w['device']} {w['backend']}" for w in row["workers"].values())
    text = (f"{row['variant']}: [{ranks}] restarts {row['restarts']}, resumed at step {row['resumed_from_step']}, "
            f"sha256 {'equal' if row['same_sha256'] else 'DIFFERENT'}")
    if "nccl_collectives" in row:
        ops = row["nccl_collectives"]["killed"]
        text += ", NCCL ran " + (", ".join(f"{n} {k}" for k, n in sorted(ops.items())) or "nothing")
    return text


def check_one_rank(s: Session) -> dict:
    """A 1-worker ddp/fsdp job gets a real process group through the local engine: NCCL on a GPU."""
    cuda = s.device == "cuda"
    variants = s.sizes.one_rank_variants
    runs = [run for v in variants for run in
            resume_runs(s, f"one_rank/{v}", [*STRATEGIES[v], "scale.workers=1"], kill_rank=0, log_nccl=cuda)]
    results = s.run_all(runs)
    rows = [judge_resume(v, clean, killed, world=1, backend="nccl" if cuda else "gloo",
                         device="cuda:0" if cuda else "cpu", log_nccl=cuda)
            for v, clean, killed in zip(variants, results[::2], results[1::2])]
    return {"ok": all(r["ok"] for r in rows), "summary": "; ".join(map(describe_resume, rows)), "variants": rows}


def check_two_ranks_gloo(s: Session) -> dict:
    """2 ranks on one GPU over gloo, with async checkpoints; what gloo cannot do on CUDA tensors
    is named and covered on CPU ranks. The runs see one GPU (the first), also on a machine with
    more, so the ranks share it and the default backend has to refuse."""
    from gloo_collectives import PROBES

    cuda = s.device == "cuda"
    one_gpu = {"CUDA_VISIBLE_DEVICES": "0"} if cuda else {}
    collectives = probe_gloo(s, one_gpu)
    known = {c["collective"]: c for c in collectives}
    lacking = [name for name, c in known.items() if not c["ok"]]
    unanswered = [name for name in PROBES if name not in known]  # the probe died first
    runs, plans = [], []
    for v in s.sizes.two_rank_variants:
        missing = [c for c in NEEDS[v] if c in lacking or c not in known]
        on_cpu_ranks = cuda and bool(missing)  # gloo's CPU path instead of the one it lacks
        label = f"two_ranks_gloo/{v}" + ("-cpu-ranks" if on_cpu_ranks else "")
        env = {"CUDA_VISIBLE_DEVICES": ""} if on_cpu_ranks else one_gpu
        overrides = [*STRATEGIES[v], "scale.workers=2", "scale.backend=gloo", "checkpoint.async_save=true"]
        runs += resume_runs(s, label, overrides, kill_rank=1, env=env)
        plans.append((v, missing, "cuda:0" if cuda and not on_cpu_ranks else "cpu"))
    if cuda:  # NCCL takes one GPU per rank: with one GPU, the default backend must refuse 2 ranks
        runs.append(s.scaletrain("two_ranks_gloo/default_backend", TINY_GPT,
                                 ["scale.strategy=ddp", "scale.workers=2", "train.max_steps=1"], one_gpu))
    results = s.run_all(runs)
    pairs = results[:2 * len(plans)]
    rows = []
    for (v, missing, device), clean, killed in zip(plans, pairs[0::2], pairs[1::2]):
        row = judge_resume(v, clean, killed, world=2, backend="gloo", device=device)
        if missing and cuda:
            row["on_cpu_ranks_since_gloo_did_not_run"] = missing
        rows.append(row)
    row = {"ok": bool(known) and all(r["ok"] for r in rows), "collectives": collectives,
           "gloo_lacks": lacking, "no_result": unanswered, "variants": rows}
    texts = [describe_resume(r) + (f" (on CPU ranks: it needs {', '.join(r['on_cpu_ranks_since_gloo_did_not_run'])}, "
                                   "which gloo did not run on CUDA tensors)" if "on_cpu_ranks_since_gloo_did_not_run" in r
                                   else "") for r in rows]
    if cuda:
        row["default_backend"] = judge_refusal(results[-1])
        row["ok"] = row["ok"] and row["default_backend"]["ok"]
        texts.append("default backend: " + (row["default_backend"]["line"] or row["default_backend"]["error"]))
    probed = f"gloo on {s.device} tensors lacks " + (", ".join(lacking) if lacking else "none of the collectives probed")
    if unanswered:
        probed += f" (no result for {', '.join(unanswered)}: the probe died first)"
    row["summary"] = probed + "; " + "; ".join(texts)
    return row


def probe_gloo(s: Session, env: dict[str, str]) -> list[dict]:
    """bench/gloo_collectives.py on 2 ranks sharing the device: one row per collective."""
    argv = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2",
            str(REPO / "bench" / "gloo_collectives.py"), f"--device={s.device}"]
    result = s.run_all([Run("two_ranks_gloo/collectives", argv, env)])[0]
    return [row for row in json_lines(result["stdout"]) if "collective" in row]


def judge_refusal(result: dict) -> dict:
    """2 workers on 1 GPU with the default backend: exit 2 before starting, one line naming the fix."""
    stderr = (Path(result["folder"]) / "stderr").read_text(errors="replace")
    errors = [line for line in stderr.splitlines() if line.startswith("error:")]
    line = errors[0] if len(errors) == 1 else None
    ok = result["rc"] == 2 and line is not None and "scale.backend: gloo" in line
    return {"ok": ok, "rc": result["rc"], "line": line, "error": None if ok else result.get("error") or stderr[-300:]}


# ---------------------------------------------------------------------------------------------
# 4. The planner's memory prediction against what the runs measured


def check_memory(s: Session) -> dict:
    import torch

    gpus = torch.cuda.device_count() if s.device == "cuda" else 1
    shape = list(s.sizes.memory_shape)
    labels = s.sizes.memory_variants
    workers = {label: memory.workers_for(label, gpus) for label in labels}
    runs = [s.scaletrain(f"memory/{re.sub(r'[^a-z]+', '_', label).strip('_')}", memory.JOB,
                         memory.variant_overrides(label, shape, workers[label], s.sizes.memory_steps))
            for label in labels]
    profile = s.memory_profile or in_background(memory.planner_profile, shape)
    results = s.run_all(runs)
    job, planner = profile(s.left() - RESERVE_S)
    rows = []
    for label, result in zip(labels, results):
        done = summary(result)
        rows.append(memory.compare(label, job, planner, workers[label], done["run_dir"], s.device) if done
                    else {"strategy": label, "ok": False, "error": result.get("error")})
    return {"ok": all(r["ok"] for r in rows), "params": planner.params, "shape": shape, "summary":
            f"{planner.params / 1e6:.1f}M parameters: " + "; ".join(describe_memory(r, s.device) for r in rows),
            "variants": rows}


def describe_memory(row: dict, device: str) -> str:
    if "error" in row:
        return f"{row['strategy']}: {row['error']}"
    if device == "cuda":
        error = f"{row['relative_error']:+.1%}" if row["relative_error"] is not None else "no peak logged"
        return (f"{row['strategy']}: predicted {row['predicted_bytes'] / 2**30:.2f} GiB, peak "
                f"{(row['measured_peak_bytes'] or 0) / 2**30:.2f} GiB ({error})")
    state = sum(row["state_bytes_by_rank"].get(0, {}).get(k, 0) for k in ("params", "grads", "optimizer"))
    return (f"{row['strategy']}: state bytes {'equal to' if row['state_bytes_exact'] else 'DIFFERENT from'} "
            f"the prediction ({state / 2**20:.2f} MiB)")


# ---------------------------------------------------------------------------------------------
# 5. Steps/s of scaletrain and of a hand-written loop, side by side


def check_throughput(s: Session) -> dict:
    from scaletrain.config.loading import load_job

    z = s.sizes
    overrides = [*z.throughput_shape, *ONE_PROCESS, "train.precision=bf16", f"train.max_steps={z.throughput_steps}",
                 f"train.log_every={z.throughput_log_every}"]
    job = load_job(TINY_GPT, [*QUIET, *overrides])
    sides = {"scaletrain": lambda n: s.scaletrain(f"throughput/scaletrain-{n}", TINY_GPT, overrides),
             "loop": lambda n: Run(f"throughput/loop-{n}", baseline_argv(job, s.device, z))}
    measured: dict[str, list[float]] = {"scaletrain": [], "loop": []}
    failures, notes, last_pair_s = [], [], 0.0
    for n in range(1, z.throughput_repeats + 1):
        if n > 1 and s.left() < 1.5 * last_pair_s + RESERVE_S:
            notes.append(f"stopped after {n - 1} of {z.throughput_repeats} repeats: the budget")
            break
        started = time.monotonic()
        for side, make in sides.items():  # A B A B: one run at a time, alone on the device
            result = s.run_all([make(n)], parallel=1)[0]
            value = steps_per_s(side, result, z.throughput_timed_from)
            if value is None:
                failures.append(f"{result['label']}: {result.get('error') or 'no steps/s reported'}")
            else:
                measured[side].append(value)
        last_pair_s = time.monotonic() - started
    ok = not failures and bool(measured["scaletrain"])
    medians = {side: statistics.median(v) if v else None for side, v in measured.items()}
    ratio = medians["scaletrain"] / medians["loop"] if ok else None
    text = (f"{medians['scaletrain']:.2f} steps/s against {medians['loop']:.2f} for the hand-written loop "
            f"(ratio {ratio:.3f}; {len(measured['scaletrain'])} repeats, bf16, batch {job.data.batch_size})"
            if ok else "; ".join(failures))
    return {"ok": ok, "summary": text, "steps_per_s": measured, "median_steps_per_s": medians, "ratio": ratio,
            "steps": z.throughput_steps, "timed_from": z.throughput_timed_from, "notes": notes}


def baseline_argv(job, device: str, z: Sizes) -> list[str]:
    """bench/baselines/single_loop.py with the job's model, batch, optimizer, schedule and clipping."""
    o, t = job.optim, job.train
    return [sys.executable, str(REPO / "bench" / "baselines" / "single_loop.py"), "--example=tiny_gpt",
            f"--task-args={json.dumps(job.task.args)}", f"--device={device}", f"--precision={t.precision}",
            f"--steps={t.max_steps}", f"--batch-size={job.data.batch_size}", f"--lr={o.lr}",
            f"--weight-decay={o.weight_decay}", "--betas", str(o.betas[0]), str(o.betas[1]),
            f"--warmup-steps={o.warmup_steps}", f"--min-lr-ratio={o.min_lr_ratio}",
            f"--clip={t.clip_grad_norm or 1e9}", f"--log-every={t.log_every}", f"--seed={job.seed}",
            f"--timed-from={z.throughput_timed_from}"]


def steps_per_s(side: str, result: dict, timed_from: int) -> float | None:
    if side == "scaletrain":
        done = summary(result)
        return steady_steps_per_s(done["run_dir"], skip=timed_from) if done else None
    lines = [row for row in json_lines(result["stdout"]) if "steps_per_s" in row]
    return lines[-1]["steps_per_s"] if result["rc"] == 0 and lines else None


# ---------------------------------------------------------------------------------------------
# The command

CHECKS = {"determinism": check_determinism, "one_rank": check_one_rank, "two_ranks_gloo": check_two_ranks_gloo,
          "memory": check_memory, "throughput": check_throughput}


def run_check(s: Session, name: str) -> dict:
    """One check as a row: {check, ok (None: skipped), seconds, summary, details...}."""
    needs = s.sizes.least_s.get(name, 0) + RESERVE_S  # the reserve: for writing the results
    if s.left() < needs:
        return {"check": name, "ok": None, "seconds": 0.0,
                "skipped": f"the budget: {max(0.0, s.left()):.0f} s left, the check needs at least {needs:.0f} s"}
    started = time.monotonic()
    try:
        row = CHECKS[name](s)
    except Exception as exc:  # a check that breaks is a failed check, with its traceback
        row = {"ok": False, "summary": f"{type(exc).__name__}: {exc}",
               "traceback": traceback.format_exc()[-3000:]}
    return {"check": name, "ok": row.pop("ok"), "seconds": round(time.monotonic() - started, 1), **row}


def machine(device: str) -> dict:
    import torch

    info = {"python": platform.python_version(), "torch": torch.__version__, "cuda": torch.version.cuda,
            "cores": os.cpu_count(), "platform": platform.platform()}
    if device == "cuda":
        props = torch.cuda.get_device_properties(0)
        info.update(gpu=props.name, gpus=torch.cuda.device_count(), gpu_memory_gib=round(props.total_memory / 2**30, 1),
                    compute_capability=f"{props.major}.{props.minor}",
                    nccl=".".join(map(str, torch.cuda.nccl.version())))
    return info


def write_json(report: dict, path: str | None) -> None:
    """Atomically: a reader (or a kill mid-write) never sees half a file."""
    if not path:
        return
    target = Path(path)
    target.parent.mkdir(parents=True, exist_ok=True)
    partial = target.with_name(target.name + ".tmp")
    partial.write_text(json.dumps(report, indent=2) + "\n")
    partial.replace(target)


def table(report: dict) -> str:
    """docs/benchmarks.md's GPU section, markers included."""
    m = report["machine"]
    where = (f"{m['gpu']} ({m['gpu_memory_gib']} GiB), torch {m['torch']}, CUDA {m['cuda']}, NCCL {m['nccl']}"
             if report["device"] == "cuda" else f"the CPU path (--device cpu), torch {m['torch']}")
    lines = [GPU_SECTION[0], "## On one GPU (`make gpu-check`)", "",
             f"Generated by `bench/gpu_check.py` on {report['started_at']}: {where}, Python {m['python']}, "
             f"{m['cores']} cores; {report['elapsed_s']:.0f} s of a {report['budget_s']:.0f} s budget. What each "
             "check does: the script's docstring; raw results: `bench/results/latest/gpu.json`.", "",
             "| check | result | seconds | ok |", "|---|---|---|---|"]
    for row in report["checks"]:
        ok = "skipped" if row["ok"] is None else "yes" if row["ok"] else "**no**"
        text = row.get("summary") or row.get("skipped") or ""
        lines.append(f"| {row['check']} | {text.replace('|', '/')} | {row['seconds']:.0f} | {ok} |")
    lines.append(GPU_SECTION[1])
    return "\n".join(lines)


def write_table(report: dict) -> None:
    page = REPO / "docs" / "benchmarks.md"
    text = page.read_text()
    current = gpu_section(text)
    if current is None:
        raise SystemExit(f"error: {page} has no {GPU_SECTION[0]} ... {GPU_SECTION[1]} section to fill")
    page.write_text(text.replace(current, table(report)))


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", choices=["cuda", "cpu"], default="cuda")
    parser.add_argument("--out", help="the results file (default on cuda: bench/results/latest/gpu.json; on cpu: none)")
    parser.add_argument("--only", help="comma-separated checks: " + ",".join(CHECKS))
    parser.add_argument("--budget-s", type=float, default=450,
                        help="seconds for everything: a check that no longer fits is skipped, a run is cut at it")
    parser.add_argument("--table", action="store_true", help="write the results into docs/benchmarks.md")
    parser.add_argument("--results", help="run nothing: write the table from this results file")
    parser.add_argument("--keep", action="store_true", help="keep the runs' scratch folder (its path is in the results)")
    args = parser.parse_args(argv)
    args.names = args.only.split(",") if args.only else list(CHECKS)
    unknown = [name for name in args.names if name not in CHECKS]
    if unknown:
        parser.error(f"unknown check {', '.join(unknown)}; choose from {', '.join(CHECKS)}")
    if args.out is None and args.device == "cuda" and not args.results:
        args.out = str(REPO / "bench" / "results" / "latest" / "gpu.json")
    return args


class Interrupted(BaseException):
    """SIGTERM or Ctrl-C (a BaseException: no check's error handling may take it for a failure)."""

    def __init__(self, signum: int):
        super().__init__(signal.Signals(signum).name)
        self.signum = signum


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.results:
        write_table(json.loads(Path(args.results).read_text()))
        return 0
    started = time.monotonic()
    import torch

    if args.device == "cuda" and not torch.cuda.is_available():
        print("error: --device cuda needs a CUDA device; this machine has none (try --device cpu)", file=sys.stderr)
        return 2
    import shutil
    import tempfile

    root = Path(tempfile.mkdtemp(prefix="st-gpu-check-"))
    session = Session(args.device, root, started + args.budget_s)
    report = {"device": args.device, "started_at": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
              "budget_s": args.budget_s, "machine": machine(args.device), "scratch": str(root), "checks": []}

    def interrupt(signum, frame):  # the runs in flight die first: nothing is left waiting on them
        session.stop()
        raise Interrupted(signum)

    for signum in (signal.SIGTERM, signal.SIGINT):
        signal.signal(signum, interrupt)
    session.prepare(args.names)
    code = None
    try:
        for name in args.names:
            row = run_check(session, name)
            report["checks"].append(row)
            status = "skipped" if row["ok"] is None else "ok" if row["ok"] else "FAILED"
            print(f"{name:15s} {status:7s} {row['seconds']:6.1f} s  {row.get('summary') or row.get('skipped')}",
                  file=sys.stderr, flush=True)
            report["elapsed_s"] = round(time.monotonic() - started, 1)
            write_json(report, args.out)
    except Interrupted as stop:
        report["interrupted"] = f"{stop} after {len(report['checks'])} of {len(args.names)} checks"
        code = 128 + stop.signum
    finally:
        session.stop()
        if not args.keep:
            shutil.rmtree(root, ignore_errors=True)
    report["elapsed_s"] = round(time.monotonic() - started, 1)
    report["ok"] = code is None and all(row["ok"] is not False for row in report["checks"])
    write_json(report, args.out)
    print(json.dumps(report, indent=2))
    if args.table:
        write_table(report)
    return code or (0 if report["ok"] else 1)


if __name__ == "__main__":
    sys.exit(main())
