"""The job file's three ways to name code (task, loop, script), a loop's checkpointed state, the
loop handed over by value, and a script's arguments as MLflow params: in one process."""

import json
import os

import pytest
import torch
from torch import nn

import scaletrain
from scaletrain.checkpoint.state import LoopObjects
from scaletrain.config import parse_job
from scaletrain.errors import ConfigError, ScaletrainError
from scaletrain.rundir.names import LOOP_FILE_ENV, LOOP_KEY_ENV
from scaletrain.runners.pickled_loop import read_loop, write_loop
from scaletrain.tracking.mlflow_run import job_params, script_arguments
from tests.helpers.loops import loop_job
from tests.helpers.tasks import toy_job


def problems(data):
    with pytest.raises(ConfigError) as info:
        parse_job(data)
    return info.value.problems


def test_a_job_names_its_code_exactly_one_way(tmp_path):
    both = {**toy_job(tmp_path), "loop": {"target": "m:f"}}
    assert problems(both) == ["set exactly one of task: (a scaletrain Task, `module:factory`), loop: (your own "
                              "training loop, `module:function`) or script: (a torchrun script) (task and loop are set)"]
    neither = {k: v for k, v in toy_job(tmp_path).items() if k != "task"}
    assert problems(neither)[0].startswith("set exactly one of task:")
    # A task job's sections stay required, listed with every other problem of the file.
    no_optim = {k: v for k, v in toy_job(tmp_path).items() if k != "optim"}
    no_optim["data"] = {"batch_size": 0}
    assert problems(no_optim) == ["data.batch_size: must be a positive integer, got 0",
                                  "optim: required; add it to the job file"]


def test_a_loop_job_takes_only_what_a_loop_uses(tmp_path):
    assert problems({**loop_job(tmp_path), "data": {"batch_size": 8}}) == [
        "a loop job builds its own data loaders and optimizer: move the data settings into loop.args "
        "(your loop reads them as ctx.config)"]
    assert problems(loop_job(tmp_path, train={"epochs": 2, "max_steps": None})) == [
        "train.epochs is the Task runner's; a loop job's train: takes only max_steps (the total, for the "
        "progress bar) and log_every"]
    assert problems(loop_job(tmp_path, scale={"strategy": "zero1"})) == [
        "scale.strategy zero1 shards the optimizer the Task runner builds; a loop builds its own: use ddp or fsdp"]
    job = parse_job(loop_job(tmp_path))
    assert job.kind == "loop" and job.data is None and job.optim is None
    assert parse_job(job.model_dump(mode="json")) == job  # what the workers read back


def test_a_script_job_runs_on_the_local_engine(tmp_path):
    script = {"name": "s", "script": {"path": "train.py", "args": ["--lr", "0.1"]}, "scale": {"engine": "ray"}}
    assert problems(script) == ["a script runs on the local engine (one launcher per machine, scale.nodes "
                                "for several): set scale.engine local"]
    job = parse_job({**script, "scale": {"workers": 2}})
    assert job.kind == "script"
    # What a node joining a job on several machines compares: a script job has one too.
    from scaletrain.checkpoint.location import config_hash

    other = parse_job({**script, "scale": {"workers": 2}, "script": {"path": "train.py", "args": ["--lr", "0.2"]}})
    assert config_hash(job) != config_hash(other) and config_hash(job) == config_hash(parse_job(job.model_dump()))


def test_a_loops_plain_values_travel_as_json_and_the_rest_through_dcp():
    model = nn.Linear(2, 2)
    optimizer = torch.optim.AdamW(model.parameters())
    state = LoopObjects({"model": model, "optimizer": optimizer, "epoch": 3, "best": {"loss": 0.5}})
    assert state.values() == {"epoch": 3, "best": {"loss": 0.5}}
    assert set(state.dcp_state()) == {"model", "optimizer"}
    with pytest.raises(TypeError, match=r"cannot keep 'ids' in a checkpoint: it is a set; keep numbers"):
        LoopObjects({"model": model, "ids": {1, 2}}).values()
    with pytest.raises(TypeError, match=r"the optimizer 'optimizer' steps parameters of no module in the state"):
        LoopObjects({"optimizer": optimizer}).dcp_state()


