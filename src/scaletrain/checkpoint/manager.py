"""Save and restore training state: through torch.distributed.checkpoint (DCP), or TF's own
checkpoint for a TensorFlow job (the TrainingState writes its files: checkpoint/state.py).

A checkpoint holds the training state (the model and optimizer, or a loop's objects; DCP: each
rank writes its shards, so one written by N workers loads on M), plus ``trainer.json`` (step, epoch, samples, LR schedule, run ids, config
hash). Every rank hashes the files it wrote; rank 0 writes the manifest last (storage.py). Loading
verifies every hash before DCP reads a byte, and falls back to the previous checkpoint with one
warning when the newest is damaged; a checkpoint that holds what scaletrain never writes (or
fails its HMAC) is refused outright.

A save that fails (storage full, unwritable, unreachable) fails on every rank alike and costs a
warning, never the run: training goes on, the next save tries again, and the final weights are
still written. (Restarting would only redo the steps since the last checkpoint, from step 0
when there is none, and meet the same storage.)
"""

from __future__ import annotations

import json
import logging
import queue
import shutil
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from scaletrain.checkpoint import single_file
from scaletrain.checkpoint.manifest import (
    KEY_ENV,
    TRAINER_STATE_FILE,
    CheckpointRefused,
    FileEntry,
    Manifest,
    ManifestError,
    file_path,
    hash_files,
)
from scaletrain.checkpoint.retention import RetentionPolicy, to_delete
from scaletrain.checkpoint.state import DcpState, TrainingState, Written
from scaletrain.checkpoint.storage import (
    CheckpointStorage,
    checkpoint_name,
    is_remote,
    open_storage,
    step_of,
)
from scaletrain.distributed import collectives
from scaletrain.errors import ScaletrainError
from scaletrain.observe.telemetry import current as telemetry
from scaletrain.rundir import CHECKPOINT_CACHE_DIR

__all__ = ["CheckpointManager", "Restored", "TRAINER_STATE_FILE", "CheckpointError", "REPLICATED_STRATEGIES"]

REPLICATED_STRATEGIES = ("single", "ddp")  # every rank holds the whole state

log = logging.getLogger("scaletrain.checkpoint")


class CheckpointError(ScaletrainError):
    """A checkpoint cannot be used (message says why and what to do)."""

    code = "ST-CHECKPOINT"


@dataclass
class Restored:
    name: str
    step: int
    trainer_state: dict[str, Any]


