"""Job file -> validated JobConfig, with `--set a.b=c` overrides and one-line error messages.

Whatever the file holds (any YAML, any bytes), loading returns a JobConfig or raises ConfigError
with one line per problem: tests/unit/test_config_fuzz.py holds it to that.
"""

from __future__ import annotations

import difflib
import json
import math
import os
import re
import types
import typing
from pathlib import Path
from typing import Any, Literal

import annotated_types
import yaml
from pydantic import BaseModel, ValidationError
from pydantic.fields import FieldInfo

from scaletrain.config.schema import BOOL_REJECTED, REQUIRED, JobConfig
from scaletrain.errors import ConfigError

__all__ = ["load_job", "read_job_mapping", "parse_job", "apply_overrides", "job_to_yaml", "job_schema"]

_INT = "tag:yaml.org,2002:int"
MAX_FILE_BYTES = 1 << 20  # a job file describes a job; data lives in files its task reads
MAX_DEPTH = 64  # nesting of mappings and lists
MAX_VALUES = 100_000  # values in the document, aliases counted each time they are used
_LINE = 300  # characters of one problem line at most
_NUMBER_TEXT = re.compile(r"[-+]?(\.?[0-9][0-9_.]*([eE][-+]?[0-9]+)?|\.?inf|\.?nan)", re.I)


class _JobLoader(yaml.SafeLoader):
    """YAML 1.1 without base-60 integers: ``nodes: 1:2`` is the text MIN:MAX, not 62."""

    def fetch_flow_collection_start(self, token_class: type) -> None:
        # PyYAML's scanner slows down with every open `[` or `{` (2 s for 2,000): stop early.
        if self.flow_level >= MAX_DEPTH:
            raise _too_deep(self.get_mark())
        super().fetch_flow_collection_start(token_class)

    def add_indent(self, column: int) -> bool:
        if len(self.indents) >= MAX_DEPTH:
            raise _too_deep(self.get_mark())
        return super().add_indent(column)

    def construct_object(self, node: yaml.Node, deep: bool = False) -> Any:
        # PyYAML's scalar constructors raise plain ValueError, KeyError... on values like
        # `2001-13-01`, `!!int abc` or `!!bool x`: report them like any YAML error, with the line.
        try:
            return super().construct_object(node, deep=deep)
        except (ValueError, LookupError, AttributeError, TypeError, OverflowError) as exc:
            value, reason = _clip(repr(node.value), 40), str(exc).split(";")[0]
            problem = f"cannot read {value} as {_short_tag(node.tag)}: {reason}"
            raise yaml.constructor.ConstructorError(None, None, problem, node.start_mark) from None


_JobLoader.yaml_implicit_resolvers = {
    first: [(tag, regexp) for tag, regexp in resolvers if tag != _INT]
    for first, resolvers in yaml.SafeLoader.yaml_implicit_resolvers.items()
}
_JobLoader.add_implicit_resolver(
    _INT,
    re.compile(r"^(?:[-+]?0b[0-1_]+|[-+]?0[0-7_]+|[-+]?(?:0|[1-9][0-9_]*)|[-+]?0x[0-9a-fA-F_]+)$"),
    list("-+0123456789"),
)


def _too_deep(mark: yaml.Mark) -> yaml.YAMLError:
    return yaml.scanner.ScannerError(None, None, f"nested more than {MAX_DEPTH} levels deep", mark)


def _short_tag(tag: str) -> str:
    return tag.replace("tag:yaml.org,2002:", "!!")


def _load_yaml(text: str) -> Any:
    return yaml.load(text, Loader=_JobLoader)  # noqa: S506 (a SafeLoader)


def load_job(path: str | Path, overrides: list[str] | tuple[str, ...] = ()) -> JobConfig:
    """Read a YAML job file, apply dotted overrides, validate. Raises ConfigError."""
    path = Path(path)
    return parse_job(read_job_mapping(path), overrides, source=str(path))


