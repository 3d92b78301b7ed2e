"""The job schema: what a job file may say, with defaults and limits.

Every section rejects unknown keys, so a typo fails loudly instead of being ignored.
"""

from __future__ import annotations

import re
from typing import Annotated, Any, Literal

from pydantic import BaseModel, BeforeValidator, ConfigDict, Field, field_validator, model_validator

__all__ = [
    "JobConfig",
    "TaskConfig",
    "DataConfig",
    "OptimConfig",
    "TrainConfig",
    "ScaleConfig",
    "TrackingConfig",
    "CheckpointConfig",
    "KeepBest",
    "RecoveryConfig",
]


BOOL_REJECTED = "a boolean where a number belongs"


def _reject_bool(value: Any) -> Any:
    # YAML `true` would otherwise pass as the number 1.
    if isinstance(value, bool):
        raise ValueError(BOOL_REJECTED)
    return value


_Number = BeforeValidator(_reject_bool)
PositiveFloat = Annotated[float, _Number, Field(gt=0)]
NonNegativeFloat = Annotated[float, _Number, Field(ge=0)]
PositiveInt = Annotated[int, _Number, Field(ge=1)]
NonNegativeInt = Annotated[int, _Number, Field(ge=0)]
Fraction = Annotated[float, _Number, Field(ge=0, le=1)]

_TARGET = re.compile(r"^[A-Za-z_][\w.]*:[A-Za-z_][\w.]*$")


class Section(BaseModel):
    model_config = ConfigDict(extra="forbid", validate_default=True)


class TaskConfig(Section):
    """Which Python task to train: ``package.module:attr`` plus keyword arguments for it."""

    target: str = Field(description="import path of the task factory, `package.module:attr`")
    args: dict[str, Any] = Field(default_factory=dict, description="keyword arguments for it")

    @field_validator("target")
    @classmethod
    def _check_target(cls, target: str) -> str:
        if not _TARGET.match(target):
            raise ValueError(f"must look like 'package.module:attr', got {target!r}")
        return target


class DataConfig(Section):
    batch_size: PositiveInt = Field(description="samples per worker per micro-step")
    loader_workers: NonNegativeInt = Field(
        0, description="DataLoader worker processes per training worker"
    )
    shuffle: bool = Field(True, description="reshuffle every epoch (seeded)")


class OptimConfig(Section):
    name: Literal["adamw", "sgd"] = "adamw"
    lr: PositiveFloat = Field(description="peak learning rate")
    weight_decay: NonNegativeFloat = 0.0
    betas: tuple[Fraction, Fraction] = (0.9, 0.999)
    momentum: Fraction = Field(0.0, description="SGD only")
    schedule: Literal["constant", "cosine", "linear"] = "cosine"
    warmup_steps: NonNegativeInt = 0
    min_lr_ratio: Fraction = Field(0.0, description="final lr as a fraction of the peak lr")


class TrainConfig(Section):
    max_steps: PositiveInt | None = Field(None, description="optimizer steps to run")
    epochs: PositiveInt | None = Field(None, description="or: passes over the training data")
    grad_accum: PositiveInt = Field(1, description="micro-steps per optimizer step")
    clip_grad_norm: PositiveFloat | None = Field(None, description="max global grad norm")
    precision: Literal["fp32", "bf16"] = "fp32"
    eval_every: PositiveInt | None = Field(None, description="evaluate every N steps (and at the end)")
    log_every: PositiveInt = Field(10, description="report train metrics every N steps")

    @model_validator(mode="after")
    def _one_length(self) -> TrainConfig:
        if (self.max_steps is None) == (self.epochs is None):
            raise ValueError("set exactly one of train.max_steps or train.epochs")
        return self


Dtype = Literal["fp32", "bf16", "fp16"]


class FSDPConfig(Section):
    """FSDP2 (``fully_shard``) settings for the fsdp and hsdp strategies."""

    reshard_after_forward: bool = Field(
        True, description="free each block's gathered parameters after its forward (less memory, "
        "one more all-gather in backward); false keeps them until backward (ZeRO-2-like)"
    )
    param_dtype: Literal["fp32", "bf16"] | None = Field(
        None, description="dtype parameters are gathered and computed in (default: as stored, "
        "fp32); fp16 is not offered: it needs loss scaling, use bf16"
    )
    reduce_dtype: Dtype | None = Field(
        None, description="dtype gradients are reduced in (default: fp32, also with bf16 "
        "parameters: low-precision sums lose small gradients)"
    )
    cpu_offload: bool = Field(
        False, description="keep sharded parameters, gradients and optimizer state in CPU memory"
    )
    shard_size: PositiveInt | None = Field(
        None, description="hsdp: ranks in one shard group (default: the workers on one node); "
        "groups replicate each other"
    )


