"""Datasets that do not fit in memory: Parquet shards on a local disk or object storage
(``s3://``, ``gs://``... through fsspec), read one row group at a time.

A task returns ``ParquetShards(location)`` from ``train_dataset()``; scaletrain's sampler then
reads it in ``SHARD_ORDER`` (data/shard_order.py): row groups permuted and samples shuffled
within windows of them, a pure function of (seed, epoch, position), so global batches are the
same at any world size and a resume needs nothing but the step. Each rank (each loader worker)
fetches only the row groups its batches touch, with range reads, and keeps the decoded ones in a
cache bounded in bytes. Nothing is pickled: Parquet is columns and a footer.

``write_shards`` turns columns (a dict, a pyarrow Table, or an iterable of either, for data that
does not fit either) into ``part-00000.parquet``... and ``index.json``, the row counts of every row
group, so a reader opens no footer to know the dataset's length; written last, it marks the set
complete.
"""

from __future__ import annotations

import hashlib
import json
import os
import posixpath
import threading
from collections import OrderedDict
from collections.abc import Callable, Mapping
from typing import Any

import numpy as np
from torch.utils.data import Dataset

from scaletrain.data.shard_order import RowGroups
from scaletrain.errors import TaskError
from scaletrain.rundir.filesystem import open_filesystem

__all__ = ["ParquetShards", "write_shards", "INDEX_FILE"]

INDEX_FILE = "index.json"
_FORMAT = "scaletrain-shards-1"
_MIB = 1 << 20


