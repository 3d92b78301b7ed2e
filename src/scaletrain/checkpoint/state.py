"""What a checkpoint holds, and the format that writes it: the Task runner's model and optimizer,
or the objects a user's loop hands to ``ctx.save`` (modules, optimizers, anything with
``state_dict()``, tensors, plain values), through DCP; a TensorFlow model through TF's own
checkpoint (runners/keras/checkpoint.py).

A TrainingState writes this rank's files into a staging folder and names them, and reads them
back, so the CheckpointManager's staging, hashing, manifest, atomic commit, verification,
retention and storage are the same for every kind of job. The DCP calls stay in dcp_io.py,
imported only when a checkpoint is written or read.
"""

from __future__ import annotations

import json
import math
import re
from pathlib import Path
from typing import Any, Protocol

import torch

from scaletrain.checkpoint.manifest import METADATA_FILE, STATE_FILE, FileEntry, Manifest, file_path

__all__ = ["TrainingState", "DcpState", "ModelAndOptimizer", "LoopObjects", "plain_values", "Written"]

# A file this rank wrote -> (size, hash) hashed while it was written; a file missing here is
# hashed from disk.
Written = dict[str, tuple[int, str]]


class TrainingState(Protocol):
    """What the CheckpointManager saves and restores, in whatever format it is kept."""

    supports_async: bool  # can be staged in memory and written by a background thread

    def write(self, staging: Path, group: Any) -> Written:
        """Write this rank's part into ``staging`` (every rank calls it: a collective)."""

    def own_files(self, staging: Path, rank: int) -> list[str]:
        """The names of the files in ``staging`` this rank wrote (rank 0: also the index)."""

    def check_index(self, local: Path, manifest: Manifest) -> None:
        """Rank 0, before a load: the format's index read as data, checked against the manifest."""

    def read(self, local: Path, files: dict[str, FileEntry], group: Any) -> None:
        """Load the verified checkpoint in ``local`` into the live objects (every rank)."""


class DcpState:
    """A state kept through DCP: each rank writes its shards (``__<rank>_<n>.distcp``), rank 0
    the index; one written by N workers loads on M."""

    supports_async = True

    def dcp_state(self) -> dict[str, Any]:
        """The state DCP writes, or fills in place on a load (the same keys)."""
        raise NotImplementedError

    def whole_state(self) -> dict[str, Any]:
        """The state when every rank holds it whole (the single-file format), in dcp_state()'s
        layout."""
        return self.dcp_state()

    def load_dcp_state(self, state: dict[str, Any], full: bool = False) -> None:
        """Put a loaded state back into the live objects (``full``: whole tensors, from a
        single-file checkpoint, that a sharded object takes its shards of)."""
        raise NotImplementedError

    def write(self, staging: Path, group: Any) -> Written:
        from scaletrain.checkpoint import dcp_io

        return dcp_io.save(self.dcp_state(), str(staging), group)

    def own_files(self, staging: Path, rank: int) -> list[str]:
        own = re.compile(rf"^__{rank}_\d+\.distcp$")
        names = [p.name for p in staging.iterdir() if own.match(p.name)]
        return names + [METADATA_FILE] if rank == 0 else names

    def check_index(self, local: Path, manifest: Manifest) -> None:
        if STATE_FILE in manifest.files:
            from scaletrain.checkpoint import single_file

            single_file.check(file_path(local, STATE_FILE))
            return
        from scaletrain.checkpoint.dcp_metadata import read_metadata

        read_metadata(file_path(local, METADATA_FILE).read_bytes(), manifest.files)

    def read(self, local: Path, files: dict[str, FileEntry], group: Any) -> None:
        if STATE_FILE in files:
            from scaletrain.checkpoint import single_file

            self.load_dcp_state(single_file.load(file_path(local, STATE_FILE)), full=True)
            return
        from scaletrain.checkpoint import dcp_io

        dcp_io.load(self, str(local), files, group)


