"""Save and restore training state through torch.distributed.checkpoint (DCP).

A checkpoint holds the model and optimizer (DCP: each rank writes its shards, so one written by N
workers loads on M), plus ``trainer.json`` (step, epoch, samples, LR schedule, run ids, config
hash). Every rank hashes the files it wrote; rank 0 writes the manifest last (storage.py). Loading
verifies every hash before DCP reads a byte, and falls back to the previous checkpoint with one
warning when the newest is damaged.
"""

from __future__ import annotations

import json
import logging
import queue
import re
import shutil
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from scaletrain.checkpoint.manifest import FileEntry, Manifest, ManifestError, hash_files
from scaletrain.checkpoint.retention import RetentionPolicy, to_delete
from scaletrain.checkpoint.storage import (
    CheckpointStorage,
    checkpoint_name,
    is_remote,
    open_storage,
    step_of,
)
from scaletrain.distributed import collectives
from scaletrain.errors import ScaletrainError

__all__ = ["CheckpointManager", "Restored", "TRAINER_STATE_FILE", "CheckpointError"]

TRAINER_STATE_FILE = "trainer.json"
log = logging.getLogger("scaletrain.checkpoint")


class CheckpointError(ScaletrainError):
    """A checkpoint cannot be used (message says why and what to do)."""


@dataclass
class Restored:
    name: str
    step: int
    trainer_state: dict[str, Any]


@dataclass
class _Pending:
    """An async save in flight on this rank."""

    name: str
    step: int
    staging: Path
    metrics: dict[str, float]
    done: threading.Event
    entries: dict[str, FileEntry] | None = None
    error: BaseException | None = None


