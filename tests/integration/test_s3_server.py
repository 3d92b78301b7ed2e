"""The loopback S3 server (moto) as s3fs meets it: endpoint and credentials from the environment."""

import pytest

fsspec = pytest.importorskip("fsspec")
pytest.importorskip("s3fs")


def test_write_list_read_remove_through_fsspec(s3_server):
    fs = fsspec.filesystem("s3", skip_instance_cache=True)
    payload = bytes(range(256)) * 4 + b"tail"
    with fs.open("s3://ckpt/a/b.bin", "wb") as f:
        f.write(payload)

    assert fs.ls("s3://ckpt/a") == ["ckpt/a/b.bin"]
    assert fs.cat_file("s3://ckpt/a/b.bin") == payload
    assert fs.info("s3://ckpt/a/b.bin")["size"] == len(payload)
    # It is on the moto server itself, not only in s3fs's caches.
    head = s3_server.client().head_object(Bucket="ckpt", Key="a/b.bin")
    assert head["ContentLength"] == len(payload)

    fs.rm("s3://ckpt/a/b.bin")
    assert not fs.exists("s3://ckpt/a/b.bin")
    fresh = fsspec.filesystem("s3", skip_instance_cache=True)
    assert not fresh.exists("s3://ckpt/a/b.bin")
    assert fresh.ls("s3://ckpt") == []
