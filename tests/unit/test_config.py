import json

import pytest
import yaml

from scaletrain.config import apply_overrides, job_schema, job_to_yaml, load_job, parse_job
from scaletrain.config.schema import OptimConfig
from scaletrain.errors import ConfigError

BASE = {
    "task": {"target": "pkg.mod:Task"},
    "data": {"batch_size": 8},
    "optim": {"lr": 1e-3},
    "train": {"max_steps": 10},
}


def problems(data=BASE, overrides=()):
    with pytest.raises(ConfigError) as info:
        parse_job(data, overrides)
    return info.value.problems


def test_defaults_fill_in():
    job = parse_job(BASE)
    assert job.scale.workers == 1
    assert job.scale.resolved_strategy == "single"
    assert job.optim.name == "adamw"
    assert job.train.precision == "fp32"
    assert parse_job(BASE, ["scale.workers=2"]).scale.resolved_strategy == "ddp"


def test_unknown_key_suggests_the_closest():
    assert problems(overrides=["optim.lrr=1"]) == ["optim.lrr: unknown key; did you mean 'lr'?"]
    assert problems(overrides=["trian.max_steps=1"]) == [
        "trian: unknown key; did you mean 'train'?"
    ]


def test_wrong_type_names_the_field_path():
    assert problems(overrides=["optim.lr=fast"]) == [
        'optim.lr: must be a positive number, got "fast"'
    ]
    assert problems(overrides=["optim.name=adam"]) == [
        "optim.name: must be one of 'adamw', 'sgd', got \"adam\""
    ]
    assert problems(overrides=["deterministic=maybe"]) == [
        'deterministic: must be true or false, got "maybe"'
    ]
    assert problems(overrides=["train.max_steps=true"]) == [
        "train.max_steps: must be a positive integer or null, got true"
    ]
    assert problems(overrides=["optim.betas=[0.9,2]"]) == [
        "optim.betas[1]: must be a number between 0 and 1, got 2"
    ]


def test_workers_below_one():
    assert problems(overrides=["scale.workers=0"]) == [
        "scale.workers: must be a positive integer, got 0"
    ]


def test_section_rules():
    assert problems(overrides=["train.epochs=3"]) == [
        "train: set exactly one of train.max_steps or train.epochs"
    ]
    assert problems(overrides=["scale.workers=2", "scale.strategy=single"]) == [
        "scale: strategy 'single' runs one process but workers is 2; use strategy 'ddp' or 'auto' ('mirrored' for a TensorFlow job)"
    ]
    assert problems(overrides=["task.target=nocolon"]) == [
        "task.target: must look like 'package.module:attr', got 'nocolon'"
    ]


def test_missing_section_and_every_problem_listed():
    data = {k: v for k, v in BASE.items() if k != "optim"}
    data["data"] = {"batch_size": 0}
    assert problems(data) == [
        "data.batch_size: must be a positive integer, got 0",
        "optim: required; add it to the job file",
    ]


def test_a_misspelt_required_key_is_one_problem():
    optim = {k: v for k, v in BASE["optim"].items() if k != "lr"}
    data = {**BASE, "optim": {**optim, "lrr": 3e-3}}
    assert problems(data) == ["optim.lrr: unknown key; did you mean 'lr'?"]
    # Not a near miss of it: the missing key is still its own problem.
    data = {**BASE, "optim": {**optim, "zz": 3e-3}}
    assert problems(data) == [
        "optim.lr: required; add it to the job file",
        f"optim.zz: unknown key; valid keys here: {', '.join(OptimConfig.model_fields)}",
    ]


def test_overrides_parse_values_as_yaml():
    job = parse_job(BASE, ["optim.lr=3e-4", "scale.workers=2", "train.clip_grad_norm=null"])
    assert job.optim.lr == pytest.approx(3e-4)
    assert job.scale.workers == 2
    assert job.train.clip_grad_norm is None
    assert parse_job(BASE, ["task.args.layers=[1, 2]"]).task.args == {"layers": [1, 2]}


def test_overrides_do_not_touch_the_input():
    data = json.loads(json.dumps(BASE))
    apply_overrides(data, ["optim.lr=1"])
    assert data == BASE


@pytest.mark.parametrize(
    "item, message",
    [
        ("optim.lr", "--set 'optim.lr': expected KEY=VALUE"),
        ("=3", "--set '=3': expected KEY=VALUE"),
        ("optim..lr=3", "--set 'optim..lr=3': expected KEY=VALUE"),
        ("optim.lr.x=3", "--set 'optim.lr.x=3': 'optim.lr' is a value, not a section"),
    ],
)
def test_bad_override_syntax(item, message):
    with pytest.raises(ConfigError) as info:
        parse_job(BASE, [item])
    assert str(info.value).startswith(message)


def test_load_job_file_errors(tmp_path):
    with pytest.raises(ConfigError, match="job file '.*nope.yaml' not found"):
        load_job(tmp_path / "nope.yaml")
    bad = tmp_path / "bad.yaml"
    bad.write_text("task:\n  target: a:b\n data: [\n")
    with pytest.raises(ConfigError) as info:
        load_job(bad)
    assert info.value.problems[0].startswith("line 3, column 2: invalid YAML")
    empty = tmp_path / "empty.yaml"
    empty.write_text("")
    with pytest.raises(ConfigError, match="the job file is empty"):
        load_job(empty)
    listed = tmp_path / "list.yaml"
    listed.write_text("- 1\n- 2\n")
    with pytest.raises(ConfigError, match="must be a mapping of sections"):
        load_job(listed)


def test_name_defaults_to_file_stem_and_yaml_round_trips(tmp_path):
    path = tmp_path / "my-job.yaml"
    path.write_text(yaml.safe_dump(BASE))
    job = load_job(path)
    assert job.name == "my-job"
    again = tmp_path / "again.yaml"
    again.write_text(job_to_yaml(job))
    assert load_job(again) == job


def test_schema_lists_every_section():
    schema = job_schema()
    assert set(schema["properties"]) >= {
        "task", "loop", "script", "data", "optim", "train", "scale", "seed", "deterministic"
    }
    assert schema["oneOf"] == [{"required": ["task", "data", "optim", "train"]}, {"required": ["loop"]},
                               {"required": ["script"]}]
    json.dumps(schema)
