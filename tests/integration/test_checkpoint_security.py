"""Checkpoints are data, never code: what a crafted checkpoint gets from the commands a user runs
(`checkpoints verify` on a bucket, `resume`), with the real S3 server and real runs."""

import hashlib
import json
import pickle
import subprocess
import sys
from pathlib import Path

from scaletrain.checkpoint.manifest import Manifest
from tests.helpers.run import scaletrain_cli
from tests.helpers.tasks import toy_job
from tests.integration.test_cli import write_job

KEY_ENV = "SCALETRAIN_CHECKPOINT_KEY"
KEY = "k3y-that-must-never-be-printed"


def _entry(data: bytes) -> dict:
    return {"size": len(data), "sha256": hashlib.sha256(data).hexdigest()}


def _finished_run(root: Path, env: dict | None = None, **sections) -> Path:
    job = write_job(root, toy_job(root, train={"max_steps": 5}, **sections))
    result = scaletrain_cli("run", str(job), "--json", env=env)
    assert result.returncode == 0, result.stderr[-2000:]
    return Path(json.loads(result.stdout)["run_dir"])


def _rewrite_file(checkpoint: Path, name: str, data: bytes) -> None:
    """Replace one file of a checkpoint and make its manifest match again (what anyone who can
    write the folder can do)."""
    (checkpoint / name).write_bytes(data)
    manifest = json.loads((checkpoint / "manifest.json").read_text())
    manifest["files"][name] = _entry(data)
    (checkpoint / "manifest.json").write_text(json.dumps(manifest))


class _Payload:
    """Unpickling this opens (creates) the marker file: code run by whoever reads the pickle."""

    def __init__(self, marker: Path):
        self.marker = str(marker)

    def __reduce__(self):
        return (open, (self.marker, "w"))


def _index_with_payload(metadata_file: Path, marker: Path) -> bytes:
    """The checkpoint's own DCP index, plus a payload: unprotected, DCP loads it and resumes
    as if nothing happened, the payload having run."""
    import torch.distributed.checkpoint  # noqa: F401  (the index's classes)

    metadata = pickle.loads(metadata_file.read_bytes())  # our own file, written by DCP above
    metadata.planner_data = {**metadata.planner_data, "x": _Payload(marker)}
    return pickle.dumps(metadata)


def test_verify_on_a_bucket_refuses_a_manifest_naming_a_path_outside_the_cache(s3_server, tmp_path):
    scratch = tmp_path / "scratch"  # the verify cache is a temporary folder under it
    scratch.mkdir()
    client = s3_server.client()
    payload = b"export PATH=/attacker:$PATH\n"
    for name, escape in [("../../escape", scratch / "escape"), (str(tmp_path / "abs"), tmp_path / "abs")]:
        prefix = f"evil-{len(name)}/step-00000001"
        files = {".metadata": b"index", "trainer.json": b"{}", name: payload}
        for file, data in files.items():
            client.put_object(Bucket="ckpt", Key=f"{prefix}/{file}", Body=data)
        manifest = {"step": 1, "world_size": 1, "strategy": "single",
                    "files": {file: _entry(data) for file, data in files.items()}}
        client.put_object(Bucket="ckpt", Key=f"{prefix}/manifest.json", Body=json.dumps(manifest))

        result = scaletrain_cli("checkpoints", "verify", f"s3://ckpt/{prefix.split('/')[0]}", "--json",
                                env={"TMPDIR": str(scratch)})
        assert result.returncode == 1, result.stderr
        [row] = json.loads(result.stdout)
        assert (row["name"], row["status"]) == ("step-00000001", "refused")
        assert row["why"] == f"the manifest names {name!r}, which is not a file of a checkpoint: refused"
        assert not escape.exists()
    assert list(scratch.iterdir()) == []  # not even the cache's own files: nothing was fetched


def test_resume_refuses_a_checkpoint_whose_index_would_run_code(tmp_path):
    run_dir = _finished_run(tmp_path, checkpoint={"format": "dcp"})  # DCP's index is a pickle
    checkpoint = run_dir / "checkpoints" / "step-00000005"
    marker = tmp_path / "marker"
    forged = _index_with_payload(checkpoint / ".metadata", marker)
    # The payload is live: a plain unpickling of the forged index (DCP's own) runs it.
    (tmp_path / "probe").write_bytes(forged)
    probe = subprocess.run([sys.executable, "-c", "import pickle, sys, torch.distributed.checkpoint; "
                            "pickle.loads(open(sys.argv[1], 'rb').read())", str(tmp_path / "probe")])
    assert probe.returncode == 0 and marker.exists()
    marker.unlink()

    _rewrite_file(checkpoint, ".metadata", forged)  # the hashes match again
    expected_why = (".metadata names io.open, which a DCP index never holds (not written by "
                    "scaletrain): refused, nothing from it was run")

    # One more step than the finished run trained: resume must load the newest checkpoint.
    result = scaletrain_cli("resume", str(run_dir), "--set", "train.max_steps=6")
    assert result.returncode == 1
    assert "Traceback" not in result.stderr
    errors = [line for line in result.stderr.splitlines() if line.startswith("error: ")]
    assert len(errors) == 1 and errors[0].endswith(f"checkpoint {checkpoint} refused: {expected_why}")
    assert not marker.exists()

    verify = scaletrain_cli("checkpoints", "verify", str(checkpoint), "--json")
    assert verify.returncode == 1
    assert [(r["status"], r["why"]) for r in json.loads(verify.stdout)] == [("refused", expected_why)]
    assert not marker.exists()


