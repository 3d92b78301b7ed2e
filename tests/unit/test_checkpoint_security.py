"""Checkpoints are data, never code: manifest names, DCP's index read with the allow-list, the
HMAC, set-aside checkpoints kept, NaN metrics in retention, and saves that fail."""

import hashlib
import json
import os
import pickle
from pathlib import Path

import pytest

import scaletrain
from scaletrain.checkpoint.dcp_metadata import read_metadata
from scaletrain.checkpoint.manifest import (
    KEY_ENV,
    CheckpointRefused,
    FileEntry,
    Manifest,
    file_path,
)
from scaletrain.checkpoint.retention import RetentionPolicy, to_delete
from scaletrain.checkpoint.storage import LocalStorage
from tests.helpers.tasks import toy_job

LAYOUT = {".metadata": FileEntry(5, "a" * 64), "trainer.json": FileEntry(2, "b" * 64),
          "__0_0.distcp": FileEntry(9, "c" * 64)}


def _manifest(**changes) -> Manifest:
    return Manifest(**{"step": 3, "world_size": 1, "strategy": "single", "files": dict(LAYOUT), **changes})


@pytest.mark.parametrize("name", [
    "../../escape", "/etc/passwd", "sub/__0_0.distcp", "__0_0.distcp/..", "a\\b", "a\x00b", "..", "",
    "manifest.json", "__0_0.distcp\n", "__٠_0.distcp",
])
def test_a_manifest_naming_anything_but_a_checkpoints_files_is_refused(name):
    text = _manifest(files={**LAYOUT, name: FileEntry(1, "d" * 64)}).to_json()
    with pytest.raises(CheckpointRefused) as refused:
        Manifest.from_json(text)
    assert str(refused.value) == f"the manifest names {name!r}, which is not a file of a checkpoint: refused"
    assert "\n" not in str(refused.value)


def test_a_manifest_must_list_the_index_and_the_trainer_state():
    files = {k: v for k, v in LAYOUT.items() if k != ".metadata"}
    with pytest.raises(CheckpointRefused, match=r"^the manifest lists no index \(\.metadata, state\.safetensors or tf\.index\): refused$"):
        Manifest.from_json(_manifest(files=files).to_json())
    files = {k: v for k, v in LAYOUT.items() if k != "trainer.json"}
    with pytest.raises(CheckpointRefused, match=r"^the manifest does not list trainer\.json: refused$"):
        Manifest.from_json(_manifest(files=files).to_json())
    assert sorted(Manifest.from_json(_manifest().to_json()).files) == sorted(LAYOUT)
    # A TensorFlow job's: TF's index and data shards; nothing else TF might name.
    entry = next(iter(LAYOUT.values()))
    tf_files = {"trainer.json": entry, "tf.index": entry, "tf.data-00000-of-00001": entry}
    assert sorted(Manifest.from_json(_manifest(files=tf_files).to_json()).files) == sorted(tf_files)
    with pytest.raises(CheckpointRefused, match=r"names 'tf\.data-0-of-1', which is not a file of a checkpoint"):
        Manifest.from_json(_manifest(files={**tf_files, "tf.data-0-of-1": entry}).to_json())


def test_a_file_linked_outside_the_checkpoint_folder_is_refused(tmp_path):
    folder = tmp_path / "step-00000003"
    folder.mkdir()
    (tmp_path / "secret").write_text("x")
    (folder / "__0_0.distcp").symlink_to(tmp_path / "secret")
    with pytest.raises(CheckpointRefused, match=r"^__0_0.distcp resolves outside the checkpoint folder: refused$"):
        file_path(folder, "__0_0.distcp")
    assert file_path(folder, "trainer.json") == folder / "trainer.json"


