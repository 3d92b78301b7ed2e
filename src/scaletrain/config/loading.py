"""Job file -> validated JobConfig, with `--set a.b=c` overrides and one-line error messages."""

from __future__ import annotations

import difflib
import json
import re
import types
import typing
from pathlib import Path
from typing import Any, Literal

import annotated_types
import yaml
from pydantic import BaseModel, ValidationError
from pydantic.fields import FieldInfo

from scaletrain.config.schema import BOOL_REJECTED, JobConfig
from scaletrain.errors import ConfigError

__all__ = ["load_job", "parse_job", "apply_overrides", "job_to_yaml", "job_schema"]

_INT = "tag:yaml.org,2002:int"


class _JobLoader(yaml.SafeLoader):
    """YAML 1.1 without base-60 integers: ``nodes: 1:2`` is the text MIN:MAX, not 62."""


_JobLoader.yaml_implicit_resolvers = {
    first: [(tag, regexp) for tag, regexp in resolvers if tag != _INT]
    for first, resolvers in yaml.SafeLoader.yaml_implicit_resolvers.items()
}
_JobLoader.add_implicit_resolver(
    _INT,
    re.compile(r"^(?:[-+]?0b[0-1_]+|[-+]?0[0-7_]+|[-+]?(?:0|[1-9][0-9_]*)|[-+]?0x[0-9a-fA-F_]+)$"),
    list("-+0123456789"),
)


def _load_yaml(text: str) -> Any:
    return yaml.load(text, Loader=_JobLoader)  # noqa: S506 (a SafeLoader)


def load_job(path: str | Path, overrides: list[str] | tuple[str, ...] = ()) -> JobConfig:
    """Read a YAML job file, apply dotted overrides, validate. Raises ConfigError."""
    path = Path(path)
    if not path.exists():
        raise ConfigError(f"job file '{path}' not found; check the path")
    if path.is_dir():
        raise ConfigError(f"'{path}' is a directory; pass a job file (.yaml)")
    try:
        text = path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        raise ConfigError(f"cannot read job file '{path}': {exc}") from None
    try:
        data = _load_yaml(text)
    except yaml.YAMLError as exc:
        raise ConfigError(_yaml_problem(exc), source=str(path)) from None
    if data is None:
        raise ConfigError("the job file is empty; see examples/digits.yaml", source=str(path))
    if not isinstance(data, dict):
        raise ConfigError(
            f"a job file must be a mapping of sections (task, data, optim, ...), "
            f"got {type(data).__name__}",
            source=str(path),
        )
    data.setdefault("name", path.stem)
    return parse_job(data, overrides, source=str(path))


def parse_job(
    data: dict[str, Any], overrides: list[str] | tuple[str, ...] = (), source: str | None = None
) -> JobConfig:
    """Validate an already-parsed job mapping (the Python API's entry)."""
    data = apply_overrides(data, overrides)
    try:
        return JobConfig.model_validate(data)
    except ValidationError as exc:
        raise ConfigError([_describe(err) for err in exc.errors()], source=source) from None


def apply_overrides(data: dict[str, Any], overrides: list[str] | tuple[str, ...]) -> dict[str, Any]:
    """Return a copy of ``data`` with each ``a.b.c=value`` applied (value parsed as YAML)."""
    result = json.loads(json.dumps(data, default=str)) if overrides else data
    for item in overrides:
        key, sep, raw = item.partition("=")
        key = key.strip()
        if not sep or not key or any(not part for part in key.split(".")):
            raise ConfigError(
                f"--set {item!r}: expected KEY=VALUE with a dotted key, e.g. --set optim.lr=3e-4"
            )
        try:
            value = _load_yaml(raw) if raw.strip() else ""
        except yaml.YAMLError:
            value = raw
        node = result
        parts = key.split(".")
        for depth, part in enumerate(parts[:-1]):
            child = node.setdefault(part, {})
            if not isinstance(child, dict):
                where = ".".join(parts[: depth + 1])
                raise ConfigError(f"--set {item!r}: '{where}' is a value, not a section")
            node = child
        node[parts[-1]] = value
    return result


def job_to_yaml(job: JobConfig) -> str:
    """The resolved job as YAML: every default filled in, in schema order."""
    return yaml.safe_dump(job.model_dump(mode="json"), sort_keys=False)


def job_schema() -> dict[str, Any]:
    """JSON Schema of the job file, for editors (yaml-language-server) and docs."""
    schema = JobConfig.model_json_schema()
    schema["title"] = "scaletrain job"
    return schema


# ---------------------------------------------------------------- error messages


def _yaml_problem(exc: yaml.YAMLError) -> str:
    mark = getattr(exc, "problem_mark", None)
    problem = getattr(exc, "problem", None) or str(exc).splitlines()[0]
    if mark is not None:
        return f"line {mark.line + 1}, column {mark.column + 1}: invalid YAML: {problem}"
    return f"invalid YAML: {problem}"