def read_job_mapping(path: Path) -> dict[str, Any]:
    """A job file's mapping, read and parsed but not validated (``name`` defaults to the file's
    stem). Raises ConfigError."""
    if not path.exists():
        raise ConfigError(f"job file '{path}' not found; check the path")
    if path.is_dir():
        raise ConfigError(f"'{path}' is a directory; pass a job file (.yaml)")
    try:
        with open(path, "rb") as handle:
            raw = handle.read(MAX_FILE_BYTES + 1)
        text = raw.decode("utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        raise ConfigError(f"cannot read job file '{path}': {exc}") from None
    if len(raw) > MAX_FILE_BYTES:
        raise ConfigError(
            f"the job file is larger than {MAX_FILE_BYTES >> 20} MiB; a job file describes a job: "
            "put data in files its task reads", source=str(path),
        )
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
    return data


def parse_job(
    data: dict[str, Any], overrides: list[str] | tuple[str, ...] = (), source: str | None = None
) -> JobConfig:
    """Validate an already-parsed job mapping (the Python API's entry)."""
    _check_shape(data, source)
    if overrides:
        data = apply_overrides(data, overrides)
        _check_shape(data, source)  # --set values are YAML too
    try:
        return JobConfig.model_validate(data)
    except ValidationError as exc:
        problems = [_clip(_describe(err), _LINE) for err in _without_misspelt(exc.errors())]
        raise ConfigError(problems, source=source) from None


def _without_misspelt(errors: list[Any]) -> list[Any]:
    """A required key written with a typo is one problem, not two: 'optim.lrr: unknown key;
    did you mean 'lr'?' says it all, so 'optim.lr: required' is left out."""
    meant: set[tuple[str, ...]] = set()
    for err in errors:
        loc = tuple(map(str, err["loc"]))
        if err["type"] == "extra_forbidden" and (model := _model_at(loc)) is not None:
            close = difflib.get_close_matches(loc[-1], list(model.model_fields), n=1, cutoff=0.6)
            meant.update(loc[:-1] + (name,) for name in close)
    return [err for err in errors if not (err["type"] == "missing" and tuple(map(str, err["loc"])) in meant)]


def _is_unicode(text: str) -> bool:
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:  # "\ud800" in double quotes: no file, log or terminal takes it
        return False
    return True


def _check_shape(data: Any, source: str | None) -> None:
    """Refuse a document too deep, too large once its aliases are expanded (`&a [*a, *a]`,
    nested), that contains itself, or with text no file or terminal takes (a lone surrogate):
    everything after loading would recurse, blow up or crash on it."""
    budget = [MAX_VALUES]

    def walk(node: Any, depth: int, inside: frozenset[int]) -> str | None:
        budget[0] -= 1
        if budget[0] < 0:
            return f"has more than {MAX_VALUES} values (a YAML alias counts each time it is used)"
        if isinstance(node, str) and not _is_unicode(node):
            return f"has text that is not Unicode: {_show(node)} (a lone surrogate escape); remove it"
        if not isinstance(node, (dict, list)):
            return None
        if isinstance(node, dict):
            bad = next((k for k in node if isinstance(k, str) and not _is_unicode(k)), None)
            if bad is not None:
                return f"has a key that is not Unicode: {_show(bad)} (a lone surrogate escape); remove it"
        if id(node) in inside:
            return "has a YAML alias inside the mapping or list it refers to"
        if depth >= MAX_DEPTH:
            return f"is nested more than {MAX_DEPTH} levels deep"
        inside = inside | {id(node)}
        children = node.values() if isinstance(node, dict) else node
        return next(filter(None, (walk(child, depth + 1, inside) for child in children)), None)

    problem = walk(data, 0, frozenset())
    if problem:
        raise ConfigError(f"the job {problem}", source=source)


def apply_overrides(data: dict[str, Any], overrides: list[str] | tuple[str, ...]) -> dict[str, Any]:
    """Return a copy of ``data`` with each ``a.b.c=value`` applied (value parsed as YAML)."""
    result = _plain_copy(data) if overrides else data
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


def _plain_copy(node: Any) -> Any:
    """A deep copy of mappings and lists (tuples become lists, paths strings)."""
    if isinstance(node, dict):
        return {key: _plain_copy(value) for key, value in node.items()}
    if isinstance(node, (list, tuple)):
        return [_plain_copy(value) for value in node]
    return os.fspath(node) if isinstance(node, os.PathLike) else node


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
    problem = _clip(getattr(exc, "problem", None) or str(exc).splitlines()[0], 200)
    if mark is not None:
        return f"line {mark.line + 1}, column {mark.column + 1}: invalid YAML: {problem}"
    return f"invalid YAML: {problem}"


def _clip(text: str, limit: int) -> str:
    """One line of at most ``limit`` characters."""
    text = " ".join(text.splitlines())
    return text if len(text) <= limit else text[: limit - 3] + "..."


# A number past its upper bound, or not finite: the message states the whole range.
_ABOVE = {"less_than", "less_than_equal", "finite_number", "int_parsing_size"}
_OUT_OF_RANGE = _ABOVE | {"greater_than", "greater_than_equal"}


def _describe(err: dict[str, Any]) -> str:
    loc = tuple(str(p) for p in err["loc"])
    field, index = _leaf_field(loc), None
    if field is None and len(loc) > 1 and re.fullmatch(r"[0-9]{1,3}", loc[-1]):
        # An element of a tuple field (optim.betas): pydantic appends its index to the loc.
        field = _leaf_field(loc[:-1])
        if field is not None and typing.get_origin(_unwrap(field.annotation)) is tuple:
            index = int(loc[-1])
        else:
            field = None
    path = ".".join(map(_key, loc if index is None else loc[:-1])) or "job"
    if index is not None:
        path += f"[{index}]"
    kind = err["type"]
    if err.get("input") is REQUIRED:
        return f"{path}: required; add it to the job file"
    if kind == "extra_forbidden":
        return f"{path}: unknown key{_suggestion(loc)}"
    if kind == "missing" and index is not None:  # a tuple field with too few elements
        expected = _expected(field, None, None, False)  # type: ignore[arg-type]  # a tuple field's element: field is set
        return f"{'.'.join(loc[:-1])}: must be {expected}, got {_show(err['input'])}"
    if kind == "missing":
        return f"{path}: required; add it to the job file"
    if kind in ("model_type", "model_attributes_type", "dict_type"):
        return f"{path}: must be a section (a mapping of keys), got {_show(err['input'])}"
    message = str(err.get("ctx", {}).get("error", err["msg"]))
    if kind == "value_error" and message != BOOL_REJECTED:
        # One of the schema's own rules: its message is already written for users.
        return f"{path}: {message}" if loc else message
    expected = None
    if field is not None:
        name = loc[-2] if index is not None else loc[-1]
        expected = _expected(field, index, _unit(name), full=kind in _ABOVE)
        if expected is not None and kind in _OUT_OF_RANGE:
            expected = expected.removesuffix(" or null")  # it is a number: null is beside the point
    if expected is None:
        return f"{path}: {err['msg']}, got {_show(err['input'])}"
    return f"{path}: must be {expected}, got {_show(err['input'])}"


def _key(part: str) -> str:
    """A key as the path shows it; quoted when it has spaces, quotes, newlines or is long."""
    return part if re.fullmatch(r"[\w.\-\[\]]{1,60}", part) else _clip(json.dumps(part), 60)


def _show(value: Any) -> str:
    """An input value in one short line, as YAML would write it."""
    if isinstance(value, float) and not math.isfinite(value):
        return ".nan" if math.isnan(value) else ".inf" if value > 0 else "-.inf"
    if isinstance(value, int) and not isinstance(value, bool) and value.bit_length() > 64:
        return f"an integer of {value.bit_length()} bits"
    if isinstance(value, str) and _NUMBER_TEXT.fullmatch(value):
        return _clip(value, 80)  # a number YAML 1.1 reads as text, like 1e10: as written
    if isinstance(value, float) and value.is_integer() and abs(value) >= 1e6:
        return f"{value:g}"  # 1e+10, not 10000000000.0
    if isinstance(value, (str, int, float, bool)) or value is None:
        return _clip(json.dumps(value), 80)
    try:
        text = yaml.safe_dump(value, default_flow_style=True, width=math.inf)
    except (yaml.YAMLError, ValueError, RecursionError):  # e.g. an integer of 5000 digits inside
        text = f"a {type(value).__name__}"
    return _clip(text.strip().removesuffix("\n...").strip(), 80)


def _unit(name: str) -> str | None:
    return "seconds" if name.endswith("_s") else "minutes" if name.endswith("_minutes") else None


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


def _expected(field: FieldInfo, index: int | None, unit: str | None, full: bool) -> str | None:
    """What the field (or element ``index`` of a tuple field) must be. ``full``: with every
    bound; otherwise short, for a value of the wrong type or under the lower bound."""
    annotation, metadata = field.annotation, list(field.metadata)
    optional = type(None) in typing.get_args(annotation)
    args = typing.get_args(_unwrap(annotation))
    if index is not None and index < len(args):
        annotation, metadata, optional = typing.Optional[args[index]], [], False  # type: ignore[assignment]  # a type form, as the annotation
    bounds: dict[str, float] = {}
    for item in _constraints(annotation, metadata):
        for name in ("gt", "ge", "lt", "le"):
            if getattr(item, name, None) is not None:
                bounds[name] = getattr(item, name)
    text = _describe_type(_unwrap(annotation), bounds, unit, full)
    if text is None:
        return None
    return f"{text} or null" if optional else text


def _describe_type(inner: Any, bounds: dict[str, float], unit: str | None, full: bool) -> str | None:
    if typing.get_origin(inner) is Literal:
        return "one of " + ", ".join(repr(v) for v in typing.get_args(inner))
    if inner is bool:
        return "true or false"
    if inner is str:
        return "a string"
    if inner in (int, float):
        return _describe_number(inner is int, bounds, unit, full)
    if typing.get_origin(inner) is tuple:
        return f"a list of {len(typing.get_args(inner))} numbers"
    return None


def _describe_number(integer: bool, bounds: dict[str, float], unit: str | None, full: bool) -> str:
    noun = "integer" if integer else "number"
    gt, ge, le = bounds.get("gt"), bounds.get("ge"), bounds.get("le")
    positive = gt == 0 or (integer and ge == 1)
    if ge == 0 and le is not None and not integer and not unit:
        return f"a number between 0 and {le:g}"
    if not full and positive:
        return f"a positive {noun}"
    if not full and ge == 0:
        return "a non-negative integer" if integer else "a number >= 0"
    of = f" of {unit}" if unit else ""
    if positive:
        text = f"a positive {noun}{of}" + (f" up to {_bound(le)}" if le is not None else "")
    elif ge is not None and le is not None:
        text = f"{'an' if integer else 'a'} {noun}{of} from {_bound(ge)} to {_bound(le)}"
    else:
        text = f"{'an' if integer else 'a'} {noun}{of}"
    if le is None:
        return text.replace("a ", "a finite ", 1) if full else text
    days = le / {"seconds": 86400, "minutes": 1440}.get(unit or "", math.inf)
    return text + (f" (about {days:.0f} days)" if days >= 2 else "")


def _bound(value: float) -> str:
    return str(value) if isinstance(value, int) else f"{value:g}"
