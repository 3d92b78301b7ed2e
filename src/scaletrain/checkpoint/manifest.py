"""The manifest: written last, it is what makes a folder of files a checkpoint.

It lists the size and sha256 of every file, and what the checkpoint holds (step, world size,
strategy, metrics, versions, run ids, config hash). A checkpoint whose manifest is missing, does
not parse, or does not match its files does not exist for resume.

The hashes catch corruption, not tampering: whoever can write the storage can write a matching
manifest. So the manifest is read as untrusted data: it may name only the files of a checkpoint's
own layout (checked before any is downloaded or opened), and with ``SCALETRAIN_CHECKPOINT_KEY``
set it carries an HMAC that only holders of the key can make.
"""

from __future__ import annotations

import hashlib
import hmac
import json
import os
import re
from dataclasses import asdict, dataclass, field
from pathlib import Path

from scaletrain.rundir import CHECKPOINT_KEY_ENV

__all__ = [
    "MANIFEST_FILE",
    "METADATA_FILE",
    "TRAINER_STATE_FILE",
    "STATE_FILE",
    "TF_INDEX_FILE",
    "KEY_ENV",
    "FORMAT_VERSION",
    "FileEntry",
    "Manifest",
    "ManifestError",
    "CheckpointRefused",
    "file_path",
    "sha256_file",
    "hash_files",
]

MANIFEST_FILE = "manifest.json"
METADATA_FILE = ".metadata"  # DCP's index of the checkpoint (a pickle)
TRAINER_STATE_FILE = "trainer.json"
STATE_FILE = "state.safetensors"  # a small unsharded state in one file (single_file.py)
KEY_ENV = CHECKPOINT_KEY_ENV
FORMAT_VERSION = 1
_CHUNK = 4 << 20
TF_INDEX_FILE = "tf.index"  # a TensorFlow job's checkpoint (TF's tensor bundle: tf.index, tf.data-*)
# Every file a checkpoint has: DCP's index, the trainer's state and DCP's __<rank>_<n>.distcp;
# or, for a TensorFlow job, TF's index and data shards.
_FILE_NAME = re.compile(
    r"\.metadata|trainer\.json|__[0-9]+_[0-9]+\.distcp|state\.safetensors|tf\.index|tf\.data-[0-9]{5}-of-[0-9]{5}")


class ManifestError(Exception):
    """The manifest is missing, malformed, or does not match the files (message says which)."""


class CheckpointRefused(ManifestError):
    """The checkpoint holds what scaletrain never writes, or fails its HMAC: refused outright
    (never skipped for an older one, as a damaged checkpoint is)."""


@dataclass(frozen=True)
class FileEntry:
    size: int
    sha256: str


