"""`scaletrain resume`'s decisions before any worker starts: which run a target names, whether a
finished run is left alone, and how a run resumed at another size keeps its global batch."""

import json
from pathlib import Path

import pytest

from scaletrain.config import parse_job
from scaletrain.errors import ConfigError, ScaletrainError
from scaletrain.recovery.resume import RunFinished, find_run_dir, keep_global_batch, prepare_resume
from scaletrain.rundir import RunLock, RunSpec
from scaletrain.rundir.lock import RunInUse
from tests.helpers.tasks import toy_job

RUN_ID = "20261202-141500-3fa9c1"


def make_run(root, run_id=RUN_ID, summary=None, **sections):
    """A run directory as a launch leaves it: spec.json (the resolved job) and, if given, summary.json."""
    job = parse_job(toy_job(root, **sections)).model_dump(mode="json")
    spec = RunSpec.in_dir(job, root / "runs", run_id=run_id)
    spec.write()
    run_dir = Path(spec.run_dir)
    if summary is not None:
        (run_dir / "summary.json").write_text(json.dumps({"run_id": run_id, **summary}), encoding="utf-8")
    return run_dir


def make_checkpoint(run_dir, step):
    folder = run_dir / "checkpoints" / f"step-{step:08d}"
    folder.mkdir(parents=True)
    (folder / "manifest.json").write_text("{}", encoding="utf-8")
    (folder / "trainer.json").write_text(json.dumps({"run_dir": str(run_dir), "step": step}), encoding="utf-8")
    return folder


@pytest.fixture
def here(tmp_path, monkeypatch):
    """The user's working directory: run ids are looked up under ./runs."""
    monkeypatch.chdir(tmp_path)
    return tmp_path


# Which run a target names

def test_a_run_directory_names_itself(here):
    run_dir = make_run(here)
    assert find_run_dir(str(run_dir)) == (run_dir, None)
    assert find_run_dir("runs/toy/" + RUN_ID) == (run_dir, None)  # relative to where the user is


def test_a_run_id_or_its_unique_start_is_looked_up_under_the_runs_root(here):
    run_dir = make_run(here)
    assert find_run_dir(RUN_ID) == (run_dir, None)
    assert find_run_dir("20261202-1415") == (run_dir, None)
    other_root = here / "elsewhere"
    moved = make_run(other_root)
    assert find_run_dir(RUN_ID, runs_root=other_root / "runs") == (moved, None)


def test_an_exact_run_id_wins_over_longer_ids_it_starts(here):
    exact = make_run(here, run_id="20261202-141500-3fa9c1")
    make_run(here, run_id="20261202-141500-3fa9c1b")
    assert find_run_dir("20261202-141500-3fa9c1") == (exact, None)


def test_a_run_id_start_shared_by_several_runs_is_refused_with_them(here):
    first = make_run(here, run_id="20261202-141500-aaaaaa")
    second = make_run(here, run_id="20261202-141500-bbbbbb")
    with pytest.raises(ConfigError) as refused:
        find_run_dir("20261202-141500")
    assert str(refused.value) == (
        f"run id '20261202-141500' matches 2 runs (runs/toy/{first.name}, runs/toy/{second.name}); "
        "pass the run directory, or more of the id"
    )


def test_many_matches_are_listed_five_at_most(here):
    for n in range(7):
        make_run(here, run_id=f"20261202-141500-00000{n}")
    with pytest.raises(ConfigError, match=r"matches 7 runs \(.*-000004 and 2 more\); pass the run directory"):
        find_run_dir("20261202")


def test_a_checkpoint_folder_names_its_run_and_itself(here):
    run_dir = make_run(here)
    folder = make_checkpoint(run_dir, 10)
    assert find_run_dir(str(folder)) == (run_dir, folder)


def test_a_checkpoint_whose_run_directory_is_gone_is_refused(here):
    run_dir = make_run(here)
    folder = make_checkpoint(run_dir, 10)
    (run_dir / "spec.json").unlink()
    with pytest.raises(ScaletrainError) as refused:
        find_run_dir(str(folder))
    assert str(refused.value) == (
        f"checkpoint {folder} belongs to run directory {run_dir}, which is not here; resume needs "
        "that run directory (its spec.json)"
    )


