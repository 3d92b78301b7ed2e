"""The job schema: what a job file may say, with defaults and limits.

Every section rejects unknown keys, so a typo fails loudly instead of being ignored. Every number
is finite and bounded: a value past a bound is a typo or a unit mix-up, and it must fail here, in
one line, not after the run directory, the MLflow run and the workers exist (Python's timers
overflow near 9.2e9 s, torch elastic and Ray take whole seconds, Optuna and numpy 32-bit seeds).
The bounds (MAX_*) sit far above any real job.
"""

from __future__ import annotations

import math
import re
from typing import Annotated, Any, Literal

from pydantic import (
    AfterValidator,
    BaseModel,
    BeforeValidator,
    ConfigDict,
    Field,
    field_validator,
    model_validator,
)

__all__ = [
    "JobConfig",
    "TaskConfig",
    "LoopConfig",
    "ScriptConfig",
    "DataConfig",
    "OptimConfig",
    "TrainConfig",
    "ScaleConfig",
    "TrackingConfig",
    "CheckpointConfig",
    "KeepBest",
    "RecoveryConfig",
    "MAX_SECONDS",
    "MAX_NAME",
    "MAX_SEED",
    "MAX_WORKERS",
    "MAX_LOCAL_WORKERS",
    "REQUIRED",
]

MAX_SECONDS = 1e7  # every *_s wait or timeout: about 116 days
MAX_MINUTES = 1e5  # checkpoint.every_minutes: about 69 days
MAX_STEPS = 10**9  # optimizer steps, and every "every N steps"
MAX_EPOCHS = 10**6
MAX_BATCH = 10**7  # samples per worker per micro-step
MAX_GRAD_ACCUM = 10**5
MAX_WORKERS = 10**5  # training processes of one job, on a Ray cluster included
MAX_LOCAL_WORKERS = 1024  # processes the local engine starts on one machine
MAX_NODES = 10**4
MAX_CORES = 1024  # threads, CPUs or DataLoader processes per worker: more than a machine has
MAX_GPUS_PER_WORKER = 64
MAX_KEEP = 10**6  # checkpoints kept
MAX_RESTARTS = 10**4
MAX_LR = 10.0  # above it every optimizer here diverges (1e3 is a typo of 1e-3)
MAX_WEIGHT_DECAY = 10.0
MAX_SEED = 2**32 - 1  # numpy, Optuna and DataLoader workers take 32-bit seeds
MAX_NAME = 100  # characters: it names folders and the MLflow experiment
MIN_HANG_TIMEOUT_S = 1.0  # Ray's process-group timeout takes whole seconds
MIN_SAVE_MINUTES = 0.005  # 0.3 s; checkpoints that often: checkpoint.every_steps
MIN_SYSTEM_METRICS_S = 0.1


BOOL_REJECTED = "a boolean where a number belongs"


_EXPONENT = re.compile(r"\s*[-+]?(?:[0-9]+\.?[0-9]*|\.[0-9]+)[eE][-+]?[0-9]+\s*")


def _number(value: Any) -> Any:
    # YAML `true` would otherwise pass as the number 1.
    if isinstance(value, bool):
        raise ValueError(BOOL_REJECTED)
    # YAML 1.1 reads `1e6` as text; it means a number, and `max_steps: 1e6` a whole one.
    if isinstance(value, str) and _EXPONENT.fullmatch(value) and math.isfinite(float(value)):
        return float(value)
    return value


def _below_one(value: float) -> float:
    # torch's Adam refuses a beta of 1 (its bias correction divides by 1 - beta**t); an SGD
    # momentum of 1 never forgets a gradient.
    if value >= 1:
        raise ValueError(f"must be below 1 (a decay of 1 never forgets), got {value:g}; e.g. 0.999")
    return value


_Number = BeforeValidator(_number)
PositiveFloat = Annotated[float, Field(gt=0), _Number]
Fraction = Annotated[float, Field(ge=0, le=1), _Number]
Decay = Annotated[float, Field(ge=0, le=1), _Number, AfterValidator(_below_one)]
Seconds = Annotated[float, Field(gt=0, le=MAX_SECONDS), _Number]
WaitSeconds = Annotated[float, Field(ge=0, le=MAX_SECONDS), _Number]  # 0: do not wait
Steps = Annotated[int, Field(ge=1, le=MAX_STEPS), _Number]