def test_a_loop_handed_over_by_value_loads_only_when_its_hmac_verifies(tmp_path, monkeypatch):
    def train(ctx):
        return "trained"

    monkeypatch.setattr(train, "__module__", "__main__")  # as a notebook's or script's own function
    env = write_loop(train, tmp_path)
    assert oct(os.stat(env[LOOP_FILE_ENV]).st_mode & 0o777) == "0o600"
    monkeypatch.setenv(LOOP_FILE_ENV, env[LOOP_FILE_ENV])
    monkeypatch.setenv(LOOP_KEY_ENV, env[LOOP_KEY_ENV])
    assert read_loop("train")(None) == "trained"
    blob = open(env[LOOP_FILE_ENV], "rb").read()
    open(env[LOOP_FILE_ENV], "wb").write(blob[:-1] + bytes([blob[-1] ^ 1]))
    with pytest.raises(ScaletrainError, match=r"refused the loop in .*: its HMAC does not verify"):
        read_loop("train")
    monkeypatch.delenv(LOOP_KEY_ENV)
    with pytest.raises(ScaletrainError, match=r"runs only through scaletrain.run_loop\(\.\.\.\) from there"):
        read_loop("train")


def test_a_scripts_arguments_become_params():
    assert script_arguments(["--lr", "0.1", "--epochs=3", "--amp", "--beta", "-0.5", "data.csv"]) == {
        "lr": "0.1", "epochs": "3", "amp": "true", "beta": "-0.5", "0": "data.csv"}
    params = job_params({"name": "s", "task": None, "data": None, "script": {"path": "t.py", "args": ["--lr", "1"]}})
    assert params == {"name": "s", "script.path": "t.py", "script.args": ["--lr", "1"], "script.args.lr": "1"}


def test_report_and_should_stop_are_no_ops_outside_launch(monkeypatch):
    monkeypatch.delenv("SCALETRAIN_SPEC", raising=False)
    assert scaletrain.report({"loss": 1.0}) is None
    assert scaletrain.should_stop() is False


def test_launch_names_a_missing_script_in_one_line(tmp_path):
    from tests.helpers.run import scaletrain_cli

    result = scaletrain_cli("launch", "--workers", "2", "nowhere.py", cwd=tmp_path)
    assert result.returncode == 2 and result.stderr.strip() == (
        "error: script 'nowhere.py' not found; give the path of a Python file")
    job = tmp_path / "job.yaml"
    job.write_text(json.dumps(toy_job(tmp_path)))
    (tmp_path / "train.py").write_text("print('hi')\n")
    result = scaletrain_cli("launch", "--job", str(job), "train.py", cwd=tmp_path)
    assert result.returncode == 2 and "--job: the file names its code (task:)" in result.stderr


def test_a_loop_runs_in_process_with_its_card_weights_and_checkpoints(tmp_path):
    summary = scaletrain.run(loop_job(tmp_path, scale={"workers": 1}, recovery={"max_restarts": 0}))
    assert summary["engine"] == "in-process" and summary["strategy"] == "single" and summary["steps"] == 40
    run_dir = tmp_path / "runs" / "loop" / summary["run_id"]
    card = json.loads((run_dir / "run_card.json").read_text())
    assert card["data_fingerprint"].startswith("sha256:")
    assert summary["weights"] == str(run_dir / "model.safetensors") and summary["checkpoint_step"] == 40
    assert sorted(p.name for p in (run_dir / "checkpoints").iterdir()) == [
        "step-00000020", "step-00000030", "step-00000040"]
    again = scaletrain.resume(str(run_dir))  # finished: nothing to do, said so
    assert "nothing to resume" in again["note"]


def test_plan_and_check_on_a_loop_job(tmp_path):
    from tests.helpers.run import REPO, scaletrain_cli

    planned = scaletrain_cli("plan", "examples/digits_loop.yaml")
    assert planned.returncode == 2 and planned.stderr.startswith("error: scaletrain plan builds the model of a task")
    checked = scaletrain_cli("check", "examples/digits_loop.yaml", "--set", f"run_dir={tmp_path}", cwd=REPO)
    assert checked.returncode == 0, checked.stderr
