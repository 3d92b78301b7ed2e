"""Fuzzed job files: loading one returns a JobConfig or raises ConfigError, never anything else.

Documents are random YAML: real schema keys mixed with garbage at random depths, every YAML type,
unicode, huge, negative, infinite and NaN numbers, tags (`!!python/object`, `!!binary`,
`!!timestamp`), anchors and aliases (cycles, billion laughs), deep nesting, non-UTF-8 bytes, the
empty file. They go through `resolve_job`, the function `scaletrain validate` and `scaletrain run`
load jobs with, in-process; a job that loads must print (`job_to_yaml`) and load back equal. A
few nasty files also go through the real CLI: exit 2, `error:` lines only, no traceback.

CI runs a fixed set of examples (derandomized: the same ones on every run, a few seconds). For a
deeper search on a workstation (random, 20,000 examples per test, several minutes; a failure
prints the document that caused it):

    HYPOTHESIS_PROFILE=deep pytest --timeout=0 tests/unit/test_config_fuzz.py
"""

from __future__ import annotations

import copy
import os
import typing

import pytest
import yaml
from hypothesis import HealthCheck, Phase, given, settings
from hypothesis import strategies as st
from pydantic import BaseModel

from scaletrain.api import resolve_job
from scaletrain.config import job_to_yaml, load_job
from scaletrain.config.schema import JobConfig
from scaletrain.errors import ConfigError
from tests.helpers.run import scaletrain_cli

_PROFILES = {
    # No shrinking in CI: a failure reports the document as generated, at once.
    "ci": settings(max_examples=200, derandomize=True, deadline=None, database=None,
                   phases=[Phase.explicit, Phase.generate], suppress_health_check=list(HealthCheck)),
    "deep": settings(max_examples=20_000, deadline=None, database=None,
                     suppress_health_check=list(HealthCheck)),
}
FUZZ = _PROFILES[os.environ.get("HYPOTHESIS_PROFILE", "ci")]

BASE = {
    "task": {"target": "tests.helpers.tasks:ToyTask", "args": {"hidden": 8}},
    "data": {"batch_size": 8},
    "optim": {"lr": 0.01},
    "train": {"max_steps": 10},
}


def _schema_paths(model: type[BaseModel] = JobConfig, prefix: tuple[str, ...] = ()) -> list[tuple]:
    """Every key path of the schema, sections included: where mutations land."""
    paths = []
    for name, field in model.model_fields.items():
        paths.append((*prefix, name))
        for arg in (field.annotation, *typing.get_args(field.annotation)):
            if isinstance(arg, type) and issubclass(arg, BaseModel):
                paths += _schema_paths(arg, (*prefix, name))
    return paths


PATHS = _schema_paths()
KEYS = sorted({part for path in PATHS for part in path})

# Scalars as YAML writes them, the edge cases first.
YAML_WORDS = [
    ".inf", "-.inf", ".nan", ".NaN", "1e400", "-1e400", "1e10", "1e-12", "0x10", "0o17", "0b101",
    "017", "1_000", "0x" + "f" * 3000, "9" * 5000, "1:2", "3:2", "~", "null", "yes", "no", "on",
    "off", "true", "=", "<<", "2001-12-14", "2001-13-01", "2001-12-14 25:00:00", "''", '""',
    "'\\ud800'", '"\\ud800"', '"\\0"', '"a\\nb"', "-", "?", "!!python/object:os.system",
    "!!python/name:os.system ''", "!!binary /w==", "!!binary '@@'", "!!timestamp x", "!!int abc",
    "!!int ''", "!!bool x", "!!float .", "!!set {a, b}", "!!omap [a: 1]", "!!str", "!!null x",
    "&a [1, *a]", "*nowhere", "[" * 2000 + "]" * 2000, "{a: " * 80 + "1" + "}" * 80,
]
numbers = st.one_of(
    st.integers(), st.integers(min_value=-(2**80), max_value=2**80),
    st.sampled_from([0, -1, 1, 2**31, 2**32, 2**32 - 1, 2**63, 2**64, 10**100]),
    st.floats(allow_nan=True, allow_infinity=True),
)
scalars = st.one_of(st.none(), st.booleans(), numbers, st.text(max_size=12), st.sampled_from(KEYS))
values = st.recursive(
    scalars,
    lambda inner: st.one_of(
        st.lists(inner, max_size=4),
        st.dictionaries(st.one_of(st.sampled_from(KEYS), st.text(max_size=8)), inner, max_size=4),
    ),
    max_leaves=12,
)


@st.composite
def mutated_jobs(draw) -> str:
    """A valid job with a few keys set to random values, at real paths or garbage ones; some
    values spelled in raw YAML (`.inf`, `!!binary`, `&a [1, *a]`) that no Python value dumps to."""
    job = copy.deepcopy(BASE)
    words = []
    for _ in range(draw(st.integers(1, 4))):
        path = draw(st.one_of(st.sampled_from(PATHS), st.lists(
            st.sampled_from(KEYS) | st.text(max_size=6), min_size=1, max_size=5)))
        node = job
        for part in path[:-1]:
            child = node.get(part)
            node[part] = child if isinstance(child, dict) else {}
            node = node[part]
        if draw(st.booleans()):
            node[path[-1]] = draw(values)
        else:
            words.append(draw(st.sampled_from(YAML_WORDS)))
            node[path[-1]] = f"WORD{len(words) - 1}"
    text = yaml.safe_dump(job, sort_keys=False, allow_unicode=draw(st.booleans()))
    for i, word in reversed(list(enumerate(words))):
        text = text.replace(f"WORD{i}", word)
    return text


