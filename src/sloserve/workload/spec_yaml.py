"""Reading a workload spec: a shipped name or a YAML file (``load_workload_spec``), validated field by
field (``parse_workload_spec``) by pydantic models (strict: 2.5 is not an integer, "8" not a number)
with their errors in our words. The spec's types are in spec.py.

NOTE: the package imports this module only when it is used (``sloserve.workload.__getattr__``), so a
run that reads no YAML spec does not load pydantic.
"""

from __future__ import annotations

import typing
from pathlib import Path
from typing import Annotated, Any, Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError

from sloserve.core.errors import ConfigError, UnknownNameError, yaml_error_message
from sloserve.core.request import SLO, RequestClass
from sloserve.core.yaml_loader import load_yaml
from sloserve.workload.limits import MAX_ARRIVAL_CV, MAX_LENGTH_TOKENS, MAX_NUM_REQUESTS, MAX_PRIORITY
from sloserve.workload.spec import (
    PROCESSES,
    ArrivalSpec,
    ConversationSource,
    FixedSource,
    LogNormalSource,
    Source,
    StreamSpec,
    TraceSource,
    UniformSource,
    WorkloadSpec,
    bundled_workloads_dir,
    list_workloads,
    trace_source,
)

# The keys of each arrival process (spec.ArrivalSpec): required, and no others.
_PROCESS_KEYS = {
    "poisson": ("rate",),
    "gamma": ("rate", "cv"),
    "trace": (),
    "offline": (),
    "closed-batches": ("batch_size",),
}


def load_workload_spec(name_or_path: str) -> WorkloadSpec:
    """Load a workload spec: a shipped name (see ``list_workloads``) or the path of a YAML file."""
    name = str(name_or_path)
    bundled = bundled_workloads_dir() / f"{name}.yaml"
    if "/" not in name and not name.endswith((".yaml", ".yml")) and bundled.is_file():
        text, origin, base_dir = bundled.read_text(encoding="utf-8"), f"{name}.yaml", None
    else:
        path = Path(name).expanduser()
        if not path.is_file():
            if "/" in name or "\\" in name or name.endswith((".yaml", ".yml")):
                raise ConfigError(f"workload file {name} not found")
            err = UnknownNameError("workload", name, list(list_workloads()))
            err.args = (f"{err.args[0]}; or give the path of a .yaml file",)
            raise err
        try:
            text = path.read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError) as exc:
            raise ConfigError(f"{name}: cannot read: {exc}") from exc
        origin, base_dir = name, path.parent
    try:
        data = load_yaml(text)
    except yaml.YAMLError as exc:
        raise ConfigError(f"{origin}: invalid YAML: {yaml_error_message(exc)}") from exc
    default = Path(origin).name.removesuffix(".yaml").removesuffix(".yml")
    return parse_workload_spec(data, origin=origin, base_dir=base_dir, default_name=default)


def parse_workload_spec(
    data: Any,
    *,
    origin: str = "<workload>",
    base_dir: Path | None = None,
    default_name: str = "workload",
) -> WorkloadSpec:
    """Validate a decoded spec (a dict as read from YAML) and return a ``WorkloadSpec``.

    Fields are checked by the pydantic models below; every problem raises ``ConfigError`` naming
    ``origin``, the stream (index and name) and the field, e.g.
    ``workload.yaml: streams[1] (batch): arrival.rate must be > 0, got -2``.
    """
    if data is None:
        raise ConfigError(f"{origin}: empty workload spec")
    top = _validated(_SpecFields, data, f"{origin}: ", "workload spec ")
    streams: list[StreamSpec] = []
    for i, raw in enumerate(top.streams):
        stream = _parse_stream(raw, i, origin, base_dir)
        if any(s.name == stream.name for s in streams):
            raise ConfigError(f"{origin}: streams[{i}].name {stream.name!r} is used by another stream")
        streams.append(stream)
    total = sum(s.num_requests for s in streams)
    if total > MAX_NUM_REQUESTS:
        raise ConfigError(
            f"{origin}: the streams' num_requests add up to {total:,}, above the {MAX_NUM_REQUESTS:,} a workload "
            "may hold"
        )
    return WorkloadSpec(top.name or default_name, streams, top.description, origin)


# --------------------------------------------------------------------------------------------
# validation: pydantic models of the YAML (strict: 2.5 is not an integer, "8" not a number)
# --------------------------------------------------------------------------------------------
class _Fields(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)


TokenCount = Annotated[int, Field(ge=1, le=MAX_LENGTH_TOKENS)]
RequestCount = Annotated[int, Field(ge=1, le=MAX_NUM_REQUESTS)]
PositiveNumber = Annotated[float, Field(gt=0, allow_inf_nan=False)]
NonNegativeNumber = Annotated[float, Field(ge=0, allow_inf_nan=False)]
Range = Annotated[list[TokenCount], Field(min_length=2, max_length=2)]


class _SpecFields(_Fields):
    name: Annotated[str, Field(min_length=1)] | None = None
    description: str = ""
    streams: Annotated[list[Any], Field(min_length=1)]