# Counts, bounded (written out: a type checker reads no function call as a type).
BatchSize = Annotated[int, Field(ge=1, le=MAX_BATCH), _Number]
CoresOrZero = Annotated[int, Field(ge=0, le=MAX_CORES), _Number]
StepsOrZero = Annotated[int, Field(ge=0, le=MAX_STEPS), _Number]
Epochs = Annotated[int, Field(ge=1, le=MAX_EPOCHS), _Number]
GradAccum = Annotated[int, Field(ge=1, le=MAX_GRAD_ACCUM), _Number]
Workers = Annotated[int, Field(ge=1, le=MAX_WORKERS), _Number]
Cores = Annotated[int, Field(ge=1, le=MAX_CORES), _Number]
Keep = Annotated[int, Field(ge=1, le=MAX_KEEP), _Number]
Restarts = Annotated[int, Field(ge=0, le=MAX_RESTARTS), _Number]
Seed = Annotated[int, Field(ge=0, le=MAX_SEED), _Number]


def _parse_nodes(nodes: Any) -> int | str:
    """A count, or MIN:MAX (elastic); ``2:2`` is the count 2."""
    number = given = nodes if isinstance(nodes, bool) else _number(nodes)  # 1e3 as written: 1000.0
    if isinstance(number, float) and number.is_integer():
        number = int(number)
    pattern = r"\s*([0-9]{1,9})\s*(?::\s*([0-9]{1,9})\s*)?"
    match = re.fullmatch(pattern, number) if isinstance(number, str) else None
    if isinstance(number, int) and not isinstance(number, bool):
        low = high = number
    elif match:
        low, high = int(match.group(1)), int(match.group(2) or match.group(1))
    else:
        raise ValueError(f"must be a count or MIN:MAX, got {_written(given)}")
    if not 1 <= low <= high <= MAX_NODES:
        raise ValueError(
            f"must be a count from 1 to {MAX_NODES}, or MIN:MAX with 1 <= MIN <= MAX <= {MAX_NODES}, "
            f"got {_written(given)}"
        )
    return low if low == high else f"{low}:{high}"


def _written(value: Any) -> str:
    """A value in a message, short, as YAML writes numbers."""
    if isinstance(value, bool):
        return str(value).lower()
    if isinstance(value, float) and not math.isfinite(value):
        return ".nan" if math.isnan(value) else ".inf" if value > 0 else "-.inf"
    if isinstance(value, float) and value.is_integer() and abs(value) >= 1e6:
        return f"{value:g}"
    if isinstance(value, int) and value.bit_length() > 64:
        return f"an integer of {value.bit_length()} bits"
    text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."


def _not_json(value: Any, where: str) -> str | None:
    """Why ``value`` would not reach the workers as it is (the job travels as JSON), or None."""
    if value is None or isinstance(value, (str, bool)):
        return None
    if isinstance(value, int):
        if value.bit_length() <= 64:
            return None
        what = f"an integer of {value.bit_length()} bits"
    elif isinstance(value, float):
        if math.isfinite(value):
            return None
        what = "not a finite number"
    elif isinstance(value, list):
        problems = (_not_json(item, f"{where}[{i}]") for i, item in enumerate(value))
        return next(filter(None, problems), None)
    elif isinstance(value, dict):
        for key, item in value.items():
            if not isinstance(key, str):
                return f"key {key!r} in {where or 'args'} is not a string; quote it"
            problem = _not_json(item, f"{where}.{key}" if where else key)
            if problem:
                return problem
        return None
    else:
        kinds = {"bytes": "binary data", "date": "a date", "datetime": "a date and time"}
        what = kinds.get(type(value).__name__, f"a {type(value).__name__}")
    return (
        f"{where!r} is {what}, which cannot reach the workers (the job travels as JSON); "
        "write a string, a 64-bit integer, a finite number, a list or a mapping"
    )


_TARGET = re.compile(r"^[A-Za-z_][\w.]*:[A-Za-z_][\w.]*$")


class _Required:
    """Stands for a section a task job must have and lacks: it fails validation as one, and the
    loader says ``<section>: required``."""

    def __repr__(self) -> str:
        return "<required>"


REQUIRED = _Required()


class Section(BaseModel):
    # No inf or nan in any number: they validate against every bound and crash later.
    model_config = ConfigDict(extra="forbid", validate_default=True, allow_inf_nan=False)