class ParquetShards(Dataset):
    """The rows of the Parquet files at ``location`` (a folder or prefix, local or ``s3://...``),
    one sample per row: a dict of the ``columns`` (all by default) as numpy values, passed
    through ``transform`` when given (a module-level function: loader workers pickle it).

    ``shuffle_window``: row groups mixed by one shuffle window (the quality/memory trade-off of
    data/shard_order.py). ``cache_mib``: decoded row groups each process keeps (at least one);
    a window's row groups should fit, or they are read again.
    """

    _fs: Any
    _handles: OrderedDict[int, tuple[Any, Any]]
    _cache: OrderedDict[int, tuple[dict[str, np.ndarray], int]]

    def __init__(self, location: str, *, columns: list[str] | None = None, shuffle_window: int = 16,
                 cache_mib: float = 256, transform: Callable[[dict[str, Any]], Any] | None = None):
        if shuffle_window < 1:
            raise TaskError(f"ParquetShards: shuffle_window is {shuffle_window}; use 1 or more row groups")
        if cache_mib <= 0:
            raise TaskError(f"ParquetShards: cache_mib is {cache_mib}; use a positive size in MiB")
        self.location = location.rstrip("/") or "/"
        self.columns = list(columns) if columns is not None else None
        self.shuffle_window = shuffle_window
        self.cache_bytes = int(cache_mib * _MIB)
        self.transform = transform
        self.files, sizes = self._layout()
        self.row_groups = RowGroups(tuple(size for per_file in sizes for size in per_file), shuffle_window)
        # Row group g is row group `_local[g]` of file `_file_of[g]`; its first row is `_starts[g]`.
        self._file_of = np.repeat(np.arange(len(sizes)), [len(s) for s in sizes])
        self._local = np.concatenate([np.arange(len(s)) for s in sizes]).astype(np.int64)
        self._starts = np.concatenate([[0], np.cumsum(self.row_groups.sizes)[:-1]]).astype(np.int64)
        self._reset()

    # ------------------------------------------------------------------ layout

    def _layout(self) -> tuple[list[str], list[list[int]]]:
        fs, root = self._fs_and_root()
        self._base = root  # the folder the files are named from (pickled: plain text)
        index_path = posixpath.join(root, INDEX_FILE)
        try:
            if fs.exists(index_path):
                with fs.open(index_path, "rb") as f:
                    return _read_index(json.loads(f.read()), self.location)
            if fs.isfile(root):  # one file: its folder is the root
                root, found = posixpath.dirname(root), [root]
                self._base = root
            else:
                found = sorted(p for p in fs.find(root) if p.endswith(".parquet"))
        except (OSError, ValueError) as exc:
            raise TaskError(f"cannot read the shards at {self.location}: {exc}; check the path and its "
                            "credentials (object storage reads them from the environment)") from None
        if not found:
            raise TaskError(f"no Parquet files at {self.location}; write them with "
                            "scaletrain.data.write_shards(...) or point ParquetShards at their folder")
        import pyarrow.parquet as pq

        names, sizes = [], []
        for path in found:
            with fs.open(path, "rb") as f:
                meta = pq.ParquetFile(f).metadata
            counts = [meta.row_group(i).num_rows for i in range(meta.num_row_groups)]
            if not sum(counts):
                continue  # a file with no rows holds no sample
            if not all(counts):
                raise TaskError(f"{path} has an empty row group; rewrite it with scaletrain.data.write_shards(...)")
            names.append(posixpath.relpath(path, root))
            sizes.append(counts)
        return names, sizes

    def _fs_and_root(self) -> tuple[Any, str]:
        return _filesystem(self.location)

    # ------------------------------------------------------------------ reading

    def __len__(self) -> int:
        return self.row_groups.rows

    def __getitem__(self, index: int) -> Any:
        return self.__getitems__([index])[0]

    def __getitems__(self, indices: list[int]) -> list[Any]:
        wanted = np.asarray(indices, dtype=np.int64)
        if wanted.size and (wanted.min() < 0 or wanted.max() >= len(self)):
            raise IndexError(f"sample index outside [0, {len(self)})")
        groups = np.searchsorted(self._starts, wanted, side="right") - 1
        samples = []
        for index, group in zip(wanted.tolist(), groups.tolist(), strict=True):
            columns = self._group(group)
            row = index - int(self._starts[group])
            sample = {name: values[row] for name, values in columns.items()}
            samples.append(self.transform(sample) if self.transform is not None else sample)
        return samples

    def _group(self, group: int) -> dict[str, np.ndarray]:
        if self._pid != os.getpid():
            self._reset()  # a forked loader worker: the parent's clients and files are not its own
        with self._lock:
            found = self._cache.get(group)
            if found is not None:
                self._cache.move_to_end(group)
                self.stats["hits"] += 1
                return found[0]
        columns, nbytes = self._read(group)
        with self._lock:
            self._cache[group] = (columns, nbytes)
            self._cached_bytes += nbytes
            self.stats["row_groups_read"] += 1
            self.stats["bytes_decoded"] += nbytes
            while self._cached_bytes > self.cache_bytes and len(self._cache) > 1:
                _, (_, freed) = self._cache.popitem(last=False)
                self._cached_bytes -= freed
        return columns

    def _read(self, group: int) -> tuple[dict[str, np.ndarray], int]:
        import pyarrow.parquet as pq

        file = int(self._file_of[group])
        opened = self._handles.get(file)
        if opened is None:
            if self._fs is None:
                self._fs = self._fs_and_root()[0]
            raw = self._fs.open(posixpath.join(self._base, self.files[file]), "rb")
            opened = self._handles[file] = (pq.ParquetFile(raw), raw)
            if len(self._handles) > 8:  # few files open at once: a window spans a few of them
                _, (_, oldest) = self._handles.popitem(last=False)
                oldest.close()
        table = opened[0].read_row_group(int(self._local[group]), columns=self.columns)
        columns = {name: table.column(name).to_numpy(zero_copy_only=False) for name in table.column_names}
        return columns, max(1, table.nbytes)

    def _reset(self) -> None:
        """Per-process state: the filesystem, open files and the cache are made where used."""
        self._pid = os.getpid()
        self._fs = None
        self._handles = OrderedDict()  # file number -> (pyarrow ParquetFile, its open fsspec file)
        self._cache = OrderedDict()  # row group -> (its columns, bytes)
        self._cached_bytes = 0
        self._lock = threading.Lock()
        self.stats = {"row_groups_read": 0, "bytes_decoded": 0, "hits": 0}

    def __getstate__(self) -> dict[str, Any]:
        state = {k: v for k, v in self.__dict__.items()
                 if k not in ("_pid", "_fs", "_handles", "_cache", "_cached_bytes", "_lock", "stats")}
        return state

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)
        self._reset()

    def fingerprint(self) -> str:
        """For the run card: sha256 over the files, their row groups' sizes and the first row
        group's values (one range read, not a sample from all over the store)."""
        digest = hashlib.sha256(json.dumps({"files": self.files, "row_groups": self.row_groups.sizes,
                                            "columns": self.columns}).encode())
        for name, values in sorted(self._group(0).items()):
            digest.update(name.encode())
            digest.update(repr(values.tolist()).encode())
        return "sha256:" + digest.hexdigest()

    def __repr__(self) -> str:
        return (f"ParquetShards({self.location!r}: {len(self)} rows in {len(self.row_groups.sizes)} row groups "
                f"of {len(self.files)} files)")