class ModelAndOptimizer(DcpState):
    """The Task runner's state: the model and its optimizer, keyed by parameter names."""

    def __init__(self, model: torch.nn.Module, optimizer: torch.optim.Optimizer):
        self.model, self.optimizer = model, optimizer

    def dcp_state(self) -> dict[str, Any]:
        from scaletrain.checkpoint import dcp_io

        return dcp_io.state_of(self.model, self.optimizer)

    def load_dcp_state(self, state: dict[str, Any], full: bool = False) -> None:
        if self._load_whole_state(state):
            return
        from scaletrain.checkpoint import dcp_io

        dcp_io.set_state(self.model, self.optimizer, state, full)

    def whole_state(self) -> dict[str, Any]:
        """What DCP's get_state_dict gives a plain module (or DDP's) and a plain optimizer,
        without importing DCP (0.8 s, at a DDP job's first save, on every rank): the module's
        state_dict, the optimizer's state and groups keyed by parameter names (a tied
        parameter by its first name). Anything else (a compiled or wrapped module, a sharded
        optimizer or parameter, a parameter the module does not name) goes through DCP."""
        plain = self._plain()
        if plain is None:
            return self.dcp_state()
        module, names, params = plain
        optimizer = self.optimizer
        return {"model": module.state_dict(), "optim": {
            "state": {names[id(p)]: dict(optimizer.state[p]) for p in params if p in optimizer.state},
            "param_groups": [{**{k: v for k, v in group.items() if k != "params"},
                              "params": [names[id(p)] for p in group["params"]]}
                             for group in optimizer.param_groups],
        }}

    def _load_whole_state(self, state: dict[str, Any]) -> bool:
        """whole_state's inverse, without DCP: its set_state_dict first runs a fake optimizer
        step to create the state it then overwrites (half of a 576 MiB state's load). False
        (nothing changed) when the objects or the state's groups are not plain ones."""
        plain = self._plain()
        optim = state.get("optim")
        if plain is None or not isinstance(optim, dict) or not isinstance(optim.get("param_groups"), list):
            return False
        module, names, _params = plain
        groups = self.optimizer.param_groups
        saved = optim["param_groups"]
        if len(saved) != len(groups) or any(
                not isinstance(kept, dict) or kept.get("params") != [names[id(p)] for p in group["params"]]
                for kept, group in zip(saved, groups)):
            return False  # another order or grouping: DCP matches them by name
        module.load_state_dict(state["model"])
        # torch keys the saved state by the saved groups' entries, matched to the live groups in
        # order: here the names
        self.optimizer.load_state_dict({"state": dict(optim.get("state", {})), "param_groups": saved})
        return True

    def _plain(self) -> tuple[torch.nn.Module, dict[int, str], list[torch.nn.Parameter]] | None:
        """(module, parameter names by id, the optimizer's parameters) when the model is a
        plain module (or DDP's) with plain parameters and the optimizer a plain one over them:
        the states whole_state takes and _load_whole_state puts back; None otherwise."""
        module = getattr(self.model, "module", self.model)  # DDP's wrapper adds nothing to the names
        if hasattr(self.optimizer, "checkpoint_state") or not isinstance(module, torch.nn.Module):
            return None
        names: dict[int, str] = {}
        for name, parameter in module.named_parameters():
            if type(parameter) not in (torch.Tensor, torch.nn.Parameter) or any(
                    part in name for part in _WRAPPER_PREFIXES):
                return None  # a DTensor's shard (FSDP, TP), a wrapped module's names
            names.setdefault(id(parameter), name)
        if any(part in name for name, _ in module.named_buffers() for part in _WRAPPER_PREFIXES):
            return None
        params = [p for group in self.optimizer.param_groups for p in group["params"]]
        if any(id(p) not in names for p in params):
            return None
        return module, names, params