def test_with_a_key_manifests_carry_an_hmac_that_resume_checks(tmp_path):
    run_dir = _finished_run(tmp_path, env={KEY_ENV: KEY}, checkpoint={"every_steps": 2, "keep_last": 5})
    checkpoints = run_dir / "checkpoints"
    newest = checkpoints / "step-00000005"
    assert len(json.loads((newest / "manifest.json").read_text())["hmac"]) == 64

    good = scaletrain_cli("checkpoints", "verify", str(checkpoints), "--json", env={KEY_ENV: KEY})
    assert good.returncode == 0 and {r["status"] for r in json.loads(good.stdout)} == {"verified"}
    # Without the key: verified (the hashes), and said that authenticity was not checked.
    unchecked = scaletrain_cli("checkpoints", "verify", str(checkpoints), "--json", env={KEY_ENV: ""})
    assert unchecked.returncode == 0
    assert {(r["status"], r["why"]) for r in json.loads(unchecked.stdout)} == {
        ("verified", f"carries an HMAC, not checked: {KEY_ENV} is not set")}
    wrong = scaletrain_cli("checkpoints", "verify", str(checkpoints), "--json", env={KEY_ENV: "another"})
    assert wrong.returncode == 1 and {r["status"] for r in json.loads(wrong.stdout)} == {"refused"}

    # Someone who can write the folder but has no key: new data, hashes and all, no valid HMAC.
    _rewrite_file(newest, "trainer.json", (newest / "trainer.json").read_bytes() + b" ")
    result = scaletrain_cli("resume", str(run_dir), "--set", "train.max_steps=6", env={KEY_ENV: KEY})
    assert result.returncode == 1 and "Traceback" not in result.stderr
    errors = [line for line in result.stderr.splitlines() if line.startswith("error: ")]
    assert len(errors) == 1 and errors[0].endswith(
        f"checkpoint {newest} refused: the manifest has an HMAC that does not match for the key in "
        f"{KEY_ENV} (written without that key, or changed since): refused; unset {KEY_ENV} only "
        "if you trust whoever can write this storage")

    # The key is nowhere: not in the output, not in any file the runs wrote.
    for text in (good.stdout, good.stderr, wrong.stdout, result.stdout, result.stderr):
        assert KEY not in text
    files = [path for path in run_dir.rglob("*") if path.is_file()]
    assert len(files) > 10
    for path in files:
        assert KEY.encode() not in path.read_bytes(), path


def test_checkpoints_set_aside_on_a_bucket_keep_their_files_when_the_step_is_saved_again(s3_server, tmp_path):
    """What `scaletrain resume CHECKPOINT` does to the newer checkpoints (set aside), then the
    resumed timeline (another data order) saves those steps again."""
    import scaletrain
    from scaletrain.checkpoint.storage import open_storage

    job = toy_job(tmp_path, train={"max_steps": 30},
                  checkpoint={"dir": "s3://ckpt/aside", "every_steps": 10, "keep_last": 5})
    first = scaletrain.run(job)
    storage = open_storage(f"s3://ckpt/aside/toy/{first['run_id']}")
    fs, root = storage.fs, storage.path

    def files_of(prefix: str) -> dict[str, bytes]:
        return {key.rsplit("/", 1)[1]: fs.cat_file(key) for key in fs.find(f"{root}/{prefix}")}

    def verified(prefix: str) -> None:
        local = tmp_path / "check" / prefix
        local.mkdir(parents=True)
        for name, data in files_of(prefix).items():
            (local / name).write_bytes(data)
        Manifest.from_json((local / "manifest.json").read_bytes()).check_dir(local)

    def set_aside_after(step: int, seed: int) -> dict:
        for name in storage.names()[step // 10:]:
            storage.set_aside(name)
        return scaletrain.resume(first["run_dir"], [f"seed={seed}"])

    original = files_of("step-00000020")
    assert set(original) == {"manifest.json", "state.safetensors", "trainer.json"}
    second = set_aside_after(10, 8)
    assert second["resumed_from_step"] == 10 and second["checkpoint_step"] == 30
    assert files_of("superseded-step-00000020") == original  # every byte, manifest included
    verified("superseded-step-00000020")
    resaved = files_of("step-00000020")
    assert resaved["state.safetensors"] != original["state.safetensors"]  # the other timeline's
    verified("step-00000020")

    set_aside_after(10, 9)  # the same step set aside again
    assert files_of("superseded-step-00000020") == original
    assert files_of("superseded-step-00000020-2") == resaved
    assert storage.names() == ["step-00000010", "step-00000020", "step-00000030"]