class _LengthsFields(_Fields):
    prompt: TokenCount
    output: TokenCount


class _RangesFields(_Fields):
    prompt: Range
    output: Range


MeanStd = Annotated[
    list[Annotated[float, Field(gt=0, le=MAX_LENGTH_TOKENS, allow_inf_nan=False)]], Field(min_length=2, max_length=2)
]


class _MomentsFields(_Fields):
    prompt: MeanStd
    output: MeanStd


class _ConversationFields(_Fields):
    trace: Annotated[str, Field(min_length=1)]
    columns: dict[str, str] | None = None
    turns: Range
    think_time_s: NonNegativeNumber = 0.0
    system_prompt_tokens: Annotated[int, Field(ge=0, le=MAX_LENGTH_TOKENS)] = 0


class _SourceFields(_Fields):
    trace: Annotated[str, Field(min_length=1)] | None = None
    columns: dict[str, str] | None = None
    fixed: _LengthsFields | None = None
    uniform: _RangesFields | None = None
    lognormal: _MomentsFields | None = None
    conversations: _ConversationFields | None = None


class _ArrivalFields(_Fields):
    process: Literal["poisson", "gamma", "trace", "offline", "closed-batches"]
    rate: PositiveNumber | None = None
    cv: Annotated[float, Field(gt=0, le=MAX_ARRIVAL_CV, allow_inf_nan=False)] | None = None
    batch_size: RequestCount | None = None


class _SLOFields(_Fields):
    ttft_s: PositiveNumber | None = None
    tpot_s: PositiveNumber | None = None
    jct_s: PositiveNumber | None = None


class _StreamFields(_Fields):
    model_config = ConfigDict(extra="forbid", strict=True, populate_by_name=True)
    name: Annotated[str, Field(min_length=1)] | None = None
    request_class: Literal["rt", "be", "RT", "BE"] = Field(default="rt", alias="class")
    source: _SourceFields
    arrival: _ArrivalFields
    num_requests: RequestCount
    slo: _SLOFields | None = None
    max_tokens: TokenCount | None = None
    start_s: NonNegativeNumber = 0.0
    priority: Annotated[int, Field(ge=-MAX_PRIORITY, le=MAX_PRIORITY)] = 0


# Hints after "is required" for fields whose shape is not obvious.
_REQUIRED_HINTS = {
    "source": ": {trace: NAME_OR_PATH}, {fixed: ...}, {uniform: ...}, {lognormal: ...} or {conversations: ...}",
    "arrival": f": {{process: ...}} with process one of {', '.join(PROCESSES)}",
}


def _validated(model: type[_Fields], data: Any, prefix: str, what: str = "") -> Any:
    """``data`` (``what`` it is, for the message) validated as ``model``, or a ConfigError for its
    first problem, in our words."""
    if not isinstance(data, dict):
        raise ConfigError(f"{prefix}{what}must be a mapping, got {_show(data)}")
    try:
        return model.model_validate(data)
    except ValidationError as e:
        # NOTE: an unknown key first: a misspelt key also shows as a missing one
        errors = sorted(e.errors(), key=lambda err: err["type"] != "extra_forbidden")
        raise ConfigError(prefix + _message(model, errors[0])) from None


def _message(model: type[_Fields], error: dict[str, Any]) -> str:
    """One pydantic error as "field problem, got value"."""
    loc = [x for x in error["loc"] if not str(x).startswith(("function-", "constrained-"))]
    field_path = "".join(f"[{x}]" if isinstance(x, int) else f".{x}" for x in loc).lstrip(".")
    value, kind, ctx = error.get("input"), error["type"], error.get("ctx") or {}
    if kind == "missing":
        return f"{field_path} is required{_REQUIRED_HINTS.get(field_path, '')}"
    if kind == "extra_forbidden":
        parent = _model_at(model, loc[:-1])
        valid = ", ".join(f.alias or name for name, f in parent.model_fields.items()) if parent else ""
        return f"unknown key {field_path!r}; valid: {valid}"
    if field_path == "streams":
        return f"streams must be a non-empty list of streams, got {_show(value)}"
    if kind == "literal_error" and field_path == "class":
        return f"class must be 'rt' or 'be', got {_show(value)}"
    if kind == "literal_error":
        return f"{field_path} must be one of {', '.join(PROCESSES)}; got {_show(value)}"
    bounds = {"greater_than": ("gt", ">"), "greater_than_equal": ("ge", ">="), "less_than_equal": ("le", "<=")}
    if kind in bounds:
        key, relation = bounds[kind]
        return f"{field_path} must be {relation} {_bound(ctx[key])}, got {_show(value)}"
    expected = {
        "int_type": "an integer",
        "int_from_float": "an integer",
        "float_type": "a number",
        "finite_number": "finite",
        "string_type": "a string",
        "dict_type": "a mapping",
        "model_type": "a mapping",
        "model_attributes_type": "a mapping",
        "list_type": _pair(field_path),
        "too_short": _pair(field_path),
        "too_long": _pair(field_path),
        "string_too_short": "a non-empty string",
    }.get(kind)
    if expected is not None:
        return f"{field_path} must be {expected}, got {_show(value)}"
    return f"{field_path}: {error['msg']}"


