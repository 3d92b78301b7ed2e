"""Where checkpoints live: a local (or shared) folder, or object storage through fsspec.

Both follow one protocol: DCP writes a checkpoint's files into a local folder; ``publish``
moves each rank's files to the storage; ``commit`` (rank 0, after every rank has published)
makes it a checkpoint by writing the manifest last. A folder without a valid manifest is never
read, and the storage never offers a half-written checkpoint under a checkpoint's name:

- local: files are written to ``.staging-<name>`` beside the checkpoints, the manifest is
  written and fsynced, then the folder is renamed into place and the parent fsynced;
- object storage: each file is uploaded and its size confirmed, then the manifest is
  uploaded. Reading downloads into a local cache and verifies before anything is loaded; only
  the names a manifest may hold are downloaded, and only into the cache.

A checkpoint set aside (``scaletrain resume CHECKPOINT`` on the newer ones) keeps its files and
manifest under ``superseded-step-N`` (``-2``, ``-3``... when that step was set aside before), out
of the way of the step being saved again.
"""

from __future__ import annotations

import os
import re
import shutil
from abc import ABC, abstractmethod
from pathlib import Path

from scaletrain.checkpoint.manifest import MANIFEST_FILE, Manifest, ManifestError, file_path
from scaletrain.errors import ConfigError
from scaletrain.rundir.atomic import fsync_dir, write_text_atomic
from scaletrain.rundir.filesystem import open_filesystem

__all__ = [
    "CheckpointStorage",
    "LocalStorage",
    "ObjectStorage",
    "open_storage",
    "checkpoint_name",
    "step_of",
    "is_remote",
]

_NAME = re.compile(r"^step-([0-9]{8,})$")
_STAGING_PREFIX = ".staging-"


def checkpoint_name(step: int) -> str:
    return f"step-{step:08d}"


def step_of(name: str) -> int | None:
    match = _NAME.match(name)
    return int(match.group(1)) if match else None


def is_remote(location: str) -> bool:
    return "://" in location and not location.startswith("file://")


def _checked(name: str) -> str:
    if step_of(name) is None:
        raise ManifestError(f"{name!r} is not a checkpoint name (step-NNNNNNNN)")
    return name


def _aside_name(name: str, taken: set[str]) -> str:
    """``superseded-<name>``, or with the first free ``-N`` when that step was set aside before."""
    candidate, count = f"superseded-{name}", 1
    while candidate in taken:
        count += 1
        candidate = f"superseded-{name}-{count}"
    return candidate


class CheckpointStorage(ABC):
    """The checkpoints of one run, under ``location``."""

    def __init__(self, location: str):
        self.location = location.rstrip("/")

    @abstractmethod
    def staging_dir(self, name: str, local_scratch: Path) -> Path:
        """The local folder DCP writes checkpoint ``name`` into (the same path on every rank
        of a machine)."""

    @abstractmethod
    def publish(self, name: str, staging: Path, files: list[str]) -> None:
        """Make this rank's ``files`` of ``staging`` durable in the storage."""

    @abstractmethod
    def commit(self, name: str, staging: Path, manifest: Manifest) -> None:
        """Rank 0, after every rank published: check the files, then write the manifest last."""

    @abstractmethod
    def names(self) -> list[str]:
        """Checkpoint names present (committed or not), oldest step first."""

    @abstractmethod
    def read_manifest(self, name: str) -> Manifest:
        """The manifest of ``name``; raises ManifestError when it is missing or malformed."""

    @abstractmethod
    def local_copy(self, name: str, manifest: Manifest, cache: Path) -> Path:
        """A local folder with the files of ``name`` (downloaded into ``cache`` if remote)."""

    @abstractmethod
    def delete(self, name: str) -> None: ...

    @abstractmethod
    def set_aside(self, name: str) -> str:
        """Make ``name`` no longer a checkpoint of this run without deleting its bytes; returns
        where it went."""

    @abstractmethod
    def sweep_incomplete(self) -> list[str]:
        """Remove what a crashed save left behind; return what was removed."""

    def describe(self, name: str) -> str:
        return f"{self.location}/{name}"


class LocalStorage(CheckpointStorage):
    def __init__(self, location: str):
        super().__init__(location.removeprefix("file://"))
        self.root = Path(self.location)

    def staging_dir(self, name: str, local_scratch: Path) -> Path:
        return self.root / f"{_STAGING_PREFIX}{name}"

    def publish(self, name: str, staging: Path, files: list[str]) -> None:
        pass  # DCP fsyncs each file it writes; the rename in commit() publishes them all

    def commit(self, name: str, staging: Path, manifest: Manifest) -> None:
        for file in manifest.files:
            if not (staging / file).is_file():
                raise ManifestError(f"{file} was not written")
        write_text_atomic(staging / MANIFEST_FILE, manifest.to_json())
        fsync_dir(staging)
        final = self.root / name
        if final.exists():  # a step saved again after falling back past it
            aside = self.root / f"{_STAGING_PREFIX}replaced-{name}"
            shutil.rmtree(aside, ignore_errors=True)
            os.replace(final, aside)
            shutil.rmtree(aside, ignore_errors=True)
        os.replace(staging, final)
        fsync_dir(self.root)

    def names(self) -> list[str]:
        if not self.root.is_dir():
            return []
        found = [p.name for p in self.root.iterdir() if p.is_dir() and step_of(p.name) is not None]
        return sorted(found, key=lambda n: step_of(n) or 0)

    def read_manifest(self, name: str) -> Manifest:
        path = self.root / name / MANIFEST_FILE
        try:
            text = path.read_text(encoding="utf-8")
        except FileNotFoundError:
            raise ManifestError("no manifest (an unfinished save)") from None
        except OSError as exc:
            raise ManifestError(f"cannot read the manifest: {exc}") from None
        return Manifest.from_json(text)

    def local_copy(self, name: str, manifest: Manifest, cache: Path) -> Path:
        return self.root / _checked(name)

    def delete(self, name: str) -> None:
        # Renamed first, so a crash mid-delete leaves no half checkpoint under a valid name.
        aside = self.root / f"{_STAGING_PREFIX}deleted-{name}"
        os.replace(self.root / name, aside)
        shutil.rmtree(aside)

    def set_aside(self, name: str) -> str:
        target = self.root / _aside_name(name, set(os.listdir(self.root)))
        os.rename(self.root / name, target)
        fsync_dir(self.root)
        return str(target)

    def sweep_incomplete(self) -> list[str]:
        if not self.root.is_dir():
            return []
        removed = []
        for path in self.root.iterdir():
            if path.name.startswith(_STAGING_PREFIX):
                shutil.rmtree(path, ignore_errors=True)
                removed.append(path.name)
        return removed


