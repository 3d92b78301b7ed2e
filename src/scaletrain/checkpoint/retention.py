"""Which checkpoints to keep: the last N, the best K by a metric, every Mth step.

A pure function of the committed manifests, so it is easy to test and the same wherever it runs.
The newest checkpoint is always kept, and only committed checkpoints are ever candidates, so a
delete never happens before a newer checkpoint is verified and in place.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from scaletrain.checkpoint.manifest import Manifest

__all__ = ["RetentionPolicy", "to_delete"]


@dataclass(frozen=True)
class RetentionPolicy:
    keep_last: int = 2
    best_metric: str | None = None
    best_mode: str = "min"
    best_count: int = 1
    keep_every: int | None = None


def to_delete(committed: dict[str, Manifest], policy: RetentionPolicy) -> list[str]:
    """Names to delete, oldest first. ``committed`` maps names to manifests."""
    by_step = sorted(committed, key=lambda name: committed[name].step)
    keep = set(by_step[-max(1, policy.keep_last):])
    if policy.keep_every:
        keep |= {n for n in by_step if committed[n].step % policy.keep_every == 0}
    if policy.best_metric:
        best_metric = policy.best_metric
        # A NaN or infinite value ranks nowhere: it is not a best (NaN would sort anywhere).
        scored = [n for n in by_step if _finite(committed[n].metrics.get(best_metric))]
        sign = 1.0 if policy.best_mode == "min" else -1.0
        # Ties go to the newer checkpoint.
        scored.sort(key=lambda n: (sign * committed[n].metrics[best_metric], -committed[n].step))
        keep |= set(scored[: policy.best_count])
    return [n for n in by_step if n not in keep]


def _finite(value: object) -> bool:
    return isinstance(value, (int, float)) and math.isfinite(value)
