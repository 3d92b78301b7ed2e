"""Measurements independent of the planner's own code, for the tests and bench/."""

from __future__ import annotations

import torch
from torch.utils.data import default_collate


def saved_tensor_bytes(task, model, batch_size):
    """Independent measurement: bytes of distinct storages autograd keeps for backward."""
    params = {p.untyped_storage().data_ptr() for p in model.parameters()}
    storages = {}

    def pack(tensor):
        storage = tensor.untyped_storage()
        if storage.data_ptr() not in params:
            storages[storage.data_ptr()] = storage.nbytes()
        return tensor

    dataset = task.train_dataset()
    batch = default_collate([dataset[i] for i in range(batch_size)])
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = task.loss(model, batch)
    (out[0] if isinstance(out, tuple) else out).backward()
    return sum(storages.values())
