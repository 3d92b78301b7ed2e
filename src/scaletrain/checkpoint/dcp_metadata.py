"""DCP's ``.metadata`` read as data: DCP itself reads it with a plain ``pickle.load``, which
runs whatever code the file names, and a matching hash does not make it ours (whoever can
write the storage can re-hash it).

The restricted unpickler resolves only the names a DCP index holds (its metadata dataclasses,
``torch.Size``, dtypes and layouts, a path); anything else is refused before it is called. The
index may then point DCP only at files the manifest lists.
"""

from __future__ import annotations

import functools
import io
import pickle
from typing import Any

from scaletrain.checkpoint.manifest import METADATA_FILE, CheckpointRefused, FileEntry, bytes_digest

__all__ = ["read_metadata"]

_DCP = "torch.distributed.checkpoint.metadata"
_ALLOWED = {
    *((_DCP, name) for name in (
        "Metadata", "StorageMeta", "MetadataIndex", "ChunkStorageMetadata", "TensorStorageMetadata",
        "BytesStorageMetadata", "TensorProperties", "_MEM_FORMAT_ENCODING",
    )),
    ("torch.distributed.checkpoint.filesystem", "_StorageInfo"),
    ("torch", "Size"),
    ("torch.serialization", "_get_layout"),  # a layout by its name
    ("pathlib", "PosixPath"),  # StorageMeta.checkpoint_id: where it was written
    ("pathlib", "PurePosixPath"),
    ("collections", "OrderedDict"),
}


class _IndexUnpickler(pickle.Unpickler):
    def find_class(self, module: str, name: str) -> Any:
        if (module, name) in _ALLOWED:
            return super().find_class(module, name)
        if module == "torch" and name in _torch_values():
            return _torch_values()[name]
        raise CheckpointRefused(
            f"{METADATA_FILE} names {module}.{name}, which a DCP index never holds (not written "
            "by scaletrain): refused, nothing from it was run"
        )


@functools.cache
def _torch_values() -> dict[str, Any]:
    """torch.float32, torch.strided... (read from torch's namespace, never imported by name)."""
    import torch

    kinds = (torch.dtype, torch.layout, torch.memory_format)
    return {name: value for name, value in vars(torch).items() if isinstance(value, kinds)}


def read_metadata(data: bytes, files: dict[str, FileEntry]) -> Any:
    """DCP's Metadata from the bytes of ``.metadata``: they must hash to the manifest's entry,
    unpickle with the allow-list, and name as data files only files in ``files``."""
    entry = files.get(METADATA_FILE)
    if entry is None or bytes_digest(data, entry.algorithm) != entry.digest:
        raise CheckpointRefused(f"{METADATA_FILE} is not the file the manifest lists: refused")
    try:
        metadata = _IndexUnpickler(io.BytesIO(data)).load()
    except CheckpointRefused:
        raise
    except Exception as exc:  # a truncated or garbled pickle: nothing was run
        raise CheckpointRefused(f"{METADATA_FILE} does not unpickle ({type(exc).__name__}: {exc}): refused") from None
    from torch.distributed.checkpoint.filesystem import _StorageInfo
    from torch.distributed.checkpoint.metadata import Metadata

    if type(metadata) is not Metadata or not isinstance(metadata.storage_data, dict):
        raise CheckpointRefused(f"{METADATA_FILE} is not a DCP index: refused")
    for info in metadata.storage_data.values():
        path = getattr(info, "relative_path", None)
        if type(info) is not _StorageInfo or not isinstance(path, str) or path not in files \
                or not path.endswith(".distcp"):
            raise CheckpointRefused(
                f"{METADATA_FILE} points at {path!r}, which the manifest does not list: refused"
            )
    return metadata
