"""Parquet shards: written and read back sample for sample, on disk and on a real S3-compatible
server; a window of the shard order reads exactly its row groups, through a cache bounded in
bytes; a bad index or location is one line naming the fix."""

from __future__ import annotations

import json
import pickle

import numpy as np
import pytest

from scaletrain.data.sampler import SHARD_ORDER, DataLayout, GlobalBatchSampler
from scaletrain.data.shards import INDEX_FILE, ParquetShards, write_shards
from scaletrain.errors import TaskError

ROWS = 1000


def columns(start: int, stop: int) -> dict:
    ids = np.arange(start, stop, dtype=np.int64)
    return {"id": ids, "tokens": [np.arange(i % 7, i % 7 + 5, dtype=np.int16) for i in ids],
            "label": (ids % 3).astype(np.float32)}


def check_every_sample(shards: ParquetShards) -> None:
    assert len(shards) == ROWS
    order = np.random.default_rng(0).permutation(ROWS).tolist()
    for index, sample in zip(order, shards.__getitems__(order), strict=True):
        assert sample["id"] == index
        assert sample["tokens"].tolist() == list(range(index % 7, index % 7 + 5))
        assert sample["label"] == index % 3


def test_written_in_chunks_and_read_back_sample_for_sample(tmp_path):
    # Chunks of 300 rows (data that comes in pieces) into row groups of 64, 4 per file.
    chunks = (columns(s, min(s + 300, ROWS)) for s in range(0, ROWS, 300))
    index = write_shards(chunks, str(tmp_path / "shards"), rows_per_group=64, groups_per_file=4)
    assert index["rows"] == ROWS
    assert [f["name"] for f in index["files"]] == [f"part-{i:05d}.parquet" for i in range(4)]
    assert [c for f in index["files"] for c in f["row_groups"]] == [64] * 15 + [40]
    shards = ParquetShards(str(tmp_path / "shards"), shuffle_window=4)
    check_every_sample(shards)
    assert shards.row_groups.sizes == tuple([64] * 15 + [40])
    # Without index.json, the files' footers say the same.
    (tmp_path / "shards" / INDEX_FILE).unlink()
    footers = ParquetShards(str(tmp_path / "shards"), shuffle_window=4)
    assert footers.row_groups == shards.row_groups and footers.files == shards.files
    # Pickled into a loader worker: its own (empty) cache and file handles.
    copy = pickle.loads(pickle.dumps(shards))
    assert copy.stats["row_groups_read"] == 0
    check_every_sample(copy)


def test_a_window_reads_its_row_groups_once_through_a_bounded_cache(tmp_path):
    write_shards(columns(0, ROWS), str(tmp_path / "s"), rows_per_group=50, groups_per_file=5)
    shards = ParquetShards(str(tmp_path / "s"), shuffle_window=4, columns=["id", "label"])
    layout = DataLayout(ROWS, 25, 2, 1)
    # 4 steps of 50 samples = one window of 4 row groups of 50; both ranks' batches.
    for rank in (0, 1):
        for batch in GlobalBatchSampler(layout, rank=rank, seed=1, stop_step=4, order=SHARD_ORDER,
                                        row_groups=shards.row_groups):
            samples = shards.__getitems__(batch)
            assert [s["id"] for s in samples] == list(batch)
            assert set(samples[0]) == {"id", "label"}  # only the columns asked for
    assert shards.stats["row_groups_read"] == 4
    # A cache smaller than one row group keeps one: reading the window again reads each group again.
    tiny = ParquetShards(str(tmp_path / "s"), shuffle_window=4, cache_mib=1e-6)
    tiny.__getitems__(list(range(0, ROWS, 50)))
    assert tiny.stats["row_groups_read"] == 20 and len(tiny._cache) == 1


def test_shards_on_a_real_s3_server(s3_server):
    location = "s3://ckpt/corpus/train"
    write_shards(columns(0, ROWS), location, rows_per_group=100, groups_per_file=3)
    found = s3_server.client().list_objects_v2(Bucket="ckpt", Prefix="corpus/train/")["Contents"]
    listed = sorted(item["Key"].rsplit("/", 1)[1] for item in found)
    assert listed == [INDEX_FILE] + [f"part-{i:05d}.parquet" for i in range(4)]
    shards = ParquetShards(location, shuffle_window=2)
    check_every_sample(shards)
    # Each row group was fetched once for the whole dataset (10 groups, cache large enough).
    assert shards.stats["row_groups_read"] == 10


def test_bad_locations_and_indexes_are_one_line(tmp_path):
    with pytest.raises(TaskError, match=r"no Parquet files at .*nothing; write them with scaletrain.data.write_shards"):
        ParquetShards(str(tmp_path / "nothing"))
    write_shards(columns(0, 100), str(tmp_path / "s"), rows_per_group=50)
    index = json.loads((tmp_path / "s" / INDEX_FILE).read_text())
    index["files"][0]["name"] = "../../etc/passwd"
    (tmp_path / "s" / INDEX_FILE).write_text(json.dumps(index))
    with pytest.raises(TaskError) as caught:
        ParquetShards(str(tmp_path / "s"))
    message = str(caught.value)
    assert "is not a shard index" in message and "delete index.json" in message and "\n" not in message
    with pytest.raises(TaskError, match="shuffle_window is 0"):
        ParquetShards(str(tmp_path / "s"), shuffle_window=0)
    # Writing over a set would mix old and new files: refused, nothing touched.
    before = sorted(p.name for p in (tmp_path / "s").iterdir())
    with pytest.raises(ValueError, match="already holds shards; write to a new folder, or delete them first"):
        write_shards(columns(0, 10), str(tmp_path / "s"))
    assert sorted(p.name for p in (tmp_path / "s").iterdir()) == before


def test_one_parquet_file_is_a_dataset_too(tmp_path):
    write_shards(columns(0, ROWS), str(tmp_path / "s"), rows_per_group=300, groups_per_file=10)
    one = ParquetShards(str(tmp_path / "s" / "part-00000.parquet"))
    assert one.files == ["part-00000.parquet"] and one.row_groups.sizes == (300, 300, 300, 100)
    check_every_sample(one)


def test_the_run_card_fingerprint_reads_one_row_group(tmp_path):
    from scaletrain.tracking.run_card import data_fingerprint

    write_shards(columns(0, ROWS), str(tmp_path / "a"), rows_per_group=100)
    shards = ParquetShards(str(tmp_path / "a"))
    first = data_fingerprint(None, shards)
    assert first.startswith("sha256:") and shards.stats["row_groups_read"] == 1
    changed = columns(0, ROWS)
    changed["label"][3] = 7.0
    write_shards(changed, str(tmp_path / "b"), rows_per_group=100)
    assert data_fingerprint(None, ParquetShards(str(tmp_path / "b"))) != first
