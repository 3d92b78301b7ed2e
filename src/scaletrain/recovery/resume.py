"""`scaletrain resume`: find the run to continue and prepare its spec for another launch.

A run is continued in place: the same run directory, run id (so the same checkpoint location),
MLflow run and metric journal. Resuming from one named checkpoint sets the run's newer
checkpoints aside (renamed, never deleted), so every restart of the new attempt resumes from
the chosen timeline.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

from scaletrain.checkpoint.location import checkpoint_location, global_batch
from scaletrain.checkpoint.manifest import MANIFEST_FILE, ManifestError
from scaletrain.checkpoint.storage import CheckpointStorage, open_storage, step_of
from scaletrain.config import parse_job
from scaletrain.config.schema import JobConfig
from scaletrain.errors import ConfigError, ScaletrainError
from scaletrain.rundir import (
    CHECKPOINT_CACHE_DIR,
    LOGS_DIR,
    SPEC_FILE,
    SUMMARY_FILE,
    RunLock,
    RunSpec,
    check_run_ref,
    worker_log_name,
)

__all__ = ["prepare_resume", "find_run_dir", "keep_global_batch", "RunFinished"]


class RunFinished(Exception):
    """Not an error: the run trained every step its job asks for; resuming it changes nothing."""

    def __init__(self, summary: dict, length_key: str):
        super().__init__(summary.get("run_id"))
        self.summary = summary
        self.note = (
            f"run {summary.get('run_id')} finished at step {summary.get('steps')}: nothing to resume "
            f"(to train it longer, pass --set {length_key}=N)"
        )


def find_run_dir(target: str, runs_root: str | Path = "runs") -> tuple[Path, Path | None]:
    """The run directory for ``target`` and, when it names one checkpoint folder, that folder."""
    path = Path(target).expanduser()
    if (path / SPEC_FILE).is_file():
        return path.resolve(), None
    if (path / MANIFEST_FILE).is_file():
        state = _trainer_state(path)
        run_dir = Path(state.get("run_dir", ""))
        if not (run_dir / SPEC_FILE).is_file():
            raise ScaletrainError(
                f"checkpoint {path} belongs to run directory {run_dir or '?'}, which is not here; "
                "resume needs that run directory (its spec.json)"
            )
        return run_dir.resolve(), path.resolve()
    if not path.exists() and "/" not in target:
        check_run_ref(target)  # a run id or the start of one, never a glob pattern
        matches = sorted(Path(runs_root).glob(f"*/{target}/spec.json")) or sorted(
            Path(runs_root).glob(f"*/{target}*/spec.json"))
        if len(matches) == 1:
            return matches[0].parent.resolve(), None
        if len(matches) > 1:
            names = ", ".join(str(m.parent) for m in matches[:5])
            more = f" and {len(matches) - 5} more" if len(matches) > 5 else ""
            raise ConfigError(f"run id {target!r} matches {len(matches)} runs ({names}{more}); "
                              "pass the run directory, or more of the id")
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
) -> tuple[RunSpec, list[str], RunLock]:
    """The spec to launch again, notes for the log (what was adjusted to fit), and the run
    directory's lock, held: nothing is changed before it is taken; the caller releases it
    when the launch is over."""
    run_dir, folder = find_run_dir(target)
    try:
        spec = RunSpec.read(run_dir / SPEC_FILE)
    except (OSError, ValueError, TypeError) as exc:
        raise ScaletrainError(f"cannot read {run_dir / 'spec.json'}: {exc}") from None
    if folder is None:
        _refuse_if_finished(spec, run_dir, overrides)
    notes = _continue_here(spec, run_dir)
    lock = RunLock(run_dir, spec.run_id, spec.node_rank).acquire()
    try:
        notes += _prepare(spec, run_dir, folder, overrides)
    except BaseException:
        lock.release()
        raise
    return spec, notes, lock


def _refuse_if_finished(spec: RunSpec, run_dir: Path, overrides: list[str] | tuple[str, ...]) -> None:
    """A finished run is left as it is (no worker, no lock, no MLflow attempt) unless the
    overrides make it longer, or its checkpoints end before its last step (newer ones set
    aside: that timeline is trained again). Raises RunFinished with its summary."""
    try:
        summary = json.loads((run_dir / SUMMARY_FILE).read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return
    if not isinstance(summary, dict) or summary.get("status") != "finished" or summary.get("run_id") != spec.run_id:
        return
    source = str(run_dir / SPEC_FILE)
    recorded, asked = parse_job(spec.job, source=source), parse_job(spec.job, overrides, source=source)
    if any(getattr(recorded.train, key) != getattr(asked.train, key) for key in ("max_steps", "epochs")):
        return
    if recorded.checkpoint.enabled and isinstance(summary.get("steps"), int):
        location = spec.checkpoints or checkpoint_location(recorded, spec.run_id, spec.run_dir)
        try:
            steps = [step_of(name) or 0 for name in open_storage(location).names()]
        except Exception:  # unreadable here: resume itself says why
            return
        if steps and max(steps) < summary["steps"]:
            return
    raise RunFinished(summary, "train.epochs" if recorded.train.epochs is not None else "train.max_steps")


def _prepare(spec: RunSpec, run_dir: Path, folder: Path | None,
             overrides: list[str] | tuple[str, ...]) -> list[str]:
    source = str(run_dir / SPEC_FILE)
    config = parse_job(spec.job, overrides, source=source)
    notes: list[str] = []
    if not any(item.split("=", 1)[0].strip() == "train.grad_accum" for item in overrides):
        config, notes = keep_global_batch(parse_job(spec.job, source=source), config)
    spec.job = config.model_dump(mode="json")
    if any(item.split("=", 1)[0].strip().startswith("checkpoint.dir") for item in overrides):
        spec.checkpoints = None  # moved on purpose: resolved again from here
    if not config.checkpoint.enabled:
        return notes
    storage = open_storage(spec.checkpoints or checkpoint_location(config, spec.run_id, spec.run_dir))
    if folder is None:
        _check_found(storage, run_dir, spec.run_id)
        return notes
    checkpoint = _in_location(storage, folder, spec.run_id)
    try:
        manifest = storage.read_manifest(checkpoint)
        manifest.check_dir(storage.local_copy(checkpoint, manifest, run_dir / CHECKPOINT_CACHE_DIR))
    except ManifestError as exc:
        raise ScaletrainError(f"checkpoint {checkpoint} failed verification: {exc}") from None
    for name in storage.names():
        if (step_of(name) or 0) > manifest.step:
            storage.set_aside(name)
    return notes


def _continue_here(spec: RunSpec, run_dir: Path) -> list[str]:
    """The directory named is the run directory, whatever spec.json says: a moved run continues
    where it is now (with its own checkpoints, if they live in it); a copy of a run whose
    original is still there is refused (two directories would continue one run: its MLflow
    run, its run id, a checkpoint location outside both)."""
    recorded = Path(spec.run_dir)
    if recorded == run_dir or (recorded.exists() and _same(recorded, run_dir)):
        return []
    if (recorded / SPEC_FILE).exists():
        raise ConfigError(
            f"{run_dir} is a copy of run directory {recorded}, which is still there: resume that "
            "one (a copy would continue the same run in two places)"
        )
    inside = spec.checkpoints and not _remote(spec.checkpoints) and _under(spec.checkpoints, recorded)
    if inside:
        spec.checkpoints = str(run_dir / Path(spec.checkpoints).relative_to(recorded))  # type: ignore[arg-type]  # inside implies checkpoints is set
    spec.run_dir = str(run_dir)
    return [f"run directory moved from {recorded}: continuing in {run_dir}"]


def _in_location(storage: CheckpointStorage, folder: Path, run_id: str) -> str:
    """The name of the checkpoint folder the user passed, in the run's own checkpoint location
    (what resume loads and sets newer ones aside in); a copy elsewhere is refused, since it
    is not what would be loaded."""
    own = Path(storage.location) / folder.name
    if _remote(storage.location) or not own.exists() or not _same(own, folder):
        raise ConfigError(
            f"checkpoint {folder} is not one of run {run_id}'s checkpoints (they are in "
            f"{storage.location}): name a folder there, or copy this one into it"
        )
    return folder.name


def _check_found(storage: CheckpointStorage, run_dir: Path, run_id: str) -> None:
    """A run that saved checkpoints resumes from one, or not at all: never from step 0 over its
    own record (a checkpoint location moved, unmounted, or resolved from elsewhere)."""
    try:
        if storage.names():
            return
    except Exception as exc:  # the store's own error (network, permission): say which
        raise ScaletrainError(f"cannot list the checkpoints in {storage.location}: "
                              f"{type(exc).__name__}: {exc}") from None
    saved = _saved_step(run_dir)
    if saved is not None:
        raise ScaletrainError(
            f"run {run_id} saved checkpoints (the newest at step {saved}) but none are in "
            f"{storage.location}: put them back there, or pass --set checkpoint.dir=WHERE they "
            "are; to train from step 0, start a new run with `scaletrain run`"
        )


def _saved_step(run_dir: Path) -> int | None:
    """The newest step this run's record says was checkpointed: an attempt's summary, or rank
    0's log (which an attempt that failed also leaves)."""
    steps = []
    try:
        summary = json.loads((run_dir / SUMMARY_FILE).read_text(encoding="utf-8"))
        steps.append(summary.get("checkpoint_step"))
    except (OSError, ValueError, AttributeError):
        pass
    try:
        with open(run_dir / LOGS_DIR / worker_log_name(0), encoding="utf-8") as log:
            for line in log:
                if '"checkpoint saved"' in line:
                    steps.append(step_of(str(json.loads(line).get("checkpoint", "")).rsplit("/", 1)[-1]))
    except (OSError, ValueError):
        pass
    found = [step for step in steps if isinstance(step, int)]
    return max(found) if found else None


def _remote(location: str) -> bool:
    return "://" in location and not location.startswith("file://")


def _under(path: str, folder: Path) -> bool:
    return Path(path) == folder or folder in Path(path).parents


def _same(a: Path, b: Path) -> bool:
    try:
        return os.path.samefile(a, b)
    except OSError:
        return False


def keep_global_batch(trained: JobConfig, resumed: JobConfig) -> tuple[JobConfig, list[str]]:
    """A run resumed at another size (workers, per-worker batch) keeps its global batch, so it
    reads the same batches and computes the same numbers: ``train.grad_accum`` makes up the
    difference. Refused, with what would fit, when no whole number of micro-steps does. A
    loop job's batches are the loop's own business."""
    if trained.task is None or resumed.task is None:
        return resumed, []
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
