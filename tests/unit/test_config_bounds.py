"""Every number in a job file is finite and bounded, and a value past a bound is one `error:`
line naming the field and its range, exit 2, before anything exists (review M7)."""

from __future__ import annotations

import math

import pytest
import yaml

from scaletrain.config import parse_job
from scaletrain.config.schema import MAX_SEED, JobConfig
from scaletrain.errors import ConfigError
from tests.helpers.run import scaletrain_cli
from tests.helpers.tasks import toy_job

BASE = {
    "task": {"target": "pkg.mod:Task"},
    "data": {"batch_size": 8},
    "optim": {"lr": 1e-3},
    "train": {"max_steps": 10},
}


def problems(*overrides: str) -> list[str]:
    with pytest.raises(ConfigError) as info:
        parse_job(BASE, list(overrides))
    return info.value.problems


def numeric_fields(schema: dict, prefix: str = "") -> dict[str, dict]:
    """Dotted path -> JSON schema of every number in the job (tuple elements as path[i])."""
    defs, found = schema.get("$defs", {}), {}

    def visit(node: dict, path: str) -> None:
        if "$ref" in node:
            node = defs[node["$ref"].rsplit("/", 1)[-1]]
        for option in node.get("anyOf", []):
            if option.get("type") in ("integer", "number"):
                found[path] = option
            elif "$ref" in option:
                visit(option, path)
        if node.get("type") in ("integer", "number"):
            found[path] = node
        for i, item in enumerate(node.get("prefixItems", [])):
            found[f"{path}[{i}]"] = item
        for key, child in node.get("properties", {}).items():
            visit(child, f"{path}.{key}" if path else key)

    visit(schema, prefix)
    return found


NUMBERS = numeric_fields(JobConfig.model_json_schema())
FINITE_ONLY = {"train.clip_grad_norm"}  # any finite norm is a valid clip; no cap would be honest


def override(path: str, value: str) -> list[str]:
    if path.endswith("]"):  # a tuple element: optim.betas[1]
        field, index = path[:-1].split("[")
        items = ["0.9", "0.999"]
        items[int(index)] = value
        return [f"{field}=[{', '.join(items)}]"]
    if path.startswith("checkpoint.keep_best."):
        return [f"{path}={value}", "checkpoint.keep_best.metric=train/loss"]
    return [f"{path}={value}"]


def test_every_number_in_the_schema_is_found():
    # The walk above must see the fields it is meant to check, or the tests below check nothing.
    assert {"optim.lr", "optim.betas[1]", "recovery.hang_timeout_s", "tracking.flush_timeout_s",
            "scale.workers", "scale.fsdp.shard_size", "checkpoint.keep_best.count", "seed"} <= set(NUMBERS)
    assert len(NUMBERS) >= 35


@pytest.mark.parametrize("path", sorted(NUMBERS))
def test_every_number_refuses_inf_and_nan_naming_the_field(path):
    for value, shown in ((".inf", ".inf"), ("-.inf", "-.inf"), (".nan", ".nan")):
        [line] = problems(*override(path, value))
        assert line.startswith(f"{path}: must be ") and line.endswith(f", got {shown}"), line


@pytest.mark.parametrize("path", sorted(set(NUMBERS) - FINITE_ONLY))
def test_every_number_has_an_upper_bound_the_message_states(path):
    schema = NUMBERS[path]
    bound = schema.get("maximum", schema.get("exclusiveMaximum"))
    assert bound is not None and bound < 1e12, f"{path} has no upper bound: {schema}"
    [line] = problems(*override(path, "1e30"))
    assert line.startswith(f"{path}: must be ") and line.endswith(", got 1e+30"), line
    assert f"{bound:g}" in line or str(bound) in line or "below 1" in line, line


@pytest.mark.parametrize(
    "setting, message",
    [
        ("optim.lr=1e3", "optim.lr: must be a positive number up to 10, got 1000.0"),
        ("optim.betas=[0.9, 1]",
         "optim.betas[1]: must be below 1 (a decay of 1 never forgets), got 1; e.g. 0.999"),
        ("recovery.hang_timeout_s=1e10", "recovery.hang_timeout_s: must be a number of seconds from 1 "
         "to 1e+07 (about 116 days), got 1e+10"),
        ("recovery.hang_timeout_s=0.5", "recovery.hang_timeout_s: must be a number of seconds from 1 "
         "to 1e+07 (about 116 days), got 0.5"),
        ("recovery.grace_period_s=.inf", "recovery.grace_period_s: must be a positive number of "
         "seconds up to 1e+07 (about 116 days), got .inf"),
        ("tracking.flush_timeout_s=1e10", "tracking.flush_timeout_s: must be a number of seconds from "
         "0 to 1e+07 (about 116 days), got 1e+10"),
        ("tracking.system_metrics_every_s=0.001", "tracking.system_metrics_every_s: must be 0 (off) or "
         "at least 0.1 seconds, got 0.001; sampling more often takes the training's cores"),
        ("checkpoint.every_minutes=1e-12", "checkpoint.every_minutes: must be a number of minutes from "
         "0.005 to 100000 (about 69 days), got 1e-12"),
        ("scale.workers=1000000", "scale.workers: must be a positive integer up to 100000, got 1000000"),
        ("scale.workers=2048", "scale: the local engine would start 2048 workers on one machine, more "
         "than 1024; spread them with scale.nodes or use scale.engine: ray"),
        ("scale.nodes=20000", "scale.nodes: must be a count from 1 to 10000, or MIN:MAX with 1 <= MIN "
         "<= MAX <= 10000, got 20000"),
        ("data.loader_workers=100000", "data.loader_workers: must be an integer from 0 to 1024, got 100000"),
        (f"seed={MAX_SEED + 1}", f"seed: must be an integer from 0 to {MAX_SEED}, got {MAX_SEED + 1}"),
        ("seed=0x" + "f" * 3000, f"seed: must be an integer from 0 to {MAX_SEED}, got an integer of 12000 bits"),
        ("name=" + "n" * 101, "name: at most 100 characters (it names a folder), got 101; set a shorter name"),
        ("train.clip_grad_norm=.inf", "train.clip_grad_norm: must be a finite positive number, got .inf"),
        ("task.args.scale=.inf", "task.args: 'scale' is not a finite number, which cannot reach the "
         "workers (the job travels as JSON); write a string, a 64-bit integer, a finite number, a list "
         "or a mapping"),
    ],
)
def test_the_message_names_the_field_the_bound_and_the_value(setting, message):
    assert problems(setting) == [message]


