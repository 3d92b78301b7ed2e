"""The raw baseline for throughput: a hand-written PyTorch DDP loop under torchrun, on the same
model, data and loss as an example job (the example's task object supplies them, so both
sides do exactly the same arithmetic, the per-step accuracy included).

Written as a competent user would: DistributedSampler and DataLoader, AdamW with decay on
matrices only, linear warmup then cosine to ``min_lr_ratio``, gradient clipping, the loss and
metrics kept on the device and all-reduced only every ``log_every`` steps. Rank 0 prints one
JSON line: the time of the first finished step and steady-state steps/s (from step
``--timed-from``); every rank prints the median time of its steps (batch to scheduler step,
as scaletrain's workers time theirs) over the last 1024.

    torchrun --standalone --nproc-per-node 2 bench/baselines/ddp_loop.py --example digits --steps 600
"""

import argparse
import json
import math
import os
import statistics
import sys
import time
from collections import deque
from pathlib import Path

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel
from torch.utils.data import DataLoader, DistributedSampler

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"
TASKS = {  # the example job's task.args
    "digits": ("digits", "DigitsTask", {"hidden": 128, "dropout": 0.1}),
    "tiny_gpt": ("tiny_gpt", "TinyGPTTask", {"layers": 2, "dim": 64, "heads": 4, "context": 32, "vocab": 32}),
}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--example", choices=sorted(TASKS), default="digits")
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--batch-size", type=int, default=32)
    parser.add_argument("--lr", type=float, default=3e-3)
    parser.add_argument("--weight-decay", type=float, default=0.01)
    parser.add_argument("--betas", type=float, nargs=2, default=(0.9, 0.999))
    parser.add_argument("--warmup-steps", type=int, default=20)
    parser.add_argument("--min-lr-ratio", type=float, default=0.0)
    parser.add_argument("--clip", type=float, default=1.0)
    parser.add_argument("--log-every", type=int, default=20)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--timed-from", type=int, default=None, help="steady state from this step (default: log_every)")
    args = parser.parse_args()

    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(args.seed)
    sys.path.insert(0, str(EXAMPLES))
    module, cls, task_args = TASKS[args.example]
    task = getattr(__import__(module), cls)(**task_args)
    train = task.train_dataset()

    model = DistributedDataParallel(task.build_model())
    decay = [p for p in model.parameters() if p.dim() >= 2]
    no_decay = [p for p in model.parameters() if p.dim() < 2]
    optimizer = torch.optim.AdamW(
        [{"params": decay, "weight_decay": args.weight_decay}, {"params": no_decay, "weight_decay": 0.0}],
        lr=args.lr, betas=tuple(args.betas),
    )

    def lr_lambda(step: int) -> float:
        if step < args.warmup_steps:
            return (step + 1) / args.warmup_steps
        progress = min(1.0, (step - args.warmup_steps) / max(1, args.steps - args.warmup_steps))
        return args.min_lr_ratio + (1 - args.min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * progress))

    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lr_lambda)
    sampler = DistributedSampler(train, shuffle=True, seed=args.seed, drop_last=True)
    loader = DataLoader(train, batch_size=args.batch_size, sampler=sampler, drop_last=True)

    step, epoch = 0, 0
    first_step_at = None
    timed_from = None
    recent: deque[float] = deque(maxlen=1024)
    while step < args.steps:
        sampler.set_epoch(epoch)
        started = time.perf_counter()
        for batch in loader:
            loss, metrics = task.loss(model, batch)
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), args.clip)
            optimizer.step()
            scheduler.step()
            recent.append(time.perf_counter() - started)
            step += 1
            if step == 1:
                first_step_at = time.time()
            if step == (args.timed_from or args.log_every):
                timed_from = (time.perf_counter(), step)
            if step % args.log_every == 0:
                values = torch.stack([loss.detach(), *(v.detach() for v in metrics.values())])
                dist.all_reduce(values)
                if rank == 0:
                    print(f"step {step} loss {values[0].item() / world:.4f}", flush=True)
            if step >= args.steps:
                break
            started = time.perf_counter()
        epoch += 1
    elapsed = time.perf_counter() - timed_from[0]
    # One write: torchrun runs ranks unbuffered on a shared stdout, print() would split the line.
    sys.stdout.write(json.dumps({"rank": rank, "step_time_median_s": statistics.median(recent)}) + "\n")
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
