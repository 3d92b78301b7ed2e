"""Checkpoints in one process: format, manifest, verification, retention, exact resume."""

import hashlib
import hmac
import json
import os
from datetime import datetime
from pathlib import Path

import pytest

import scaletrain
from scaletrain.checkpoint.manifest import FileEntry, Manifest, ManifestError
from scaletrain.checkpoint.retention import RetentionPolicy, to_delete
from scaletrain.checkpoint.storage import LocalStorage
from scaletrain.errors import ConfigError, RunPreempted, ScaletrainError
from scaletrain.recovery.faults import FAULT_ENV, parse_faults
from tests.helpers.run import read_metrics
from tests.helpers.tasks import toy_job


def checkpoints_of(summary) -> Path:
    return Path(summary["run_dir"]) / "checkpoints"


@pytest.mark.parametrize(("format", "files"), [
    ("auto", ["state.safetensors", "trainer.json"]),  # a small state every rank holds whole: one file
    ("dcp", [".metadata", "__0_0.distcp", "trainer.json"]),
])
def test_a_checkpoint_holds_the_state_trainer_state_and_a_manifest_of_hashes(tmp_path, format, files):
    summary = scaletrain.run(toy_job(tmp_path, train={"max_steps": 30, "eval_every": 30},
                                     checkpoint={"every_steps": 10, "format": format}))
    root = checkpoints_of(summary)
    assert sorted(p.name for p in root.iterdir()) == ["step-00000020", "step-00000030"]  # keep_last 2
    last = root / "step-00000030"
    manifest = Manifest.from_json((last / "manifest.json").read_text())
    assert sorted(manifest.files) == files
    assert manifest.step == 30 and manifest.world_size == 1 and manifest.strategy == "single"
    assert manifest.run_id == summary["run_id"]
    assert manifest.versions["scaletrain"] == scaletrain.__version__
    assert "eval/accuracy" in manifest.metrics and "train/loss" in manifest.metrics
    manifest.check_dir(last)  # every size and hash matches
    state = json.loads((last / "trainer.json").read_text())
    assert state["step"] == 30 and state["samples"] == 30 * 16 and state["epoch"] == 30 // 32
    assert state["scheduler"]["last_epoch"] == 30
    assert summary["checkpoint_step"] == 30


