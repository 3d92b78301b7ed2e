"""Device, backend, threads, precision and determinism: every hardware choice lives here."""

from __future__ import annotations

import contextlib
import os
from dataclasses import dataclass
from typing import Any

import torch
from torch.utils._pytree import tree_map

from scaletrain.distributed.env import DistEnv
from scaletrain.errors import ConfigError

__all__ = [
    "Placement",
    "PlacementError",
    "choose_placement",
    "control_placement",
    "sharing_message",
    "check_local_workers",
    "check_bf16",
    "threads_per_worker",
    "apply_threads",
    "set_determinism",
    "seed_rng",
    "autocast",
    "to_device",
]


@dataclass(frozen=True)
class Placement:
    device: torch.device
    backend: str  # "nccl" (one GPU per rank) or "gloo" (CPU tensors, or GPUs shared by ranks)

    @property
    def group_backend(self) -> str:
        """What the process group is created with. NCCL takes only CUDA tensors: CPU tensors
        (control messages, CPU-offloaded shards) go over gloo in the same group."""
        return "cpu:gloo,cuda:nccl" if self.backend == "nccl" else "gloo"


_NCCL_WITHOUT_CUDA = "scale.backend is nccl but this machine has no CUDA device; use auto or gloo"


class PlacementError(ConfigError):
    """The workers do not fit the devices as asked (one line: what to change)."""

    code = "ST-PLACEMENT"


def choose_placement(
    env: DistEnv, backend: str = "auto", engine_device: torch.device | None = None
) -> Placement:
    """One GPU per local rank with NCCL when CUDA is present, else the CPU with gloo.

    ``backend``: auto | nccl | gloo. NCCL refuses two ranks on one GPU, so more local workers
    than GPUs stop here with one line unless gloo is asked for (ranks then share the GPUs,
    round robin, and collectives copy through host memory). ``engine_device``: the GPU an
    engine already gave this worker (Ray Train); it is kept, not recomputed.
    """
    if not torch.cuda.is_available():
        if backend == "nccl":
            raise PlacementError(_NCCL_WITHOUT_CUDA)
        return Placement(torch.device("cpu"), "gloo")
    if engine_device is not None and engine_device.type == "cuda":
        device = engine_device
    else:
        gpus = torch.cuda.device_count()
        if env.local_world_size > gpus and backend != "gloo":
            raise PlacementError(sharing_message(env.local_world_size, gpus))
        device = torch.device("cuda", env.local_rank % gpus)
    torch.cuda.set_device(device)
    return Placement(device, "gloo" if backend == "gloo" else "nccl")


def control_placement() -> Placement:
    """A worker whose model another framework places (a TensorFlow job): torch keeps to the CPU
    and gloo, for the control messages (stop, save, reports) beside that framework's collectives."""
    return Placement(torch.device("cpu"), "gloo")


def check_local_workers(workers: int, backend: str) -> None:
    """Before any worker starts: NCCL needs GPUs, one per worker on this machine."""
    if backend == "nccl" and not torch.cuda.is_available():
        raise PlacementError(_NCCL_WITHOUT_CUDA)
    if backend != "gloo" and torch.cuda.is_available():
        gpus = torch.cuda.device_count()
        if workers > gpus:
            raise PlacementError(sharing_message(workers, gpus))


def sharing_message(workers: int, gpus: int) -> str:
    return (
        f"{workers} workers on this machine but {gpus} GPU{'s' if gpus != 1 else ''}: NCCL needs "
        f"one GPU per worker; set scale.workers to at most {gpus} per machine, or "
        "scale.backend: gloo to let workers share GPUs (slower collectives)"
    )


def check_bf16(device: torch.device, precision: str) -> None:
    """bf16 on a GPU without native bf16 (before Ampere) is emulated and slow: refuse it."""
    if precision == "bf16" and device.type == "cuda":
        if not torch.cuda.is_bf16_supported(including_emulation=False):
            raise PlacementError(
                f"train.precision bf16: {torch.cuda.get_device_name(device)} has no native bf16 "
                "(it needs compute capability 8.0+); use train.precision: fp32"
            )


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


def to_device(batch: Any, device: torch.device) -> Any:
    """Every tensor of a batch (any nesting of lists, tuples, dicts) on ``device``; on the CPU,
    the batch as it is. Non-blocking: from pinned memory the copy overlaps the step."""
    if device.type == "cpu":
        return batch
    return tree_map(lambda x: x.to(device, non_blocking=True) if isinstance(x, torch.Tensor) else x, batch)
