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

    .venv/bin/python bench/checkpoint_io.py --repeats 5 --small-repeats 15
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
from scaletrain.checkpoint.state import ModelAndOptimizer  # noqa: E402


def adamw(model: nn.Module) -> torch.optim.Optimizer:
    params = list(model.parameters())
    groups = [{"params": [p for p in params if p.dim() >= 2], "weight_decay": 0.01},
              {"params": [p for p in params if p.dim() < 2], "weight_decay": 0.0}]
    return torch.optim.AdamW(groups, lr=1e-3)  # scaletrain's parameter groups


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


def rotated(items: list, by: int) -> list:
    return items[by % len(items):] + items[:by % len(items)]


PAYLOADS: dict[str, bytes] = {}  # per state: random bytes as many as torch.save writes


def one_repeat(name: str, tmp: Path, async_saves: int, rotate: int) -> dict[str, float]:
    """Every method once on a fresh folder, saves then loads, each list rotated by ``rotate``
    so no method always runs first; returns seconds (and bytes)."""
    model, optimizer = build(name)
    state = {"model": model.state_dict(), "optim": optimizer.state_dict()}
    if name not in PAYLOADS:
        buffer = io.BytesIO()
        torch.save(state, buffer)
        PAYLOADS[name] = os.urandom(buffer.tell())
    payload = PAYLOADS[name]
    row: dict[str, float] = {"bytes": len(payload)}
    work = tmp / "work"
    shutil.rmtree(work, ignore_errors=True)
    work.mkdir()

    def write(path: Path, fsync: bool, data: bytes | None = None) -> None:
        with open(path, "wb") as handle:
            if data is None:
                torch.save(state, handle)
            else:
                handle.write(data)
            if fsync:
                handle.flush()
                os.fsync(handle.fileno())

    def sync_save() -> dict[str, float]:
        sync = manager(work / "sync", tmp)
        seconds = timed(lambda: sync.save(1, ModelAndOptimizer(model, optimizer), {**TRAINER_STATE, "step": 1}, {}))
        sync.close()
        return {"st_sync_save_s": seconds}

    def async_save() -> dict[str, float]:
        stalls = []
        asy = manager(work / "async", tmp, async_save=True)
        for step in range(1, async_saves + 1):
            trainer_state = {**TRAINER_STATE, "step": step}
            stalls.append(timed(lambda: asy.save(step, ModelAndOptimizer(model, optimizer), trainer_state, {})))  # noqa: B023  called at once, in this iteration
            asy.wait_pending()  # commit before the next save: the stall is save()'s alone
        asy.close()
        return {"st_async_first_stall_s": stalls[0],
                "st_async_steady_stall_s": statistics.median(stalls[1:])}

    def torch_loads() -> dict[str, float]:
        fresh_model, fresh_opt = build(name, stepped=False)
        load_only = timed(lambda: torch.load(work / "synced.pt", weights_only=True))

        def load_into() -> None:
            loaded = torch.load(work / "synced.pt", weights_only=True)
            fresh_model.load_state_dict(loaded["model"])
            fresh_opt.load_state_dict(loaded["optim"])

        return {"torch_load_s": load_only, "torch_load_into_s": timed(load_into)}

    def st_load() -> dict[str, float]:
        fresh_model, fresh_opt = build(name, stepped=False)
        reader = manager(work / "sync", tmp)
        seconds = timed(lambda: reader.restore_latest(ModelAndOptimizer(fresh_model, fresh_opt)))
        reader.close()
        got = fresh_opt.state_dict()["state"][0]["exp_avg"]
        assert torch.equal(got, state["optim"]["state"][0]["exp_avg"]), "optimizer not restored"
        return {"st_load_s": seconds}

    saves = [
        lambda: {"raw_write_fsync_s": timed(lambda: write(work / "raw.bin", True, payload))},
        lambda: {"torch_save_s": timed(lambda: write(work / "plain.pt", False))},
        lambda: {"torch_save_fsync_s": timed(lambda: write(work / "synced.pt", True))},
        sync_save,
        async_save,
    ]
    for method in rotated(saves, rotate) + rotated([torch_loads, st_load], rotate):
        row.update(method())
    row["st_bytes"] = sum(f.stat().st_size for f in (work / "sync").rglob("*") if f.is_file())
    shutil.rmtree(work)
    return row


