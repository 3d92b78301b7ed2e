"""scaletrain's object storage for checkpoints (checkpoint/storage.py ObjectStorage) against a
real S3 server (moto's, on loopback): the commit protocol (files first, each confirmed, the
manifest last), what counts as a checkpoint, sweeping unfinished saves, setting steps aside
and deleting, each checked on the server itself rather than through s3fs's caches."""

import hashlib

import pytest

pytest.importorskip("s3fs")

from scaletrain.checkpoint.manifest import FileEntry, Manifest, ManifestError  # noqa: E402
from scaletrain.checkpoint.storage import open_storage  # noqa: E402


@pytest.fixture
def location(tmp_path):
    """A run's prefix of its own in the module's bucket."""
    return f"s3://ckpt/runs/job/{tmp_path.name}"


def keys(s3_server, location: str) -> list[str]:
    """What the server holds under the run's prefix, as the server lists it."""
    prefix = location.removeprefix("s3://ckpt/") + "/"
    listed = s3_server.client().list_objects_v2(Bucket="ckpt", Prefix=prefix)
    return sorted(item["Key"][len(prefix):] for item in listed.get("Contents", []))


def staged(tmp_path, step: int, payload: bytes = b"weights") -> tuple:
    """A checkpoint's files in a local staging folder, and their manifest."""
    folder = tmp_path / f"staging-{step}"
    folder.mkdir()
    files = {".metadata": b"index", "trainer.json": b'{"step": %d}' % step, "__0_0.distcp": payload * 1000}
    for name, data in files.items():
        (folder / name).write_bytes(data)
    entries = {name: FileEntry(len(data), hashlib.sha256(data).hexdigest(), "sha256") for name, data in files.items()}
    return folder, Manifest(step=step, world_size=1, strategy="single", files=entries)


def save(storage, tmp_path, step: int, payload: bytes = b"weights") -> Manifest:
    folder, manifest = staged(tmp_path, step, payload)
    name = f"step-{step:08d}"
    storage.publish(name, folder, sorted(manifest.files))
    storage.commit(name, folder, manifest)
    return manifest


def test_a_checkpoint_exists_once_its_manifest_is_up_and_reads_back_verified(s3_server, tmp_path, location):
    storage = open_storage(location)
    folder, manifest = staged(tmp_path, 10)
    storage.publish("step-00000010", folder, sorted(manifest.files))
    # Uploaded, confirmed on the server, the local copies gone; not a checkpoint yet.
    assert keys(s3_server, location) == ["step-00000010/.metadata", "step-00000010/__0_0.distcp", "step-00000010/trainer.json"]
    assert not [p for p in folder.glob("*")]
    with pytest.raises(ManifestError, match="no manifest"):
        storage.read_manifest("step-00000010")
    storage.commit("step-00000010", folder, manifest)
    assert "step-00000010/manifest.json" in keys(s3_server, location)
    assert storage.names() == ["step-00000010"]
    read = storage.read_manifest("step-00000010")
    assert read.files == manifest.files and read.step == 10
    local = storage.local_copy("step-00000010", read, tmp_path / "cache")
    read.check_dir(local)  # every byte as written
    assert storage.describe("step-00000010") == f"{location}/step-00000010"


def test_a_file_that_did_not_arrive_whole_is_never_committed(s3_server, tmp_path, location):
    storage = open_storage(location)
    folder, manifest = staged(tmp_path, 20)
    storage.publish("step-00000020", folder, [".metadata", "trainer.json"])  # a rank's shard never came
    with pytest.raises(ManifestError, match="__0_0.distcp was not uploaded"):
        storage.commit("step-00000020", folder, manifest)
    (folder / "__0_0.distcp").write_bytes(b"short")
    storage.publish("step-00000020", folder, ["__0_0.distcp"])
    with pytest.raises(ManifestError, match=r"__0_0.distcp: uploaded 5 bytes, expected 7000"):
        storage.commit("step-00000020", folder, manifest)
    assert "step-00000020/manifest.json" not in keys(s3_server, location)
    # The next save sweeps the unfinished one; committed ones stay.
    save(storage, tmp_path, 30)
    assert storage.sweep_incomplete() == ["step-00000020"]
    assert [key for key in keys(s3_server, location) if key.startswith("step-00000020/")] == []
    assert storage.names() == ["step-00000030"]


def test_set_aside_twice_then_delete(s3_server, tmp_path, location):
    storage = open_storage(location)
    first = save(storage, tmp_path, 40, b"first")
    assert storage.set_aside("step-00000040") == f"{location}/superseded-step-00000040"
    second = save(storage, tmp_path, 40, b"again")  # the new timeline saves step 40 again
    assert storage.set_aside("step-00000040") == f"{location}/superseded-step-00000040-2"
    assert storage.names() == []  # neither is a checkpoint of the run any more
    held = keys(s3_server, location)
    for aside, manifest in (("superseded-step-00000040", first), ("superseded-step-00000040-2", second)):
        assert sorted(k.split("/", 1)[1] for k in held if k.startswith(aside + "/")) == sorted(
            [*manifest.files, "manifest.json"])
    data = s3_server.client().get_object(Bucket="ckpt", Key=location.removeprefix("s3://ckpt/") + "/superseded-step-00000040/__0_0.distcp")
    assert data["Body"].read() == b"first" * 1000
    save(storage, tmp_path, 50)
    storage.delete("step-00000050")
    assert [k for k in keys(s3_server, location) if k.startswith("step-00000050")] == []