def test_the_bounds_keep_what_real_jobs_use():
    job = parse_job(BASE, [
        "optim.lr=10", "optim.betas=[0, 0.99999]", "recovery.hang_timeout_s=1", "seed=4294967295",
        "recovery.grace_period_s=1e7", "tracking.flush_timeout_s=0", "tracking.system_metrics_every_s=0",
        "checkpoint.every_minutes=0.005", "scale.workers=1024", "name=" + "n" * 100,
        "scale.engine=ray", "scale.cpus_per_worker=0.5", "scale.gpus_per_worker=0.25",
    ])
    assert (job.seed, job.optim.lr, job.recovery.grace_period_s) == (MAX_SEED, 10, 1e7)
    assert parse_job(BASE, ["scale.workers=100000", "scale.engine=ray"]).scale.workers == 100_000
    assert math.isfinite(job.tracking.flush_timeout_s)


# ------------------------------------------------------------------ through the CLI


def write_job(tmp_path, job) -> str:
    path = tmp_path / "job.yaml"
    path.write_text(yaml.safe_dump(job, sort_keys=False) if isinstance(job, dict) else job)
    return str(path)


def assert_one_error_line(result, expected: str) -> None:
    assert result.returncode == 2, result.stderr
    assert "Traceback" not in result.stderr
    assert result.stderr.strip().splitlines() == [expected]


@pytest.mark.parametrize(
    "section, text, message",
    [
        ("inf", "optim: {lr: .inf}", "optim.lr: must be a positive number up to 10, got .inf"),
        ("nan", "scale: {cpus_per_worker: .nan}",
         "scale.cpus_per_worker: must be a positive number up to 1024, got .nan"),
        ("huge timeout", "scale: {connect_timeout_s: 1e10}", "scale.connect_timeout_s: must be a "
         "positive number of seconds up to 1e+07 (about 116 days), got 1e+10"),
        ("huge workers", "scale: {workers: 1000000}",
         "scale.workers: must be a positive integer up to 100000, got 1000000"),
        ("long name", "name: " + "n" * 150,
         "name: at most 100 characters (it names a folder), got 150; set a shorter name"),
        ("seed", "seed: 4294967296", "seed: must be an integer from 0 to 4294967295, got 4294967296"),
    ],
)
def test_validate_answers_a_number_out_of_bounds_with_one_line(tmp_path, section, text, message):
    job = {k: v for k, v in toy_job(tmp_path).items() if k not in ("scale", "seed", "name")}
    path = write_job(tmp_path, yaml.safe_dump(job) + text + "\n")
    assert_one_error_line(scaletrain_cli("validate", path), f"error: {path}: {message}")


@pytest.mark.parametrize(
    "setting, message",
    [
        # Each of these crashed before: every worker at start (faulthandler's OverflowError),
        # the launcher (int(inf)), or the tracker after training (Event.wait), losing summary.json.
        ({"recovery": {"hang_timeout_s": 1e10}}, "recovery.hang_timeout_s: must be a number of "
         "seconds from 1 to 1e+07 (about 116 days), got 1e+10"),
        ({"tracking": {"enabled": True, "flush_timeout_s": 1e10}}, "tracking.flush_timeout_s: must "
         "be a number of seconds from 0 to 1e+07 (about 116 days), got 1e+10"),
        ({"recovery": {"grace_period_s": math.inf}, "scale": {"workers": 2}}, "recovery.grace_period_s: "
         "must be a positive number of seconds up to 1e+07 (about 116 days), got .inf"),
    ],
)
def test_run_refuses_values_that_crashed_before_any_run_directory_exists(tmp_path, setting, message):
    path = write_job(tmp_path, toy_job(tmp_path, **setting))
    assert_one_error_line(scaletrain_cli("run", path), f"error: {path}: {message}")
    assert not (tmp_path / "runs").exists()