class ScaleConfig(Section):
    workers: PositiveInt = Field(1, description="training processes (on this machine, or on the Ray cluster)")
    engine: Literal["local", "ray"] = Field(
        "local", description="who starts the workers: local (torch elastic) or ray (Ray Train)"
    )
    backend: Literal["auto", "nccl", "gloo"] = Field(
        "auto", description="collectives: auto (NCCL on GPUs, one GPU per worker; gloo on CPUs), "
        "nccl, or gloo (on GPUs: lets several workers share one GPU, slower)"
    )
    address: str | None = Field(
        None,
        description="ray engine: the cluster to join (default: RAY_ADDRESS; none: start a local "
        "Ray instance for the run)",
    )
    connect_timeout_s: PositiveFloat = Field(
        60.0, description="ray engine: how long joining scale.address may take (the address to "
        "answer, and its head to accept this process) before the run stops with one line"
    )
    strategy: Literal["auto", "single", "ddp", "fsdp", "hsdp"] = Field(
        "auto", description="single, ddp (full replicas), fsdp (parameters, gradients and optimizer "
        "state sharded), hsdp (sharded within a group, replicated across groups); auto: the "
        "planner's choice for these workers (single for 1; ddp when a replica fits, else fsdp), logged"
    )
    fsdp: FSDPConfig = Field(default_factory=FSDPConfig)
    activation_checkpointing: bool = Field(
        False, description="recompute each block's activations in backward instead of keeping them "
        "(any strategy; blocks: the task's blocks(model), else the repeated layers found in the model)"
    )
    threads_per_worker: PositiveInt | None = Field(
        None,
        description="intra-op threads per worker (default: local: cores / workers; ray: "
        "cpus_per_worker)",
    )
    nodes: Annotated[int, _Number, Field(ge=1)] | str = Field(
        1, description="local engine: machines the job runs on, each with its own `scaletrain run "
        "--node-rank N`; a count, or MIN:MAX to go on with fewer after losing some (elastic: the "
        "global batch is kept with more accumulation); scale.workers are split evenly"
    )
    rdzv_endpoint: str | None = Field(
        None, description="several nodes: HOST:PORT where the driver (node 0) listens for the "
        "others; HOST is the driver's address as the other nodes reach it"
    )
    cpus_per_worker: PositiveFloat = Field(1, description="ray engine: CPUs Ray reserves per worker")
    gpus_per_worker: NonNegativeFloat | None = Field(
        None, description="ray engine: GPUs per worker (default: 1 when the cluster has GPUs, else 0)"
    )

    @property
    def node_range(self) -> tuple[int, int]:
        """(MIN, MAX) nodes."""
        low, _, high = str(self.nodes).partition(":")
        return int(low), int(high or low)

    @property
    def workers_per_node(self) -> int:
        return self.workers // self.node_range[1]

    @field_validator("nodes")
    @classmethod
    def _check_nodes(cls, nodes: int | str) -> int | str:
        if isinstance(nodes, int):
            return nodes
        match = re.fullmatch(r"\s*(\d+)\s*(?::\s*(\d+)\s*)?", nodes)
        if not match:
            raise ValueError(f"must be a count or MIN:MAX, got {nodes!r}")
        low, high = int(match.group(1)), int(match.group(2) or match.group(1))
        if not 1 <= low <= high:
            raise ValueError(f"needs 1 <= MIN <= MAX, got {nodes!r}")
        return low if low == high else f"{low}:{high}"

    @field_validator("rdzv_endpoint")
    @classmethod
    def _check_endpoint(cls, endpoint: str | None) -> str | None:
        if endpoint is None:
            return None
        host, _, port = endpoint.rpartition(":")
        if not host.strip("[]") or not port.isdigit() or not 0 < int(port) < 65536:
            raise ValueError(f"must be HOST:PORT, e.g. 10.0.0.5:29400, got {endpoint!r}")
        return endpoint

    @model_validator(mode="after")
    def _nodes_fit(self) -> ScaleConfig:
        low, high = self.node_range
        if high == 1:
            return self
        if self.engine != "local":
            raise ValueError("scale.nodes is for the local engine; Ray places workers on its nodes itself")
        if self.rdzv_endpoint is None:
            raise ValueError(
                f"{high} nodes need scale.rdzv_endpoint (HOST:PORT of node 0, e.g. --rdzv-endpoint "
                "10.0.0.5:29400)"
            )
        if self.workers % high:
            raise ValueError(
                f"scale.workers ({self.workers}) must split evenly over {high} nodes; use a multiple of {high}"
            )
        return self

    @model_validator(mode="after")
    def _strategy_fits(self) -> ScaleConfig:
        if self.strategy == "single" and self.workers > 1:
            raise ValueError(
                f"strategy 'single' runs one process but workers is {self.workers}; "
                "use strategy 'ddp' or 'auto'"
            )
        size = self.fsdp.shard_size
        if self.strategy == "hsdp" and size is not None and self.workers % size:
            raise ValueError(
                f"hsdp needs workers ({self.workers}) to be a multiple of fsdp.shard_size ({size}); "
                "change one of them"
            )
        return self

    @property
    def resolved_strategy(self) -> str:
        if self.strategy != "auto":
            return self.strategy
        return "single" if self.workers == 1 else "ddp"


