"""What a search is asked to do (the `scaletrain tune` flags), checked in one place."""

from __future__ import annotations

from dataclasses import dataclass, field

from scaletrain.errors import ConfigError
from scaletrain.tune.space import Dimension

__all__ = ["SearchOptions"]


@dataclass
class SearchOptions:
    trials: int = 8
    max_concurrent: int = 1
    metric: str = "eval/loss"
    mode: str = "min"
    search: str = "random"  # random | optuna
    scheduler: str = "asha"  # asha | none
    max_failures: int = 2  # Tune retries of a failed trial (each resumes from its checkpoint)
    address: str | None = None
    overrides: list[str] = field(default_factory=list)

    def check(self, space: list[Dimension]) -> None:
        problems = []
        if self.trials < 1:
            problems.append(f"--trials must be at least 1, got {self.trials}")
        if self.max_concurrent < 1:
            problems.append(f"--max-concurrent must be at least 1, got {self.max_concurrent}")
        if self.mode not in ("min", "max"):
            problems.append(f"--mode must be min or max, got {self.mode!r}")
        if self.search not in ("random", "optuna"):
            problems.append(f"--search must be random or optuna, got {self.search!r}")
        if self.scheduler not in ("asha", "none"):
            problems.append(f"--scheduler must be asha or none, got {self.scheduler!r}")
        if "/" not in self.metric or self.metric.split("/", 1)[0] not in ("train", "eval"):
            problems.append(f"--metric names a train/ or eval/ metric, e.g. eval/loss; got {self.metric!r}")
        if self.search == "optuna" and any(d.kind == "grid" for d in space):
            problems.append("grid rules need --search random (Optuna samples; it does not enumerate)")
        if problems:
            raise ConfigError(problems)
