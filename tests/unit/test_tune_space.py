import pytest

from scaletrain.config.loading import parse_job
from scaletrain.errors import ConfigError
from scaletrain.tune.search import SearchOptions
from scaletrain.tune.space import load_space
from tests.helpers.tasks import toy_job


@pytest.fixture
def job(tmp_path):
    return parse_job(toy_job(tmp_path, train={"max_steps": 40, "eval_every": 10}))


def problems(tmp_path, job, text):
    space = tmp_path / "space.yaml"
    space.write_text(text)
    with pytest.raises(ConfigError) as info:
        load_space(space, job)
    return [line.split(": ", 1)[1] for line in str(info.value).splitlines()]


def test_a_good_space_reads_every_rule(tmp_path, job):
    space = tmp_path / "space.yaml"
    space.write_text(
        "optim.lr: {loguniform: [1.0e-4, 1.0e-2]}\n"
        "optim.weight_decay: {uniform: [0.0, 0.1]}\n"
        "task.args.hidden: {randint: [8, 64]}\n"
        "data.batch_size: {choice: [16, 32]}\n"
        "train.clip_grad_norm: {grid: [0.5, 1.0]}\n"
    )
    dims = {d.key: (d.kind, d.values) for d in load_space(space, job)}
    assert dims == {
        "optim.lr": ("loguniform", (1.0e-4, 1.0e-2)),
        "optim.weight_decay": ("uniform", (0.0, 0.1)),
        "task.args.hidden": ("randint", (8, 64)),
        "data.batch_size": ("choice", (16, 32)),
        "train.clip_grad_norm": ("grid", (0.5, 1.0)),
    }


def test_an_unknown_key_is_named(tmp_path, job):
    [line] = problems(tmp_path, job, "optim.lrr: {uniform: [0.1, 0.2]}\n")
    assert line == "optim.lrr: the job does not take it: optim.lrr: unknown key; did you mean 'lr'?"


def test_an_unknown_task_argument_is_named(tmp_path, job):
    [line] = problems(tmp_path, job, "task.args.hiden: {randint: [8, 64]}\n")
    assert line.startswith("task.args.hiden: the job does not take it: ")
    assert "hiden" in line


def test_low_above_high_is_named(tmp_path, job):
    [line] = problems(tmp_path, job, "optim.lr: {loguniform: [0.1, 0.001]}\n")
    assert line == "optim.lr: loguniform low end 0.1 is not below its high end 0.001; write [low, high]"


def test_an_empty_choice_is_named(tmp_path, job):
    [line] = problems(tmp_path, job, "data.batch_size: {choice: []}\n")
    assert line == "data.batch_size: choice needs a non-empty list of values, e.g. {choice: [16, 32]}"


def test_every_bad_rule_gets_its_own_line(tmp_path, job):
    lines = problems(tmp_path, job, (
        "optim.lr: {gaussian: [0, 1]}\n"
        "optim.weight_decay: {uniform: [0.1]}\n"
        "task.args.hidden: {randint: [8.5, 64]}\n"
        "optim.warmup_steps: {loguniform: [0, 10]}\n"
    ))
    assert lines == [
        "optim.lr: unknown rule 'gaussian'; use one of uniform, loguniform, randint, choice, grid",
        "optim.weight_decay: uniform needs [low, high], two numbers, e.g. {uniform: [1, 10]}",
        "task.args.hidden: randint needs two integers, got [8.5, 64]",
        "optim.warmup_steps: loguniform needs a low end above 0, got 0",
    ]


def test_a_value_of_the_wrong_type_for_the_key_is_named(tmp_path, job):
    [line] = problems(tmp_path, job, "optim.lr: {choice: [fast, slow]}\n")
    assert line == 'optim.lr: the job does not take it: optim.lr: must be a positive number, got "fast"'


def test_grid_with_optuna_is_refused(tmp_path, job):
    space = tmp_path / "space.yaml"
    space.write_text("optim.lr: {grid: [0.1, 0.2]}\n")
    with pytest.raises(ConfigError, match="grid rules need --search random"):
        SearchOptions(search="optuna").check(load_space(space, job))


def test_the_example_space_fits_the_example_job():
    from scaletrain.config import load_job
    from tests.helpers.run import REPO

    job = load_job(REPO / "examples" / "digits.yaml")
    dims = load_space(REPO / "examples" / "spaces" / "digits.yaml", job, [str(REPO / "examples")])
    assert [d.key for d in dims] == ["optim.lr", "optim.weight_decay", "task.args.hidden", "data.batch_size"]
