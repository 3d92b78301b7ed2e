"""A user's own training loop, written the way a Ray Train user writes one: plain PyTorch (a
model, AdamW, a data loader), with scaletrain's ctx where Ray Train has ray.train."""

from __future__ import annotations

import time

import torch
from torch import nn
from torch.utils.data import TensorDataset


def toy_data(samples: int = 512, dim: int = 16) -> TensorDataset:
    generator = torch.Generator().manual_seed(42)
    x = torch.randn(samples, dim, generator=generator)
    y = (x @ torch.randn(dim, 4, generator=generator)).argmax(dim=-1)
    return TensorDataset(x, y)


def train_loop(ctx) -> None:
    steps, batch_size = ctx.config.get("steps", 40), ctx.config.get("batch_size", 16)
    ctx.seed_everything()
    model = ctx.prepare(nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Dropout(0.1), nn.Linear(32, 4)))
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.01)
    state = {"model": model, "optimizer": optimizer, "epochs_done": 0}
    ctx.restore(state)
    loader = ctx.loader(toy_data(), batch_size=batch_size)
    while ctx.step < steps:
        for x, y in loader:
            loss = nn.functional.cross_entropy(model(x), y)
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
            ctx.report({"loss": loss})
            time.sleep(ctx.config.get("step_sleep", 0))  # tests: slow steps, so a stop lands mid-run
            if ctx.should_stop() or ctx.step >= steps:
                break
        else:
            state["epochs_done"] += 1  # a plain value: kept in the checkpoint's JSON
        if ctx.stopped_on:
            return


def loop_job(tmp_path, **sections) -> dict:
    """A job mapping for train_loop; keyword arguments merge into its sections."""
    job = {
        "name": "loop",
        "loop": {"target": "tests.helpers.loops:train_loop", "args": {"steps": 40}},
        "train": {"max_steps": 40},
        "scale": {"workers": 2},
        "checkpoint": {"every_steps": 10, "keep_last": 3},
        "recovery": {"max_restarts": 1, "grace_period_s": 20},
        "seed": 7,
        "run_dir": str(tmp_path / "runs"),
        "tracking": {"enabled": False},
    }
    for key, value in sections.items():
        job[key] = {**job[key], **value} if isinstance(value, dict) and isinstance(job.get(key), dict) else value
    return job
