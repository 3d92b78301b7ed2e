"""Fingerprints and export of model weights."""

from __future__ import annotations

import hashlib
from pathlib import Path

import torch
from torch import nn

from scaletrain.rundir.atomic import atomic_path

__all__ = ["state_dict_sha256", "save_weights", "save_state_weights"]


def state_dict_sha256(state_dict: dict[str, torch.Tensor]) -> str:
    """sha256 over names, dtypes, shapes and bytes: equal iff the weights are bit-identical."""
    digest = hashlib.sha256()
    for name in sorted(state_dict):
        tensor = state_dict[name]
        if not isinstance(tensor, torch.Tensor):
            continue
        tensor = tensor.detach().to("cpu").contiguous()
        digest.update(name.encode())
        digest.update(str(tensor.dtype).encode())
        digest.update(str(tuple(tensor.shape)).encode())
        digest.update(tensor.reshape(-1).view(torch.uint8).numpy().tobytes())
    return digest.hexdigest()


def save_weights(model: nn.Module, path: str | Path, metadata: dict[str, str] | None = None) -> Path:
    """Write the model's weights as safetensors (tied weights stored once), atomically."""
    from safetensors.torch import save_model

    path = Path(path)
    with atomic_path(path) as tmp:
        save_model(model, str(tmp), metadata=metadata)
    return path


def save_state_weights(state: dict[str, torch.Tensor], path: str | Path,
                       metadata: dict[str, str] | None = None) -> Path:
    """Write gathered weights (a sharded model's full state dict) as safetensors, atomically."""
    from safetensors.torch import save_file

    tensors = {name: t.detach().to("cpu").contiguous().clone() for name, t in state.items()
               if isinstance(t, torch.Tensor)}
    path = Path(path)
    with atomic_path(path) as tmp:
        save_file(tensors, str(tmp), metadata=metadata)
    return path
