"""A torchrun script that asks scaletrain for more: its metrics through scaletrain.report() and
an agreed stop through scaletrain.should_stop() (both no-ops under plain torchrun)."""

import argparse
import time

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel

import scaletrain


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--sleep", type=float, default=0.0)
    args = parser.parse_args()
    dist.init_process_group("gloo")
    torch.manual_seed(0)
    model = DistributedDataParallel(nn.Linear(8, 2))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    for step in range(1, args.steps + 1):
        loss = model(torch.randn(16, 8)).pow(2).mean()
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        scaletrain.report({"loss": loss.item()}, step=step)
        time.sleep(args.sleep)
        if scaletrain.should_stop():
            if dist.get_rank() == 0:
                print(f"stopping at step {step}", flush=True)
            break
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
