"""The manifest: written last, it is what makes a folder of files a checkpoint.

It lists the size and sha256 of every file, and what the checkpoint holds (step, world size,
strategy, metrics, versions, run ids, config hash). A checkpoint whose manifest is missing, does
not parse, or does not match its files does not exist for resume: nothing from it is unpickled.
"""

from __future__ import annotations

import hashlib
import json
import os
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

__all__ = [
    "MANIFEST_FILE",
    "FORMAT_VERSION",
    "FileEntry",
    "Manifest",
    "ManifestError",
    "sha256_file",
    "hash_files",
]

MANIFEST_FILE = "manifest.json"
FORMAT_VERSION = 1
_CHUNK = 4 << 20


class ManifestError(Exception):
    """The manifest is missing, malformed, or does not match the files (message says which)."""


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

    def to_json(self) -> str:
        data = asdict(self)
        data["files"] = {name: asdict(entry) for name, entry in sorted(self.files.items())}
        return json.dumps(data, indent=2, sort_keys=True)

    @classmethod
    def from_json(cls, text: str | bytes) -> Manifest:
        try:
            data = json.loads(text)
            files = {str(k): FileEntry(int(v["size"]), str(v["sha256"])) for k, v in data.pop("files").items()}
            if int(data.get("format", 0)) > FORMAT_VERSION:
                raise ManifestError(
                    f"written by a newer scaletrain (format {data['format']}); upgrade scaletrain"
                )
            known = set(cls.__dataclass_fields__) - {"files"}
            return cls(files=files, **{k: v for k, v in data.items() if k in known})
        except ManifestError:
            raise
        except (ValueError, TypeError, KeyError, AttributeError) as exc:
            raise ManifestError(f"the manifest is malformed ({type(exc).__name__}: {exc})") from None

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
            self.check_file(name, Path(directory) / name)


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