@dataclass
class _Choice:
    """Rank 0's pick, sent to every rank: the checkpoint, where rank 0 verified it, its
    manifest (every machine checks its own copy against this one), or why none is usable."""

    name: str
    local_dir: str = ""
    manifest: Manifest | None = None
    error: str = ""


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
    single: bool = False  # the state as one file (single_file.py)


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
        single_file: bool = True,
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
        # A state every rank holds whole goes in one file from rank 0 (single_file.py: any size
        # with one process, a small one with several);
        # checkpoint.format: dcp turns it off.
        self.single_file = single_file and strategy in REPLICATED_STRATEGIES
        # Checkpoint collectives get their own gloo group: an async save's background thread
        # must never interleave with the training collectives on the default group.
        self.group = collectives.new_gloo_group()
        self._pending: _Pending | None = None
        self._stager: Any = None
        self._jobs: queue.Queue | None = None  # async saves for the writer thread
        self._retention: threading.Thread | None = None
        self.last_saved_step: int | None = None

    # ------------------------------------------------------------------ save

    def save(self, step: int, training_state: TrainingState, trainer_state: dict[str, Any],
             metrics: dict[str, float]) -> None:
        """Write a checkpoint of ``step``: ``training_state`` through DCP, ``trainer_state`` as
        trainer.json. Synchronous unless async_save; every rank calls it. A failure anywhere is
        a warning on every rank (see the module's docstring)."""
        started = time.perf_counter()
        try:
            self._save(step, training_state, trainer_state, metrics)
        finally:
            if self.rank == 0:  # the training thread's stall for this save
                telemetry().observe("checkpoint_save_seconds", time.perf_counter() - started)

    def _save(self, step: int, training_state: TrainingState, trainer_state: dict[str, Any],
              metrics: dict[str, float]) -> None:
        self.wait_pending()
        name = checkpoint_name(step)
        staging = self.storage.staging_dir(name, self.scratch_dir)
        error = None
        if self.rank == 0:
            try:
                self._prepare(step, staging, trainer_state)
            except Exception as exc:
                error = exc
        state = training_state.whole_state() if self.single_file and isinstance(training_state, DcpState) else None
        limit = single_file.SMALL_STATE_BYTES if self.world_size > 1 else None  # one writer either way
        ready, single = self._all_ready(name, error, state is not None and single_file.fits(state, limit))
        if not ready:  # the barrier before the state is written
            return
        if not (self.async_save and training_state.supports_async):
            try:
                if single and state is not None:  # rank 0 writes the whole state; the others wait at the commit
                    written = single_file.save(state, staging) if self.rank == 0 else {}
                    own = list(written)
                else:
                    written = training_state.write(staging, self.group)
                    own = training_state.own_files(staging, self.rank)
                self._crash_point(step)
                entries: dict[str, FileEntry] | str = self._own_files_hashed(staging, own, written)
                self.storage.publish(name, staging, list(entries))
            except Exception as exc:
                entries = _failure(exc)
            self._commit(name, step, staging, metrics, entries)
            return
        assert isinstance(training_state, DcpState)  # noqa: S101  the only format staged in memory
        pending = _Pending(name, step, staging, metrics, threading.Event(), single=single)
        if single and self.rank != 0:  # nothing to write on this rank
            pending.entries = {}
            pending.done.set()
        else:
            try:
                staged = self._stage(state if state is not None else training_state.dcp_state())
            except Exception as exc:  # agreed on, with the other ranks, at the commit
                pending.error = exc
                pending.done.set()
            else:
                assert self._jobs is not None  # noqa: S101  an invariant: set when async saves start
                self._jobs.put((pending, staged))
        self._pending = pending
        telemetry().set("checkpoint_writes_pending", 1)

    def _prepare(self, step: int, staging: Path, trainer_state: dict[str, Any]) -> None:
        """Rank 0: clear what earlier saves left, and write the trainer's state."""
        if self._retention is not None:  # a delete in flight looks like an unfinished save
            self._retention.join()
        for removed in self.storage.sweep_incomplete():
            log.info("removed an unfinished checkpoint save: %s", removed)
        shutil.rmtree(staging, ignore_errors=True)
        staging.mkdir(parents=True)
        identity = {key: _value(value) for key, value in self.identity.items()}
        state = {**trainer_state, **identity, "step": step, "world_size": self.world_size}
        (staging / TRAINER_STATE_FILE).write_text(json.dumps(state, indent=2), encoding="utf-8")

    def _all_ready(self, name: str, error: BaseException | None, single: bool) -> tuple[bool, bool]:
        """Every rank learns whether any failed, and whether all can write the state as one file
        (one all-reduce: the cost of a barrier)."""
        flags = collectives.all_reduce(torch.tensor([float(error is not None), float(not single)]), "max",
                                       self.group).tolist()
        if flags[0]:
            self._save_failed(name, _failure(error) if error is not None else "")
        return not flags[0], not flags[1]

    def _save_failed(self, name: str, why: str) -> None:
        """The warning for a save that failed: its reason on the rank it failed on, a pointer
        from rank 0 when that was another."""
        if self.rank == 0:
            telemetry().work("checkpoint_save", 1, errors=1)
        if why:
            log.warning("saving checkpoint %s failed: %s; the run goes on without it",
                        self.storage.describe(name), why)
        elif self.rank == 0:
            log.warning("saving checkpoint %s failed on another rank (its log says why); "
                        "the run goes on without it", self.storage.describe(name))

    def _stage(self, state: dict[str, Any]) -> dict[str, Any]:
        from scaletrain.checkpoint import dcp_io

        if self._stager is None:
            self._stager = dcp_io.Stager()
            self._jobs = queue.Queue()
            # A daemon: a save stuck in a collective (another rank died) must not hold up exit.
            # The thread works on this rank's GPU (a new thread starts on cuda:0, where DCP's
            # writer would otherwise open a context for every rank).
            device = torch.cuda.current_device() if torch.cuda.is_initialized() else None
            threading.Thread(target=self._write_saves, args=(self._jobs, device), daemon=True,
                             name="scaletrain-ckpt").start()
        return self._stager.stage(state)  # the copy is the only stall

    def _write_saves(self, jobs: queue.Queue, device: int | None) -> None:
        """The writer thread: one async save at a time, until close()."""
        if device is not None:
            torch.cuda.set_device(device)
        while (job := jobs.get()) is not None:
            self._write_in_background(*job)

    def _write_in_background(self, pending: _Pending, staged: dict[str, Any]) -> None:
        from scaletrain.checkpoint import dcp_io

        try:
            if pending.single:  # rank 0 (the others have nothing to write)
                written = single_file.save(staged, pending.staging)
                own = list(written)
            else:
                written = dcp_io.save(staged, str(pending.staging), self.group)
                own = DcpState().own_files(pending.staging, self.rank)
            self._crash_point(pending.step)
            pending.entries = self._own_files_hashed(pending.staging, own, written)
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
        telemetry().set("checkpoint_writes_pending", 0)
        entries = _failure(pending.error) if pending.error is not None else pending.entries or {}
        self._commit(pending.name, pending.step, pending.staging, pending.metrics, entries)

    def _own_files_hashed(self, staging: Path, names: list[str], written: Written) -> dict[str, FileEntry]:
        """The files this rank wrote (rank 0: also trainer.json), with the hashes taken while
        they were written; a file whose size on disk differs from what went through the hash
        (or that was not written through it) is hashed from disk."""
        if self.rank == 0:
            names = [*names, TRAINER_STATE_FILE]
        entries: dict[str, FileEntry] = {}
        for name in sorted(names):
            size, digest = written.get(name, (-1, ""))
            if size == (staging / name).stat().st_size:
                entries[name] = FileEntry(size, digest)
            else:
                entries.update(hash_files(staging, [name]))
        return entries

    def _commit(self, name: str, step: int, staging: Path, metrics: dict[str, float],
                entries: dict[str, FileEntry] | str) -> None:
        """Every rank's files (or why it failed) to every rank; rank 0 writes the manifest."""
        gathered = collectives.all_gather_object(entries, self.group)
        if any(isinstance(part, str) for part in gathered):
            self._save_failed(name, entries if isinstance(entries, str) else "")
            return
        if self.rank != 0:
            self.last_saved_step = step
            return
        try:
            self._write_manifest(name, step, staging, metrics, gathered)
        except Exception as exc:  # only rank 0 writes it: the others have gone on already
            self._save_failed(name, _failure(exc))
            return
        self.last_saved_step = step
        figures = telemetry()
        figures.work("checkpoint_save", 1)
        figures.set("last_checkpoint_step", step)
        figures.set("last_checkpoint_timestamp_seconds", time.time())
        self._apply_retention()

    def _write_manifest(self, name: str, step: int, staging: Path, metrics: dict[str, float],
                        gathered: list[dict[str, FileEntry]]) -> None:
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
        self.storage.commit(name, staging, manifest.sign())
        # step: the one the checkpoint holds (an async save commits a few steps later)
        log.info("checkpoint saved", extra={"checkpoint": self.storage.describe(name), "step": step,
                                            "bytes": manifest.total_bytes, "async": self.async_save})

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

    def abandon(self, timeout_s: float = 30.0) -> None:
        """Training failed on this rank: let the background threads end without any collective
        (peers may be gone). An async save still writing is not committed; one stuck in a
        collective after ``timeout_s`` is left to die with the process (a daemon)."""
        pending, self._pending = self._pending, None
        if pending is not None:
            pending.done.wait(timeout_s)
        if self._retention is not None:
            self._retention.join(timeout_s)
        if self._jobs is not None:
            self._jobs.put(None)
            self._jobs = None

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

    def restore_latest(self, training_state: TrainingState) -> Restored | None:
        """Load the newest checkpoint that verifies (every rank calls it); None when there is none.

        Rank 0 picks and verifies (hashes, HMAC, DCP's index); the choice and its manifest are
        broadcast; on object storage the first worker of every other machine downloads and
        verifies it against that manifest into its machine's cache (no machine reads another's
        disk); then every rank loads its part through DCP.
        """
        started = time.perf_counter()
        restored = self._restore_latest(training_state)
        if restored is not None and self.rank == 0:
            telemetry().set("checkpoint_restore_seconds", time.perf_counter() - started)
            telemetry().set("last_checkpoint_step", restored.step)
        return restored

    def _restore_latest(self, training_state: TrainingState) -> Restored | None:
        choice = self._pick_verified(training_state) if self.rank == 0 else None
        choice = collectives.broadcast_object(choice, 0, self.group)
        if choice is None:
            return None
        if choice.error:
            raise CheckpointError(choice.error)
        local_dir = self._on_this_machine(choice)
        try:
            training_state.read(Path(local_dir), choice.manifest.files, self.group)
        except CheckpointRefused as exc:  # changed since rank 0 verified it
            raise CheckpointError(f"checkpoint {self.storage.describe(choice.name)} refused: {exc}") from None
        trainer_state = json.loads(file_path(local_dir, TRAINER_STATE_FILE).read_text(encoding="utf-8"))
        self.last_saved_step = step_of(choice.name)
        return Restored(choice.name, int(trainer_state["step"]), trainer_state)

    def _on_this_machine(self, choice: _Choice) -> str:
        """Where this rank reads the chosen checkpoint: the storage's folder itself (a shared
        path), or this machine's verified copy of it (object storage)."""
        if not is_remote(self.storage.location):
            return choice.local_dir
        cache = self.scratch_dir / CHECKPOINT_CACHE_DIR
        error = ""
        if self.local_rank == 0 and self.rank != 0:
            try:
                choice.manifest.check_dir(self.storage.local_copy(choice.name, choice.manifest, cache))  # type: ignore[union-attr,arg-type]  # a choice without an error has its manifest
            except (ManifestError, OSError) as exc:
                where = self.storage.describe(choice.name)
                error = f"checkpoint {where} failed verification on this machine: {exc}"
        errors = collectives.all_gather_object(error, self.group)
        if any(errors):  # every rank stops, none waits for a peer that gave up
            raise CheckpointError(next(e for e in errors if e))
        return str(cache / choice.name)

    def _pick_verified(self, training_state: TrainingState) -> _Choice | None:
        """Rank 0: the newest checkpoint whose files match its manifest, falling back past a
        damaged one with a warning; a refused one (tampered, or failing the HMAC) stops it."""
        for name in reversed(self.storage.names()):
            where = self.storage.describe(name)
            try:
                manifest = self.storage.read_manifest(name)
            except CheckpointRefused as exc:
                return _Choice(name, error=f"checkpoint {where} refused: {exc}")
            except ManifestError:  # an unfinished save: not a checkpoint
                continue
            try:
                local = self.storage.local_copy(name, manifest, self.scratch_dir / CHECKPOINT_CACHE_DIR)
                manifest.check_dir(local)
                training_state.check_index(Path(local), manifest)
            except CheckpointRefused as exc:
                return _Choice(name, error=f"checkpoint {where} refused: {exc}")
            except (ManifestError, OSError) as exc:
                log.warning("checkpoint %s failed verification (%s); using the previous one", where, exc)
                continue
            if manifest.signed_but_unchecked:
                log.warning("checkpoint %s carries an HMAC, but %s is not set: its integrity is "
                            "checked, its authenticity is not", where, KEY_ENV)
            log.info("resuming from checkpoint %s", where)
            return _Choice(name, str(local), manifest)
        return None

    def _crash_point(self, step: int) -> None:
        if self.fault_hook is not None:
            self.fault_hook(step)


def _value(item: Any) -> Any:
    return item() if callable(item) else item


def _failure(exc: BaseException) -> str:
    return f"{type(exc).__name__}: {exc}"
