"""An unsharded state as one file: ``state.safetensors``, written by rank 0 alone.

DCP's fixed costs (a save plan agreed by every rank, one torch.save per tensor, an index
pickle, a file and an fsync per rank) are ~35 ms for a 0.3 MiB state, 10x torch.save, and its
load of a large one runs a fake optimizer step first. When every rank holds the same state (one
process, DDP: every tensor a plain one), rank 0 writes it in one safetensors file instead: the
tensors, and the tree around them (dicts, lists, tuples, numbers, strings: an optimizer's
param_groups) as JSON in the file's metadata. Nothing in it is code: loading parses JSON and
copies bytes. One process writes it at any size; with several, only a small state
(SMALL_STATE_BYTES): above that, DCP's writes from every rank in parallel win.

The file is written straight from the tensors' memory (safetensors' own writer copied or
wrote slower than torch.save), in safetensors' layout, and read back through safetensors. Its
hash is taken from the same memory in another thread while the bytes go to disk.

The manifest, the hashes, the atomic commit and the verified load are the manager's, as for
DCP. A load puts the whole state on every rank (the state was the same on every rank), so it
resumes on any number of workers; a sharded strategy (FSDP) loads it as a full state dict.
"""

from __future__ import annotations

import json
import os
import struct
from pathlib import Path
from typing import Any

import torch

from scaletrain.checkpoint.manifest import OVERLAP_MIN_BYTES, STATE_FILE, hash_in_background, new_hasher

__all__ = ["STATE_FILE", "SMALL_STATE_BYTES", "fits", "save", "load", "check"]

SMALL_STATE_BYTES = 64 << 20  # the limit with several ranks (see above)
_STRUCTURE_KEY = "scaletrain.structure"
# torch's dtypes by safetensors' names for them; a tensor of another dtype keeps DCP's format
_DTYPES = {torch.float64: "F64", torch.float32: "F32", torch.float16: "F16", torch.bfloat16: "BF16",
           torch.int64: "I64", torch.int32: "I32", torch.int16: "I16", torch.int8: "I8",
           torch.uint8: "U8", torch.bool: "BOOL"}


def fits(state: dict[str, Any], limit: int | None = SMALL_STATE_BYTES) -> bool:
    """True when ``state`` holds only plain tensors (of safetensors' dtypes) and JSON's values,
    within ``limit`` bytes (None: any size)."""
    total = 0

    def walk(item: Any) -> bool:
        nonlocal total
        if isinstance(item, torch.Tensor):
            if type(item) not in (torch.Tensor, torch.nn.Parameter) or item.is_sparse or item.dtype not in _DTYPES:
                return False
            total += item.numel() * item.element_size()
            return limit is None or total <= limit
        if isinstance(item, dict):
            return all(isinstance(k, str) and walk(v) for k, v in item.items())
        if type(item) in (list, tuple):
            return all(walk(v) for v in item)
        return item is None or type(item) in (bool, int, float, str)

    return walk(state)


def _encode(item: Any, tensors: dict[str, torch.Tensor]) -> Any:
    """The tree as JSON: {"d": dict} {"l": list} {"t": tuple} {"x": tensor name} {"v": value}.
    (Tied weights are written once per name: the file holds bytes, not storages.)"""
    if isinstance(item, torch.Tensor):
        name = str(len(tensors))
        tensors[name] = item.detach().to("cpu").contiguous()
        return {"x": name}
    if isinstance(item, dict):
        return {"d": {k: _encode(v, tensors) for k, v in item.items()}}
    if isinstance(item, list):
        return {"l": [_encode(v, tensors) for v in item]}
    if isinstance(item, tuple):
        return {"t": [_encode(v, tensors) for v in item]}
    return {"v": item}