@dataclass
class Manifest:
    step: int
    world_size: int
    strategy: str
    files: dict[str, FileEntry]  # relative path -> size and hash
    metrics: dict[str, float] = field(default_factory=dict)
    run_id: str = ""
    mlflow_run_id: str | None = None
    config_hash: str = ""
    created_at: float = 0.0
    versions: dict[str, str] = field(default_factory=dict)
    format: int = FORMAT_VERSION
    hmac: str | None = None  # of everything else, with SCALETRAIN_CHECKPOINT_KEY (when it was set)

    def to_json(self) -> str:
        data = asdict(self)
        data["files"] = {name: asdict(entry) for name, entry in sorted(self.files.items())}
        return json.dumps(data, indent=2, sort_keys=True)

    def sign(self) -> Manifest:
        """Add the HMAC when SCALETRAIN_CHECKPOINT_KEY is set (the writer's side)."""
        key = _key()
        self.hmac = _mac(key, self) if key else None
        return self

    @property
    def signed_but_unchecked(self) -> bool:
        """It carries an HMAC that nobody checked (no key in this environment)."""
        return self.hmac is not None and _key() is None

    @classmethod
    def from_json(cls, text: str | bytes) -> Manifest:
        """Parse and check a manifest read from storage: file names of a checkpoint's layout
        only, and a valid HMAC when SCALETRAIN_CHECKPOINT_KEY is set."""
        try:
            data = json.loads(text)
            files = {str(k): FileEntry(int(v["size"]), str(v["sha256"])) for k, v in data.pop("files").items()}
            if int(data.get("format", 0)) > FORMAT_VERSION:
                raise ManifestError(
                    f"written by a newer scaletrain (format {data['format']}); upgrade scaletrain"
                )
            known = set(cls.__dataclass_fields__) - {"files"}
            manifest = cls(files=files, **{k: v for k, v in data.items() if k in known})
        except ManifestError:
            raise
        except (ValueError, TypeError, KeyError, AttributeError) as exc:
            raise ManifestError(f"the manifest is malformed ({type(exc).__name__}: {exc})") from None
        _check_names(manifest.files)
        _authenticate(manifest)
        return manifest

    @property
    def total_bytes(self) -> int:
        return sum(entry.size for entry in self.files.values())

    def check_file(self, name: str, path: str | os.PathLike) -> None:
        """Raise ManifestError unless ``path`` has the recorded size and hash."""
        entry = self.files[name]
        try:
            size = os.path.getsize(path)
        except OSError:
            raise ManifestError(f"{name} is missing") from None
        if size != entry.size:
            raise ManifestError(f"{name} has {size} bytes, the manifest says {entry.size} (truncated?)")
        if sha256_file(path) != entry.sha256:
            raise ManifestError(f"{name} does not match its sha256 (corrupted)")

    def check_dir(self, directory: str | os.PathLike) -> None:
        """Verify every listed file under ``directory``."""
        for name in sorted(self.files):
            self.check_file(name, file_path(directory, name))


def file_path(directory: str | os.PathLike, name: str) -> Path:
    """``directory / name`` for a file of a checkpoint, refused unless ``name`` is one of the
    layout's names and the path stays inside ``directory``."""
    _check_name(name)
    root = Path(directory)
    path = root / name
    if path.resolve().parent != root.resolve():  # a link to elsewhere
        raise CheckpointRefused(f"{name} resolves outside the checkpoint folder: refused")
    return path


def _check_name(name: str) -> None:
    if not _FILE_NAME.fullmatch(name):
        raise CheckpointRefused(f"the manifest names {name!r}, which is not a file of a checkpoint: refused")


def _check_names(files: dict[str, FileEntry]) -> None:
    for name in sorted(files):
        _check_name(name)
    if TRAINER_STATE_FILE not in files:
        raise CheckpointRefused(f"the manifest does not list {TRAINER_STATE_FILE}: refused")
    if METADATA_FILE not in files and TF_INDEX_FILE not in files and STATE_FILE not in files:
        raise CheckpointRefused(
            f"the manifest lists no index ({METADATA_FILE}, {STATE_FILE} or {TF_INDEX_FILE}): refused")


def _key() -> bytes | None:
    value = os.environ.get(KEY_ENV)
    return value.encode() if value else None


def _mac(key: bytes, manifest: Manifest) -> str:
    """HMAC-SHA256 of the manifest's canonical JSON (every field but the HMAC itself)."""
    data = asdict(manifest)
    del data["hmac"]
    canonical = json.dumps(data, sort_keys=True, separators=(",", ":"), allow_nan=True)
    return hmac.new(key, canonical.encode(), hashlib.sha256).hexdigest()


def _authenticate(manifest: Manifest) -> None:
    key = _key()
    if key is None:
        return  # the hashes still catch corruption; signed_but_unchecked tells the caller
    given = manifest.hmac
    if not isinstance(given, str) or not hmac.compare_digest(given.encode(), _mac(key, manifest).encode()):
        why = "has no HMAC" if given is None else "has an HMAC that does not match"
        raise CheckpointRefused(
            f"the manifest {why} for the key in {KEY_ENV} (written without that key, or changed "
            f"since): refused; unset {KEY_ENV} only if you trust whoever can write this storage"
        )


def sha256_file(path: str | os.PathLike) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as handle:
        while chunk := handle.read(_CHUNK):
            digest.update(chunk)
    return digest.hexdigest()


def hash_files(directory: str | os.PathLike, names: list[str]) -> dict[str, FileEntry]:
    root = Path(directory)
    return {
        name: FileEntry(os.path.getsize(root / name), sha256_file(root / name)) for name in names
    }
