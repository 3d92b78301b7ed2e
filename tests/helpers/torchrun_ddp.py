"""A training script written for torchrun that knows nothing of scaletrain: plain DDP on gloo,
metrics to MLflow with plain mlflow.log_metric on rank 0.

    torchrun --nproc-per-node 2 tests/helpers/torchrun_ddp.py --steps 20 --lr 0.05
"""

import argparse
import os
import time

import mlflow
import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--lr", type=float, default=0.05)
    parser.add_argument("--sleep", type=float, default=0.0)
    parser.add_argument("--fail-at", type=int, default=-1)
    parser.add_argument("--hang-at", type=int, default=-1)
    parser.add_argument("--busy-at-hang", type=float, default=0.0)  # seconds rank 0 computes then
    args = parser.parse_args()

    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(0)
    model = DistributedDataParallel(nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 4)))
    optimizer = torch.optim.SGD(model.parameters(), lr=args.lr)
    generator = torch.Generator().manual_seed(1 + rank)
    for step in range(args.steps):
        x = torch.randn(32, 16, generator=generator)
        y = x[:, :4].argmax(dim=-1)
        loss = nn.functional.cross_entropy(model(x), y)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        if step == args.fail_at and rank == world - 1:
            raise ValueError(f"bad batch at step {step}")
        if step == args.hang_at and rank == world - 1:
            time.sleep(3600)  # a deadlock: no output, no CPU time
        if step == args.hang_at and rank == 0:
            end = time.monotonic() + args.busy_at_hang
            while time.monotonic() < end:  # busy (CPU time: progress), then it waits for rank 1
                pass
        if rank == 0:
            mlflow.log_metric("loss", loss.item(), step=step)
        print(f"rank {rank} step {step} loss {loss.item():.4f} restarts {os.environ.get('TORCHELASTIC_RESTART_COUNT')}",
              flush=True)
        time.sleep(args.sleep)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
