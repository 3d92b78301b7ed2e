"""The raw baseline for single-device throughput: a hand-written PyTorch loop on one GPU (or the
CPU), on the same model, data and loss as an example job (the example's task object supplies
them, so both sides do exactly the same arithmetic, the per-step accuracy included).

Written as a competent user would: a shuffled DataLoader (pinned memory and non-blocking copies
on a GPU), AdamW with decay on matrices only, linear warmup then cosine to ``min_lr_ratio``,
bf16 autocast around forward and loss, gradient clipping, the loss and metrics kept on the
device and read back only every ``log_every`` steps. Prints one JSON line: steady-state
steps/s from step ``--timed-from`` (the device synchronized at both ends of the window) and
the time of the first finished step.

    python bench/baselines/single_loop.py --example tiny_gpt --task-args '{"layers": 8, "dim": 1024}'
"""

import argparse
import contextlib
import json
import math
import sys
import time
from pathlib import Path

import torch
from torch.utils.data import DataLoader

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"
TASKS = {"digits": ("digits", "DigitsTask"), "tiny_gpt": ("tiny_gpt", "TinyGPTTask")}


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    parser.add_argument("--example", choices=sorted(TASKS), default="tiny_gpt")
    parser.add_argument("--task-args", default="{}", help="the job's task.args, as JSON")
    parser.add_argument("--device", choices=["cuda", "cpu"], default="cuda")
    parser.add_argument("--precision", choices=["fp32", "bf16"], default="bf16")
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--batch-size", type=int, default=8)
    parser.add_argument("--lr", type=float, default=3e-3)
    parser.add_argument("--weight-decay", type=float, default=0.1)
    parser.add_argument("--betas", type=float, nargs=2, default=(0.9, 0.95))
    parser.add_argument("--warmup-steps", type=int, default=20)
    parser.add_argument("--min-lr-ratio", type=float, default=0.1)
    parser.add_argument("--clip", type=float, default=1.0)
    parser.add_argument("--log-every", type=int, default=20)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--timed-from", type=int, default=None, help="steady state from this step (default: log_every)")
    return parser.parse_args()


def to_device(batch, device: torch.device):
    return [x.to(device, non_blocking=True) for x in batch]


def main() -> None:
    args = parse_args()
    device = torch.device(args.device)
    torch.manual_seed(args.seed)
    sys.path.insert(0, str(EXAMPLES))
    module, cls = TASKS[args.example]
    task = getattr(__import__(module), cls)(**json.loads(args.task_args))
    model = task.build_model().to(device)
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
    loader = DataLoader(task.train_dataset(), batch_size=args.batch_size, shuffle=True, drop_last=True,
                        generator=torch.Generator().manual_seed(args.seed), pin_memory=device.type == "cuda")
    autocast = (torch.autocast(device.type, dtype=torch.bfloat16) if args.precision == "bf16"
                else contextlib.nullcontext())
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    timed_from_step = args.timed_from or args.log_every

    step, first_step_at, timed_from = 0, None, None
    model.train()
    while step < args.steps:
        for batch in loader:
            with autocast:
                loss, metrics = task.loss(model, to_device(batch, device))
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), args.clip)
            optimizer.step()
            scheduler.step()
            step += 1
            if step == 1:
                first_step_at = time.time()
            if step % args.log_every == 0:  # the only host sync: read the loss and metrics back
                values = torch.stack([loss.detach().float(), *(v.detach().float() for v in metrics.values())])
                print(f"step {step} loss {values[0].item():.4f}", file=sys.stderr, flush=True)
            if step == timed_from_step:
                sync()
                timed_from = (time.perf_counter(), step)
            if step >= args.steps:
                break
    sync()
    elapsed = time.perf_counter() - timed_from[0]
    print(json.dumps({"first_step_at": first_step_at, "steps_per_s": (step - timed_from[1]) / elapsed,
                      "steps": step, "device": str(device), "precision": args.precision}), flush=True)


if __name__ == "__main__":
    main()