# Pieces of YAML syntax, for documents that are barely YAML.
TOKENS = [
    "\n", "  ", "\t", ": ", "- ", "? ", "{", "}", "[", "]", ",", "&a ", "*a", "<<: *a", "'", '"',
    "#", "---\n", "...\n", "%YAML 1.1\n", "%TAG ! tag:x,2000:\n", "!x ", "|\n", ">\n", "\\", "\ufeff",
    "\x00", "\x85", "\u2028", *YAML_WORDS, *KEYS,
]
raw_documents = st.one_of(
    st.lists(st.sampled_from(TOKENS) | st.text(max_size=4), max_size=40).map("".join),
    st.builds(lambda job, tail: job + tail, st.just(yaml.safe_dump(BASE)),
              st.lists(st.sampled_from(TOKENS), max_size=12).map("".join)),
    # A valid job plus `key: <YAML>`, or a value nested in a few random keys.
    st.builds(lambda job, keys, words: job + "".join(f"{'  ' * i}{k}:\n" for i, k in enumerate(keys))
              + "  " * len(keys) + "x: " + " ".join(words) + "\n",
              st.just(yaml.safe_dump(BASE)), st.lists(st.sampled_from(KEYS), max_size=3),
              st.lists(st.sampled_from(YAML_WORDS), min_size=1, max_size=3)),
)


def _load_or_refuse(path) -> None:
    """The contract: a JobConfig that prints and loads back equal, or ConfigError lines."""
    try:
        config, _ = resolve_job(str(path))
    except ConfigError as exc:
        assert exc.problems, "a ConfigError says what is wrong"
        for problem in exc.problems:
            assert "\n" not in problem and 0 < len(problem) <= 400, problem
        return
    assert isinstance(config, JobConfig)
    again = path.with_name("again.yaml")
    again.write_text(job_to_yaml(config), encoding="utf-8")
    assert load_job(again) == config


@pytest.fixture(scope="module")
def scratch(tmp_path_factory):
    return tmp_path_factory.mktemp("fuzz") / "job.yaml"


@FUZZ
@given(document=mutated_jobs())
def test_a_job_with_random_values_loads_or_is_refused_in_lines(scratch, document):
    scratch.write_text(document, encoding="utf-8")
    _load_or_refuse(scratch)


@FUZZ
@given(document=raw_documents, junk=st.binary(max_size=8), at=st.integers(0, 10**6))
def test_any_bytes_load_or_are_refused_in_lines(scratch, document, junk, at):
    data = document.encode("utf-8", "surrogatepass")
    at %= len(data) + 1
    scratch.write_bytes(data[:at] + junk + data[at:])
    _load_or_refuse(scratch)


NASTY = {
    "empty": b"",
    "not_utf8": b"task: {target: a:b}\ndata: \xff\xfe\n",
    "python_tag": b"task: !!python/object/apply:os.system [echo hi]\n",
    "deep": b"task: " + b"[" * 5000 + b"]" * 5000 + b"\n",
    "billion_laughs": b"a: &a [1, 1, 1, 1, 1, 1, 1, 1, 1]\n" + b"".join(
        b"%c: &%c [%s]\n" % (ord("a") + i, ord("a") + i, b", ".join([b"*%c" % (ord("a") + i - 1)] * 9))
        for i in range(1, 9)
    ),
    "cycle": yaml.safe_dump(BASE).replace("hidden: 8", "hidden: &x [*x]").encode(),
    "hex_seed": yaml.safe_dump(BASE).encode() + b"seed: 0x" + b"f" * 3000 + b"\n",
    "bad_date": yaml.safe_dump(BASE).encode() + b"name: 2001-13-01\n",
}


@pytest.mark.parametrize("name", sorted(NASTY))
def test_the_cli_answers_a_nasty_file_with_one_error_line(tmp_path, name):
    path = tmp_path / "job.yaml"
    path.write_bytes(NASTY[name])
    result = scaletrain_cli("validate", str(path))
    assert result.returncode == 2, result.stderr
    assert "Traceback" not in result.stderr
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: "), result.stderr


def test_a_file_name_with_a_newline_is_still_one_error_line(tmp_path):
    path = tmp_path / "two\nlines.yaml"
    path.write_bytes(NASTY["python_tag"])
    result = scaletrain_cli("validate", str(path))
    assert result.returncode == 2 and "Traceback" not in result.stderr
    assert result.stderr.splitlines() == [
        f"error: {tmp_path}/two lines.yaml: line 1, column 7: invalid YAML: could not determine a "
        "constructor for the tag 'tag:yaml.org,2002:python/object/apply:os.system'"
    ]
