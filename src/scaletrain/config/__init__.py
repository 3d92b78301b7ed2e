"""Job configuration: the pydantic schema and the YAML loader with overrides."""

from scaletrain.config.loading import apply_overrides, job_schema, job_to_yaml, load_job, parse_job
from scaletrain.config.schema import (
    DataConfig,
    JobConfig,
    OptimConfig,
    ScaleConfig,
    TaskConfig,
    TrainConfig,
)

__all__ = [
    "JobConfig",
    "TaskConfig",
    "DataConfig",
    "OptimConfig",
    "TrainConfig",
    "ScaleConfig",
    "load_job",
    "parse_job",
    "apply_overrides",
    "job_to_yaml",
    "job_schema",
]