def _bound(value: Any) -> str:
    """A limit as a message shows it: 10,000,000 and 0, not 1e+07 and 0.0."""
    if isinstance(value, float) and value.is_integer():
        value = int(value)
    return f"{value:,}" if isinstance(value, int) else f"{value:g}"


def _pair(field_path: str) -> str:
    return "a list [mean, std]" if field_path.startswith("source.lognormal") else "a list [lo, hi]"


def _model_at(model: type[_Fields], loc: list[Any]) -> type[_Fields] | None:
    """The model class that the field path ``loc`` leads to (None past a plain field)."""
    for name in loc:
        fields = {f.alias or n: f for n, f in model.model_fields.items()}
        annotation = fields[name].annotation if name in fields else None
        inner = [
            a for a in (*typing.get_args(annotation), annotation) if isinstance(a, type) and issubclass(a, _Fields)
        ]
        if not inner:
            return None
        model = inner[0]
    return model


def _show(value: Any) -> str:
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        return str(value)
    return repr(value)


def _parse_stream(raw: Any, i: int, origin: str, base_dir: Path | None) -> StreamSpec:
    name = raw.get("name", f"stream{i}") if isinstance(raw, dict) else None
    label = f"{origin}: streams[{i}] ({name}): " if isinstance(name, str) and name else f"{origin}: streams[{i}]: "
    fields = _validated(_StreamFields, raw, label)
    name = fields.name or f"stream{i}"

    def error(fld: str, msg: str) -> ConfigError:
        return ConfigError(f"{label}{fld} {msg}")

    source = _parse_source(fields.source, label, base_dir, error)
    arrival = _parse_arrival(fields.arrival, label)
    if arrival.process == "trace" and not isinstance(source, TraceSource):
        raise error("arrival.process", "'trace' needs a trace source with arrival times")
    if isinstance(source, ConversationSource) and arrival.process == "closed-batches":
        raise error("arrival.process", "'closed-batches' does not apply to conversations (their turns are closed-loop)")
    slo = SLO() if fields.slo is None else SLO(fields.slo.ttft_s, fields.slo.tpot_s, fields.slo.jct_s)
    return StreamSpec(
        name,
        RequestClass(fields.request_class.lower()),
        source,
        arrival,
        fields.num_requests,
        slo,
        fields.max_tokens,
        float(fields.start_s),
        fields.priority,
        frozenset(fields.model_fields_set & {"request_class", "priority", "slo", "max_tokens"}),
    )


def _parse_source(fields: _SourceFields, label: str, base_dir: Path | None, error) -> Source:
    kinds = ("trace", "fixed", "uniform", "lognormal", "conversations")
    given = [k for k in kinds if getattr(fields, k) is not None]
    if len(given) != 1:
        raise error("source", f"must have exactly one of {', '.join(kinds)}; got {', '.join(given) or 'none'}")
    if fields.columns is not None and fields.trace is None:
        raise error("source.columns", "applies only to a trace source")
    if fields.fixed is not None:
        return FixedSource(fields.fixed.prompt, fields.fixed.output)
    if fields.conversations is not None:
        chat = fields.conversations
        lo, hi = chat.turns
        if lo > hi:
            raise error("source.conversations.turns", f"must have lo <= hi, got [{lo}, {hi}]")
        lengths = trace_source(chat.trace, chat.columns, label, base_dir)
        return ConversationSource(
            lengths.trace, lengths.columns, (lo, hi), chat.think_time_s, chat.system_prompt_tokens
        )
    if fields.lognormal is not None:
        for role in ("prompt", "output"):
            mean = getattr(fields.lognormal, role)[0]
            if mean < 1:  # NOTE: also keeps std / mean, and so the log-normal's sigma, finite
                raise error(f"source.lognormal.{role}", f"must have a mean >= 1 token, got {mean}")
        return LogNormalSource(tuple(fields.lognormal.prompt), tuple(fields.lognormal.output))
    if fields.uniform is not None:
        ranges = []
        for role in ("prompt", "output"):
            lo, hi = getattr(fields.uniform, role)
            if lo > hi:
                raise error(f"source.uniform.{role}", f"must have lo <= hi, got [{lo}, {hi}]")
            ranges.append((lo, hi))
        return UniformSource(ranges[0], ranges[1])
    return trace_source(fields.trace, fields.columns, label, base_dir)


def _parse_arrival(fields: _ArrivalFields, label: str) -> ArrivalSpec:
    """The keys each process takes (``_PROCESS_KEYS``): required, and no others."""
    process = fields.process
    wanted = _PROCESS_KEYS[process]
    for key in ("rate", "cv", "batch_size"):
        value = getattr(fields, key)
        if value is None and key in wanted:
            raise ConfigError(f"{label}arrival.{key} is required for process {process!r}")
        if value is not None and key not in wanted:
            raise ConfigError(f"{label}unknown key 'arrival.{key}'; valid: {', '.join(('process', *wanted))}")
    return ArrivalSpec(process, fields.rate, fields.cv, fields.batch_size)