class TrackingConfig(Section):
    """MLflow tracking. Credentials never go here: MLflow reads them from its own environment
    variables (MLFLOW_TRACKING_TOKEN, MLFLOW_TRACKING_USERNAME/PASSWORD)."""

    enabled: bool = True
    uri: str | None = Field(
        None,
        description="tracking server or store; default: MLFLOW_TRACKING_URI, else "
        "sqlite:///mlflow.db in the working directory",
    )
    experiment: str | None = Field(None, description="experiment name; default: the job name")
    log_every_steps: PositiveInt | None = Field(
        None, description="send train metrics every N steps; default: train.log_every"
    )
    flush_timeout_s: NonNegativeFloat = Field(
        30.0, description="at the end, how long to wait for an unreachable tracker"
    )
    system_metrics_every_s: NonNegativeFloat = Field(
        10.0, description="sample CPU, memory, disk, network, GPU every N seconds; 0: off"
    )
    log_model: bool = Field(
        True, description="log the final model in MLflow's PyTorch format (torch.export); "
        "the weights are logged either way"
    )


class KeepBest(Section):
    """Keep the K checkpoints with the best value of a metric recorded at their step."""

    metric: str = Field(description="a metric name as logged, e.g. 'eval/loss' or 'train/loss'")
    mode: Literal["min", "max"] = "min"
    count: PositiveInt = 1


class CheckpointConfig(Section):
    """Verified checkpoints (torch.distributed.checkpoint + a manifest of hashes)."""

    dir: str | None = Field(
        None,
        description="where checkpoints go: a path or an object storage URL (s3://bucket/prefix); "
        "checkpoints land in <dir>/<job name>/<run id>/. Default: <run dir>/checkpoints",
    )
    every_steps: PositiveInt | None = Field(None, description="save every N optimizer steps")
    every_minutes: PositiveFloat | None = Field(None, description="save every N minutes of training")
    at_end: bool = Field(True, description="save after the last step")
    keep_last: PositiveInt = Field(2, description="keep the newest N checkpoints")
    keep_best: KeepBest | None = Field(None, description="also keep the best K by a metric")
    keep_every: PositiveInt | None = Field(
        None, description="also keep every checkpoint whose step is a multiple of N"
    )
    async_save: bool = Field(
        False, description="write in a background thread; training stalls only to copy the state"
    )

    @property
    def enabled(self) -> bool:
        return bool(self.every_steps or self.every_minutes or self.at_end)


class RecoveryConfig(Section):
    """What happens when a worker fails, hangs or is preempted."""

    max_restarts: NonNegativeInt = Field(
        0, description="restart all workers from the newest verified checkpoint up to N times"
    )
    grace_period_s: PositiveFloat = Field(
        60.0, description="on SIGTERM/SIGUSR1: time to agree on a step and checkpoint before a kill"
    )
    node_wait_s: PositiveFloat = Field(
        30.0, description="several nodes: how long to wait for missing nodes before starting "
        "(or, with scale.nodes MIN:MAX, before going on with fewer after a node is lost)"
    )
    hang_timeout_s: PositiveFloat = Field(
        900.0,
        description="a rank that makes no progress for this long dumps every thread's stack and "
        "ends the attempt (counts as a failure)",
    )


class JobConfig(Section):
    """A whole training job, as written in a YAML job file."""

    name: str = Field("job", description="job name; runs go to <run_dir>/<name>/<run id>/")
    task: TaskConfig
    data: DataConfig
    optim: OptimConfig
    train: TrainConfig
    scale: ScaleConfig = Field(default_factory=ScaleConfig)
    tracking: TrackingConfig = Field(default_factory=TrackingConfig)
    checkpoint: CheckpointConfig = Field(default_factory=CheckpointConfig)
    recovery: RecoveryConfig = Field(default_factory=RecoveryConfig)
    seed: NonNegativeInt = 0
    deterministic: bool = Field(False, description="use deterministic kernels (slower)")
    run_dir: str = Field("runs", description="where run directories are created")

    @field_validator("name")
    @classmethod
    def _name_is_a_folder(cls, name: str) -> str:
        if not re.fullmatch(r"[\w.-]+", name) or name in {".", ".."}:
            raise ValueError(f"must be a folder name (letters, digits, _ - .), got {name!r}")
        return name
