"""The machine a plan is for: detected, or described by flags for a what-if.

Bandwidths are what one rank can move, in bytes per second; FLOP/s is what one device
sustains on this model's matmuls (peak x utilization for GPUs, measured for the CPU); a
collective's fixed cost is what one call takes beyond its bytes (latency, launch, the
framework's bookkeeping). Defaults are stated in docs/planning.md with their sources.
"""

from __future__ import annotations

import os
import time
from dataclasses import asdict, dataclass

import torch

__all__ = ["Hardware", "detect_hardware", "named_gpu", "GPU_PEAK_FLOPS", "GPU_MEMORY_GIB"]

GB = 1e9
# Dense bf16/fp16 tensor-core peaks from the vendors' datasheets (FLOP/s).
GPU_PEAK_FLOPS = {"H200": 989e12, "H100": 989e12, "A100": 312e12, "L40S": 362e12, "L4": 121e12,
                  "A10": 125e12, "V100": 125e12, "T4": 65e12}
# Memory per device in GiB as the devices report it (nvidia-smi's total, MiB / 1024), not the
# datasheets' decimal GB: an H200 "141 GB" shows 143771 MiB, an H100 "80 GB" 81559 MiB.
GPU_MEMORY_GIB = {"H200": 140.4, "H100": 79.6, "A100": 80.0, "L40S": 45.0, "L4": 22.5, "A10": 22.5,
                  "V100": 32.0, "T4": 15.0}
NVLINK = ("H200", "H100", "A100", "V100")
GPU_UTILIZATION = 0.4  # model FLOPs utilization a well-tuned job reaches (torchtitan, MosaicML reports)
GPU_COLLECTIVE_S = 30e-6  # one NCCL collective on small messages (nccl-tests: tens of microseconds)
# One gloo collective between CPU workers, FSDP2's per-call bookkeeping included: fitted to
# bench/results/strategies.json (tiny_gpt, 2 workers: FSDP's 9 calls per step against DDP's 1;
# 3.5 and 5.0 ms in two runs on this 2-core machine).
CPU_COLLECTIVE_S = 4e-3
HOST_MEMORY_PER_GPU = 256 * 1024**3  # a DGX H100: 2 TiB for 8 GPUs


@dataclass
class Hardware:
    device: str  # cuda | cpu
    name: str
    devices_per_node: int
    nodes: int
    memory_bytes: float  # per device
    flops: float  # sustained, per device
    intra_bw: float  # bytes/s per rank within a node
    inter_bw: float  # bytes/s per rank across nodes
    offload_bw: float = 25 * GB  # host <-> device (PCIe 4.0 x16)
    host_memory_bw: float = 20 * GB  # a CPU optimizer step streams its state at this rate
    collective_s: float = GPU_COLLECTIVE_S  # fixed cost of one collective call
    host_memory_bytes: float | None = None  # per node; None: not checked
    source: str = "detected"

    @property
    def world(self) -> int:
        return self.devices_per_node * self.nodes

    def as_dict(self) -> dict:
        return asdict(self)


def detect_hardware() -> Hardware:
    if torch.cuda.is_available():
        props = torch.cuda.get_device_properties(0)
        peak = next((v for k, v in GPU_PEAK_FLOPS.items() if k in props.name), 100e12)
        nvlink = any(k in props.name for k in NVLINK)
        return Hardware(
            device="cuda", name=props.name, devices_per_node=torch.cuda.device_count(), nodes=1,
            memory_bytes=float(props.total_memory), flops=peak * GPU_UTILIZATION,
            intra_bw=(150 if nvlink else 12) * GB, inter_bw=12.5 * GB, host_memory_bytes=_host_memory(),
        )
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    memory = _host_memory()
    return Hardware(
        device="cpu", name=f"CPU, {cores} cores", devices_per_node=cores, nodes=1,
        memory_bytes=memory / cores, flops=_cpu_flops(), intra_bw=2 * GB, inter_bw=1.25 * GB,
        offload_bw=float("inf"), collective_s=CPU_COLLECTIVE_S, host_memory_bytes=memory,
    )


def _host_memory() -> float:
    return float(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES"))


def _cpu_flops() -> float:
    """One thread's sustained matmul FLOP/s (each CPU worker gets about one core)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        a, b = torch.randn(256, 256), torch.randn(256, 256)
        a @ b
        runs, started = 0, time.perf_counter()
        while time.perf_counter() - started < 0.1:
            a @ b
            runs += 1
        return 2 * 256**3 * runs / (time.perf_counter() - started)
    finally:
        torch.set_num_threads(threads)


def named_gpu(name: str, devices_per_node: int = 8, nodes: int = 1) -> Hardware:
    """A what-if machine of ``devices_per_node`` GPUs of a known model (H100, A100, L4...)."""
    key = next((k for k in GPU_PEAK_FLOPS if k.lower() == name.lower()), None)
    if key is None:
        raise ValueError(f"unknown GPU {name!r}; known: {', '.join(GPU_PEAK_FLOPS)} (or give --memory-gb and --tflops)")
    return Hardware(
        device="cuda", name=key, devices_per_node=devices_per_node, nodes=nodes,
        memory_bytes=GPU_MEMORY_GIB[key] * 1024**3, flops=GPU_PEAK_FLOPS[key] * GPU_UTILIZATION,
        intra_bw=(150 if key in NVLINK else 12) * GB, inter_bw=12.5 * GB,
        host_memory_bytes=float(HOST_MEMORY_PER_GPU * devices_per_node), source=f"what-if: {key}",
    )