def _describe(err: dict[str, Any]) -> str:
    loc = tuple(str(p) for p in err["loc"])
    path = ".".join(loc) or "job"
    kind = err["type"]
    if kind == "extra_forbidden":
        return f"{path}: unknown key{_suggestion(loc)}"
    if kind == "missing":
        return f"{path}: required; add it to the job file"
    if kind in ("model_type", "model_attributes_type", "dict_type"):
        return f"{path}: must be a section (a mapping of keys), got {_show(err['input'])}"
    message = str(err.get("ctx", {}).get("error", err["msg"]))
    if kind == "value_error" and message != BOOL_REJECTED:
        # One of the schema's own rules: its message is already written for users.
        return f"{path}: {message}" if loc else message
    field = _leaf_field(loc)
    expected = _expected(field) if field is not None else None
    if expected is not None and loc[-1].isdigit():
        path = f"{'.'.join(loc[:-1])}[{loc[-1]}]"
        expected = _element_expected(field, int(loc[-1])) or expected
    if expected is None:
        return f"{path}: {err['msg']}, got {_show(err['input'])}"
    return f"{path}: must be {expected}, got {_show(err['input'])}"


def _show(value: Any) -> str:
    if isinstance(value, (str, int, float, bool)) or value is None:
        return json.dumps(value)
    return yaml.safe_dump(value, default_flow_style=True).strip()


def _model_at(loc: tuple[str, ...]) -> type[BaseModel] | None:
    """The pydantic model that owns the last key of ``loc``."""
    model: type[BaseModel] = JobConfig
    for part in loc[:-1]:
        field = model.model_fields.get(part)
        inner = _unwrap(field.annotation) if field else None
        if not (isinstance(inner, type) and issubclass(inner, BaseModel)):
            return None
        model = inner
    return model


def _leaf_field(loc: tuple[str, ...]) -> FieldInfo | None:
    # For tuples pydantic appends an index to the loc; describe the whole field.
    while loc and loc[-1].isdigit():
        loc = loc[:-1]
    model = _model_at(loc) if loc else None
    return model.model_fields.get(loc[-1]) if model else None


def _suggestion(loc: tuple[str, ...]) -> str:
    model = _model_at(loc)
    if model is None:
        return ""
    valid = list(model.model_fields)
    close = difflib.get_close_matches(loc[-1], valid, n=1, cutoff=0.6)
    if close:
        return f"; did you mean '{close[0]}'?"
    return f"; valid keys here: {', '.join(valid)}"


def _unwrap(annotation: Any) -> Any:
    """Optional[Annotated[X, ...]] -> X."""
    if typing.get_origin(annotation) in (typing.Union, types.UnionType):
        args = [a for a in typing.get_args(annotation) if a is not type(None)]
        if len(args) == 1:
            return _unwrap(args[0])
    if typing.get_origin(annotation) is typing.Annotated:
        return _unwrap(typing.get_args(annotation)[0])
    return annotation


def _constraints(annotation: Any, metadata: list[Any]) -> list[Any]:
    """Constraint objects (Gt, Ge, Le...) on a field, including those inside Optional[Annotated]."""
    found = [m for m in metadata if isinstance(m, annotated_types.BaseMetadata)]
    for arg in typing.get_args(annotation):
        if typing.get_origin(arg) is typing.Annotated:
            for extra in typing.get_args(arg)[1:]:
                found += _constraints(None, [extra, *getattr(extra, "metadata", [])])
    return found


def _expected(field: FieldInfo) -> str | None:
    annotation = field.annotation
    optional = type(None) in typing.get_args(annotation)
    bounds: dict[str, float] = {}
    for item in _constraints(annotation, list(field.metadata)):
        for name in ("gt", "ge", "lt", "le"):
            if getattr(item, name, None) is not None:
                bounds[name] = getattr(item, name)
    text = _describe_type(_unwrap(annotation), bounds)
    if text is None:
        return None
    return f"{text} or null" if optional else text


def _element_expected(field: FieldInfo, index: int) -> str | None:
    """What one element of a tuple field must be."""
    args = typing.get_args(_unwrap(field.annotation))
    if index >= len(args):
        return None
    element = args[index]
    bounds: dict[str, float] = {}
    for item in _constraints(typing.Optional[element], []):
        for name in ("gt", "ge", "lt", "le"):
            if getattr(item, name, None) is not None:
                bounds[name] = getattr(item, name)
    return _describe_type(_unwrap(element), bounds)


def _describe_type(inner: Any, bounds: dict[str, float]) -> str | None:
    if typing.get_origin(inner) is Literal:
        return "one of " + ", ".join(repr(v) for v in typing.get_args(inner))
    if inner is bool:
        return "true or false"
    if inner is str:
        return "a string"
    if inner in (int, float):
        noun = "an integer" if inner is int else "a number"
        if bounds.get("gt") == 0 or (inner is int and bounds.get("ge") == 1):
            return "a positive integer" if inner is int else "a positive number"
        if bounds.get("ge") == 0 and "le" in bounds:
            return f"{noun} between 0 and {bounds['le']:g}"
        if bounds.get("ge") == 0:
            return "a non-negative integer" if inner is int else "a number >= 0"
        return noun
    if typing.get_origin(inner) is tuple:
        return f"a list of {len(typing.get_args(inner))} numbers"
    return None