def test_hmac_made_with_the_key_checked_with_it_and_unchecked_without(monkeypatch):
    monkeypatch.setenv(KEY_ENV, "key-one")
    signed = _manifest(metrics={"eval/loss": float("nan")}).sign()
    assert len(signed.hmac) == 64
    assert Manifest.from_json(signed.to_json()).hmac == signed.hmac  # NaN and all, canonical
    data = json.loads(signed.to_json())
    data["step"] = 4  # anyone can change a field ...
    with pytest.raises(CheckpointRefused, match="has an HMAC that does not match for the key in SCALETRAIN_CHECKPOINT_KEY"):
        Manifest.from_json(json.dumps(data))
    del data["hmac"]  # ... or drop the HMAC: neither passes with the key
    with pytest.raises(CheckpointRefused, match="^the manifest has no HMAC for the key in SCALETRAIN_CHECKPOINT_KEY"):
        Manifest.from_json(json.dumps(data))
    monkeypatch.setenv(KEY_ENV, "key-two")
    with pytest.raises(CheckpointRefused, match="does not match"):
        Manifest.from_json(signed.to_json())
    monkeypatch.delenv(KEY_ENV)
    unchecked = Manifest.from_json(signed.to_json())
    assert unchecked.signed_but_unchecked and not Manifest.from_json(json.dumps(data)).signed_but_unchecked
    assert _manifest().sign().hmac is None  # no key: no HMAC, as before


# ------------------------------------------------------------------ DCP's index


@pytest.fixture(scope="module")
def dcp_checkpoint(tmp_path_factory):
    """A real DCP index: model and AdamW state (tensors of several dtypes, non-tensor items)."""
    import torch
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict

    folder = tmp_path_factory.mktemp("dcp")
    model = torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.BatchNorm1d(4)).to(torch.bfloat16)
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.1)
    model(torch.randn(5, 3, dtype=torch.bfloat16)).sum().backward()
    optimizer.step()
    model_sd, optim_sd = get_state_dict(model, optimizer)
    dcp.save({"model": model_sd, "optim": optim_sd}, checkpoint_id=str(folder))
    files = {p.name: FileEntry(p.stat().st_size, hashlib.sha256(p.read_bytes()).hexdigest(), "sha256")
             for p in folder.iterdir()}
    return folder, files


def _with(files: dict, data: bytes) -> dict:
    return {**files, ".metadata": FileEntry(len(data), hashlib.sha256(data).hexdigest(), "sha256")}


def test_a_real_dcp_index_reads_with_the_allow_list(dcp_checkpoint):
    folder, files = dcp_checkpoint
    data = (folder / ".metadata").read_bytes()
    metadata = read_metadata(data, files)
    assert metadata.state_dict_metadata.keys() == pickle.loads(data).state_dict_metadata.keys()
    assert {info.relative_path for info in metadata.storage_data.values()} == {"__0_0.distcp"}


class _Call:
    def __init__(self, func, *args):
        self.func, self.args = func, args

    def __reduce__(self):
        return (self.func, self.args)


@pytest.mark.parametrize("payload, named", [
    (_Call(os.system, "true"), "posix.system"),
    (_Call(eval, "1"), "builtins.eval"),
    (_Call(Path.write_text, Path("/nonexistent/x"), "x"), "pathlib.Path.write_text"),  # a dotted name
    (_Call(getattr, Path("/"), "exists"), "builtins.getattr"),
])
def test_an_index_naming_anything_else_is_refused_before_it_is_called(dcp_checkpoint, payload, named):
    import torch.distributed.checkpoint  # noqa: F401

    folder, files = dcp_checkpoint
    metadata = pickle.loads((folder / ".metadata").read_bytes())
    metadata.planner_data = {"x": payload}
    data = pickle.dumps(metadata)
    with pytest.raises(CheckpointRefused) as refused:
        read_metadata(data, _with(files, data))
    assert str(refused.value) == (f".metadata names {named}, which a DCP index never holds (not written "
                                  "by scaletrain): refused, nothing from it was run")


def test_an_index_pointing_at_a_file_the_manifest_does_not_list_is_refused(dcp_checkpoint):
    import torch.distributed.checkpoint  # noqa: F401

    folder, files = dcp_checkpoint
    metadata = pickle.loads((folder / ".metadata").read_bytes())
    for info in metadata.storage_data.values():
        info.relative_path = "../../etc/shadow"
    data = pickle.dumps(metadata)
    with pytest.raises(CheckpointRefused, match=r"^\.metadata points at '\.\./\.\./etc/shadow', which the manifest does not list: refused$"):
        read_metadata(data, _with(files, data))
    with pytest.raises(CheckpointRefused, match=r"^\.metadata is not the file the manifest lists: refused$"):
        read_metadata(data, files)  # and its bytes must be the ones the manifest hashed