def _filesystem(location: str) -> tuple[Any, str]:
    return open_filesystem(location, TaskError, f"ParquetShards {location!r}")


def _read_index(document: Any, location: str) -> tuple[list[str], list[list[int]]]:
    """index.json, checked: file names inside the folder, positive row counts."""
    problem = None
    if not isinstance(document, dict) or document.get("format") != _FORMAT:
        problem = f"its format is not {_FORMAT}"
    else:
        files = document.get("files")
        if not isinstance(files, list) or not files:
            problem = "it lists no files"
        else:
            names, sizes = [], []
            for entry in files:
                name = entry.get("name") if isinstance(entry, dict) else None
                counts = entry.get("row_groups") if isinstance(entry, dict) else None
                if (not isinstance(name, str) or not name or name.startswith("/") or ".." in name.split("/")
                        or not isinstance(counts, list) or not counts
                        or not all(isinstance(c, int) and not isinstance(c, bool) and c > 0 for c in counts)):
                    problem = f"entry {entry!r} is not a file name in the folder with positive row counts"
                    break
                names.append(name)
                sizes.append(counts)
            if problem is None:
                return names, sizes
    raise TaskError(f"{location}/{INDEX_FILE} is not a shard index ({problem}); rewrite the shards with "
                    "scaletrain.data.write_shards(...), or delete index.json to read the files' footers")


def write_shards(data: Any, location: str, *, rows_per_group: int = 1024, groups_per_file: int = 16,
                 compression: str = "zstd") -> dict[str, Any]:
    """Write ``data`` as Parquet shards and their ``index.json`` at ``location`` (a local folder or
    ``s3://bucket/prefix``); returns the index. ``data``: a dict of equal-length columns, a pyarrow
    Table, or an iterable of those (chunks of data that does not fit in memory), written as they
    come. Row groups of ``rows_per_group`` rows are the unit of reading and shuffling; 1024 rows of
    a few KiB each keep a range read efficient on object storage."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    if rows_per_group < 1 or groups_per_file < 1:
        raise ValueError("rows_per_group and groups_per_file are positive")
    fs, root = _filesystem(location.rstrip("/") or "/")
    if fs.exists(posixpath.join(root, INDEX_FILE)) or (fs.isdir(root) and any(
            p.endswith(".parquet") for p in fs.find(root))):
        raise ValueError(f"{location} already holds shards; write to a new folder, or delete them first "
                         "(a new set beside an old one would mix them)")
    fs.makedirs(root, exist_ok=True)
    chunks = [data] if isinstance(data, (Mapping, pa.Table)) else data
    files: list[dict[str, Any]] = []
    pending: pa.Table | None = None
    writer: Any = None
    sink: Any = None
    groups_in_file = 0

    def emit(table: pa.Table) -> None:
        nonlocal writer, sink, groups_in_file
        if writer is None:
            name = f"part-{len(files):05d}.parquet"
            sink = fs.open(posixpath.join(root, name), "wb")
            writer = pq.ParquetWriter(sink, table.schema, compression=compression)
            files.append({"name": name, "row_groups": []})
        writer.write_table(table, row_group_size=rows_per_group)
        files[-1]["row_groups"].append(table.num_rows)
        groups_in_file += 1
        if groups_in_file == groups_per_file:
            close()

    def close() -> None:
        nonlocal writer, sink, groups_in_file
        if writer is not None:
            writer.close()
            sink.close()
        writer, sink, groups_in_file = None, None, 0

    for chunk in chunks:
        if chunk is None:
            continue
        table = chunk if isinstance(chunk, pa.Table) else pa.table(dict(chunk))
        pending = table if pending is None else pa.concat_tables([pending, table])
        while pending.num_rows >= rows_per_group:
            emit(pending.slice(0, rows_per_group))
            pending = pending.slice(rows_per_group)
    if pending is not None and pending.num_rows:
        emit(pending)
    close()
    if not files:
        raise ValueError("write_shards got no rows")
    index = {"format": _FORMAT, "files": files, "rows": sum(sum(f["row_groups"]) for f in files)}
    with fs.open(posixpath.join(root, INDEX_FILE), "wb") as f:
        f.write(json.dumps(index, indent=1).encode())
    return index

