"""Handwritten digits with your own training loop: plain PyTorch, the way a Ray Train or
Lightning Fabric user writes it. scaletrain hands the loop a ``ctx``; nothing else changes.

Run it from a job file (`scaletrain run examples/digits_loop.yaml`) or in one call from Python
or a notebook: ``scaletrain.run_loop(train, workers=2, config={"steps": 300})``.
"""

import torch
from sklearn.datasets import load_digits
from torch import nn
from torch.utils.data import TensorDataset


def datasets(eval_fraction: float = 0.2):
    images, labels = load_digits(return_X_y=True)
    x = torch.tensor(images, dtype=torch.float32) / 16.0
    y = torch.tensor(labels, dtype=torch.long)
    order = torch.randperm(len(x), generator=torch.Generator().manual_seed(1234))
    n_eval = int(len(x) * eval_fraction)
    return TensorDataset(x[order[n_eval:]], y[order[n_eval:]]), TensorDataset(x[order[:n_eval]], y[order[:n_eval]])


def train(ctx):
    config = {"steps": 300, "lr": 3e-3, "batch_size": 32, "hidden": 128, **ctx.config}
    train_set, eval_set = datasets()
    ctx.seed_everything()  # the same initial weights on every worker
    hidden = config["hidden"]
    model = ctx.prepare(nn.Sequential(
        nn.Linear(64, hidden), nn.GELU(), nn.Dropout(0.1),
        nn.Linear(hidden, hidden), nn.GELU(), nn.Dropout(0.1),
        nn.Linear(hidden, 10),
    ))
    optimizer = torch.optim.AdamW(model.parameters(), lr=config["lr"], weight_decay=0.01)
    scheduler = torch.optim.lr_scheduler.CosineAnnealingLR(optimizer, T_max=config["steps"])
    state = {"model": model, "optimizer": optimizer, "scheduler": scheduler}
    ctx.restore(state)  # after a restart: the newest verified checkpoint; a fresh start: nothing
    loader = ctx.loader(train_set, batch_size=config["batch_size"])

    while ctx.step < config["steps"]:
        for images, labels in loader:  # the rest of this epoch, from where the checkpoint left off
            loss = nn.functional.cross_entropy(model(images), labels)
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
            scheduler.step()
            if (ctx.step + 1) % 20 == 0:
                ctx.report({"loss": loss.item(), "lr": scheduler.get_last_lr()[0]})
            if ctx.should_stop() or ctx.step >= config["steps"]:
                break  # preempted (a checkpoint of this step is written), or done
        if ctx.stopped_on:
            return

    model.eval()
    correct = total = 0
    with torch.no_grad():
        for images, labels in ctx.eval_loader(eval_set, batch_size=256):
            correct += (model(images).argmax(dim=-1) == labels).sum().item()
            total += len(labels)
    counts = torch.tensor([correct, total], dtype=torch.float64)
    if ctx.world_size > 1:
        torch.distributed.all_reduce(counts)
    ctx.report({"eval/accuracy": counts[0].item() / counts[1].item()}, step=ctx.step)
