"""Training from a stream on 2 gloo workers: a SIGKILL between checkpoints resumes to the same
weights, from the stream's saved state (stateful) or by reading its pass again and skipping
what was trained on (stateless, with one warning); a run preempted on 2 workers and resumed on
1 reads the same global batches."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

import scaletrain
from scaletrain.recovery.faults import FAULT_ENV
from tests.helpers.run import assert_same_losses_after, preempt_then_resume_on_one_worker
from tests.helpers.tasks import toy_job

pytestmark = pytest.mark.distributed


def stream_job(root: Path, **args) -> dict:
    # 512 samples, global batch 32: 16 steps a pass; 40 steps read 2.5 passes.
    return toy_job(root, task={"target": "tests.helpers.tasks:StreamingToyTask", "args": args},
                   train={"max_steps": 40, "log_every": 1, "eval_every": 20},
                   checkpoint={"every_steps": 10}, scale={"workers": 2},
                   recovery={"max_restarts": 1, "grace_period_s": 20})


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    return scaletrain.run(stream_job(tmp_path_factory.mktemp("reference"), stateful=True))


def worker_lines(summary: dict, message_part: str) -> list[dict]:
    found = []
    for log in sorted(Path(summary["run_dir"], "logs").glob("worker-*.jsonl")):
        found += [e for e in map(json.loads, log.read_text().splitlines()) if message_part in e["message"]]
    return found


def killed(monkeypatch, job: dict) -> dict:
    monkeypatch.setenv(FAULT_ENV, "sigkill:rank=1:step=25")
    try:
        return scaletrain.run(job)
    finally:
        monkeypatch.delenv(FAULT_ENV)


def test_a_stateful_stream_resumes_from_its_saved_state(tmp_path, monkeypatch, reference):
    loaded = tmp_path / "loaded.jsonl"
    summary = killed(monkeypatch, stream_job(tmp_path, stateful=True, loaded_log=str(loaded)))
    assert summary["restarts"] == 1 and summary["resumed_from_step"] == 20
    assert summary["weights_sha256"] == reference["weights_sha256"]
    # Both restarted ranks loaded the state after step 20: pass 1 (16 steps each), 4 x 32 samples in.
    states = [json.loads(line) for line in loaded.read_text().splitlines()]
    assert states == [{"epoch": 1, "index": 128}] * 2
    assert not worker_lines(summary, "has no state_dict()")
    card = json.loads(Path(summary["run_dir"], "run_card.json").read_text())
    assert card["data_fingerprint"].startswith("not known: a stream (Stream)")


def test_a_stateless_stream_is_read_again_and_skipped_with_one_warning(tmp_path, monkeypatch, reference):
    summary = killed(monkeypatch, stream_job(tmp_path, stateful=False))
    assert summary["restarts"] == 1 and summary["resumed_from_step"] == 20
    assert summary["weights_sha256"] == reference["weights_sha256"]
    warned = worker_lines(summary, "has no state_dict()/load_state_dict(): a resume reads it again")
    assert [(w["rank"], w["level"]) for w in warned] == [(0, "warning")] * 2  # once per attempt, rank 0
    skipped = worker_lines(summary, "skipped the 128 samples of pass 1 trained on before the checkpoint")
    assert sorted(w["rank"] for w in skipped) == [0, 1]


def test_preempted_on_two_workers_resumed_on_one_reads_the_same_batches(tmp_path, monkeypatch, reference):
    # Slow steps: a stop is agreed within a quarter second, so the run must last longer.
    job = stream_job(tmp_path, stateful=True, step_sleep=0.02)
    stopped_at, resumed = preempt_then_resume_on_one_worker(job, monkeypatch)
    said = worker_lines(resumed, "resuming the training stream at sample")
    samples_in_pass = (stopped_at % 16) * 32  # 16 steps of 32 samples a pass
    assert [e["message"] for e in said][-1] == (
        f"resuming the training stream at sample {samples_in_pass} of pass {stopped_at // 16}, from its "
        "saved state; global batches of 32 samples, the same at any number of workers")
    assert_same_losses_after(reference, resumed, stopped_at, 40)
