"""The shipped examples really learn, on 2 local workers, as `make run` trains them."""

import json
from pathlib import Path

import scaletrain
from tests.helpers.run import REPO, read_metrics

# digits on two workers reaching 95%: test_readme.py's `make run` trains exactly that job.


def test_tiny_gpt_loss_falls_clearly(tmp_path):
    summary = scaletrain.run(
        REPO / "examples" / "tiny_gpt.yaml",
        ["train.max_steps=120", "train.eval_every=60", f"run_dir={tmp_path}"],
    )
    train = read_metrics(summary["run_dir"])
    assert train[0]["loss"] > 3.0  # ln(32) = 3.47 at the start
    assert summary["eval"]["loss"] < 0.5 * train[0]["loss"]


def test_tiny_gpt_trains_on_a_text_file(tmp_path):
    text = tmp_path / "text.txt"
    text.write_text("the quick brown fox jumps over the lazy dog. " * 200)
    summary = scaletrain.run(
        REPO / "examples" / "tiny_gpt.yaml",
        [f"task.args.text_file={text}", "train.max_steps=40", "scale.workers=1",
         "train.eval_every=null", f"run_dir={tmp_path}"],
    )
    train = read_metrics(summary["run_dir"])
    assert summary["steps"] == 40
    assert train[-1]["loss"] < train[0]["loss"] - 1.0


def test_job_files_reference_the_current_schema():
    committed = json.loads((REPO / "docs" / "job.schema.json").read_text())
    from scaletrain.config import job_schema

    assert committed == job_schema(), "run: scaletrain schema > docs/job.schema.json"
    for job in Path(REPO, "examples").glob("*.yaml"):
        assert "$schema=../docs/job.schema.json" in job.read_text()