def test_a_checkpoint_without_trainer_json_is_refused(here):
    folder = here / "step-00000010"
    folder.mkdir()
    (folder / "manifest.json").write_text("{}", encoding="utf-8")
    with pytest.raises(ScaletrainError, match=r"^checkpoint .*step-00000010 has no readable trainer.json \("):
        find_run_dir(str(folder))


@pytest.mark.parametrize("target", ["runs/toy", "toy", "20991231", "missing/run"])
def test_anything_else_is_one_clear_line(here, target):
    """A directory without spec.json (here the job's folder of runs), a job name, an unknown id."""
    make_run(here)
    with pytest.raises(ConfigError) as refused:
        find_run_dir(target)
    assert str(refused.value) == (
        f"cannot resume {target!r}: not a run directory (with spec.json), a checkpoint folder (with "
        "manifest.json) or a run id under ./runs; see `scaletrain runs`"
    )


def test_a_run_directory_without_spec_json_is_one_clear_line(here):
    run_dir = make_run(here)
    (run_dir / "spec.json").unlink()
    with pytest.raises(ConfigError) as refused:
        prepare_resume(str(run_dir))
    assert str(refused.value) == (
        f"cannot resume {str(run_dir)!r}: not a run directory (with spec.json), a checkpoint folder (with "
        "manifest.json) or a run id under ./runs; see `scaletrain runs`"
    )
    assert "\n" not in str(refused.value)


def test_a_glob_pattern_is_not_a_run_id(here):
    make_run(here)
    with pytest.raises(ConfigError, match=r"^'2026\*' is not a run id: use the scaletrain or MLflow run id"):
        find_run_dir("2026*")


def test_an_unreadable_spec_json_says_so(here):
    run_dir = make_run(here)
    (run_dir / "spec.json").write_text('{"job": ', encoding="utf-8")
    with pytest.raises(ScaletrainError, match=rf"^cannot read {run_dir}/spec.json: "):
        prepare_resume(RUN_ID)


# A finished run is left as it is

def test_a_finished_run_raises_run_finished_with_its_note(here):
    summary = {"status": "finished", "steps": 20}
    make_run(here, summary=summary)
    with pytest.raises(RunFinished) as finished:
        prepare_resume(RUN_ID)
    assert finished.value.note == (
        f"run {RUN_ID} finished at step 20: nothing to resume (to train it longer, pass --set train.max_steps=N)"
    )
    assert finished.value.summary == {"run_id": RUN_ID, **summary}
    assert not (here / "runs" / "toy" / RUN_ID / ".lock").exists(), "refused before the lock"


def test_a_finished_run_measured_in_epochs_says_which_length_to_set(here):
    make_run(here, summary={"status": "finished", "steps": 64}, train={"epochs": 2, "max_steps": None})
    with pytest.raises(RunFinished) as finished:
        prepare_resume(RUN_ID)
    assert finished.value.note.endswith("(to train it longer, pass --set train.epochs=N)")


def test_a_finished_run_made_longer_is_prepared(here):
    run_dir = make_run(here, summary={"status": "finished", "steps": 20})
    spec, notes, lock = prepare_resume(RUN_ID, ["train.max_steps=40"])
    try:
        assert spec.job["train"]["max_steps"] == 40
        assert spec.run_dir == str(run_dir) and notes == []
    finally:
        lock.release()


@pytest.mark.parametrize("summary", [
    {"status": "failed", "steps": 20},
    {"status": "preempted", "steps": 12},
    {"status": "finished", "steps": 20, "run_id": "20261202-000000-000000"},  # another run's summary
])
def test_only_this_runs_finished_summary_stops_a_resume(here, summary):
    make_run(here, summary=summary)
    spec, notes, lock = prepare_resume(RUN_ID)
    lock.release()
    assert spec.run_id == RUN_ID


def test_a_finished_run_whose_checkpoints_end_earlier_trains_that_timeline_again(here):
    run_dir = make_run(here, summary={"status": "finished", "steps": 20})
    make_checkpoint(run_dir, 10)
    spec, notes, lock = prepare_resume(RUN_ID)
    lock.release()
    assert spec.run_id == RUN_ID