def _decode(node: Any, tensors: dict[str, torch.Tensor]) -> Any:
    if not isinstance(node, dict) or len(node) != 1:
        raise ValueError("not a state's structure")
    ((kind, value),) = node.items()
    if kind == "x":
        if value not in tensors:
            raise ValueError(f"the structure names a tensor the file does not hold: {value!r}")
        return tensors[value]
    if kind == "d":
        return {str(k): _decode(v, tensors) for k, v in value.items()}
    if kind in ("l", "t"):
        items = [_decode(v, tensors) for v in value]
        return items if kind == "l" else tuple(items)
    if kind == "v" and (value is None or type(value) in (bool, int, float, str)):
        return value
    raise ValueError(f"not a state's structure: {kind!r}")


def save(state: dict[str, Any], folder: Path) -> dict[str, tuple[int, str]]:
    """Write ``state`` as ``folder/state.safetensors`` (fsynced); returns {name: (size, hash)}."""
    tensors: dict[str, torch.Tensor] = {}
    structure = _encode(state, tensors)
    parts = _layout(tensors, {_STRUCTURE_KEY: json.dumps(structure)})
    size = sum(part.nbytes for part in parts)
    hasher = new_hasher()
    hashed = hash_in_background(hasher, parts) if size >= OVERLAP_MIN_BYTES else None
    if hashed is None:
        for part in parts:
            hasher.update(part)
    with open(Path(folder) / STATE_FILE, "wb") as handle:
        for part in parts:
            handle.write(part)
        handle.flush()
        os.fsync(handle.fileno())
    if hashed is not None:
        hashed.result()  # the tensors do not change until save returns
    return {STATE_FILE: (size, hasher.hexdigest())}


def _layout(tensors: dict[str, torch.Tensor], metadata: dict[str, str]) -> list[memoryview]:
    """The file's bytes as views of the tensors' memory, in safetensors' layout: the header's
    length (8 bytes, little-endian), the JSON header padded to 8 bytes, then every tensor's
    bytes in the header's order, the widest dtypes first so that every tensor starts aligned."""
    header: dict[str, Any] = {"__metadata__": metadata}
    views: list[memoryview] = []
    offset = 0
    for name in sorted(tensors, key=lambda n: -tensors[n].element_size()):
        tensor = tensors[name]
        view = tensor.reshape(-1).view(torch.uint8).numpy().data if tensor.numel() else memoryview(b"")
        header[name] = {"dtype": _DTYPES[tensor.dtype], "shape": list(tensor.shape),
                        "data_offsets": [offset, offset + view.nbytes]}
        views.append(view)
        offset += view.nbytes
    text = json.dumps(header, separators=(",", ":")).encode()
    text += b" " * (-len(text) % 8)
    return [memoryview(struct.pack("<Q", len(text)) + text), *views]


def load(path: Path) -> dict[str, Any]:
    """The state in a verified ``state.safetensors``: CPU tensors of their own (safetensors
    maps the file; a tensor left backed by it would change with the file)."""
    from safetensors import safe_open

    with safe_open(str(path), framework="pt") as reader:
        structure = json.loads((reader.metadata() or {})[_STRUCTURE_KEY])
        tensors = {name: reader.get_tensor(name).clone() for name in reader.keys()}  # noqa: SIM118  safe_open has no __iter__
    return _decode(structure, tensors)


def check(path: Path) -> None:
    """Rank 0, before a load (its hash already matched): the file's header read as data (no
    tensor bytes); a structure scaletrain never writes is refused."""
    from safetensors import SafetensorError, safe_open

    from scaletrain.checkpoint.manifest import CheckpointRefused

    try:
        with safe_open(str(path), framework="pt") as reader:
            structure = json.loads((reader.metadata() or {})[_STRUCTURE_KEY])
            names = set(reader.keys())  # noqa: SIM118  safe_open has no __iter__
        _decode(structure, {name: torch.empty(0) for name in names})
    except (SafetensorError, ValueError, KeyError, TypeError, RecursionError) as exc:
        raise CheckpointRefused(f"{STATE_FILE} is not a state scaletrain writes ({exc}): refused") from None
