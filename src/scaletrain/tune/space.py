"""The search space file: each dotted job key gets one sampling rule.

    optim.lr: {loguniform: [1.0e-4, 1.0e-2]}
    optim.weight_decay: {uniform: [0.0, 0.1]}
    task.args.hidden: {randint: [64, 256]}      # both ends included
    data.batch_size: {choice: [16, 32, 64]}
    train.warmup_steps: {grid: [0, 20]}         # every value, crossed with the samples

Checked before anything starts, against the job it will change: an unknown key, a range whose
low end is above its high end, an empty list each get one line naming the key and the fix.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

from scaletrain.config.loading import parse_job
from scaletrain.config.schema import JobConfig
from scaletrain.errors import ConfigError, ScaletrainError

__all__ = ["Dimension", "load_space", "KINDS"]

KINDS = ("uniform", "loguniform", "randint", "choice", "grid")
_EXAMPLE = "e.g. optim.lr: {loguniform: [1.0e-4, 1.0e-2]}"


@dataclass(frozen=True)
class Dimension:
    key: str  # a dotted job key: optim.lr, task.args.hidden
    kind: str  # one of KINDS
    values: tuple[Any, ...]  # [low, high] for ranges; the candidates for choice and grid

    def sample_value(self) -> Any:
        """A value this dimension can produce (to check the job accepts the key)."""
        return self.values[0]

    def to_ray(self) -> Any:
        from ray import tune

        if self.kind == "uniform":
            return tune.uniform(*self.values)
        if self.kind == "loguniform":
            return tune.loguniform(*self.values)
        if self.kind == "randint":  # Ray's upper bound is exclusive; ours is included
            return tune.randint(self.values[0], self.values[1] + 1)
        if self.kind == "choice":
            return tune.choice(list(self.values))
        return tune.grid_search(list(self.values))


def load_space(path: str | Path, job: JobConfig, search_path: list[str] | None = None) -> list[Dimension]:
    """Read and check a search space file against ``job``. Raises ConfigError."""
    path = Path(path)
    source = str(path)
    if not path.is_file():
        raise ConfigError(f"search space file '{path}' not found; check --space")
    try:
        data = yaml.safe_load(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, yaml.YAMLError) as exc:
        raise ConfigError(f"cannot read it as YAML: {str(exc).splitlines()[0]}", source=source) from None
    if not isinstance(data, dict) or not data:
        raise ConfigError(f"a search space is a mapping of job keys to rules ({_EXAMPLE})", source=source)
    problems: list[str] = []
    dimensions: list[Dimension] = []
    for key, rule in data.items():
        try:
            dimensions.append(_dimension(str(key), rule))
        except ValueError as exc:
            problems.append(f"{key}: {exc}")
    if problems:
        raise ConfigError(problems, source=source)
    problems = [p for d in dimensions if (p := _key_problem(job, d, search_path or []))]
    if problems:
        raise ConfigError(problems, source=source)
    return dimensions


def _dimension(key: str, rule: Any) -> Dimension:
    if not isinstance(rule, dict) or len(rule) != 1:
        raise ValueError(f"give exactly one rule of {', '.join(KINDS)} ({_EXAMPLE})")
    kind, values = next(iter(rule.items()))
    if kind not in KINDS:
        raise ValueError(f"unknown rule {kind!r}; use one of {', '.join(KINDS)}")
    if kind in ("choice", "grid"):
        if not isinstance(values, list) or not values:
            raise ValueError(f"{kind} needs a non-empty list of values, e.g. {{{kind}: [16, 32]}}")
        return Dimension(key, kind, tuple(values))
    if not isinstance(values, list) or len(values) != 2 or not all(_is_number(v) for v in values):
        raise ValueError(f"{kind} needs [low, high], two numbers, e.g. {{{kind}: [1, 10]}}")
    low, high = values
    if kind == "randint" and not all(isinstance(v, int) for v in values):
        raise ValueError(f"randint needs two integers, got [{low}, {high}]")
    if low >= high:
        raise ValueError(f"{kind} low end {low} is not below its high end {high}; write [low, high]")
    if kind == "loguniform" and low <= 0:
        raise ValueError(f"loguniform needs a low end above 0, got {low}")
    return Dimension(key, kind, (low, high))


def _is_number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


def _key_problem(job: JobConfig, dimension: Dimension, search_path: list[str]) -> str | None:
    """Does the job take this key and a value like the ones this rule produces?"""
    from scaletrain.task import check_task_target

    override = f"{dimension.key}={json.dumps(dimension.sample_value())}"
    try:
        trial = parse_job(job.model_dump(mode="json"), [override])
        if dimension.key.startswith("task.args.") and trial.task is not None:
            check_task_target(trial.task.target, trial.task.args, search_path)
    except ConfigError as exc:
        return f"{dimension.key}: the job does not take it: {exc.problems[0]}"
    except ScaletrainError as exc:
        return f"{dimension.key}: the job does not take it: {exc}"
    return None
