"""``scale.strategy: auto``: the planner's choice for the workers this job was given.

Decided in every worker before the model is built, from the model on the meta device (every
rank computes the same answer); activations are measured (a meta-device pass) only when the
model state takes over half a device: the first of
ddp, fsdp without resharding, fsdp (then the same with activation checkpointing) whose
memory fits one device. One worker is always single.
"""

from __future__ import annotations

import logging
import os
from typing import Any

import torch

from scaletrain.config.schema import JobConfig
from scaletrain.plan.estimate import make_plan
from scaletrain.plan.hardware import Hardware
from scaletrain.plan.model_profile import ModelProfile, profile_task
from scaletrain.plan.state_bytes import ParamShape

__all__ = ["resolve_auto_strategy", "auto_strategy_for_model"]

log = logging.getLogger("scaletrain.plan")
STATE_SHARE = 0.5


def resolve_auto_strategy(job: JobConfig, task: Any, world: int, device: torch.device, is_main: bool) -> JobConfig:
    if job.scale.strategy != "auto":
        return job
    if world == 1:
        return _with(job, "single", job.scale.activation_checkpointing)
    with torch.device("meta"):
        model = task.build_model()
    profile = ModelProfile(job.name, [ParamShape.of(p) for p in model.parameters() if p.requires_grad],
                           sum(b.nbytes for b in model.buffers()))
    memory = _device_memory(device, world)
    # Model state alone (exact, from shapes) decides when it is small next to a device; only a
    # large model is worth a pass for its activations (the task's loss runs twice, on the meta
    # device; for the rest it is never called before training, so no task state is disturbed).
    if 16 * profile.params > STATE_SHARE * memory:
        try:
            profile = profile_task(task, job.name, job.train.precision, real_pass=False, count_flops=False)
        except Exception as exc:  # a loss the meta device cannot run (.item()...): state alone
            log.debug("meta pass failed: %s", exc)
    hardware = Hardware(device=device.type, name=device.type, devices_per_node=world, nodes=1,
                        memory_bytes=memory, flops=1.0, intra_bw=1.0, inter_bw=1.0,
                        source="this job's workers")
    plan = make_plan(profile, hardware, job.data.batch_size, job.optim.name, job.optim.momentum,
                     job.train.precision, every_device=True)
    chosen = plan.recommended
    if chosen is None or chosen.option.cpu_offload:
        strategy, checkpointing = "fsdp", True
        reason = plan.reason + "; trying fsdp with activation checkpointing anyway"
    else:
        strategy, checkpointing = chosen.option.strategy, chosen.option.activation_checkpointing
        reason = plan.reason
        if profile.activations is None:
            reason += " (model state only: it takes under half a device)"
        if chosen.option.strategy == "fsdp" and not chosen.option.reshard_after_forward:
            job = job.model_copy(update={"scale": job.scale.model_copy(update={
                "fsdp": job.scale.fsdp.model_copy(update={"reshard_after_forward": False})})})
    if is_main:
        log.info("strategy auto -> %s%s: %s", strategy, " with activation checkpointing" if checkpointing else "",
                 reason, extra={"strategy": strategy, "activation_checkpointing": checkpointing})
    return _with(job, strategy, checkpointing or job.scale.activation_checkpointing)


def auto_strategy_for_model(job: JobConfig, model: torch.nn.Module, world: int, device: torch.device,
                            is_main: bool) -> JobConfig:
    """``auto`` for a user's loop (ctx.prepare): its model is given, its loss and batches are
    not, so the choice is from the model's state alone (AdamW's, the usual optimizer): ddp
    while a replica of the state takes under half a device, else fsdp."""
    if world == 1:
        return _with(job, "single", job.scale.activation_checkpointing)
    params = sum(p.numel() for p in model.parameters() if p.requires_grad)
    memory = _device_memory(device, world)
    state = 16 * params  # fp32 weights, gradients and two AdamW moments
    strategy = "ddp" if state <= STATE_SHARE * memory else "fsdp"
    if is_main:
        log.info("strategy auto -> %s: the model's state (%.3g GB with AdamW) takes %s half of a device's %.3g GB "
                 "(a loop's activations are not measured)", strategy, state / 1e9,
                 "under" if strategy == "ddp" else "over", memory / 1e9, extra={"strategy": strategy})
    return _with(job, strategy, job.scale.activation_checkpointing)


def _with(job: JobConfig, strategy: str, checkpointing: bool) -> JobConfig:
    scale = job.scale.model_copy(update={"strategy": strategy, "activation_checkpointing": checkpointing})
    return job.model_copy(update={"scale": scale})


def _device_memory(device: torch.device, world: int) -> float:
    """What one rank may use: its GPU (shared with the other ranks on it, scale.backend gloo),
    or its share of the host's memory."""
    if device.type == "cuda":
        local = int(os.environ.get("LOCAL_WORLD_SIZE", "1"))
        sharing = -(-local // max(1, torch.cuda.device_count()))
        return float(torch.cuda.get_device_properties(device).total_memory) / sharing
    return float(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")) / world
