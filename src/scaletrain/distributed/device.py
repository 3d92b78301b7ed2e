"""Device, backend, threads, precision and determinism: every hardware choice lives here."""

from __future__ import annotations

import contextlib
import os
from dataclasses import dataclass

import torch

from scaletrain.distributed.env import DistEnv

__all__ = [
    "Placement",
    "choose_placement",
    "threads_per_worker",
    "apply_threads",
    "set_determinism",
    "seed_rng",
    "autocast",
]


@dataclass(frozen=True)
class Placement:
    device: torch.device
    backend: str  # torch.distributed backend: "nccl" on CUDA, "gloo" on CPU


def choose_placement(env: DistEnv) -> Placement:
    """One GPU per local rank when CUDA is present, else the CPU with gloo."""
    if torch.cuda.is_available():
        index = env.local_rank % torch.cuda.device_count()
        torch.cuda.set_device(index)
        return Placement(torch.device("cuda", index), "nccl")
    return Placement(torch.device("cpu"), "gloo")


def threads_per_worker(local_workers: int, requested: int | None = None) -> int:
    """Split the cores we may use between the workers on this machine (torchrun sets 1)."""
    if requested:
        return requested
    try:
        cores = len(os.sched_getaffinity(0))
    except AttributeError:  # not on Linux
        cores = os.cpu_count() or 1
    return max(1, cores // max(1, local_workers))


def apply_threads(threads: int) -> None:
    """Set the intra-op thread count for torch and for libraries started after us."""
    for name in ("OMP_NUM_THREADS", "MKL_NUM_THREADS"):
        os.environ[name] = str(threads)
    torch.set_num_threads(threads)


def set_determinism(enabled: bool) -> None:
    """Deterministic kernels when asked; they cost speed, so they are opt-in.

    ``use_deterministic_algorithms`` imports torch's compiler stack (about 1.4 s on 2 cores),
    so it is only called when something changes.
    """
    if enabled:
        os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
        torch.use_deterministic_algorithms(True, warn_only=False)
        torch.backends.cudnn.benchmark = False
        torch.backends.cudnn.deterministic = True
    elif torch.are_deterministic_algorithms_enabled():
        torch.use_deterministic_algorithms(False)


def seed_rng(seed: int, device: torch.device) -> None:
    """Seed the generators a training step draws from (dropout, noise).

    ``torch.manual_seed`` would also queue a lazy CUDA seeding call with a captured stack
    trace on a machine without CUDA: 0.8 ms, a third of a small model's step. So: the CPU
    generator, plus the current GPU's when training there.
    """
    torch.default_generator.manual_seed(seed)
    if device.type == "cuda":
        torch.cuda.manual_seed(seed)


def autocast(device: torch.device, precision: str) -> contextlib.AbstractContextManager:
    """bf16 autocast for forward and loss when asked; fp32 runs without any context."""
    if precision == "bf16":
        return torch.autocast(device_type=device.type, dtype=torch.bfloat16)
    return contextlib.nullcontext()