def test_a_run_in_use_is_refused(here):
    run_dir = make_run(here)
    with RunLock(run_dir, RUN_ID):
        with pytest.raises(RunInUse):
            prepare_resume(RUN_ID)


def test_a_moved_run_directory_continues_where_it_is(here):
    run_dir = make_run(here)
    moved = here / "archive" / RUN_ID
    moved.parent.mkdir()
    run_dir.rename(moved)
    spec, notes, lock = prepare_resume(str(moved))
    lock.release()
    assert spec.run_dir == str(moved)
    assert notes == [f"run directory moved from {run_dir}: continuing in {moved}"]


def test_a_copy_of_a_run_that_is_still_there_is_refused(here):
    run_dir = make_run(here)
    copy = here / "copy"
    copy.mkdir()
    (copy / "spec.json").write_text((run_dir / "spec.json").read_text(encoding="utf-8"), encoding="utf-8")
    with pytest.raises(ConfigError, match=rf"^{copy} is a copy of run directory {run_dir}, which is still there"):
        prepare_resume(str(copy))


# Another number of workers keeps the global batch

def job(workers, batch_size, grad_accum=1):
    return parse_job(toy_job(Path("/tmp"), scale={"workers": workers}, data={"batch_size": batch_size},
                             train={"max_steps": 20, "grad_accum": grad_accum}))


def test_the_same_global_batch_changes_nothing():
    resumed = job(2, 8, grad_accum=2)
    assert keep_global_batch(job(4, 8), resumed) == (resumed, [])


def test_fewer_workers_accumulate_more_micro_steps():
    kept, notes = keep_global_batch(job(4, 8), job(2, 8))
    assert (kept.train.grad_accum, kept.scale.workers, kept.data.batch_size) == (2, 2, 8)
    assert notes == ["resumed on 2 worker(s) x data.batch_size 8: train.grad_accum 1 -> 2 keeps the global "
                     "batch of 32 samples"]


def test_more_workers_accumulate_fewer_micro_steps():
    # the resumed job is the recorded one with scale.workers overridden: it still says grad_accum 4
    kept, notes = keep_global_batch(job(1, 8, grad_accum=4), job(4, 8, grad_accum=4))
    assert kept.train.grad_accum == 1
    assert notes == ["resumed on 4 worker(s) x data.batch_size 8: train.grad_accum 4 -> 1 keeps the global "
                     "batch of 32 samples"]


def test_a_worker_count_that_cannot_make_up_the_batch_is_refused_with_those_that_can():
    with pytest.raises(ConfigError) as refused:
        keep_global_batch(job(4, 8), job(3, 8))
    assert str(refused.value) == (
        "this run trains with a global batch of 32 samples; data.batch_size 8 x scale.workers 3 cannot "
        "make it up with whole accumulation steps: with data.batch_size 8 use scale.workers in [1, 2, 4], "
        "or another data.batch_size that divides 32"
    )


def test_a_batch_size_that_does_not_divide_the_global_batch_is_refused():
    with pytest.raises(ConfigError) as refused:
        keep_global_batch(job(4, 8), job(1, 5))
    assert str(refused.value) == (
        "this run trains with a global batch of 32 samples; data.batch_size 5 does not divide it: use one that does"
    )


def test_prepare_resume_keeps_the_global_batch_unless_grad_accum_is_set(here):
    make_run(here, scale={"workers": 2})
    spec, notes, lock = prepare_resume(RUN_ID, ["scale.workers=1"])
    lock.release()
    assert (spec.job["scale"]["workers"], spec.job["train"]["grad_accum"]) == (1, 2)
    assert notes == ["resumed on 1 worker(s) x data.batch_size 16: train.grad_accum 1 -> 2 keeps the global "
                     "batch of 32 samples"]
    spec, notes, lock = prepare_resume(RUN_ID, ["scale.workers=1", "train.grad_accum=1"])
    lock.release()
    assert (spec.job["train"]["grad_accum"], notes) == (1, [])
