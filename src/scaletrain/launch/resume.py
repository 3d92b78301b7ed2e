"""`scaletrain resume`: find the run to continue and prepare its spec for another launch.

A run is continued in place: the same run directory, run id (so the same checkpoint location),
MLflow run and metric journal. Resuming from one named checkpoint sets the run's newer
checkpoints aside (renamed, never deleted), so every restart of the new attempt resumes from
the chosen timeline.
"""

from __future__ import annotations

import json
from pathlib import Path

from scaletrain.checkpoint.location import checkpoint_location, global_batch
from scaletrain.checkpoint.manifest import MANIFEST_FILE, ManifestError
from scaletrain.checkpoint.storage import open_storage, step_of
from scaletrain.config import parse_job
from scaletrain.config.schema import JobConfig
from scaletrain.errors import ConfigError, ScaletrainError
from scaletrain.rundir import RunSpec

__all__ = ["prepare_resume", "find_run_dir", "keep_global_batch"]


def find_run_dir(target: str, runs_root: str | Path = "runs") -> tuple[Path, str | None]:
    """The run directory for ``target`` and, when it names one checkpoint, that checkpoint."""
    path = Path(target).expanduser()
    if (path / "spec.json").is_file():
        return path.resolve(), None
    if (path / MANIFEST_FILE).is_file():
        state = _trainer_state(path)
        run_dir = Path(state.get("run_dir", ""))
        if not (run_dir / "spec.json").is_file():
            raise ScaletrainError(
                f"checkpoint {path} belongs to run directory {run_dir or '?'}, which is not here; "
                "resume needs that run directory (its spec.json)"
            )
        return run_dir, path.name
    if not path.exists() and "/" not in target:
        matches = sorted(Path(runs_root).glob(f"*/{target}/spec.json"))
        if len(matches) == 1:
            return matches[0].parent.resolve(), None
        if len(matches) > 1:
            raise ConfigError(f"run id {target!r} matches {len(matches)} runs; pass the run directory")
    raise ConfigError(
        f"cannot resume {target!r}: not a run directory (with spec.json), a checkpoint folder "
        f"(with {MANIFEST_FILE}) or a run id under ./{runs_root}; see `scaletrain runs`"
    )


def _trainer_state(checkpoint_dir: Path) -> dict:
    try:
        return json.loads((checkpoint_dir / "trainer.json").read_text(encoding="utf-8"))
    except (OSError, ValueError) as exc:
        raise ScaletrainError(f"checkpoint {checkpoint_dir} has no readable trainer.json ({exc})") from None


def prepare_resume(
    target: str, overrides: list[str] | tuple[str, ...] = ()
) -> tuple[RunSpec, list[str]]:
    """The spec to launch again, and notes for the log (what was adjusted to fit)."""
    run_dir, checkpoint = find_run_dir(target)
    try:
        spec = RunSpec.read(run_dir / "spec.json")
    except (OSError, ValueError, TypeError) as exc:
        raise ScaletrainError(f"cannot read {run_dir / 'spec.json'}: {exc}") from None
    source = str(run_dir / "spec.json")
    config = parse_job(spec.job, overrides, source=source)
    notes = []
    if not any(item.split("=", 1)[0].strip() == "train.grad_accum" for item in overrides):
        config, notes = keep_global_batch(parse_job(spec.job, source=source), config)
    spec.job = config.model_dump(mode="json")
    if any(item.split("=", 1)[0].strip().startswith("checkpoint.dir") for item in overrides):
        spec.checkpoints = None  # moved on purpose: resolved again from here
    storage = open_storage(spec.checkpoints or checkpoint_location(config, spec.run_id, spec.run_dir))
    if checkpoint is not None:
        try:
            manifest = storage.read_manifest(checkpoint)
            manifest.check_dir(storage.local_copy(checkpoint, manifest, run_dir / "checkpoint-cache"))
        except ManifestError as exc:
            raise ScaletrainError(f"checkpoint {checkpoint} failed verification: {exc}") from None
        for name in storage.names():
            if (step_of(name) or 0) > manifest.step:
                storage.set_aside(name)
    return spec, notes


def keep_global_batch(trained: JobConfig, resumed: JobConfig) -> tuple[JobConfig, list[str]]:
    """A run resumed at another size (workers, per-worker batch) keeps its global batch, so it
    reads the same batches and computes the same numbers: ``train.grad_accum`` makes up the
    difference. Refused, with what would fit, when no whole number of micro-steps does."""
    target, now = global_batch(trained), global_batch(resumed)
    if target == now:
        return resumed, []
    per_pass = resumed.data.batch_size * resumed.scale.workers
    if target % per_pass:
        fits = [w for w in range(1, target // resumed.data.batch_size + 1)
                if target % (resumed.data.batch_size * w) == 0]
        raise ConfigError(
            f"this run trains with a global batch of {target} samples; data.batch_size "
            f"{resumed.data.batch_size} x scale.workers {resumed.scale.workers} cannot make it up "
            f"with whole accumulation steps: with data.batch_size {resumed.data.batch_size} use "
            f"scale.workers in {fits}, or another data.batch_size that divides {target}"
            if fits else
            f"this run trains with a global batch of {target} samples; data.batch_size "
            f"{resumed.data.batch_size} does not divide it: use one that does"
        )
    accum = target // per_pass
    train = resumed.train.model_copy(update={"grad_accum": accum})
    note = (
        f"resumed on {resumed.scale.workers} worker(s) x data.batch_size {resumed.data.batch_size}: "
        f"train.grad_accum {resumed.train.grad_accum} -> {accum} keeps the global batch of "
        f"{target} samples"
    )
    return resumed.model_copy(update={"train": train}), [note]
