"""`scaletrain plan`: does this job need more than one process, and which strategy?

model_profile measures the model, hardware describes the machine, estimate puts them
together: memory per device, communication and step time for every strategy, and a choice.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any

from scaletrain.plan.estimate import Plan, make_plan
from scaletrain.plan.hardware import Hardware, detect_hardware, named_gpu
from scaletrain.plan.model_profile import ModelProfile, profile_params, profile_task, profile_transformer

__all__ = ["plan_job", "plan_keras_job", "plan_what_if", "Plan", "Hardware"]


def plan_job(config: Any, task: Any, hardware: dict[str, Any] | None = None) -> Plan:
    """Profile a resolved job's model (meta device, one measured pass) and plan for the machine."""
    profile = profile_task(task, config.name, config.train.precision, batch=config.data.batch_size,
                           optimizer=config.optim.name)
    return make_plan(profile, _hardware(hardware), config.data.batch_size * config.train.grad_accum,
                     config.optim.name, config.optim.momentum, config.train.precision)


def plan_keras_job(config: Any, search_path: list[str], hardware: dict[str, Any] | None = None) -> Plan:
    """A TensorFlow job's plan: one process, or MultiWorkerMirroredStrategy (a full replica per
    worker, gradients all-reduced), by the Keras model's state."""
    from scaletrain.plan.estimate import Option
    from scaletrain.plan.keras_profile import profile_keras_task

    assert config.task is not None  # noqa: S101  a TensorFlow task job
    profile = profile_keras_task(config.task.target, config.task.args, search_path, config.name)
    machine = _hardware(hardware)
    options = [Option("single", 1)] + ([Option("mirrored", machine.world)] if machine.world > 1 else [])
    plan = make_plan(profile, machine, config.data.batch_size, config.optim.name, config.optim.momentum,
                     config.train.precision, options=options)
    plan.notes = [n for n in plan.notes if not n.startswith("activations unknown")]
    plan.notes.insert(0, "a Keras model: parameters and model state are exact; activations and step time "
                      "are not measured for TensorFlow jobs yet, so leave room for the activations")
    return plan


def plan_what_if(params: float | None = None, shape: dict[str, int] | None = None, batch: int = 1,
                 hardware: dict[str, Any] | None = None, optimizer: str = "adamw",
                 precision: str = "bf16") -> Plan:
    profile: ModelProfile
    if shape:
        profile = profile_transformer(precision=precision, **shape)
    else:
        profile = profile_params(params or 0)
    return make_plan(profile, _hardware(hardware), batch, optimizer, 0.9 if optimizer == "sgd" else 0.0, precision)


def _hardware(overrides: dict[str, Any] | None) -> Hardware:
    given = {k: v for k, v in (overrides or {}).items() if v is not None}
    gpu = given.pop("gpu", None)
    hardware = named_gpu(gpu, given.get("devices_per_node", 8), given.get("nodes", 1)) if gpu else detect_hardware()
    if given:
        hardware = replace(hardware, source="detected, with flags", **given)
    return hardware
