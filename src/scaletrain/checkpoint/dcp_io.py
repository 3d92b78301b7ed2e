"""The torch.distributed.checkpoint calls, in one module imported only when a checkpoint is
written or read: importing DCP costs about a second, which a worker's start must not pay.

Saves hash every file as DCP writes it (the manifest needs a hash per file): no second read
of the checkpoint's bytes, and a large buffer is hashed in another thread while it is written
(hashlib and the write both release the GIL), so a save costs about max(write, hash), not
their sum.

Loads read nothing as code: DCP's index through the restricted unpickler (dcp_metadata.py),
tensors and non-tensor items with ``torch.load(weights_only=True)``, and only files the
verified manifest lists. DCP's own errors (a BaseException naming every rank's traceback) come
back as one-line exceptions.
"""

from __future__ import annotations

import copy
import io
import warnings
from collections.abc import Iterator
from concurrent.futures import Future
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint._nested_dict import set_element
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner
from torch.distributed.checkpoint.filesystem import FileSystem, FileSystemReader, FileSystemWriter
from torch.distributed.checkpoint.metadata import StorageMeta
from torch.distributed.checkpoint.staging import DefaultStager, StagingOptions
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_optimizer_state_dict,
    get_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
    set_state_dict,
)

from scaletrain.checkpoint.dcp_metadata import read_metadata
from scaletrain.checkpoint.manifest import METADATA_FILE, OVERLAP_MIN_BYTES, FileEntry, hash_in_background, new_hasher

__all__ = ["state_of", "set_state", "model_state", "optimizer_state", "set_model_state",
           "set_optimizer_state", "save", "load", "Stager", "Written", "DcpError"]

Written = dict[str, tuple[int, str]]  # file name -> (size, hash), as written by this rank

# DCP announces "assuming single process" on every call without a process group.
warnings.filterwarnings("ignore", message=".*torch.distributed is disabled.*")
warnings.filterwarnings("ignore", message=".*assuming the intent is to (save|load) in a single process.*")


class DcpError(RuntimeError):
    """DCP failed on some rank (the first failure, in one line)."""


def _one_line(exc: CheckpointException) -> BaseException:
    """The first rank's own exception out of DCP's CheckpointException."""
    for rank, (error, _trace) in sorted(exc.failures.items()):
        return error if isinstance(error, Exception) else DcpError(f"rank {rank}: {error!r}")
    return DcpError("DCP failed without naming a rank")


class _VerifiedReader(FileSystemReader):
    """DCP's file reader, but its index is checked against the manifest and read with the
    restricted unpickler (DCP's own runs pickle.load on it), on every rank that reads it."""

    def __init__(self, path: str, files: dict[str, FileEntry]):
        super().__init__(path)
        self.files = files
        self.refused: Exception | None = None  # why this rank refused the index

    def read_metadata(self, *args: Any, **kwargs: Any) -> Any:
        if kwargs.get("rank") is not None:  # DCP's fallback to per-rank indexes: never ours
            raise DcpError("a per-rank DCP index is not part of a scaletrain checkpoint")
        with self.fs.create_stream(self.fs.concat_path(self.path, METADATA_FILE), "rb") as stream:
            try:
                metadata = read_metadata(stream.read(), self.files)
            except Exception as exc:
                self.refused = exc
                raise
        metadata.storage_meta = metadata.storage_meta or StorageMeta()
        metadata.storage_meta.load_id = self.load_id
        return metadata


class _SafeLoadPlanner(DefaultLoadPlanner):
    """DCP's default planner unpickles non-tensor items with ``weights_only=False``; ours
    reads them with the restricted unpickler (optimizer hyperparameters are plain data)."""

    def load_bytes(self, read_item, value: io.BytesIO) -> None:
        loaded = torch.load(value, weights_only=True)
        if self.flatten_state_dict:
            set_element(self.original_state_dict, self.mappings[read_item.dest_index.fqn], loaded)
        else:
            self.state_dict[read_item.dest_index.fqn] = loaded