class _CodeTarget(Section):
    target: str = Field(description="import path of the task factory, `package.module:attr`")
    args: dict[str, Any] = Field(default_factory=dict, description="keyword arguments for it")

    @field_validator("target")
    @classmethod
    def _check_target(cls, target: str) -> str:
        if not _TARGET.match(target):
            raise ValueError(f"must look like 'package.module:attr', got {target!r}")
        return target

    @field_validator("args")
    @classmethod
    def _check_args(cls, args: dict[str, Any]) -> dict[str, Any]:
        problem = _not_json(args, "")
        if problem:
            raise ValueError(problem)
        return args


class TaskConfig(_CodeTarget):
    """Which Python task to train: ``package.module:attr`` plus keyword arguments for it."""

    framework: Literal["pytorch", "tensorflow"] = Field(
        "pytorch", description="what the task's model is written in: pytorch (a torch nn.Module) or "
        "tensorflow (a Keras model, trained with tf.distribute; pip install 'scaletrain[tensorflow]')",
    )


class LoopConfig(_CodeTarget):
    """Your own training loop: ``package.module:function``, called as ``function(ctx)`` on every
    worker; ``args`` reach it as ``ctx.config``."""

    target: str = Field(description="import path of the loop function, `package.module:function`")
    args: dict[str, Any] = Field(default_factory=dict, description="the loop's settings, as ctx.config")


class ScriptConfig(Section):
    """A script written for torchrun, run unchanged (``scaletrain launch``)."""

    path: str = Field(description="the script, relative to the directory the job starts from")
    args: list[str] = Field(default_factory=list, description="its command-line arguments")
    mlflow_run: Literal["auto", "always", "never"] = Field(
        "auto", description="hand the job's MLflow run to the script (MLFLOW_RUN_ID): auto = when "
        "its source mentions mlflow (rank 0 then waits for the run to open)",
    )

    @field_validator("path")
    @classmethod
    def _a_script(cls, path: str) -> str:
        if not path.strip() or "\0" in path:
            raise ValueError("name the script to run, e.g. train.py")
        return path


class DataConfig(Section):
    batch_size: BatchSize = Field(description="samples per worker per micro-step")
    loader_workers: CoresOrZero = Field(
        0, description="DataLoader worker processes per training worker"
    )
    shuffle: bool = Field(True, description="reshuffle every epoch (seeded)")
    on_error: Literal["stop", "skip"] = Field(
        "stop", description="a sample whose dataset raises: stop the run, or skip: leave it out of its "
        "batch, counted (errors_total{kind=\"sample\"}) and said in the log"
    )


class OptimConfig(Section):
    name: Literal["adamw", "sgd"] = "adamw"
    lr: Annotated[float, Field(gt=0, le=MAX_LR), _Number] = Field(description="peak learning rate")
    weight_decay: Annotated[float, Field(ge=0, le=MAX_WEIGHT_DECAY), _Number] = 0.0
    betas: tuple[Decay, Decay] = (0.9, 0.999)
    momentum: Decay = Field(0.0, description="SGD only")
    schedule: Literal["constant", "cosine", "linear"] = "cosine"
    warmup_steps: StepsOrZero = 0
    min_lr_ratio: Fraction = Field(0.0, description="final lr as a fraction of the peak lr")


class TrainConfig(Section):
    max_steps: Steps | None = Field(None, description="optimizer steps to run")
    epochs: Epochs | None = Field(None, description="or: passes over the training data")
    grad_accum: GradAccum = Field(1, description="micro-steps per optimizer step")
    clip_grad_norm: PositiveFloat | None = Field(None, description="max global grad norm")
    precision: Literal["fp32", "bf16"] = "fp32"
    eval_every: Steps | None = Field(None, description="evaluate every N steps (and at the end)")
    log_every: Steps = Field(10, description="report train metrics every N steps")
    nonfinite: Literal["stop", "skip"] = Field(
        "stop", description="a non-finite loss or gradient: stop the run, or skip: no update for that "
        "step, counted (errors_total{kind=\"step\"}) and said (one host sync a step to decide)"
    )

    @model_validator(mode="after")
    def _one_length(self) -> TrainConfig:
        if self.max_steps is not None and self.epochs is not None:
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
    shard_size: Workers | None = Field(
        None, description="hsdp: ranks in one shard group (default: the workers on one node); "
        "groups replicate each other"
    )


