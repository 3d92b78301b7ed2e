"""Memory, communication and step time of each way to run a model on some hardware, and the
recommendation. The formulas, with their sources, are in docs/planning.md.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field

from scaletrain.plan.hardware import Hardware
from scaletrain.plan.model_profile import ModelProfile
from scaletrain.plan.state_bytes import local_bytes, optimizer_bytes, zero_partition

__all__ = ["Option", "Estimate", "Plan", "make_plan", "estimate", "state_bytes_per_rank", "USABLE_MEMORY"]

USABLE_MEMORY = 0.9  # of a device's memory: the rest goes to the allocator's fragmentation, kernels, comm buffers
SIMPLICITY = ["single", "ddp", "mirrored", "zero1", "fsdp (no reshard)", "fsdp", "hsdp"]


@dataclass(frozen=True)
class Option:
    strategy: str  # single | ddp | zero1 | fsdp | hsdp; mirrored (TensorFlow's, ddp's twin)
    world: int
    shard: int = 1  # ranks a parameter is split over
    reshard_after_forward: bool = True
    activation_checkpointing: bool = False
    cpu_offload: bool = False

    @property
    def label(self) -> str:
        name = "fsdp (no reshard)" if self.strategy == "fsdp" and not self.reshard_after_forward else self.strategy
        return name + (" +AC" if self.activation_checkpointing else "") + (" +offload" if self.cpu_offload else "")

    @property
    def family(self) -> str:
        return "fsdp (no reshard)" if self.strategy == "fsdp" and not self.reshard_after_forward else self.strategy


@dataclass
class Estimate:
    option: Option
    memory: dict[str, float]  # per device: params, grads, optimizer (at rest), gathered (FSDP, transient), activations, buffers, total
    host_memory: float
    fits: bool
    comm_bytes: dict[str, float]  # per rank per step: intra_node, inter_node
    collectives: int  # calls per step
    compute_s: float | None
    comm_s: float
    step_s: float | None
    samples_per_s: float | None

    def as_dict(self) -> dict:
        row = asdict(self)
        row["option"] = {**asdict(self.option), "label": self.option.label}
        return row


@dataclass
class Plan:
    model: dict
    hardware: dict
    batch_per_device: int
    estimates: list[Estimate]
    recommended: Estimate | None
    reason: str
    notes: list[str] = field(default_factory=list)

    def as_dict(self) -> dict:
        return {"model": self.model, "hardware": self.hardware, "batch_per_device": self.batch_per_device,
                "estimates": [e.as_dict() for e in self.estimates],
                "recommended": self.recommended.option.label if self.recommended else None,
                "reason": self.reason, "notes": self.notes}


def state_bytes_per_rank(profile: ModelProfile, shard: int, rank: int, optimizer: str, momentum: float,
                         zero: int = 1) -> dict[str, int]:
    """What a rank keeps between steps: its part of the parameters, gradients, optimizer state
    (``rank``: its place in its shard group, of ``shard`` ranks; ``zero``: ranks the optimizer
    state is partitioned over by whole parameters, ZeRO-1)."""
    params = local_bytes(profile.shapes, shard, rank if zero == 1 else 0)  # ZeRO-1: whole replicas
    if zero > 1:
        opt = optimizer_bytes(zero_partition(profile.shapes, zero)[rank], optimizer, momentum)
    else:
        opt = optimizer_bytes(profile.shapes, optimizer, momentum, shard, rank)
    return {"params": params, "grads": params, "optimizer": opt}


def _options(hardware: Hardware) -> list[Option]:
    world, per_node = hardware.world, hardware.devices_per_node
    options = []
    for ac in (False, True):
        options.append(Option("single", 1, activation_checkpointing=ac))
        if world > 1:
            options.append(Option("ddp", world, activation_checkpointing=ac))
            options.append(Option("zero1", world, activation_checkpointing=ac))
            options.append(Option("fsdp", world, world, reshard_after_forward=False, activation_checkpointing=ac))
            for offload in (False, True):
                if offload and hardware.device != "cuda":
                    continue  # offloading to the host is a GPU thing: a CPU's device memory is the host's
                options.append(Option("fsdp", world, world, activation_checkpointing=ac, cpu_offload=offload))
            if hardware.nodes > 1 and per_node > 1:
                options.append(Option("hsdp", world, per_node, activation_checkpointing=ac))
    return options


def estimate(option: Option, profile: ModelProfile, hardware: Hardware, batch: int, optimizer: str,
              momentum: float, precision: str) -> Estimate:
    if option.strategy == "zero1":  # the rank whose whole parameters add up to the most state
        state = max((state_bytes_per_rank(profile, 1, r, optimizer, momentum, zero=option.world)
                     for r in range(option.world)), key=lambda s: s["optimizer"])
    else:
        state = state_bytes_per_rank(profile, option.shard, 0, optimizer, momentum)  # rank 0 holds the most
    gathered_scale = 0.5 if precision in ("bf16", "fp16") else 1.0  # FSDP gathers in the compute dtype
    params, grads, opt = float(state["params"]), float(state["grads"]), float(state["optimizer"])
    gathered = 0.0  # transient, during forward and backward: FSDP's unsharded copies
    if option.shard > 1:
        block = profile.largest_block_bytes * gathered_scale
        if option.reshard_after_forward:  # the root stays gathered; a block and the next one in flight
            gathered += profile.root_bytes * gathered_scale + 2 * block
        else:  # every block stays gathered from its forward to its backward
            gathered += profile.param_bytes * gathered_scale
        gathered += block / gathered_scale  # one block's unsharded gradients before reduce-scatter
    activations = profile.activations.bytes(batch, option.activation_checkpointing) if profile.activations else 0.0
    host = 0.0
    if option.cpu_offload:
        host = float(state["params"] + state["grads"] + state["optimizer"])
        params -= state["params"]
        grads -= state["grads"]
        opt = 0.0
    # params, grads, optimizer: the model states at rest (between steps); gathered: on top of them
    # while a step runs.
    memory = {"params": params, "grads": grads, "optimizer": opt, "gathered": gathered,
              "activations": activations, "buffers": float(profile.buffer_bytes)}
    memory["total"] = sum(memory.values())
    fits = memory["total"] <= USABLE_MEMORY * hardware.memory_bytes
    if option.cpu_offload and hardware.host_memory_bytes is not None:  # every rank of a node offloads
        fits = fits and host * min(option.world, hardware.devices_per_node) <= USABLE_MEMORY * hardware.host_memory_bytes

    n, grad_bytes = option.world, float(profile.param_bytes)  # gradients reduced in fp32
    compute_bytes = profile.param_bytes * gathered_scale
    intra = inter = 0.0
    if option.strategy in ("ddp", "zero1", "mirrored"):
        ring = 2 * (n - 1) / n * grad_bytes
        if option.strategy == "zero1":  # each owner broadcasts its updated parameters
            ring += (n - 1) / n * profile.param_bytes
        intra, inter = (ring, 0.0) if hardware.nodes == 1 else (0.0, ring)
    elif option.strategy in ("fsdp", "hsdp"):
        s = option.shard
        gathers = 2 if option.reshard_after_forward else 1
        sharded = (s - 1) / s * (gathers * compute_bytes + grad_bytes)
        replicas = n // s
        across = 2 * (replicas - 1) / replicas * grad_bytes / s if replicas > 1 else 0.0
        if option.strategy == "fsdp" and hardware.nodes > 1:
            inter = sharded
        else:
            intra, inter = sharded, across
    collectives = _collectives(option, profile)
    comm_s = intra / hardware.intra_bw + inter / hardware.inter_bw + collectives * hardware.collective_s
    compute_s = None
    step_s = None
    samples = None
    cpu_seconds = profile.cpu_seconds if hardware.device == "cpu" else None
    measured_here = cpu_seconds is not None
    if profile.flops_per_sample or measured_here:
        if measured_here:  # timed on this CPU: per-op overhead included
            compute_s = cpu_seconds[0] + cpu_seconds[1] * batch  # type: ignore[index]  # measured_here
        else:
            compute_s = profile.flops_per_sample * batch / hardware.flops  # type: ignore[operator]  # checked above
        if option.activation_checkpointing:
            compute_s *= 4 / 3  # the forward runs again in backward: forward is 1/3 of fwd+bwd
        if measured_here and profile.cpu_optimizer_seconds:  # each rank steps on its shard
            compute_s += profile.cpu_optimizer_seconds / option.shard
        if hardware.device == "cuda":  # communication overlaps compute (DDP buckets, FSDP prefetch)
            step_s = max(compute_s, comm_s)
        else:  # gloo's threads take the cores the compute runs on
            step_s = compute_s + comm_s
        if option.cpu_offload:
            moved = 2 * state["params"] * gathered_scale + state["grads"]
            step_s += moved / hardware.offload_bw + (state["params"] + state["optimizer"]) / hardware.host_memory_bw
        samples = option.world * batch / step_s
    return Estimate(option, memory, host, fits, {"intra_node": intra, "inter_node": inter},
                    collectives, compute_s, comm_s, step_s, samples)


DDP_BUCKET_BYTES = 25 * 1024**2  # DistributedDataParallel's bucket_cap_mb default
DDP_FIRST_BUCKET_BYTES = 1024**2  # its first bucket, sent early


def _collectives(option: Option, profile: ModelProfile) -> int:
    """Collective calls per step: DDP one all-reduce per gradient bucket; FSDP per block an
    all-gather in forward, another in backward when resharded, and a reduce-scatter, the same
    for the parameters outside the blocks (gathered once, kept), and the gradient norm's
    all-reduce; HSDP adds an all-reduce per group across replicas."""
    if option.world == 1:
        return 0
    grads = profile.param_bytes
    if option.strategy in ("ddp", "zero1", "mirrored"):  # TF packs gradients into all-reduces likewise
        rest = max(0, grads - DDP_FIRST_BUCKET_BYTES)
        buckets = 1 + -(-rest // DDP_BUCKET_BYTES)
        return buckets + (len(profile.shapes) if option.strategy == "zero1" else 0)  # a broadcast per parameter
    groups = len(profile.block_shapes) + (1 if profile.root_bytes else 0)
    gathers = 2 if option.reshard_after_forward else 1
    calls = len(profile.block_shapes) * (gathers + 1) + (2 if profile.root_bytes else 0) + 1
    if option.strategy == "hsdp" and option.world // option.shard > 1:
        calls += groups
    return calls


def make_plan(profile: ModelProfile, hardware: Hardware, batch: int, optimizer: str = "adamw",
              momentum: float = 0.0, precision: str = "fp32", every_device: bool = False,
              options: list[Option] | None = None) -> Plan:
    """``every_device``: only ways that use all of the hardware's devices (the workers are given);
    ``options``: the ways to weigh (default: PyTorch's)."""
    options = [o for o in (options or _options(hardware)) if not every_device or o.world == hardware.world]
    estimates = [estimate(o, profile, hardware, batch, optimizer, momentum, precision) for o in options]
    recommended, reason = _recommend(estimates, hardware, profile)
    notes = []
    if profile.assumed_blocks:
        notes.append(profile.assumed_blocks)
    if profile.activations is None:
        notes.append("activations unknown (only a parameter count): give the model's shape or a job for them")
    if profile.flops_per_sample is None:
        notes.append("no FLOP count: step times are not estimated; the choice is by memory alone")
    return Plan(
        model={"name": profile.name, "params": profile.params, "param_bytes": profile.param_bytes,
               "buffer_bytes": profile.buffer_bytes, "blocks": len(profile.block_shapes),
               "flops_per_sample": profile.flops_per_sample,
               "activation_bytes_per_sample": profile.activations.per_sample if profile.activations else None,
               "activations_measured_on": profile.activations.measured_on if profile.activations else None},
        hardware=hardware.as_dict(), batch_per_device=batch, estimates=estimates,
        recommended=recommended, reason=reason, notes=notes,
    )


def _gb(value: float) -> str:
    return f"{value / 1024**3:.2f} GiB" if value >= 1024**3 / 10 else f"{value / 1024**2:.1f} MiB"


def _recommend(estimates: list[Estimate], hardware: Hardware, profile: ModelProfile) -> tuple[Estimate | None, str]:
    usable = USABLE_MEMORY * hardware.memory_bytes
    fitting = [e for e in estimates if e.fits]
    if not fitting:
        smallest = min(estimates, key=lambda e: e.memory["total"])
        if smallest.option.cpu_offload and smallest.memory["total"] <= usable:
            per_node = smallest.host_memory * min(smallest.option.world, hardware.devices_per_node)
            return None, (f"nothing fits: {smallest.option.label} fits on the devices but keeps "
                          f"{_gb(per_node)} per node on the host, and {_gb(USABLE_MEMORY * hardware.host_memory_bytes)} "  # type: ignore[operator]  # set whenever offload fits on the devices
                          "of host memory is usable; add nodes or devices, or train in bf16")
        return None, (f"nothing fits: the smallest, {smallest.option.label}, needs {_gb(smallest.memory['total'])} "
                      f"per device and {_gb(usable)} is usable; add devices, lower data.batch_size, "
                      "train in bf16 or offload to the host")

    def rank(e: Estimate) -> tuple:
        speed = e.samples_per_s or 0.0
        return (-round(speed / max(x.samples_per_s or 1e-30 for x in fitting), 2) if speed else 0,
                SIMPLICITY.index(e.option.family), e.option.activation_checkpointing, e.option.cpu_offload)

    best = min(fitting, key=rank)
    ddp = next((e for e in estimates if e.option.label == "ddp"), None)
    single = next((e for e in estimates if e.option.label == "single"), None)
    need, have = best.memory["total"], usable
    if best.option.strategy == "single":
        if hardware.world == 1:
            return best, f"one process is enough: one device is all there is, and the job needs {_gb(need)} of its {_gb(have)}"
        return best, (f"one process is enough: it needs {_gb(need)} of {_gb(have)}, and more workers would spend "
                      "more time communicating than they save computing")
    if best.option.strategy in ("ddp", "mirrored"):
        text = (f"data parallel{' (MultiWorkerMirroredStrategy)' if best.option.strategy == 'mirrored' else ''}: a full replica fits on each device ({_gb(need)} of {_gb(have)}); the all-reduce "
                f"moves {_gb(best.comm_bytes['intra_node'] + best.comm_bytes['inter_node'])} per rank per step")
        if best.compute_s is not None:
            hidden = "hidden behind" if best.comm_s <= best.compute_s else "longer than"
            text += f", {best.comm_s * 1e3:.1f} ms {hidden} {best.compute_s * 1e3:.1f} ms of compute"
        return best, text + (" (with activation checkpointing: activations do not fit otherwise)" if best.option.activation_checkpointing else "")
    if best.option.strategy == "zero1":
        ddp_need = f"{_gb(ddp.memory['total'])}" if ddp is not None else "more"
        return best, (f"zero1: a full replica fits once the optimizer state is split over {best.option.world} ranks "
                      f"({_gb(need)} of {_gb(have)} per device; data parallel alone needs {ddp_need}); the "
                      "updated parameters are broadcast after each step")
    replica = ddp or single
    why = (f"a full replica needs {_gb(replica.memory['total'])} per device, {_gb(have)} is usable"
           if replica is not None and not replica.fits else "it is the fastest that fits")
    return best, (f"{best.option.label}: {why}; sharding over {best.option.shard} ranks brings it to {_gb(need)} "
                  f"per device")