def profile_st(name: str, tmp: Path, top: int = 15) -> str:
    """cProfile of one scaletrain sync save (top ``top`` cumulative, top 10 by own time),
    then of restore_latest into a fresh model/optimizer (top 20 cumulative)."""
    model, optimizer = build(name)
    sync = manager(tmp / "profiled", tmp)
    out = io.StringIO()
    save_profile = cProfile.Profile()
    save_profile.runcall(sync.save, 1, ModelAndOptimizer(model, optimizer), {**TRAINER_STATE, "step": 1}, {})
    sync.close()
    stats = pstats.Stats(save_profile, stream=out).strip_dirs()
    stats.sort_stats("cumulative").print_stats(top)
    stats.sort_stats("tottime").print_stats(10)
    fresh_model, fresh_opt = build(name, stepped=False)
    load_profile = cProfile.Profile()
    load_profile.runcall(manager(tmp / "profiled", tmp).restore_latest,
                         ModelAndOptimizer(fresh_model, fresh_opt))
    out.write("restore_latest into a fresh model + optimizer:\n")
    pstats.Stats(load_profile, stream=out).strip_dirs().sort_stats("cumulative").print_stats(20)
    shutil.rmtree(tmp / "profiled")
    return out.getvalue()


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--async-saves", type=int, default=4, help="async saves per manager")
    parser.add_argument("--small-repeats", type=int, default=15, help="repeats for states under 2 MiB")
    parser.add_argument("--states", default=",".join(STATES))
    parser.add_argument("--profile-state", default="mlp_50m")
    parser.add_argument("--threads", type=int, default=1,
                        help="intra-op threads; with 2 on a busy 2-core machine the async staging "
                        "copies wait on descheduled OpenMP threads (stalls of 8-240 ms, bimodal)")
    parser.add_argument("--out", default=str(REPO / "bench/results/latest/checkpoints.json"))
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    names = args.states.split(",")
    rows: dict[str, list[dict]] = {name: [] for name in names}
    with tempfile.TemporaryDirectory(prefix="scaletrain-ckpt-io-") as tmp:
        for name in names:  # warm-up: imports, first DCP call, allocator
            one_repeat(name, Path(tmp), 2, 0)
        # A small state's save or load takes milliseconds, within this machine's noise: it gets
        # more repeats (they cost little) so that its medians resolve a 1.5x or 3x target.
        small = {name for name in names if len(PAYLOADS[name]) < 2 << 20}
        total = max(args.repeats, args.small_repeats if small else 0)
        for repeat in range(total):
            for name in names:
                if repeat < args.repeats or name in small:
                    rows[name].append(one_repeat(name, Path(tmp), args.async_saves, repeat))
            print(f"repeat {repeat + 1}/{total} done", file=sys.stderr, flush=True)
        profile = profile_st(args.profile_state, Path(tmp)) if args.profile_state else ""

    keys = ["raw_write_fsync_s", "torch_save_s", "torch_save_fsync_s", "st_sync_save_s",
            "st_async_first_stall_s", "st_async_steady_stall_s",
            "torch_load_s", "torch_load_into_s", "st_load_s"]
    summary = {}
    for name, reps in rows.items():
        s = {k: {"median": statistics.median(r[k] for r in reps), "min": min(r[k] for r in reps),
                 "max": max(r[k] for r in reps)} for k in keys}
        med = {k: v["median"] for k, v in s.items()}
        s["bytes"], s["st_bytes"], s["repeats"] = reps[0]["bytes"], reps[0]["st_bytes"], len(reps)
        s["ratios"] = {
            "st sync / torch.save": med["st_sync_save_s"] / med["torch_save_s"],
            "st sync / (torch.save+fsync)": med["st_sync_save_s"] / med["torch_save_fsync_s"],
            "async steady stall / st sync": med["st_async_steady_stall_s"] / med["st_sync_save_s"],
            "st load / torch.load": med["st_load_s"] / med["torch_load_s"],
            "st load / (torch.load+load_state_dict)": med["st_load_s"] / med["torch_load_into_s"],
        }
        summary[name] = s

    def ms(v: dict) -> str:
        return f"{v['median'] * 1e3:.1f} ({v['min'] * 1e3:.1f}-{v['max'] * 1e3:.1f})"

    print(f"\nms, median (min-max) of {args.repeats} interleaved repeats ({args.small_repeats} under 2 MiB), "
          f"{args.threads} thread(s); "
          f"async: {args.async_saves} saves per manager, steady = median of saves 2..\n")
    print("| | " + " | ".join(names) + " |\n" + "|---" * (len(names) + 1) + "|")
    print("| bytes: torch.save file | "
          + " | ".join(f"{summary[n]['bytes']:,}" for n in names) + " |")
    print("| bytes: scaletrain checkpoint | "
          + " | ".join(f"{summary[n]['st_bytes']:,}" for n in names) + " |")
    for k in keys:
        print(f"| {k[:-2]} | " + " | ".join(ms(summary[n][k]) for n in names) + " |")
    for r in summary[names[0]]["ratios"]:
        print(f"| **{r}** | " + " | ".join(f"{summary[n]['ratios'][r]:.2f}" for n in names) + " |")
    if profile:
        print(f"\ncProfile, {args.profile_state}: one scaletrain sync save\n{profile}")
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(
        {"repeats": args.repeats, "async_saves": args.async_saves, "threads": args.threads,
         "torch": torch.__version__,
         "results": summary, "profile": profile[:12000]}, indent=2))


if __name__ == "__main__":
    main()