def state_of(model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> dict[str, Any]:
    """Model and optimizer state keyed by parameter names, for any strategy (DDP unwrapped).
    An optimizer with its own share of the state (ZeRO-1) gives it in the same layout."""
    if hasattr(optimizer, "checkpoint_state"):
        return {"model": get_model_state_dict(model), "optim": optimizer.checkpoint_state(model)}
    model_sd, optim_sd = get_state_dict(model, optimizer, options=StateDictOptions())
    return {"model": model_sd, "optim": optim_sd}


class _HashingWriter:
    """A file DCP writes, hashed on the way (DCP only writes forward: it never seeks)."""

    def __init__(self, file: Any):
        self._file = file
        self._digest = new_hasher()
        self.size = 0

    def write(self, data: Any) -> int:
        view = memoryview(data).cast("B")
        if view.nbytes >= OVERLAP_MIN_BYTES:
            hashed = hash_in_background(self._digest, [view])
            written = self._file.write(view)
            hashed.result()  # the buffer is only borrowed until write() returns
        else:
            self._digest.update(view)
            written = self._file.write(view)
        self.size += view.nbytes
        return written

    def hexdigest(self) -> str:
        return self._digest.hexdigest()

    def __getattr__(self, name: str) -> Any:  # tell, fileno, flush, close
        return getattr(self._file, name)


class _HashingFileSystem(FileSystem):
    """DCP's local file system, recording the size and hash of every file it writes."""

    def __init__(self) -> None:
        self.written: Written = {}

    @contextmanager
    def create_stream(self, path: str | Any, mode: str) -> Iterator[Any]:
        if "w" not in mode:
            with super().create_stream(path, mode) as stream:
                yield stream
            return
        path = Path(path)
        with path.open(mode) as file:
            writer = _HashingWriter(file)
            yield writer
        self.written[path.name] = (writer.size, writer.hexdigest())

    def rename(self, path: str | Any, new_path: str | Any) -> None:
        super().rename(path, new_path)  # DCP writes .metadata.tmp, then renames it
        entry = self.written.pop(Path(path).name, None)
        if entry is not None:
            self.written[Path(new_path).name] = entry


def _writer(path: str) -> tuple[FileSystemWriter, Written]:
    writer = FileSystemWriter(path)
    writer.fs = _HashingFileSystem()
    return writer, writer.fs.written


def save(state: dict[str, Any], path: str, group: Any) -> Written:
    """Write ``state`` under ``path``; returns what this rank wrote, hashed."""
    writer, written = _writer(path)
    try:
        dcp.save(state, checkpoint_id=path, storage_writer=writer, process_group=group)
    except CheckpointException as exc:
        raise _one_line(exc) from None
    return written


class _NotPlain(Exception):
    """The state holds a tensor subclass (FSDP's DTensor): DCP's stager rebuilds those."""


# torch 2.11's DefaultStager clears its deep-copy dispatch table at the end of every stage (to
# break a reference cycle), so its second stage raises KeyError: <class 'type'>; 2.12 stopped
# doing that. There one stager serves one save (found on a torch 2.11 GPU machine's files).
_STAGER_REUSABLE = torch.torch_version.TorchVersion(torch.__version__) >= (2, 12)  # type: ignore[operator]  # TorchVersion compares with tuples


class Stager:
    """Copies of the state in CPU buffers reused from one save to the next: what an async save
    writes while training changes the original. Plain tensors (one process, DDP) are copied
    straight into their buffers; a state with DTensors (FSDP) goes through DCP's stager. (DCP's
    stager spends several Python calls per tensor: 4 ms for 24 small tensors, most of a small
    state's stall. DCP's own async_save also started a thread per call: the manager writes
    from one long-lived thread instead.)"""

    def __init__(self) -> None:
        self._buffers: dict[tuple, torch.Tensor] = {}
        self._dcp: DefaultStager | None = None

    def stage(self, state: dict[str, Any]) -> dict[str, Any]:
        try:
            staged = self._copy(state, ())
        except _NotPlain:
            if self._dcp is None:
                # From the GPU: pinned buffers and non-blocking copies (DCP synchronizes before
                # returning, as staging is not async); on CPUs a plain copy.
                cuda = torch.cuda.is_available()
                self._dcp = DefaultStager(StagingOptions(
                    use_pinned_memory=cuda, use_shared_memory=False, use_async_staging=False,
                    use_non_blocking_copy=cuda,
                ))
            result = self._dcp.stage(state)
            staged_state = result.result() if isinstance(result, Future) else result
            if not _STAGER_REUSABLE:  # torch < 2.12 empties its stager after each stage
                self._dcp.close()
                self._dcp = None
            return staged_state
        if torch.cuda.is_available():
            torch.cuda.synchronize()  # the copies from the GPU were non-blocking
        return staged

    def _copy(self, item: Any, key: tuple) -> Any:
        if isinstance(item, torch.Tensor):
            if type(item) not in (torch.Tensor, torch.nn.Parameter):
                raise _NotPlain
            buffer = self._buffers.get(key)
            if buffer is None or buffer.shape != item.shape or buffer.dtype != item.dtype:
                buffer = torch.empty(item.shape, dtype=item.dtype, pin_memory=item.is_cuda)
                self._buffers[key] = buffer
            return buffer.copy_(item.detach(), non_blocking=item.is_cuda)
        if isinstance(item, dict):
            return {k: self._copy(v, (*key, k)) for k, v in item.items()}
        if type(item) in (list, tuple):
            return type(item)(self._copy(v, (*key, i)) for i, v in enumerate(item))
        return copy.deepcopy(item)

    def close(self) -> None:
        self._buffers.clear()
        if self._dcp is not None:
            self._dcp.close()
            self._dcp = None


def load(target: Any, path: str, files: dict[str, FileEntry], group: Any) -> None:
    """Load a verified checkpoint (``files``: its manifest's) into ``target`` (a
    checkpoint.state.TrainingState), resharding as needed."""
    state = target.dcp_state()
    reader = _VerifiedReader(path, files)
    try:
        dcp.load(state, storage_reader=reader, planner=_SafeLoadPlanner(), process_group=group)
    except CheckpointException as exc:
        raise (reader.refused or _one_line(exc)) from None
    target.load_dcp_state(state)


def set_state(model: torch.nn.Module, optimizer: torch.optim.Optimizer, state: dict[str, Any],
              full: bool = False) -> None:
    """Put a loaded ``state_of`` back into the model and optimizer. ``full``: whole tensors (a
    single-file checkpoint's), which a sharded model takes its shards of."""
    options = StateDictOptions(full_state_dict=full)
    if hasattr(optimizer, "load_checkpoint_state"):
        set_model_state_dict(model, state["model"], options=options)
        optimizer.load_checkpoint_state(model, state["optim"])
        return
    set_state_dict(model, optimizer, model_state_dict=state["model"],
                   optim_state_dict=state["optim"], options=options)


def model_state(model: torch.nn.Module) -> dict[str, Any]:
    return get_model_state_dict(model)


def optimizer_state(model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> dict[str, Any]:
    return get_optimizer_state_dict(model, optimizer)


def set_model_state(model: torch.nn.Module, state: dict[str, Any], full: bool = False) -> None:
    set_model_state_dict(model, state, options=StateDictOptions(full_state_dict=full))


def set_optimizer_state(model: torch.nn.Module, optimizer: torch.optim.Optimizer, state: dict[str, Any],
                        full: bool = False) -> None:
    set_optimizer_state_dict(model, optimizer, state, options=StateDictOptions(full_state_dict=full))
