"""A small unsharded state as one file: ``state.safetensors``, written by rank 0 alone.

DCP's fixed costs (a save plan agreed by every rank, one torch.save per tensor, an index
pickle, a file and an fsync per rank) are ~35 ms for a 0.3 MiB state, 10x torch.save. When
every rank holds the same state (one process, DDP: every tensor a plain one) and it is small
(SMALL_STATE_BYTES), rank 0 writes it in one safetensors file instead: the tensors, and the
tree around them (dicts, lists, tuples, numbers, strings: an optimizer's param_groups) as JSON
in the file's metadata. Nothing in it is code: loading parses JSON and copies bytes.

The manifest, the hashes, the atomic commit and the verified load are the manager's, as for
DCP. A load puts the whole state on every rank (the state was the same on every rank), so it
resumes on any number of workers; a sharded strategy (FSDP) loads it as a full state dict.
"""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path
from typing import Any

import torch

from scaletrain.checkpoint.manifest import STATE_FILE

__all__ = ["STATE_FILE", "SMALL_STATE_BYTES", "fits", "save", "load", "check"]

SMALL_STATE_BYTES = 64 << 20  # above it, DCP's writes from every rank in parallel win
_STRUCTURE_KEY = "scaletrain.structure"


def fits(state: dict[str, Any], limit: int = SMALL_STATE_BYTES) -> bool:
    """True when ``state`` holds only plain tensors and JSON's values, within ``limit`` bytes."""
    total = 0

    def walk(item: Any) -> bool:
        nonlocal total
        if isinstance(item, torch.Tensor):
            if type(item) not in (torch.Tensor, torch.nn.Parameter) or item.is_sparse:
                return False
            total += item.numel() * item.element_size()
            return total <= limit
        if isinstance(item, dict):
            return all(isinstance(k, str) and walk(v) for k, v in item.items())
        if type(item) in (list, tuple):
            return all(walk(v) for v in item)
        return item is None or type(item) in (bool, int, float, str)

    return walk(state)


def _encode(item: Any, tensors: dict[str, torch.Tensor], seen: dict[int, str]) -> Any:
    """The tree as JSON: {"d": dict} {"l": list} {"t": tuple} {"x": tensor name} {"v": value}."""
    if isinstance(item, torch.Tensor):
        tensor = item.detach()
        storage = tensor.untyped_storage().data_ptr() if tensor.numel() else None
        if storage is not None and storage in seen:  # tied weights: safetensors keeps one per storage
            tensor = tensor.clone()
        name = str(len(tensors))
        tensors[name] = tensor.to("cpu").contiguous()
        if storage is not None:
            seen.setdefault(storage, name)
        return {"x": name}
    if isinstance(item, dict):
        return {"d": {k: _encode(v, tensors, seen) for k, v in item.items()}}
    if isinstance(item, list):
        return {"l": [_encode(v, tensors, seen) for v in item]}
    if isinstance(item, tuple):
        return {"t": [_encode(v, tensors, seen) for v in item]}
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
    """Write ``state`` as ``folder/state.safetensors`` (fsynced); returns {name: (size, sha256)}."""
    from safetensors.torch import save as to_bytes

    tensors: dict[str, torch.Tensor] = {}
    structure = _encode(state, tensors, {})
    data = to_bytes(tensors, metadata={_STRUCTURE_KEY: json.dumps(structure)})
    with open(Path(folder) / STATE_FILE, "wb") as handle:
        handle.write(data)
        handle.flush()
        os.fsync(handle.fileno())
    return {STATE_FILE: (len(data), hashlib.sha256(data).hexdigest())}


def load(path: Path) -> dict[str, Any]:
    """The state in a verified ``state.safetensors`` (CPU tensors)."""
    from safetensors import safe_open

    with safe_open(str(path), framework="pt") as reader:
        structure = json.loads((reader.metadata() or {})[_STRUCTURE_KEY])
        tensors = {name: reader.get_tensor(name) for name in reader.keys()}  # noqa: SIM118  safe_open has no __iter__
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