class ScaleConfig(Section):
    workers: Workers = Field(
        1, description="training processes (on this machine, or on the Ray cluster)"
    )
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
    connect_timeout_s: Seconds = Field(
        60.0, description="ray engine: how long joining scale.address may take (the address to "
        "answer, and its head to accept this process) before the run stops with one line"
    )
    strategy: Literal["auto", "single", "ddp", "zero1", "fsdp", "hsdp", "mirrored"] = Field(
        "auto", description="single, ddp (full replicas), zero1 (ddp with the optimizer state split "
        "over the workers), fsdp (parameters, gradients and optimizer "
        "state sharded), hsdp (sharded within a group, replicated across groups); auto: the "
        "planner's choice for these workers (single for 1; ddp when a replica fits, else fsdp), logged. "
        "TensorFlow jobs: mirrored (tf.distribute's MultiWorkerMirroredStrategy, a replica per worker) "
        "or auto (single for 1 worker, else mirrored)"
    )
    fsdp: FSDPConfig = Field(default_factory=FSDPConfig)
    activation_checkpointing: bool = Field(
        False, description="recompute each block's activations in backward instead of keeping them "
        "(any strategy; blocks: the task's blocks(model), else the repeated layers found in the model)"
    )
    threads_per_worker: Cores | None = Field(
        None,
        description="intra-op threads per worker (default: local: cores / workers; ray: "
        "cpus_per_worker)",
    )
    nodes: Annotated[
        Annotated[int, Field(ge=1, le=MAX_NODES)] | Annotated[str, Field(pattern=r"^[0-9]+:[0-9]+$")],
        BeforeValidator(_parse_nodes),
    ] = Field(
        1, description="local engine: machines the job runs on, each with its own `scaletrain run "
        "--node-rank N`; a count, or MIN:MAX to go on with fewer after losing some (elastic: the "
        "global batch is kept with more accumulation); scale.workers are split evenly"
    )
    rdzv_endpoint: str | None = Field(
        None, description="several nodes: HOST:PORT where the driver (node 0) listens for the "
        "others; HOST is the driver's address as the other nodes reach it"
    )
    cpus_per_worker: Annotated[float, Field(gt=0, le=MAX_CORES), _Number] = Field(
        1, description="ray engine: CPUs Ray reserves per worker"
    )
    gpus_per_worker: Annotated[float, Field(ge=0, le=MAX_GPUS_PER_WORKER), _Number] | None = Field(
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

    @field_validator("rdzv_endpoint")
    @classmethod
    def _check_endpoint(cls, endpoint: str | None) -> str | None:
        if endpoint is None:
            return None
        host, _, port = endpoint.rpartition(":")
        if not host.strip("[]") or not re.fullmatch(r"[0-9]{1,5}", port) or not 0 < int(port) < 65536:
            raise ValueError(f"must be HOST:PORT, e.g. 10.0.0.5:29400, got {endpoint!r}")
        return endpoint

    @model_validator(mode="after")
    def _nodes_fit(self) -> ScaleConfig:
        low, high = self.node_range
        if self.engine == "local" and self.workers_per_node > MAX_LOCAL_WORKERS:
            raise ValueError(
                f"the local engine would start {self.workers_per_node} workers on one machine, more "
                f"than {MAX_LOCAL_WORKERS}; spread them with scale.nodes or use scale.engine: ray"
            )
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
                "use strategy 'ddp' or 'auto' ('mirrored' for a TensorFlow job)"
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
    log_every_steps: Steps | None = Field(
        None, description="send train metrics every N steps; default: train.log_every"
    )
    flush_timeout_s: WaitSeconds = Field(
        30.0, description="at the end, how long to wait for an unreachable tracker"
    )
    system_metrics_every_s: WaitSeconds = Field(
        10.0, description="sample CPU, memory, disk, network, GPU every N seconds (at least "
        f"{MIN_SYSTEM_METRICS_S:g}); 0: off"
    )
    log_model: bool = Field(
        True, description="log the final model in MLflow's PyTorch format (torch.export); "
        "the weights are logged either way"
    )
    secret_names: list[str] = Field(
        default_factory=list, description="more names whose values are secrets, masked as *** "
        "in params, files and logs like the built-in ones (token, password, api_key...); a name "
        "matches by its last words: webhook_url also masks SLACK_WEBHOOK_URL and task.args.webhookUrl"
    )

    @field_validator("system_metrics_every_s")
    @classmethod
    def _sampling_rate(cls, every: float) -> float:
        if 0 < every < MIN_SYSTEM_METRICS_S:
            raise ValueError(
                f"must be 0 (off) or at least {MIN_SYSTEM_METRICS_S:g} seconds, got {every:g}; "
                "sampling more often takes the training's cores"
            )
        return every


class KeepBest(Section):
    """Keep the K checkpoints with the best value of a metric recorded at their step."""

    metric: str = Field(description="a metric name as logged, e.g. 'eval/loss' or 'train/loss'")
    mode: Literal["min", "max"] = "min"
    count: Keep = 1


class CheckpointConfig(Section):
    """Verified checkpoints (torch.distributed.checkpoint + a manifest of hashes)."""

    dir: str | None = Field(
        None,
        description="where checkpoints go: a path or an object storage URL (s3://bucket/prefix); "
        "checkpoints land in <dir>/<job name>/<run id>/. Default: <run dir>/checkpoints",
    )
    every_steps: Steps | None = Field(None, description="save every N optimizer steps")
    every_minutes: Annotated[float, Field(ge=MIN_SAVE_MINUTES, le=MAX_MINUTES), _Number] | None = (
        Field(None, description="save every N minutes of training")
    )
    at_end: bool = Field(True, description="save after the last step")
    keep_last: Keep = Field(2, description="keep the newest N checkpoints")
    keep_best: KeepBest | None = Field(None, description="also keep the best K by a metric")
    keep_every: Steps | None = Field(
        None, description="also keep every checkpoint whose step is a multiple of N"
    )
    async_save: bool = Field(
        False, description="write in a background thread; training stalls only to copy the state"
    )
    format: Literal["auto", "dcp"] = Field(
        "auto", description="auto: a state every worker holds whole (one process, DDP) and under "
        "64 MiB in one safetensors file written by rank 0 (DCP's fixed costs are 10x torch.save's "
        "there), else torch.distributed.checkpoint (every rank writes its part); dcp: always DCP. "
        "Both load on any number of workers"
    )

    @property
    def enabled(self) -> bool:
        return bool(self.every_steps or self.every_minutes or self.at_end)


class RecoveryConfig(Section):
    """What happens when a worker fails, hangs or is preempted."""

    max_restarts: Restarts = Field(
        0, description="restart all workers from the newest verified checkpoint up to N times"
    )
    grace_period_s: Seconds = Field(
        60.0, description="on SIGTERM/SIGUSR1: time to agree on a step and checkpoint before a kill"
    )
    node_wait_s: Seconds = Field(
        30.0, description="several nodes: how long to wait for missing nodes before starting "
        "(or, with scale.nodes MIN:MAX, before going on with fewer after a node is lost)"
    )
    hang_timeout_s: Annotated[float, Field(ge=MIN_HANG_TIMEOUT_S, le=MAX_SECONDS), _Number] = Field(
        900.0,
        description="a rank that makes no progress for this long dumps every thread's stack and "
        "ends the attempt (counts as a failure)",
    )


AlertAction = Literal["off", "warn", "stop"]
_ACTION = ("warn: an error line in the log, a tag on the MLflow run and the webhook (SCALETRAIN_ALERT_WEBHOOK_URL); "
           "stop: that, then the run stops at a step every rank agrees on, with a checkpoint (resume goes on); off")


class ErrorRateAlert(Section):
    threshold: Fraction = Field(0.05, description="more than this share of a kind's units of work failed")
    window_s: Annotated[float, Field(gt=0, le=MAX_SECONDS), _Number] = Field(300.0, description="over this window")
    action: AlertAction = Field("warn", description=_ACTION)


class TimeAlert(Section):
    after_s: Annotated[float, Field(gt=0, le=MAX_SECONDS), _Number]
    action: AlertAction = Field("warn", description=_ACTION)


class NoProgressAlert(TimeAlert):
    after_s: Annotated[float, Field(gt=0, le=MAX_SECONDS), _Number] = Field(
        600.0, description="no rank finished a step for this long")


class CheckpointStaleAlert(TimeAlert):
    after_s: Annotated[float, Field(gt=0, le=MAX_SECONDS), _Number] = Field(
        3600.0, description="the newest checkpoint is older than this while steps go on")


class BacklogAlert(Section):
    points: Annotated[int, Field(ge=1, le=10**9), _Number] = Field(1000, description="more metric points than this wait for MLflow "
                                                "and the backlog grew over 10 minutes")
    action: AlertAction = Field("warn", description=_ACTION)


class PlainAlert(Section):
    action: AlertAction = Field("warn", description=_ACTION)


class AlertsConfig(Section):
    """The alerts of deploy/prometheus/alerts.yml, evaluated by the launcher itself (no Prometheus needed)."""

    every_s: Annotated[float, Field(gt=0, le=3600), _Number] = Field(5.0, description="evaluate every N seconds")
    error_rate: ErrorRateAlert = Field(default_factory=ErrorRateAlert)
    no_progress: NoProgressAlert = Field(default_factory=NoProgressAlert)
    throughput_halved: PlainAlert = Field(default_factory=PlainAlert, description="samples/s over 5 minutes "
                                          "under half of the 30 minutes before")
    checkpoint_stale: CheckpointStaleAlert = Field(default_factory=CheckpointStaleAlert)
    metrics_backlog: BacklogAlert = Field(default_factory=BacklogAlert)
    restarts: PlainAlert = Field(default_factory=PlainAlert, description="the workers restarted after a failure")


class ObservabilityConfig(Section):
    """The job's live figures on a Prometheus endpoint served by the launcher
    (docs/observability.md; alert rules and a dashboard in deploy/)."""

    enabled: bool = Field(True, description="serve the job's live figures for Prometheus")
    host: str = Field(
        "127.0.0.1", description="the endpoint's address; another one (0.0.0.0) lets other machines "
        "scrape it: it has no authentication, so keep it behind your network's rules"
    )
    port: Annotated[int, Field(ge=0, le=65535), _Number] = Field(
        0, description="the endpoint's port; 0: a free one, said in the launcher's log and summary.json"
    )
    alerts: AlertsConfig = Field(default_factory=AlertsConfig)


class JobConfig(Section):
    """A whole training job, as written in a YAML job file."""

    # For editors (docs/job.schema.json): a job names its code one way; a task needs data and optim.
    model_config = ConfigDict(json_schema_extra={"oneOf": [
        {"required": ["task", "data", "optim", "train"]}, {"required": ["loop"]}, {"required": ["script"]},
    ]})

    name: str = Field("job", description="job name; runs go to <run_dir>/<name>/<run id>/")
    task: TaskConfig | None = Field(None, description="a scaletrain Task to train (this, or loop)")
    loop: LoopConfig | None = Field(None, description="or: your own training loop, called with a context")
    script: ScriptConfig | None = Field(None, description="or: a torchrun script, run unchanged")
    # The Task runner's sections, required with task: and refused with loop: (a loop builds its
    # own loaders and optimizer). Typed as always present: only a loop job's own code paths,
    # which never read them, see None.
    data: DataConfig = Field(None, validate_default=False)  # type: ignore[assignment]  # None only in a loop job (see above)
    optim: OptimConfig = Field(None, validate_default=False)  # type: ignore[assignment]  # None only in a loop job (see above)
    train: TrainConfig = Field(default_factory=TrainConfig)
    scale: ScaleConfig = Field(default_factory=ScaleConfig)
    tracking: TrackingConfig = Field(default_factory=TrackingConfig)
    checkpoint: CheckpointConfig = Field(default_factory=CheckpointConfig)
    recovery: RecoveryConfig = Field(default_factory=RecoveryConfig)
    observability: ObservabilityConfig = Field(default_factory=ObservabilityConfig)
    seed: Seed = 0
    deterministic: bool = Field(False, description="use deterministic kernels (slower)")
    run_dir: str = Field("runs", description="where run directories are created")

    @model_validator(mode="before")
    @classmethod
    def _absent_sections(cls, data: Any) -> Any:
        if not isinstance(data, dict):
            return data
        # A loop job dumped and read again says data: null, optim: null (absent, not a section).
        if any(data.get(k, 0) is None for k in ("data", "optim")):
            data = {k: v for k, v in data.items() if not (k in ("data", "optim") and v is None)}
        # A task job (or one that names no code yet) without a section it needs: reported as
        # missing beside every other problem of the file, not after them.
        if data.get("loop") is None and data.get("script") is None:
            missing = [k for k in ("data", "optim", "train") if k not in data]
            if missing:
                data = {**data, **{k: REQUIRED for k in missing}}
        return data

    @model_validator(mode="after")
    def _one_kind(self) -> JobConfig:
        given = [name for name in ("task", "loop", "script") if getattr(self, name) is not None]
        if len(given) != 1:
            raise ValueError(
                "set exactly one of task: (a scaletrain Task, `module:factory`), loop: (your own "
                "training loop, `module:function`) or script: (a torchrun script)"
                + (f" ({' and '.join(given)} are set)" if given else "")
            )
        if self.task is not None:  # its data: and optim: are there (_absent_sections)
            if self.train.max_steps is None and self.train.epochs is None:
                raise ValueError("set exactly one of train.max_steps or train.epochs")
            if self.task.framework == "tensorflow":
                return self._fits_tensorflow()
            if self.scale.strategy == "mirrored":
                raise ValueError("scale.strategy mirrored is TensorFlow's (task.framework: tensorflow); "
                                 "a PyTorch job replicates with ddp, or auto")
            return self
        kind = "loop" if self.loop is not None else "script"
        given = [name for name in ("data", "optim") if getattr(self, name) is not None]
        if given:
            where = ("into loop.args (your loop reads them as ctx.config)" if kind == "loop"
                     else "into the script's arguments")
            raise ValueError(f"a {kind} job builds its own data loaders and optimizer: move the "
                             f"{' and '.join(given)} settings {where}")
        loop_train = {"max_steps", "log_every"}
        refused = [name for name, field in TrainConfig.model_fields.items()
                   if name not in loop_train and getattr(self.train, name) != field.default]
        if refused:
            raise ValueError(f"train.{refused[0]} is the Task runner's; a {kind} job's train: takes only "
                             "max_steps (the total, for the progress bar) and log_every")
        if kind == "script":
            if self.scale.engine == "ray":
                raise ValueError("a script runs on the local engine (one launcher per machine, "
                                 "scale.nodes for several): set scale.engine local")
            return self
        if self.scale.strategy == "zero1":
            raise ValueError("scale.strategy zero1 shards the optimizer the Task runner builds; a loop "
                             "builds its own: use ddp or fsdp")
        return self

    def _fits_tensorflow(self) -> JobConfig:
        """A TensorFlow job: the settings that only mean something to PyTorch are refused, one
        line each, never ignored; scale.strategy auto becomes what will run."""
        scale, train = self.scale, self.train
        refused = {
            "scale.strategy": scale.strategy not in ("auto", "single", "mirrored") and
            f"{scale.strategy} is a PyTorch strategy; a TensorFlow job runs mirrored "
            "(MultiWorkerMirroredStrategy, a full replica per worker) or auto",
            "scale.fsdp": scale.fsdp != FSDPConfig() and "configures PyTorch's FSDP; remove it",
            "scale.activation_checkpointing": scale.activation_checkpointing and
            "is PyTorch's; remove it (TensorFlow jobs do not recompute activations yet)",
            "train.grad_accum": train.grad_accum != 1 and
            "is not supported for TensorFlow jobs yet; raise data.batch_size or scale.workers instead",
            "data.loader_workers": self.data.loader_workers != 0 and
            "starts PyTorch DataLoader processes; a TensorFlow job reads through tf.data (remove it)",
            "train.nonfinite": train.nonfinite != "stop" and
            "skip is not supported for TensorFlow jobs yet; remove it (a non-finite loss stops the run)",
            "data.on_error": self.data.on_error != "stop" and
            "skip is not supported for TensorFlow jobs yet (their data is a tf.data pipeline: use "
            "its ignore_errors()); remove it",
            "checkpoint.async_save": self.checkpoint.async_save and
            "is not supported for TensorFlow jobs yet (their checkpoints are written by TF, "
            "synchronously); set it to false",
        }
        for key, problem in refused.items():
            if problem:
                raise ValueError(f"{key} {problem}")
        if scale.strategy == "auto":
            scale.strategy = "single" if scale.workers == 1 else "mirrored"
        return self

    @property
    def kind(self) -> str:
        """What runs: ``task`` (``tensorflow`` for a TensorFlow task), ``loop`` or ``script``."""
        if self.task is not None:
            return "tensorflow" if self.task.framework == "tensorflow" else "task"
        return "loop" if self.loop is not None else "script"

    @field_validator("name")
    @classmethod
    def _name_is_a_folder(cls, name: str) -> str:
        if len(name) > MAX_NAME:
            raise ValueError(f"at most {MAX_NAME} characters (it names a folder), got {len(name)}; "
                             "set a shorter name")
        if not re.fullmatch(r"[\w.-]+", name) or name in {".", ".."}:
            raise ValueError(f"must be a folder name (letters, digits, _ - .), got {name!r}")
        return name