class CheckpointManager:
    def __init__(
        self,
        location: str,
        *,
        rank: int,
        world_size: int,
        strategy: str,
        scratch_dir: Path,
        identity: dict[str, Any],
        policy: RetentionPolicy,
        async_save: bool = False,
        fault_hook: Any = None,
        local_rank: int | None = None,
        before_commit: Any = None,
    ):
        self.storage: CheckpointStorage = open_storage(location)
        self.rank, self.world_size, self.strategy = rank, world_size, strategy
        # The first worker of each machine fetches a checkpoint into that machine's cache.
        self.local_rank = rank if local_rank is None else local_rank
        self.scratch_dir = Path(scratch_dir)
        # run_id, mlflow_run_id (a value, or a callable giving it when a checkpoint is written),
        # config_hash, global_batch, versions
        self.identity = identity
        self.policy = policy
        self.async_save = async_save
        self.fault_hook = fault_hook
        self.before_commit = before_commit  # rank 0: called before a checkpoint becomes one
        # Checkpoint collectives get their own gloo group: an async save's background thread
        # must never interleave with the training collectives on the default group.
        self.group = collectives.new_gloo_group()
        self._pending: _Pending | None = None
        self._stager: Any = None
        self._jobs: queue.Queue | None = None  # async saves for the writer thread
        self._retention: threading.Thread | None = None
        self.last_saved_step: int | None = None

    # ------------------------------------------------------------------ save

    def save(self, step: int, model: torch.nn.Module, optimizer: torch.optim.Optimizer,
             trainer_state: dict[str, Any], metrics: dict[str, float]) -> None:
        """Write a checkpoint of ``step``. Synchronous unless async_save; every rank calls it."""
        self.wait_pending()
        name = checkpoint_name(step)
        staging = self.storage.staging_dir(name, self.scratch_dir)
        if self.rank == 0:
            if self._retention is not None:  # a delete in flight looks like an unfinished save
                self._retention.join()
            for removed in self.storage.sweep_incomplete():
                log.info("removed an unfinished checkpoint save: %s", removed)
            shutil.rmtree(staging, ignore_errors=True)
            staging.mkdir(parents=True)
            identity = {key: _value(value) for key, value in self.identity.items()}
            state = {**trainer_state, **identity, "step": step, "world_size": self.world_size}
            (staging / TRAINER_STATE_FILE).write_text(json.dumps(state, indent=2), encoding="utf-8")
        self._barrier()
        from scaletrain.checkpoint import dcp_io

        state = dcp_io.state_of(model, optimizer)
        if not self.async_save:
            written = dcp_io.save(state, str(staging), self.group)
            self._crash_point(step)
            entries = self._own_files_hashed(staging, written)
            self.storage.publish(name, staging, list(entries))
            self._commit(name, step, staging, metrics, entries)
            return
        if self._stager is None:
            self._stager = dcp_io.Stager()
            self._jobs = queue.Queue()
            # A daemon: a save stuck in a collective (another rank died) must not hold up exit.
            # The thread works on this rank's GPU (a new thread starts on cuda:0, where DCP's
            # writer would otherwise open a context for every rank).
            device = torch.cuda.current_device() if torch.cuda.is_initialized() else None
            threading.Thread(target=self._write_saves, args=(self._jobs, device), daemon=True,
                             name="scaletrain-ckpt").start()
        pending = _Pending(name, step, staging, metrics, threading.Event())
        assert self._jobs is not None
        self._jobs.put((pending, self._stager.stage(state)))  # the copy is the only stall
        self._pending = pending

    def _write_saves(self, jobs: queue.Queue, device: int | None) -> None:
        """The writer thread: one async save at a time, until close()."""
        if device is not None:
            torch.cuda.set_device(device)
        while (job := jobs.get()) is not None:
            self._write_in_background(*job)

    def _write_in_background(self, pending: _Pending, staged: dict[str, Any]) -> None:
        from scaletrain.checkpoint import dcp_io

        try:
            written = dcp_io.save(staged, str(pending.staging), self.group)
            self._crash_point(pending.step)
            pending.entries = self._own_files_hashed(pending.staging, written)
            self.storage.publish(pending.name, pending.staging, list(pending.entries))
        except BaseException as exc:  # reported by the main thread at the commit
            pending.error = exc
        finally:
            pending.done.set()

    @property
    def pending_ready(self) -> bool:
        """True when no async save is in flight on this rank, or when it finished writing."""
        return self._pending is None or self._pending.done.is_set()

    @property
    def has_pending(self) -> bool:
        return self._pending is not None

    def wait_pending(self) -> None:
        """Finish (and commit) an async save in flight; every rank calls it at the same point."""
        pending, self._pending = self._pending, None
        if pending is None:
            return
        pending.done.wait()
        failed = collectives.all_reduce(torch.tensor([1.0 if pending.error else 0.0]), "max", self.group)
        if pending.error is not None:
            raise CheckpointError(
                f"saving checkpoint {pending.name} failed: {type(pending.error).__name__}: {pending.error}"
            ) from pending.error
        if failed.item():
            raise CheckpointError(f"saving checkpoint {pending.name} failed on another rank")
        self._commit(pending.name, pending.step, pending.staging, pending.metrics, pending.entries or {})

    def _own_files_hashed(self, staging: Path, written: dict[str, tuple[int, str]]) -> dict[str, FileEntry]:
        """The files this rank wrote (DCP names them ``__<rank>_<n>.distcp``), with the hashes
        taken while DCP wrote them; a file whose size on disk differs from what went through
        the hash (or that DCP did not write through it) is hashed from disk."""
        own = re.compile(rf"^__{self.rank}_\d+\.distcp$")
        names = [p.name for p in staging.iterdir() if own.match(p.name)]
        if self.rank == 0:
            names += [".metadata", TRAINER_STATE_FILE]
        entries: dict[str, FileEntry] = {}
        for name in sorted(names):
            size, digest = written.get(name, (-1, ""))
            if size == (staging / name).stat().st_size:
                entries[name] = FileEntry(size, digest)
            else:
                entries.update(hash_files(staging, [name]))
        return entries

    def _commit(self, name: str, step: int, staging: Path, metrics: dict[str, float],
                entries: dict[str, FileEntry]) -> None:
        gathered = collectives.all_gather_object(entries, self.group)
        self.last_saved_step = step
        if self.rank != 0:
            return
        files: dict[str, FileEntry] = {}
        for part in gathered:
            files.update(part)
        if self.before_commit is not None:
            self.before_commit()
        manifest = Manifest(
            step=step,
            world_size=self.world_size,
            strategy=self.strategy,
            files=files,
            metrics={k: float(v) for k, v in metrics.items()},
            run_id=self.identity.get("run_id", ""),
            mlflow_run_id=_value(self.identity.get("mlflow_run_id")),
            config_hash=self.identity.get("config_hash", ""),
            created_at=time.time(),
            versions=self.identity.get("versions", {}),
        )
        self.storage.commit(name, staging, manifest)
        log.info("checkpoint saved", extra={"checkpoint": self.storage.describe(name),
                                            "bytes": manifest.total_bytes})
        self._apply_retention()

    def _apply_retention(self) -> None:
        """Off the training thread: deleting old checkpoints can take a while on object storage."""
        if self._retention is not None:
            self._retention.join()
        self._retention = threading.Thread(target=self._retain, daemon=True, name="scaletrain-retain")
        self._retention.start()

    def _retain(self) -> None:
        try:
            committed = self.committed_manifests()
            for name in to_delete(committed, self.policy):
                try:
                    self.storage.delete(name)
                    log.info("deleted checkpoint %s (retention)", name)
                except Exception as exc:  # never stops training
                    log.warning("could not delete checkpoint %s: %s: %s", name, type(exc).__name__, exc)
        except Exception as exc:
            log.warning("checkpoint retention failed: %s: %s", type(exc).__name__, exc)

    def close(self) -> None:
        """Finish what is in flight (every rank calls it), then release the stager."""
        self.wait_pending()
        if self._retention is not None:
            self._retention.join()
        if self._jobs is not None:
            self._jobs.put(None)
            self._jobs = None
        if self._stager is not None:
            self._stager.close()
            self._stager = None

    # ------------------------------------------------------------------ load

    def committed_manifests(self) -> dict[str, Manifest]:
        """Checkpoints with a readable manifest, by name, oldest first (files not yet checked)."""
        found: dict[str, Manifest] = {}
        for name in self.storage.names():
            try:
                manifest = self.storage.read_manifest(name)
            except ManifestError:
                continue
            found[name] = manifest
        return found

    def restore_latest(self, model: torch.nn.Module, optimizer: torch.optim.Optimizer,
                       only: str | None = None) -> Restored | None:
        """Load the newest checkpoint that verifies (every rank calls it); None when there is none.

        Rank 0 picks and verifies; the chosen name is broadcast; on object storage the first
        worker of every other machine downloads and verifies it into that machine's cache (no
        machine reads another's disk); then every rank loads its part through DCP.
        """
        choice = self._pick_verified(only) if self.rank == 0 else None
        choice = collectives.broadcast_object(choice, 0, self.group)
        if choice is None:
            return None
        name, local_dir = choice
        if isinstance(local_dir, str) and local_dir.startswith("error:"):
            raise CheckpointError(local_dir[len("error:"):])
        local_dir = self._on_this_machine(name, local_dir)
        from scaletrain.checkpoint import dcp_io

        dcp_io.load(model, optimizer, local_dir, self.group)
        trainer_state = json.loads(Path(local_dir, TRAINER_STATE_FILE).read_text(encoding="utf-8"))
        self.last_saved_step = step_of(name)
        return Restored(name, int(trainer_state["step"]), trainer_state)

    def _on_this_machine(self, name: str, rank0_dir: str) -> str:
        """Where this rank reads checkpoint ``name``: the storage's folder itself (a shared
        path), or this machine's verified copy of it (object storage)."""
        if not is_remote(self.storage.location):
            return rank0_dir
        cache = self.scratch_dir / "checkpoint-cache"
        error = ""
        if self.local_rank == 0 and self.rank != 0:
            try:
                manifest = self.storage.read_manifest(name)
                manifest.check_dir(self.storage.local_copy(name, manifest, cache))
            except (ManifestError, OSError) as exc:
                error = f"checkpoint {self.storage.describe(name)} failed verification on this machine: {exc}"
        errors = collectives.all_gather_object(error, self.group)
        if any(errors):  # every rank stops, none waits for a peer that gave up
            raise CheckpointError(next(e for e in errors if e))
        return str(cache / name)

    def _pick_verified(self, only: str | None) -> tuple[str, str] | None:
        manifests = self.committed_manifests()
        names = [only] if only else list(reversed(manifests))
        if only and only not in manifests:
            return (only, f"error:checkpoint {self.storage.describe(only)} has no valid manifest")
        for name in names:
            manifest = manifests[name]
            try:
                local = self.storage.local_copy(name, manifest, self.scratch_dir / "checkpoint-cache")
                manifest.check_dir(local)
            except (ManifestError, OSError) as exc:
                log.warning(
                    "checkpoint %s failed verification (%s); %s",
                    self.storage.describe(name), exc,
                    "cannot resume from it" if only else "using the previous one",
                )
                if only:
                    return (name, f"error:checkpoint {self.storage.describe(name)} failed verification: {exc}")
                continue
            log.info("resuming from checkpoint %s", self.storage.describe(name))
            return (name, str(local))
        return None

    def _crash_point(self, step: int) -> None:
        if self.fault_hook is not None:
            self.fault_hook(step)

    def _barrier(self) -> None:
        collectives.barrier(self.group)


def _value(item: Any) -> Any:
    return item() if callable(item) else item
