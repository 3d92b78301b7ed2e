"""Checkpoint I/O: scaletrain's CheckpointManager against torch.save/torch.load and the disk.

One process, no process group. For each state (model + AdamW state after one real step):
  raw          one plain write of the same number of bytes + fsync (what the disk allows)
  torch.save   torch.save({"model", "optim"}) plain, and torch.save + fsync
  st sync      CheckpointManager.save (DCP files, sha256 of every file, manifest, renames, fsyncs)
  st async     the stall: time save() takes to return (first save, and the median of later
               saves on the same manager: the first allocates staging buffers); wait_pending()
               commits before the next one
  loads        torch.load(weights_only=True) alone, torch.load + load_state_dict into a fresh
               model/optimizer, and restore_latest into a fresh model/optimizer (hash-verified)
Methods run interleaved inside each repeat; files live under a TemporaryDirectory (page cache
is warm for the loads, for all methods alike). Then one cProfile of the 50M sync save.

    .venv/bin/python bench/checkpoint_io.py --repeats 5
"""

from __future__ import annotations

import argparse
import cProfile
import io
import json
import os
import pstats
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import REPO  # noqa: E402

sys.path.insert(0, str(REPO / "examples"))
from digits import DigitsTask  # noqa: E402
from tiny_gpt import TinyGPTTask  # noqa: E402

from scaletrain.checkpoint.manager import CheckpointManager  # noqa: E402
from scaletrain.checkpoint.retention import RetentionPolicy  # noqa: E402


def adamw(model: nn.Module) -> torch.optim.Optimizer:
    params = list(model.parameters())
    return torch.optim.AdamW([{"params": [p for p in params if p.dim() >= 2], "weight_decay": 0.01},
                              {"params": [p for p in params if p.dim() < 2], "weight_decay": 0.0}], lr=1e-3)


STATES = {  # name -> (model factory, input factory)
    "digits_mlp": (lambda: DigitsTask(hidden=128).build_model(), lambda: torch.randn(32, 64)),
    "tiny_gpt": (lambda: TinyGPTTask(layers=2, dim=64, heads=4, context=32, vocab=32).build_model(),
                 lambda: torch.randint(0, 32, (8, 32))),
    "mlp_50m": (lambda: nn.Sequential(*(nn.Linear(4096, 4096) for _ in range(3))),
                lambda: torch.randn(8, 4096)),
}


def build(name: str, stepped: bool = True):
    torch.manual_seed(0)
    make_model, make_input = STATES[name]
    model = make_model()
    optimizer = adamw(model)
    if stepped:  # one real step, so the AdamW state exists
        model(make_input()).float().square().mean().backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
    return model, optimizer


def manager(location: Path, scratch: Path, async_save: bool = False) -> CheckpointManager:
    return CheckpointManager(
        str(location), rank=0, world_size=1, strategy="single", scratch_dir=scratch,
        identity={"run_id": "bench", "run_dir": str(scratch), "mlflow_run_id": None,
                  "config_hash": "bench", "versions": {"torch": torch.__version__}},
        policy=RetentionPolicy(keep_last=100), async_save=async_save,
    )


TRAINER_STATE = {"epoch": 0, "samples": 64, "global_batch": 64, "scheduler": {"last_epoch": 1}}


def timed(fn) -> float:
    os.sync()  # no dirty pages from the previous method are written back during this one
    started = time.perf_counter()
    fn()
    return time.perf_counter() - started


def one_repeat(name: str, tmp: Path, async_saves: int) -> dict[str, float]:
    """Every method once on a fresh folder; returns seconds (and bytes)."""
    model, optimizer = build(name)
    state = {"model": model.state_dict(), "optim": optimizer.state_dict()}
    row: dict[str, float] = {}
    work = tmp / "work"
    shutil.rmtree(work, ignore_errors=True)
    work.mkdir()

    def torch_save(path: Path, fsync: bool) -> None:
        with open(path, "wb") as handle:
            torch.save(state, handle)
            if fsync:
                handle.flush()
                os.fsync(handle.fileno())

    row["torch_save_s"] = timed(lambda: torch_save(work / "plain.pt", False))
    row["bytes"] = (work / "plain.pt").stat().st_size
    payload = os.urandom(int(row["bytes"]))

    def raw() -> None:
        with open(work / "raw.bin", "wb") as handle:
            handle.write(payload)
            handle.flush()
            os.fsync(handle.fileno())

    row["raw_write_fsync_s"] = timed(raw)
    row["torch_save_fsync_s"] = timed(lambda: torch_save(work / "synced.pt", True))

    sync = manager(work / "sync", tmp)
    row["st_sync_save_s"] = timed(lambda: sync.save(1, model, optimizer, {**TRAINER_STATE, "step": 1}, {}))
    sync.close()
    row["st_bytes"] = sum(f.stat().st_size for f in (work / "sync").rglob("*") if f.is_file())

    stalls = []
    asy = manager(work / "async", tmp, async_save=True)
    for step in range(1, async_saves + 1):
        stalls.append(timed(lambda: asy.save(step, model, optimizer, {**TRAINER_STATE, "step": step}, {})))
        asy.wait_pending()
    asy.close()
    row["st_async_first_stall_s"] = stalls[0]
    row["st_async_steady_stall_s"] = statistics.median(stalls[1:])

    row["torch_load_s"] = timed(lambda: torch.load(work / "synced.pt", weights_only=True))
    fresh_model, fresh_opt = build(name, stepped=False)

    def torch_load_into() -> None:
        loaded = torch.load(work / "synced.pt", weights_only=True)
        fresh_model.load_state_dict(loaded["model"])
        fresh_opt.load_state_dict(loaded["optim"])

    row["torch_load_into_s"] = timed(torch_load_into)
    fresh_model, fresh_opt = build(name, stepped=False)
    reader = manager(work / "sync", tmp)
    row["st_load_s"] = timed(lambda: reader.restore_latest(fresh_model, fresh_opt))
    assert torch.equal(fresh_opt.state_dict()["state"][0]["exp_avg"], state["optim"]["state"][0]["exp_avg"])
    reader.close()
    shutil.rmtree(work)
    return row