class LoopObjects(DcpState):
    """A loop's state, as it names it: ``{"model": model, "optimizer": opt, "epoch": 3}``.

    Modules and optimizers go through DCP's state-dict API (parameter names, any strategy, any
    number of workers on load); an optimizer is paired with the module whose parameters it
    steps. Anything else with ``state_dict()``/``load_state_dict()`` (an LR scheduler, a
    GradScaler) and tensors go to DCP as they are. Plain values (numbers, strings, lists,
    mappings) travel as JSON beside it (``values``), readable in ``scaletrain checkpoints show``.
    """

    def __init__(self, objects: dict[str, Any]):
        if not isinstance(objects, dict) or not objects:
            raise TypeError("a checkpoint's state is a dict of what to keep, e.g. "
                            "{'model': model, 'optimizer': optimizer, 'epoch': epoch}")
        self.objects = objects

    def _kept_by_dcp(self) -> dict[str, Any]:
        return {key: value for key, value in self.objects.items() if _in_dcp(value)}

    def dcp_state(self) -> dict[str, Any]:
        from scaletrain.checkpoint import dcp_io

        state: dict[str, Any] = {}
        for key, value in self._kept_by_dcp().items():
            if isinstance(value, torch.nn.Module):
                state[key] = dcp_io.model_state(value)
            elif isinstance(value, torch.optim.Optimizer):
                state[key] = dcp_io.optimizer_state(self._owner(key, value), value)
            elif isinstance(value, torch.Tensor):
                state[key] = value
            else:
                state[key] = value.state_dict()
        return state

    def load_dcp_state(self, state: dict[str, Any], full: bool = False) -> None:
        from scaletrain.checkpoint import dcp_io

        for key, value in self._kept_by_dcp().items():
            if isinstance(value, torch.nn.Module):
                dcp_io.set_model_state(value, state[key], full)
            elif isinstance(value, torch.optim.Optimizer):
                dcp_io.set_optimizer_state(self._owner(key, value), value, state[key], full)
            elif isinstance(value, torch.Tensor):
                with torch.no_grad():
                    value.copy_(state[key])
            else:
                value.load_state_dict(state[key])

    def values(self) -> dict[str, Any]:
        return plain_values({key: value for key, value in self.objects.items() if not _in_dcp(value)})

    def set_values(self, values: dict[str, Any]) -> None:
        for key in self.objects:
            if key in values and not _in_dcp(self.objects[key]):
                self.objects[key] = values[key]

    def _owner(self, key: str, optimizer: torch.optim.Optimizer) -> torch.nn.Module:
        """The module whose parameters ``optimizer`` steps (DCP keys its state by their names)."""
        stepped = {id(p) for group in optimizer.param_groups for p in group["params"]}
        for value in self.objects.values():
            if isinstance(value, torch.nn.Module) and any(id(p) in stepped for p in value.parameters()):
                return value
        raise TypeError(f"the optimizer {key!r} steps parameters of no module in the state; keep "
                        "the model beside it, e.g. {'model': model, " f"{key!r}: {key}" "}")


# Wrappers whose names DCP strips (torch.compile, activation checkpointing, FSDP1).
_WRAPPER_PREFIXES = ("_orig_mod.", "_checkpoint_wrapped_module.", "_fsdp_wrapped_module.")


def _in_dcp(value: Any) -> bool:
    return isinstance(value, (torch.nn.Module, torch.optim.Optimizer, torch.Tensor)) or (
        callable(getattr(value, "state_dict", None)) and callable(getattr(value, "load_state_dict", None))
    )


def plain_values(values: dict[str, Any]) -> dict[str, Any]:
    """``values`` as JSON keeps them, or a TypeError naming the first that it cannot keep."""
    for key, value in values.items():
        problem = _not_plain(value)
        if problem:
            raise TypeError(f"cannot keep {key!r} in a checkpoint: {problem}; keep numbers, strings, "
                            "lists, mappings, tensors, modules, optimizers or objects with state_dict()")
    return json.loads(json.dumps(values))


def _not_plain(value: Any) -> str | None:
    if value is None or isinstance(value, (str, bool, int)):
        return None
    if isinstance(value, float):
        return None if math.isfinite(value) else f"{value} is not a finite number"
    if isinstance(value, (list, tuple)):
        return next(filter(None, map(_not_plain, value)), None)
    if isinstance(value, dict):
        if not all(isinstance(k, str) for k in value):
            return "a mapping with keys that are not strings"
        return next(filter(None, map(_not_plain, value.values())), None)
    return f"it is a {type(value).__name__}"
