"""A torchrun script for bench/script_launch.py: DDP on gloo (digits MLP, batch 32 a rank),
rank 0 prints when its first step ended and its steady steps/s. Knows nothing of scaletrain."""

import argparse
import json
import time

import torch
import torch.distributed as dist
from sklearn.datasets import load_digits
from torch import nn
from torch.nn.parallel import DistributedDataParallel


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=2000)
    args = parser.parse_args()
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    x, y = load_digits(return_X_y=True)
    x, y = torch.tensor(x, dtype=torch.float32) / 16, torch.tensor(y)
    torch.manual_seed(0)
    model = DistributedDataParallel(nn.Sequential(nn.Linear(64, 128), nn.GELU(), nn.Linear(128, 10)))
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3)
    generator = torch.Generator().manual_seed(rank)
    times = []
    for step in range(args.steps):
        index = torch.randint(0, len(x), (32,), generator=generator)
        loss = nn.functional.cross_entropy(model(x[index]), y[index])
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        times.append(time.time())
        if step == 0 and rank == 0:
            print(json.dumps({"first_step_at": times[0]}), flush=True)
    steady = times[len(times) // 5:]  # past the warm-up
    if rank == 0:
        print(json.dumps({"steps_per_s": (len(steady) - 1) / (steady[-1] - steady[0]), "world": world}), flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