def profile_sync_save(name: str, tmp: Path, top: int = 15) -> str:
    model, optimizer = build(name)
    sync = manager(tmp / "profiled", tmp)
    profiler = cProfile.Profile()
    profiler.runcall(sync.save, 1, model, optimizer, {**TRAINER_STATE, "step": 1}, {})
    sync.close()
    shutil.rmtree(tmp / "profiled")
    out = io.StringIO()
    stats = pstats.Stats(profiler, stream=out).strip_dirs()
    stats.sort_stats("cumulative").print_stats(top)
    stats.sort_stats("tottime").print_stats(10)
    return out.getvalue()


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--async-saves", type=int, default=4, help="async saves per manager")
    parser.add_argument("--states", default=",".join(STATES))
    parser.add_argument("--profile-state", default="mlp_50m")
    parser.add_argument("--out", default=str(REPO / "bench/results/checkpoint_io.json"))
    args = parser.parse_args()
    names = args.states.split(",")
    rows: dict[str, list[dict]] = {name: [] for name in names}
    with tempfile.TemporaryDirectory(prefix="scaletrain-ckpt-io-") as tmp:
        for name in names:  # warm-up: imports, first DCP call, allocator
            one_repeat(name, Path(tmp), 2)
        for repeat in range(args.repeats):
            for name in names:
                rows[name].append(one_repeat(name, Path(tmp), args.async_saves))
            print(f"repeat {repeat + 1}/{args.repeats} done", file=sys.stderr, flush=True)
        profile = profile_sync_save(args.profile_state, Path(tmp)) if args.profile_state else ""

    keys = ["raw_write_fsync_s", "torch_save_s", "torch_save_fsync_s", "st_sync_save_s",
            "st_async_first_stall_s", "st_async_steady_stall_s", "torch_load_s", "torch_load_into_s", "st_load_s"]
    summary = {}
    for name, reps in rows.items():
        s = {k: {"median": statistics.median(r[k] for r in reps), "min": min(r[k] for r in reps),
                 "max": max(r[k] for r in reps)} for k in keys}
        med = {k: v["median"] for k, v in s.items()}
        s["bytes"], s["st_bytes"] = reps[0]["bytes"], reps[0]["st_bytes"]
        s["ratios"] = {
            "st_sync/torch_save": med["st_sync_save_s"] / med["torch_save_s"],
            "st_sync/torch_save_fsync": med["st_sync_save_s"] / med["torch_save_fsync_s"],
            "async_steady_stall/st_sync": med["st_async_steady_stall_s"] / med["st_sync_save_s"],
            "st_load/torch_load": med["st_load_s"] / med["torch_load_s"],
            "st_load/torch_load_into": med["st_load_s"] / med["torch_load_into_s"],
        }
        summary[name] = s

    def cell(v: dict) -> str:
        scale = 1000.0
        return f"{v['median'] * scale:.1f} ({v['min'] * scale:.1f}-{v['max'] * scale:.1f})"

    print(f"\nms, median (min-max) of {args.repeats} interleaved repeats; async: {args.async_saves} saves/manager\n")
    print("| state | bytes (torch.save / scaletrain) | " + " | ".join(k[:-2] for k in keys) + " |")
    print("|---" * (len(keys) + 2) + "|")
    for name, s in summary.items():
        print(f"| {name} | {s['bytes']:,} / {s['st_bytes']:,} | " + " | ".join(cell(s[k]) for k in keys) + " |")
    ratio_names = list(next(iter(summary.values()))["ratios"])
    print("\n| state | " + " | ".join(ratio_names) + " |")
    print("|---" * (len(ratio_names) + 1) + "|")
    for name, s in summary.items():
        print(f"| {name} | " + " | ".join(f"{s['ratios'][r]:.2f}" for r in ratio_names) + " |")
    if profile:
        print(f"\ncProfile of one scaletrain sync save ({args.profile_state}):\n{profile}")
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps({"repeats": args.repeats, "async_saves": args.async_saves,
                                          "torch": torch.__version__, "results": summary,
                                          "profile_top": profile[:6000]}, indent=2))


if __name__ == "__main__":
    main()
