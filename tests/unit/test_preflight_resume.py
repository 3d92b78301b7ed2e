"""The pre-flight of a resume knows the size of the checkpoint it will keep writing: the newest
committed one's, from its manifest (a new run's workers measure theirs once the model is built)."""

import json
from pathlib import Path

import scaletrain
from scaletrain.preflight import _newest_checkpoint_bytes
from tests.helpers.tasks import toy_job


def test_a_resume_measures_the_newest_checkpoint_from_its_manifest(tmp_path):
    summary = scaletrain.run(toy_job(tmp_path, train={"max_steps": 20, "log_every": 5},
                                     checkpoint={"every_steps": 10}))
    location = Path(summary["run_dir"]) / "checkpoints"
    manifest = json.loads((location / "step-00000020" / "manifest.json").read_text())
    expected = sum(entry["size"] for entry in manifest["files"].values())
    assert expected > 0
    assert _newest_checkpoint_bytes(str(location)) == expected


def test_no_checkpoint_yet_is_no_size(tmp_path):
    assert _newest_checkpoint_bytes(str(tmp_path / "nothing-here")) is None
