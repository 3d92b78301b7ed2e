"""`scaletrain checkpoints ls|verify PATH`: what is there, and can it be trusted."""

from __future__ import annotations

import tempfile
from pathlib import Path
from typing import Any

from scaletrain.checkpoint.manifest import (
    KEY_ENV,
    METADATA_FILE,
    STATE_FILE,
    CheckpointRefused,
    ManifestError,
)
from scaletrain.checkpoint.storage import CheckpointStorage, is_remote, open_storage, step_of
from scaletrain.errors import ConfigError
from scaletrain.rundir import SPEC_FILE

__all__ = ["describe_checkpoints"]


def _resolve(path: str) -> tuple[CheckpointStorage, list[str] | None]:
    """The storage holding the checkpoints at ``path`` (a run directory, a checkpoint location
    or one checkpoint), and the names to show (None: all)."""
    if not is_remote(path):
        local = Path(path).expanduser()
        if (local / SPEC_FILE).is_file():  # a run directory
            from scaletrain.checkpoint.location import checkpoint_location
            from scaletrain.config.schema import JobConfig
            from scaletrain.rundir import RunSpec

            spec = RunSpec.read(local / SPEC_FILE)
            job = JobConfig.model_validate(spec.job)
            return open_storage(spec.checkpoints or checkpoint_location(job, spec.run_id, spec.run_dir)), None
        if not local.exists():
            raise ConfigError(f"'{path}' does not exist; pass a run directory or a checkpoint folder")
    stripped = path.rstrip("/")
    name = stripped.rsplit("/", 1)[-1]
    if step_of(name) is not None:
        return open_storage(stripped.rsplit("/", 1)[0]), [name]
    return open_storage(stripped), None


def describe_checkpoints(path: str, verify: bool) -> list[dict[str, Any]]:
    """One row per checkpoint, oldest first: name, step, bytes, metrics, status, why.

    Without ``verify`` a checkpoint with a readable manifest is "committed"; with it every file
    is hashed and DCP's index read as data ("verified" or "corrupt"). A manifest or index that
    scaletrain never writes, or a failed HMAC, is "refused", and nothing of it is fetched."""
    storage, only = _resolve(path)
    names = only or storage.names()
    rows = []
    with tempfile.TemporaryDirectory(prefix="scaletrain-verify-") as cache:
        for name in names:
            row: dict[str, Any] = {"name": name, "step": step_of(name), "location": storage.describe(name)}
            try:
                manifest = storage.read_manifest(name)
            except CheckpointRefused as exc:
                rows.append({**row, "status": "refused", "why": str(exc)})
                continue
            except ManifestError as exc:
                rows.append({**row, "status": "incomplete", "why": str(exc)})
                continue
            row.update(
                bytes=manifest.total_bytes,
                world_size=manifest.world_size,
                strategy=manifest.strategy,
                metrics=manifest.metrics,
                created_at=manifest.created_at,
                run_id=manifest.run_id,
            )
            if not verify:
                rows.append({**row, "status": "committed", "why": ""})
                continue
            try:
                local = storage.local_copy(name, manifest, Path(cache))
                manifest.check_dir(local)
                if METADATA_FILE in manifest.files or STATE_FILE in manifest.files:  # (TF's is TF's to read)
                    from scaletrain.checkpoint.state import DcpState

                    DcpState().check_index(Path(local), manifest)
            except CheckpointRefused as exc:
                rows.append({**row, "status": "refused", "why": str(exc)})
            except (ManifestError, OSError) as exc:
                rows.append({**row, "status": "corrupt", "why": str(exc)})
            else:
                unchecked = f"carries an HMAC, not checked: {KEY_ENV} is not set"
                rows.append({**row, "status": "verified",
                             "why": unchecked if manifest.signed_but_unchecked else ""})
    return rows
