"""The raw baseline: a hand-written PyTorch DDP loop on the digits MLP, run under torchrun.

Written as a competent user would: DistributedSampler, AdamW with the same parameter groups,
warmup+cosine, clipping, no per-step host syncs except the loss print every log_every steps.
Prints one JSON line: time of the first finished step and steady-state steps/s.

    torchrun --standalone --nproc-per-node 2 bench/baselines/ddp_digits.py --steps 300
"""

import argparse
import json
import math
import os
import time

import torch
import torch.distributed as dist
from sklearn.datasets import load_digits
from torch import nn
from torch.nn.parallel import DistributedDataParallel
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--batch-size", type=int, default=32)
    parser.add_argument("--log-every", type=int, default=20)
    parser.add_argument("--warmup-steps", type=int, default=20)
    args = parser.parse_args()

    dist.init_process_group("gloo")
    rank = dist.get_rank()
    torch.manual_seed(0)

    images, labels = load_digits(return_X_y=True)
    x = torch.tensor(images, dtype=torch.float32) / 16.0
    y = torch.tensor(labels, dtype=torch.long)
    order = torch.randperm(len(x), generator=torch.Generator().manual_seed(1234))
    n_eval = int(len(x) * 0.2)
    train = TensorDataset(x[order[n_eval:]], y[order[n_eval:]])

    model = nn.Sequential(
        nn.Linear(64, 128), nn.GELU(), nn.Dropout(0.1),
        nn.Linear(128, 128), nn.GELU(), nn.Dropout(0.1),
        nn.Linear(128, 10),
    )
    model = DistributedDataParallel(model)
    decay = [p for p in model.parameters() if p.dim() >= 2]
    no_decay = [p for p in model.parameters() if p.dim() < 2]
    optimizer = torch.optim.AdamW(
        [{"params": decay, "weight_decay": 0.01}, {"params": no_decay, "weight_decay": 0.0}], lr=3e-3
    )

    def lr_lambda(step: int) -> float:
        if step < args.warmup_steps:
            return (step + 1) / args.warmup_steps
        progress = min(1.0, (step - args.warmup_steps) / max(1, args.steps - args.warmup_steps))
        return 0.5 * (1 + math.cos(math.pi * progress))

    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lr_lambda)
    sampler = DistributedSampler(train, shuffle=True, seed=0, drop_last=True)
    loader = DataLoader(train, batch_size=args.batch_size, sampler=sampler, drop_last=True)

    step, epoch = 0, 0
    first_step_at = None
    timed_from = None
    while step < args.steps:
        sampler.set_epoch(epoch)
        for inputs, targets in loader:
            loss = nn.functional.cross_entropy(model(inputs), targets)
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            optimizer.step()
            scheduler.step()
            step += 1
            if step == 1:
                first_step_at = time.time()
            if step == args.log_every:
                timed_from = (time.perf_counter(), step)
            if step % args.log_every == 0:
                value = loss.detach().clone()
                dist.all_reduce(value)
                if rank == 0:
                    print(f"step {step} loss {value.item() / dist.get_world_size():.4f}", flush=True)
            if step >= args.steps:
                break
        epoch += 1
    elapsed = time.perf_counter() - timed_from[0]
    if rank == 0:
        print(json.dumps({
            "first_step_at": first_step_at,
            "steps_per_s": (step - timed_from[1]) / elapsed,
            "steps": step,
        }), flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    main()
