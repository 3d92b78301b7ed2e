"""The manifest: written last, it is what makes a folder of files a checkpoint.

It lists the size and hash of every file, and what the checkpoint holds (step, world size,
strategy, metrics, versions, run ids, config hash). A checkpoint whose manifest is missing, does
not parse, or does not match its files does not exist for resume.

Files are hashed with BLAKE3 (format 2): a cryptographic hash at 4-5 GB/s a core, where sha256
runs at 1.4 (a verified load of a 576 MiB state spent 0.4 s on sha256 alone, more than
torch.load). Manifests of format 1 list sha256 and are still read and verified.

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
import threading
from collections.abc import Iterable
from concurrent.futures import Future
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import blake3

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
    "HASH",
    "new_hasher",
    "file_digest",
    "bytes_digest",
    "hash_files",
    "hash_in_background",
    "OVERLAP_MIN_BYTES",
]

MANIFEST_FILE = "manifest.json"
METADATA_FILE = ".metadata"  # DCP's index of the checkpoint (a pickle)
TRAINER_STATE_FILE = "trainer.json"
STATE_FILE = "state.safetensors"  # a small unsharded state in one file (single_file.py)
KEY_ENV = CHECKPOINT_KEY_ENV
FORMAT_VERSION = 2  # 2: files hashed with BLAKE3 (1: sha256, still read)
HASH = "blake3"  # what a checkpoint written now records
_HASHES = ("blake3", "sha256")  # what a manifest may name
_CHUNK = 4 << 20
OVERLAP_MIN_BYTES = 1 << 20  # below this, hashing inline is cheaper than a thread hand-off
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
    digest: str  # hex
    algorithm: str = HASH

    def to_dict(self) -> dict[str, Any]:
        """As the manifest lists it (and the HMAC covers it): {"size": n, "<algorithm>": hex}."""
        return {"size": self.size, self.algorithm: self.digest}

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> FileEntry:
        named = [name for name in _HASHES if name in data]
        if len(named) != 1 or set(data) != {"size", *named}:
            raise ValueError(f"a file entry has size and one hash of {', '.join(_HASHES)}, not {sorted(data)}")
        return cls(int(data["size"]), str(data[named[0]]), named[0])


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
        return json.dumps(_as_data(self), indent=2, sort_keys=True)

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
            files = {str(k): FileEntry.from_dict(v) for k, v in data.pop("files").items()}
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
        if file_digest(path, entry.algorithm) != entry.digest:
            raise ManifestError(f"{name} does not match its {entry.algorithm} hash (corrupted)")

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
    data = _as_data(manifest)
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


def _as_data(manifest: Manifest) -> dict[str, Any]:
    data = asdict(manifest)
    data["files"] = {name: entry.to_dict() for name, entry in sorted(manifest.files.items())}
    return data


def new_hasher(algorithm: str = HASH) -> Any:
    """A hash object (update, hexdigest); BLAKE3 on every core for large inputs. Both release
    the GIL while they hash a large buffer."""
    if algorithm == "blake3":
        return blake3.blake3(max_threads=blake3.blake3.AUTO)
    if algorithm == "sha256":
        return hashlib.sha256()
    raise ValueError(f"unknown hash {algorithm!r}")


def hash_in_background(hasher: Any, parts: Iterable[Any]) -> Future:
    """``hasher.update`` on each part in a thread of its own, while the caller writes the same
    bytes (both release the GIL: a save costs about max(write, hash), not their sum). The parts
    must not change until the future is done. The thread ends with the hash (none is left
    behind a run that ends in the caller's process)."""
    done: Future = Future()

    def run() -> None:
        try:
            for part in parts:
                hasher.update(part)
        except BaseException as exc:
            done.set_exception(exc)
        else:
            done.set_result(None)

    threading.Thread(target=run, name="scaletrain-hash", daemon=True).start()
    return done


def bytes_digest(data: bytes | memoryview, algorithm: str = HASH) -> str:
    hasher = new_hasher(algorithm)
    hasher.update(data)
    return hasher.hexdigest()


def file_digest(path: str | os.PathLike, algorithm: str = HASH) -> str:
    """The hex hash of a file's bytes (BLAKE3 maps the file and hashes it on every core)."""
    hasher = new_hasher(algorithm)
    if algorithm == "blake3":
        hasher.update_mmap(os.fspath(path))
        return hasher.hexdigest()
    with open(path, "rb") as handle:
        while chunk := handle.read(_CHUNK):
            hasher.update(chunk)
    return hasher.hexdigest()


def hash_files(directory: str | os.PathLike, names: list[str]) -> dict[str, FileEntry]:
    root = Path(directory)
    return {name: FileEntry(os.path.getsize(root / name), file_digest(root / name)) for name in names}
