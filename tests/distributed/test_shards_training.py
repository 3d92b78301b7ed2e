"""Training from Parquet shards on a real S3-compatible server (moto), 2 gloo workers: the example
task of examples/shards/; `verify-resume` (SIGKILL between checkpoints, restart) gives the same
sha256 (over a Hugging Face stream of the same files: tests/integration/test_readme.py); a run preempted on 2 workers and resumed on 1 reads exactly the same global batches,
sample id for sample id."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

import scaletrain
from scaletrain.errors import RunPreempted, WorkerFailedError
from scaletrain.recovery.faults import FAULT_ENV
from tests.helpers.run import REPO, scaletrain_cli

pytestmark = pytest.mark.distributed

EXAMPLE = REPO / "examples" / "shards"
CORPUS = "s3://ckpt/corpus"


@pytest.fixture(scope="module")
def corpus(s3_server):
    sys.path.insert(0, str(EXAMPLE))
    try:
        from corpus import write_corpus
    finally:
        sys.path.remove(str(EXAMPLE))
    # 2048 sequences of 17 tokens in row groups of 64: 32 row groups, 4 files.
    write_corpus(CORPUS, train_rows=2048, eval_rows=128, context=16, rows_per_group=64)
    return CORPUS


def shard_job(root: Path, ids: Path | None = None, **sections) -> dict:
    job = {
        "name": "corpus_lm",
        "task": {"target": "tests.helpers.tasks:RecordingCorpusLM" if ids else "corpus_lm:CorpusLM",
                 "args": {"location": CORPUS, "layers": 1, "dim": 32, "heads": 2, "shuffle_window": 4,
                          **({"record": str(ids)} if ids else {})}},
        "data": {"batch_size": 16, "loader_workers": 2},
        "optim": {"name": "adamw", "lr": 3e-3, "schedule": "constant"},
        "train": {"max_steps": 40, "log_every": 10, "eval_every": 40},
        "checkpoint": {"every_steps": 10},
        "scale": {"workers": 2},
        "recovery": {"max_restarts": 0},
        "seed": 3,
        "run_dir": str(root / "runs"),
        "tracking": {"enabled": False},
    }
    for key, value in sections.items():
        job[key] = {**job.get(key, {}), **value}
    return job


def test_verify_resume_over_shards_on_s3(tmp_path, corpus):
    job = tmp_path / "job.yaml"
    job.write_text(json.dumps(shard_job(tmp_path)))
    checked = scaletrain_cli("verify-resume", str(job), "--steps", "24", "--json", cwd=tmp_path,
                             env={"PYTHONPATH": f"{EXAMPLE}"}, timeout=400)
    assert checked.returncode == 0, checked.stderr[-3000:]
    outcome = json.loads(checked.stdout)
    assert outcome["passed"] is True and outcome["problem"] is None, outcome
    assert (outcome["killed_at_step"], outcome["resumed_from_step"], outcome["restarts"]) == (18, 12, 1)
    assert outcome["uninterrupted_sha256"] == outcome["resumed_sha256"]


def read_ids(folder: Path) -> dict[int, list[list[int]]]:
    """rank -> its training micro-batches' sample ids, in the order it read them (the last attempt's)."""
    found = {}
    for path in sorted(folder.glob("rank-*.jsonl")):
        found[int(path.stem.split("-")[1])] = [json.loads(line) for line in path.read_text().splitlines()]
    return found


def test_preempted_on_two_workers_resumed_on_one_reads_the_same_global_batches(tmp_path, monkeypatch, corpus):
    steps = 40
    monkeypatch.setenv("PYTHONPATH", str(REPO))  # the workers import tests.helpers.tasks
    reference = scaletrain.run(shard_job(tmp_path / "ref", tmp_path / "ref-ids"))
    expected = read_ids(tmp_path / "ref-ids")
    assert sorted(expected) == [0, 1] and [len(v) for v in expected.values()] == [steps, steps]
    global_batches = [expected[0][s] + expected[1][s] for s in range(steps)]
    assert len({i for batch in global_batches for i in batch}) == steps * 32  # 40 x 32 of 2048: no repeat

    job = shard_job(tmp_path / "run", tmp_path / "ids")
    job["task"]["args"]["step_sleep"] = 0.02  # a stop is agreed within a quarter second: the run must last longer
    monkeypatch.setenv(FAULT_ENV, "sigterm:rank=0:step=17")
    with pytest.raises(RunPreempted) as stopped:
        scaletrain.run(job)
    monkeypatch.delenv(FAULT_ENV)
    at = stopped.value.step
    assert at >= 17
    before = read_ids(tmp_path / "ids")
    assert [before[0][s] + before[1][s] for s in range(at)] == global_batches[:at]

    for path in (tmp_path / "ids").iterdir():
        path.unlink()
    # One worker x 32: the same global batch as 2 x 16, chunk 0 then chunk 1.
    resumed = scaletrain.resume(stopped.value.run_dir, ["scale.workers=1", "data.batch_size=32"])
    assert resumed["world_size"] == 1 and resumed["resumed_from_step"] == at
    after = read_ids(tmp_path / "ids")
    assert sorted(after) == [0] and after[0] == global_batches[at:]
    assert reference["steps"] == resumed["steps"] == steps


def test_a_resume_over_other_shards_is_refused_naming_them(tmp_path, corpus):
    done = scaletrain.run(shard_job(tmp_path, train={"max_steps": 10, "eval_every": 10}), search_path=[str(EXAMPLE)])
    assert done["checkpoint_step"] == 10
    # Another window makes another order: the resumed run would read other batches.
    with pytest.raises(WorkerFailedError) as refused:
        scaletrain.resume(done["run_dir"], ["train.max_steps=20", "task.args.shuffle_window=8"])
    message = str(refused.value)
    assert message.startswith("worker rank ") and "failed: CheckpointError: checkpoint step-00000010 was trained on Parquet shards whose row groups have digest" in message
    assert "resume on the same shards and shuffle_window" in message and "\n" not in message