class ObjectStorage(CheckpointStorage):
    """s3://, gs://, az://... through fsspec; credentials come from the environment."""

    def __init__(self, location: str):
        super().__init__(location)
        self.fs, self.path = _filesystem(self.location)

    def _key(self, *parts: str) -> str:
        return "/".join([self.path, *parts])

    def staging_dir(self, name: str, local_scratch: Path) -> Path:
        return local_scratch / f"{_STAGING_PREFIX}{name}"

    def publish(self, name: str, staging: Path, files: list[str]) -> None:
        for file in files:
            self.fs.put_file(str(staging / file), self._key(name, file))
            (staging / file).unlink()  # uploaded: this machine's disk need not keep it
        try:
            staging.rmdir()  # the last rank of a machine to publish; rank 0's goes at commit
        except OSError:
            pass

    def commit(self, name: str, staging: Path, manifest: Manifest) -> None:
        self.fs.invalidate_cache()
        for file, entry in manifest.files.items():
            try:
                size = self.fs.info(self._key(name, file))["size"]
            except FileNotFoundError:
                raise ManifestError(f"{file} was not uploaded") from None
            if size != entry.size:
                raise ManifestError(f"{file}: uploaded {size} bytes, expected {entry.size}")
        # The commit marker: uploaded only after every file is confirmed.
        self.fs.pipe_file(self._key(name, MANIFEST_FILE), manifest.to_json().encode())
        shutil.rmtree(staging, ignore_errors=True)

    def names(self) -> list[str]:
        self.fs.invalidate_cache()
        try:
            entries = self.fs.ls(self.path, detail=False)
        except FileNotFoundError:
            return []
        found = [e.rstrip("/").rsplit("/", 1)[-1] for e in entries]
        return sorted((n for n in found if step_of(n) is not None), key=lambda n: step_of(n) or 0)

    def read_manifest(self, name: str) -> Manifest:
        try:
            data = self.fs.cat_file(self._key(name, MANIFEST_FILE))
        except FileNotFoundError:
            raise ManifestError("no manifest (an unfinished save)") from None
        except OSError as exc:
            raise ManifestError(f"cannot read the manifest: {exc}") from None
        return Manifest.from_json(data)

    def local_copy(self, name: str, manifest: Manifest, cache: Path) -> Path:
        target = cache / _checked(name)
        shutil.rmtree(target, ignore_errors=True)
        target.mkdir(parents=True)
        for file in manifest.files:
            local = file_path(target, file)  # refused before anything is fetched or written
            try:
                self.fs.get_file(self._key(name, file), str(local))
            except FileNotFoundError:
                raise ManifestError(f"{file} is missing") from None
        return target

    def delete(self, name: str) -> None:
        # The manifest goes first: from then on the rest is an unfinished save, never resumed.
        try:
            self.fs.rm_file(self._key(name, MANIFEST_FILE))
        except FileNotFoundError:
            pass
        self.fs.rm(self._key(name), recursive=True)

    def set_aside(self, name: str) -> str:
        # Objects cannot be renamed: each is copied (on the server, the manifest last), then
        # the original deleted (its manifest first). A crash in between leaves both.
        self.fs.invalidate_cache()
        taken = {entry.rstrip("/").rsplit("/", 1)[-1] for entry in self.fs.ls(self.path, detail=False)}
        aside = _aside_name(name, taken)
        source, target = self._key(name), self._key(aside)
        keys = sorted(self.fs.find(source), key=lambda key: key.endswith("/" + MANIFEST_FILE))
        for key in keys:
            self.fs.copy(key, f"{target}/{key[len(source) + 1:]}")
        self.delete(name)
        return self.describe(aside)

    def sweep_incomplete(self) -> list[str]:
        """Uploads without a manifest: a save that crashed (only this run writes here)."""
        removed = []
        for name in self.names():
            # superseded-manifest.json: how earlier versions set a step aside, in place
            markers = (MANIFEST_FILE, f"superseded-{MANIFEST_FILE}")
            if not any(self.fs.exists(self._key(name, marker)) for marker in markers):
                try:
                    self.fs.rm(self._key(name), recursive=True)
                except FileNotFoundError:  # gone meanwhile
                    continue
                removed.append(name)
        return removed


def _filesystem(url: str):
    return open_filesystem(url, ConfigError, f"checkpoint.dir {url!r}")


def open_storage(location: str) -> CheckpointStorage:
    return ObjectStorage(location) if is_remote(location) else LocalStorage(location)
