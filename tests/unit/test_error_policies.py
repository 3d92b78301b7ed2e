"""train.nonfinite and data.on_error: skip goes on, counts every error beside its units of work
(the error rate the alerts read) and says so; stop (the default) stops, naming the problem."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

import scaletrain
from scaletrain.data.sampler import DataLayout, GlobalBatchSampler
from scaletrain.errors import ScaletrainError
from tests.helpers.tasks import toy_job


def figures(summary) -> dict:
    """The job's figures from every process's telemetry file of the run (what /metrics adds up)."""
    total: dict = {}
    for path in (Path(summary["run_dir"]) / "logs" / "telemetry").glob("*.json"):
        for name, value in json.loads(path.read_text())["figures"].items():
            if isinstance(value, dict) and "counts" not in value:
                for label, number in value.items():
                    total.setdefault(name, {}).setdefault(label, 0)
                    total[name][label] += number
    return total


def warnings(summary) -> list[str]:
    lines = (Path(summary["run_dir"]) / "logs" / "worker-0.jsonl").read_text().splitlines()
    return [json.loads(line)["message"] for line in lines if '"level": "warning"' in line]


def test_a_nonfinite_step_is_skipped_counted_and_said(tmp_path):
    job = toy_job(tmp_path, task={"args": {"nan_steps": [5, 9]}}, train={"max_steps": 20, "nonfinite": "skip"})
    summary = scaletrain.run(job)
    assert summary["status"] == "finished" and summary["steps"] == 20
    weights = load_file(summary["weights"])
    assert all(torch.isfinite(t).all() for t in weights.values())  # the NaN steps changed nothing
    got = figures(summary)
    assert got["errors_total"]["step"] == 2 and got["work_total"]["step"] == 20
    said = warnings(summary)
    assert said == ["step 5: non-finite loss or gradient, update skipped (train.nonfinite: skip; 1 so far)"]
    rows = [json.loads(line) for line in (Path(summary["run_dir"]) / "metrics.jsonl").read_text().splitlines()]
    losses = {row["step"]: row["loss"] for row in rows if row["split"] == "train"}
    assert losses[5] != losses[5] and losses[6] == losses[6]  # NaN reported where it happened


def test_a_nonfinite_step_stops_the_run_by_default(tmp_path):
    job = toy_job(tmp_path, task={"args": {"nan_steps": [5]}}, train={"max_steps": 20})
    with pytest.raises(ScaletrainError, match="the loss became nan at step 5"):
        scaletrain.run(job)


def test_samples_that_raise_are_skipped_counted_and_said(tmp_path):
    bad_log = tmp_path / "bad.txt"
    job = toy_job(tmp_path, task={"args": {"bad_every": 10, "bad_log": str(bad_log)}},
                  data={"on_error": "skip"}, train={"max_steps": 20})
    summary = scaletrain.run(job)
    assert summary["status"] == "finished"
    # The samples the 20 steps read (16 each), in order: each one that raised counted once.
    layout = DataLayout(dataset_len=512, batch_size=16, world_size=1, grad_accum=1)
    read = [i for batch in GlobalBatchSampler(layout, rank=0, seed=7, stop_step=20) for i in batch]
    bad = [i for i in read if i % 10 == 0]
    got = figures(summary)
    assert got["work_total"]["sample"] == 320 and got["errors_total"]["sample"] == len(bad) > 20
    assert set(bad) <= {int(i) for i in bad_log.read_text().split()}
    assert (Path(summary["run_dir"]) / "run_card.json").exists()  # its data fingerprint read them too
    first_batch = next(b for b in (read[i:i + 16] for i in range(0, 320, 16)) if any(i % 10 == 0 for i in b))
    count, first = sum(i % 10 == 0 for i in first_batch), bad[0]
    assert warnings(summary)[0].startswith(
        f"skipped {count} sample(s) whose dataset raised (data.on_error: skip; {count} so far), e.g. sample "
        f"{first}: ValueError: corrupt record {first}, in tasks.py:")


def test_samples_that_raise_stop_the_run_by_default(tmp_path):
    job = toy_job(tmp_path, task={"args": {"bad_every": 10}}, train={"max_steps": 20})
    with pytest.raises(ScaletrainError, match="corrupt record"):
        scaletrain.run(job)
