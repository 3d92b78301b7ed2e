"""The raw baseline for recovery: the digits MLP in a hand-written DDP loop (as
bench/baselines/ddp_loop.py) plus checkpoint and resume, as a competent user writes them for
torchrun --max-restarts.

Rank 0 saves {model, optimizer, scheduler, step} with torch.save every --save-every steps
(temp file, fsync, os.replace); every rank resumes from it on start and skips the batches of
the epoch already done. In the first attempt (TORCHELASTIC_RESTART_COUNT=0) rank --kill-rank
SIGKILLs itself after step --kill-step. Rank 0 appends one JSON line per event to --log-file:
{"event": "start"|"resumed"|"step"|"done", "t": unix time, "step": ..., "attempt": ...};
"start" also has the process start time and the time its imports were done.

    torchrun --nproc-per-node 2 --max-restarts 1 --rdzv-backend c10d --rdzv-endpoint 127.0.0.1:0 \
        bench/baselines/ddp_digits_resumable.py --ckpt /tmp/x/ckpt.pt --log-file /tmp/x/log.jsonl
"""

import time

STARTED = time.time()  # before the heavy imports: the restart cost includes them

import argparse  # noqa: E402
import itertools  # noqa: E402
import json  # noqa: E402
import math  # noqa: E402
import os  # noqa: E402
import signal  # noqa: E402

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
from sklearn.datasets import load_digits  # noqa: E402
from torch import nn  # noqa: E402
from torch.nn.parallel import DistributedDataParallel  # noqa: E402
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset  # noqa: E402


def main() -> None:
    imported = time.time()  # the process is up: imports done, before the process group
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--batch-size", type=int, default=32)
    parser.add_argument("--warmup-steps", type=int, default=20)
    parser.add_argument("--save-every", type=int, default=50)
    parser.add_argument("--kill-rank", type=int, default=1)
    parser.add_argument("--kill-step", type=int, default=120)
    parser.add_argument("--ckpt", required=True)
    parser.add_argument("--log-file", required=True)
    args = parser.parse_args()
    attempt = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))

    dist.init_process_group("gloo")
    rank = dist.get_rank()
    log_file = open(args.log_file, "a", encoding="utf-8") if rank == 0 else None

    def log(event: str, **fields) -> None:
        if log_file is not None:
            row = {"event": event, "t": time.time(), "attempt": attempt, **fields}
            log_file.write(json.dumps(row) + "\n")
            log_file.flush()

    log("start", started=STARTED, imported=imported)
    torch.manual_seed(0)
    images, labels = load_digits(return_X_y=True)
    x = torch.tensor(images, dtype=torch.float32) / 16.0
    y = torch.tensor(labels, dtype=torch.long)
    order = torch.randperm(len(x), generator=torch.Generator().manual_seed(1234))
    n_eval = int(len(x) * 0.2)
    train = TensorDataset(x[order[n_eval:]], y[order[n_eval:]])

    model = DistributedDataParallel(nn.Sequential(
        nn.Linear(64, 128), nn.GELU(), nn.Dropout(0.1),
        nn.Linear(128, 128), nn.GELU(), nn.Dropout(0.1),
        nn.Linear(128, 10),
    ))
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

    step = 0
    if os.path.exists(args.ckpt):
        state = torch.load(args.ckpt, weights_only=True)
        model.module.load_state_dict(state["model"])
        optimizer.load_state_dict(state["optim"])
        scheduler.load_state_dict(state["sched"])
        step = state["step"]
        log("resumed", step=step)

    epoch, skip = divmod(step, len(loader))
    while step < args.steps:
        sampler.set_epoch(epoch)
        for inputs, targets in itertools.islice(loader, skip, None):
            loss = nn.functional.cross_entropy(model(inputs), targets)
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            optimizer.step()
            scheduler.step()
            step += 1
            log("step", step=step)
            if rank == 0 and step % args.save_every == 0 and step < args.steps:
                tmp = f"{args.ckpt}.tmp"
                with open(tmp, "wb") as handle:
                    torch.save({"model": model.module.state_dict(), "optim": optimizer.state_dict(),
                                "sched": scheduler.state_dict(), "step": step}, handle)
                    handle.flush()
                    os.fsync(handle.fileno())
                os.replace(tmp, args.ckpt)
            if attempt == 0 and rank == args.kill_rank and step == args.kill_step:
                os.kill(os.getpid(), signal.SIGKILL)
            if step >= args.steps:
                break
        epoch, skip = epoch + 1, 0
    log("done", step=step)
    dist.destroy_process_group()


if __name__ == "__main__":
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    main()
