"""The raw Ray baseline: a plain Ray Train TorchTrainer script with the digits MLP loop.

Written as a competent Ray user would (Ray Train v2): `ray.train.torch.prepare_model` for
DDP, a DistributedSampler, AdamW with the same parameter groups, warmup+cosine, clipping, the
loss reported every log_every steps, threads set per worker (Ray does not), a local
`ray.init()` without a dashboard. Prints one JSON line: wall-clock time of the first finished
step and steady-state steps/s (rank 0 reports them at the end).

    .venv/bin/python bench/baselines/ray_train_digits.py --steps 600 --workers 2
"""

import argparse
import json
import math
import os
import tempfile
import time


def train_loop(config: dict) -> None:
    import ray.train
    import ray.train.torch
    import torch
    from sklearn.datasets import load_digits
    from torch import nn
    from torch.utils.data import DataLoader, DistributedSampler, TensorDataset

    torch.set_num_threads(config["threads"])
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
    model = ray.train.torch.prepare_model(model)
    decay = [p for p in model.parameters() if p.dim() >= 2]
    no_decay = [p for p in model.parameters() if p.dim() < 2]
    optimizer = torch.optim.AdamW(
        [{"params": decay, "weight_decay": 0.01}, {"params": no_decay, "weight_decay": 0.0}], lr=3e-3
    )
    steps, warmup, log_every = config["steps"], 20, config["log_every"]

    def lr_lambda(step: int) -> float:
        if step < warmup:
            return (step + 1) / warmup
        progress = min(1.0, (step - warmup) / max(1, steps - warmup))
        return 0.5 * (1 + math.cos(math.pi * progress))

    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lr_lambda)
    sampler = DistributedSampler(train, shuffle=True, seed=0, drop_last=True)
    loader = DataLoader(train, batch_size=32, sampler=sampler, drop_last=True)
    step, epoch, first_step_at, timed_from = 0, 0, None, None
    while step < steps:
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
            if step == log_every:
                timed_from = (time.perf_counter(), step)
            if step % log_every == 0:
                value = loss.detach().clone()
                torch.distributed.all_reduce(value)
            if step >= steps:
                break
        epoch += 1
    elapsed = time.perf_counter() - timed_from[0]
    if ray.train.get_context().get_world_rank() == 0:
        with open(config["out"], "w") as handle:
            json.dump({"first_step_at": first_step_at, "steps_per_s": (step - timed_from[1]) / elapsed}, handle)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=600)
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--log-every", type=int, default=20)
    args = parser.parse_args()
    os.environ.setdefault("RAY_TRAIN_V2_ENABLED", "1")
    import ray
    from ray.train import RunConfig, ScalingConfig
    from ray.train.torch import TorchTrainer

    ray.init(address="local", include_dashboard=False, log_to_driver=False)
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "result.json")
        trainer = TorchTrainer(
            train_loop,
            train_loop_config={"steps": args.steps, "log_every": args.log_every, "threads": 1, "out": out},
            scaling_config=ScalingConfig(num_workers=args.workers, resources_per_worker={"CPU": 1}),
            run_config=RunConfig(name="ray-train-digits", storage_path=os.path.join(tmp, "ray")),
        )
        trainer.fit()
        with open(out) as handle:
            print(json.dumps(json.load(handle)), flush=True)
    ray.shutdown()


if __name__ == "__main__":
    main()