# ------------------------------------------------------------------ storage and retention


def test_setting_the_same_step_aside_twice_keeps_both(tmp_path):
    storage = LocalStorage(str(tmp_path))
    for timeline in ("first", "second"):
        (tmp_path / "step-00000020").mkdir()
        (tmp_path / "step-00000020" / "trainer.json").write_text(timeline)
        storage.set_aside("step-00000020")
    assert (tmp_path / "superseded-step-00000020" / "trainer.json").read_text() == "first"
    assert (tmp_path / "superseded-step-00000020-2" / "trainer.json").read_text() == "second"
    assert storage.names() == []


def test_keep_best_ignores_nan_and_infinite_metrics():
    def manifests(values):
        return {f"step-{step:08d}": _manifest(step=step, metrics={"eval/loss": value})
                for step, value in values}

    nan, inf = float("nan"), float("inf")
    best = RetentionPolicy(keep_last=1, best_metric="eval/loss", best_mode="min", best_count=1)
    # Sorting with a NaN first leaves the list as it was: the "best" was whatever came first.
    assert to_delete(manifests([(10, nan), (20, 0.9), (30, 0.2), (40, 0.5)]), best) == [
        "step-00000010", "step-00000020"]
    assert to_delete(manifests([(10, 0.9), (20, -inf), (30, 0.3), (40, nan)]), best) == [
        "step-00000010", "step-00000020"]
    most = RetentionPolicy(keep_last=1, best_metric="eval/loss", best_mode="max", best_count=1)
    assert to_delete(manifests([(10, 0.4), (20, inf), (30, 0.1)]), most) == ["step-00000020"]


# ------------------------------------------------------------------ saves that fail


def _refuse_commits(monkeypatch, steps):
    """The storage refuses the manifest of these steps (a full disk at the commit)."""
    real_commit = LocalStorage.commit

    def commit(self, name, staging, manifest):
        if manifest.step in steps:
            raise OSError(28, "No space left on device")
        real_commit(self, name, staging, manifest)

    monkeypatch.setattr(LocalStorage, "commit", commit)


def _warnings(summary) -> list[str]:
    log = Path(summary["run_dir"], "logs", "worker-0.jsonl").read_text().splitlines()
    return [entry["message"] for entry in map(json.loads, log) if entry["level"].lower() == "warning"]


def test_a_failed_final_checkpoint_still_leaves_the_final_weights(tmp_path, monkeypatch):
    job = toy_job(tmp_path, train={"max_steps": 20}, checkpoint={"every_steps": 10})
    clean = scaletrain.run(job)
    _refuse_commits(monkeypatch, {20})
    summary = scaletrain.run(job)
    assert summary["status"] == "finished" and summary["steps"] == 20
    assert summary["checkpoint_step"] == 10  # the newest that exists
    assert summary["weights_sha256"] == clean["weights_sha256"]
    assert Path(summary["run_dir"], "model.safetensors").is_file()
    checkpoints = Path(summary["run_dir"], "checkpoints")
    assert sorted(p.name for p in checkpoints.iterdir() if not p.name.startswith(".")) == ["step-00000010"]
    assert _warnings(summary) == [
        f"saving checkpoint {checkpoints}/step-00000020 failed: OSError: [Errno 28] No space left on "
        "device; the run goes on without it"]


def test_saves_failing_from_the_start_cost_warnings_not_the_run(tmp_path, monkeypatch):
    """Nothing ever committed: a restart would retrain from step 0 into the same failure."""
    _refuse_commits(monkeypatch, {5, 10, 15})
    summary = scaletrain.run(toy_job(tmp_path, train={"max_steps": 15}, checkpoint={"every_steps": 5}))
    assert summary["status"] == "finished" and summary["steps"] == 15
    assert summary["checkpoint_step"] is None
    assert Path(summary["run_dir"], "model.safetensors").is_file()
    assert [w.split(" failed: ")[0].rsplit("/", 1)[1] for w in _warnings(summary)] == [
        "step-00000005", "step-00000010", "step-00000015"]