@pytest.mark.parametrize(("format", "name"), [("auto", "state.safetensors"), ("dcp", "__0_0.distcp")])
def test_verification_catches_truncation_and_bit_flips(tmp_path, format, name):
    summary = scaletrain.run(toy_job(tmp_path, train={"max_steps": 5}, checkpoint={"format": format}))
    folder = checkpoints_of(summary) / "step-00000005"
    manifest = Manifest.from_json((folder / "manifest.json").read_text())
    shard = folder / name
    data = bytearray(shard.read_bytes())
    data[len(data) // 2] ^= 0x01
    shard.write_bytes(bytes(data))
    with pytest.raises(ManifestError, match=rf"{name} does not match its blake3 hash \(corrupted\)"):
        manifest.check_dir(folder)
    shard.write_bytes(bytes(data[:-10]))
    with pytest.raises(ManifestError, match=r"has \d+ bytes, the manifest says \d+ \(truncated\?\)"):
        manifest.check_dir(folder)


def test_a_format_1_manifest_with_sha256_and_its_hmac_still_verifies_and_resumes(tmp_path, monkeypatch):
    """Checkpoints written before BLAKE3: sha256 entries, format 1, the HMAC over that JSON."""
    monkeypatch.setenv("SCALETRAIN_CHECKPOINT_KEY", "the-key")
    first = scaletrain.run(toy_job(tmp_path, train={"max_steps": 5}))
    folder = checkpoints_of(first) / "step-00000005"
    data = json.loads((folder / "manifest.json").read_text())
    assert data["format"] == 2 and {tuple(sorted(entry)) for entry in data["files"].values()} == {("blake3", "size")}
    data["format"] = 1
    data["files"] = {name: {"size": entry["size"], "sha256": hashlib.sha256((folder / name).read_bytes()).hexdigest()}
                     for name, entry in data["files"].items()}
    del data["hmac"]
    canonical = json.dumps(data, sort_keys=True, separators=(",", ":"), allow_nan=True)
    data["hmac"] = hmac.new(b"the-key", canonical.encode(), hashlib.sha256).hexdigest()
    (folder / "manifest.json").write_text(json.dumps(data, indent=2, sort_keys=True))
    manifest = Manifest.from_json((folder / "manifest.json").read_text())
    assert {entry.algorithm for entry in manifest.files.values()} == {"sha256"}
    manifest.check_dir(folder)
    resumed = scaletrain.resume(first["run_dir"], ["train.max_steps=8"])
    assert resumed["resumed_from_step"] == 5 and resumed["steps"] == 8
    state = folder / "state.safetensors"
    flipped = bytearray(state.read_bytes())
    flipped[-1] ^= 0x01
    state.write_bytes(bytes(flipped))
    with pytest.raises(ManifestError, match=r"state\.safetensors does not match its sha256 hash \(corrupted\)"):
        manifest.check_dir(folder)


def test_malformed_and_newer_manifests_are_refused():
    with pytest.raises(ManifestError, match="malformed"):
        Manifest.from_json("{not json")
    newer = Manifest(step=1, world_size=1, strategy="single", files={}, format=99).to_json()
    with pytest.raises(ManifestError, match="newer scaletrain"):
        Manifest.from_json(newer)


def _manifests(steps_metrics):
    return {
        f"step-{step:08d}": Manifest(step=step, world_size=1, strategy="single",
                                     files={"a": FileEntry(1, "x")}, metrics=metrics)
        for step, metrics in steps_metrics
    }


def test_retention_keeps_last_best_and_every_and_never_the_newest():
    committed = _manifests([(10, {"eval/loss": 0.5}), (20, {"eval/loss": 0.2}), (30, {"eval/loss": 0.4}),
                            (40, {"eval/loss": 0.9}), (50, {}), (60, {"eval/loss": 0.3})])
    assert to_delete(committed, RetentionPolicy(keep_last=2)) == [
        "step-00000010", "step-00000020", "step-00000030", "step-00000040"]
    best = RetentionPolicy(keep_last=1, best_metric="eval/loss", best_mode="min", best_count=2)
    assert to_delete(committed, best) == ["step-00000010", "step-00000030", "step-00000040", "step-00000050"]
    worst = RetentionPolicy(keep_last=1, best_metric="eval/loss", best_mode="max", best_count=1)
    assert "step-00000040" not in to_delete(committed, worst)
    every = RetentionPolicy(keep_last=1, keep_every=20)
    assert to_delete(committed, every) == ["step-00000010", "step-00000030", "step-00000050"]


def test_an_unfinished_save_is_not_a_checkpoint_and_is_swept(tmp_path):
    storage = LocalStorage(str(tmp_path))
    (tmp_path / "step-00000010").mkdir()  # files, no manifest: a crash before the commit
    (tmp_path / ".staging-step-00000020").mkdir()
    with pytest.raises(ManifestError, match="no manifest"):
        storage.read_manifest("step-00000010")
    assert storage.sweep_incomplete() == [".staging-step-00000020"]
    assert not (tmp_path / ".staging-step-00000020").exists()


def test_fault_specs_are_parsed_or_refused_with_one_line():
    faults = parse_faults("sigkill:rank=1:step=30; hang:rank=0:step=5:attempt=1")
    assert [(f.kind, f.rank, f.step, f.attempt) for f in faults] == [
        ("sigkill", 1, 30, 0), ("hang", 0, 5, 1)]
    with pytest.raises(ConfigError, match="unknown fault kind 'explode'"):
        parse_faults("explode:rank=0:step=1")
    with pytest.raises(ConfigError, match="expected KIND:rank=R:step=S"):
        parse_faults("raise:rank=0")


def _preempt_then_resume(tmp_path, monkeypatch, job):
    monkeypatch.setenv(FAULT_ENV, "sigusr1:rank=0:step=12")
    with pytest.raises(RunPreempted) as info:
        scaletrain.run(job)
    monkeypatch.delenv(FAULT_ENV)
    assert info.value.exit_code == 75 and info.value.step == 12 and info.value.checkpoint_step == 12
    assert str(info.value).startswith("preempted by SIGUSR1 at step 12; checkpoint of step 12 saved; "
                                      "continue with: scaletrain resume ")
    run_dir = info.value.run_dir
    assert json.loads(Path(run_dir, "summary.json").read_text())["status"] == "preempted"
    return scaletrain.resume(run_dir)


def test_preempted_then_resumed_matches_an_uninterrupted_run(tmp_path, monkeypatch):
    job = toy_job(tmp_path, task={"args": {"dropout": 0.2}}, train={"max_steps": 30, "eval_every": 10},
                  optim={"schedule": "cosine", "warmup_steps": 5})
    clean = scaletrain.run(job)
    resumed = _preempt_then_resume(tmp_path, monkeypatch, job)
    assert resumed["resumed_from_step"] == 12 and resumed["steps"] == 30 and resumed["attempt"] == 2
    assert resumed["weights_sha256"] == clean["weights_sha256"]
    steps = [row["step"] for row in read_metrics(resumed["run_dir"])]
    assert steps == list(range(1, 31))  # no gap, no duplicate
    assert [row["step"] for row in read_metrics(resumed["run_dir"], "eval")] == [10, 20, 30]


def test_negative_control_resuming_without_the_data_position_differs(tmp_path, monkeypatch):
    """Proves the exact-resume test can fail: restart the data order at step 0 on resume."""
    import scaletrain.engine.trainer as trainer_module

    job = toy_job(tmp_path, train={"max_steps": 30})
    clean = scaletrain.run(job)
    real_loader = trainer_module.train_loader

    def forgetful_loader(*args, **kwargs):
        return real_loader(*args, **{**kwargs, "start_step": 0})

    monkeypatch.setattr(trainer_module, "train_loader", forgetful_loader)
    resumed = _preempt_then_resume(tmp_path, monkeypatch, job)
    assert resumed["weights_sha256"] != clean["weights_sha256"]


def test_async_save_gives_the_same_checkpoints_and_weights(tmp_path):
    sync = scaletrain.run(toy_job(tmp_path, train={"max_steps": 30}, checkpoint={"every_steps": 10}))
    asynchronous = scaletrain.run(
        toy_job(tmp_path, train={"max_steps": 30}, checkpoint={"every_steps": 10, "async_save": True})
    )
    assert asynchronous["weights_sha256"] == sync["weights_sha256"]
    root = checkpoints_of(asynchronous)
    assert sorted(p.name for p in root.iterdir()) == ["step-00000020", "step-00000030"]
    for folder in root.iterdir():
        Manifest.from_json((folder / "manifest.json").read_text()).check_dir(folder)


def test_time_based_checkpoints(tmp_path):
    job = toy_job(tmp_path, task={"args": {"step_sleep": 0.05}}, train={"max_steps": 30},
                  checkpoint={"every_minutes": 0.005, "at_end": False, "keep_last": 100})
    summary = scaletrain.run(job)
    names = sorted(p.name for p in checkpoints_of(summary).iterdir())
    # 30 steps of >= 50 ms (1.5 s at least) with a save every 0.3 s: 2 saves or more, none at
    # step 30 (at_end off); however slow the machine, no two saves less than 0.3 s apart.
    log = Path(summary["run_dir"], "logs", "worker-0.jsonl").read_text().splitlines()
    saved = [json.loads(line) for line in log if '"checkpoint saved"' in line]
    times = [datetime.fromisoformat(entry["timestamp"]).timestamp() for entry in saved]
    gaps = [round(b - a, 3) for a, b in zip(times, times[1:])]
    assert len(names) == len(saved) >= 2 and "step-00000030" not in names, names
    assert min(gaps) >= 0.3 - 0.002, gaps  # log timestamps are to the millisecond


def test_resume_at_another_batch_size_keeps_the_global_batch_or_says_why_not(tmp_path, monkeypatch):
    job = toy_job(tmp_path, train={"max_steps": 30})
    monkeypatch.setenv(FAULT_ENV, "sigusr1:rank=0:step=12")
    with pytest.raises(RunPreempted) as info:
        scaletrain.run(job)
    monkeypatch.delenv(FAULT_ENV)
    with pytest.raises(ConfigError) as refused:
        scaletrain.resume(info.value.run_dir, ["data.batch_size=6"])
    assert str(refused.value) == (
        "this run trains with a global batch of 16 samples; data.batch_size 6 does not divide it: "
        "use one that does")
    with pytest.raises(ConfigError) as refused:
        scaletrain.resume(info.value.run_dir, ["data.batch_size=4", "scale.workers=3"])
    assert "data.batch_size 4 x scale.workers 3 cannot make it up with whole accumulation steps: " \
        "with data.batch_size 4 use scale.workers in [1, 2, 4]" in str(refused.value)
    summary = scaletrain.resume(info.value.run_dir, ["data.batch_size=8"])
    assert summary["status"] == "finished" and summary["resumed_from_step"] == 12
    launcher_log = Path(summary["run_dir"], "logs", "launcher.jsonl").read_text()
    assert ("train.grad_accum 1 -> 2 keeps the global batch of 16 samples") in launcher_log
    # A checkpoint whose global batch the job cannot have (the job file was changed by hand)
    # is still refused by the workers (one more step: the finished run loads its checkpoint).
    with pytest.raises(ScaletrainError) as refused:
        scaletrain.resume(info.value.run_dir, ["data.batch_size=8", "train.grad_accum=1", "train.max_steps=31"])
    assert "was trained with a global batch of 16 samples, this job has 8" in str(refused.value)


def test_resume_of_something_that_is_not_a_run_says_what_to_pass(tmp_path):
    with pytest.raises(ConfigError, match="not a run directory"):
        scaletrain.resume(str(tmp_path / "nothing-here"))


def test_checkpoint_section_rejects_bad_values(tmp_path):
    with pytest.raises(ConfigError) as info:
        scaletrain.run(toy_job(tmp_path, checkpoint={"every_steps": 0, "keep_best": {"mode": "up"}}))
    problems = "\n".join(info.value.problems)
    assert "checkpoint.every_steps" in problems
    assert "checkpoint.keep_best.metric" in problems
    assert "checkpoint.keep_best.mode" in problems


@pytest.fixture(autouse=True)
def _no_fault_leaks():
    yield
    assert FAULT_ENV not in os.environ


def test_a_failing_delete_is_a_warning_and_training_goes_on(tmp_path, monkeypatch):
    def refuse(self, name):
        raise PermissionError(f"read-only: {name}")

    monkeypatch.setattr(LocalStorage, "delete", refuse)
    summary = scaletrain.run(toy_job(tmp_path, train={"max_steps": 30},
                                     checkpoint={"every_steps": 10, "keep_last": 1}))
    assert summary["status"] == "finished" and summary["steps"] == 30
    assert sorted(p.name for p in checkpoints_of(summary).iterdir()) == [
        "step-00000010", "step-00000020", "step-00000030"]
    log = (Path(summary["run_dir"]) / "logs" / "worker-0.jsonl").read_text().splitlines()
    warnings = [json.loads(line)["message"] for line in log if "could not delete checkpoint" in line]
    assert warnings[0] == "could not delete checkpoint step-00000010: PermissionError: read-only: step-00000010"
