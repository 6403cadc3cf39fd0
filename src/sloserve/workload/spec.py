"""Workload specs: streams of requests (a length source, an arrival process, a class and SLOs),
read from YAML and validated field by field.

A spec file looks like::

    name: mixed-rt-be
    description: one line shown by ``sloserve workloads``
    streams:
      - name: chat                     # optional, default stream<i>; unique
        class: rt                      # rt | be (default rt)
        source: {trace: sharegpt}      # or {trace: PATH, columns: {prompt: P, output: O}}
                                       # or {fixed: {prompt: 1024, output: 128}}
                                       # or {uniform: {prompt: [512, 1024], output: [32, 128]}}
        arrival: {process: poisson, rate: 8}   # | {process: gamma, rate: 8, cv: 2}
                                               # | {process: trace} | {process: offline}
        num_requests: 1000
        slo: {ttft_s: 0.4, tpot_s: 0.2}        # optional: ttft_s, tpot_s, jct_s
        max_tokens: 512                # optional output cap (default: context_len - prompt)
        start_s: 0                     # optional offset added to this stream's arrivals

A relative trace path is looked up next to the spec file first, then in the working directory.
Building a workload from a spec lives in ``sloserve.workload.build``.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from importlib import resources
from pathlib import Path
from typing import Any

import yaml

from sloserve.core.errors import ConfigError, UnknownNameError
from sloserve.core.request import SLO, RequestClass
from sloserve.workload.traces import ROLES, TRACES, _looks_like_path

PROCESSES = ("poisson", "gamma", "trace", "offline", "closed-batches")
# closed-batches: the stream's requests in batches of batch_size; the first arrives at start_s, each
# next one when every request of the previous batch has finished (BROS §7.1's best-effort jobs).
_PROCESS_KEYS = {"poisson": ("rate",), "gamma": ("rate", "cv"), "trace": (), "offline": (),
                 "closed-batches": ("batch_size",)}
_STREAM_KEYS = ("name", "class", "source", "arrival", "num_requests", "slo", "max_tokens",
                "start_s")
_SPEC_KEYS = ("name", "description", "streams")
_SLO_KEYS = ("ttft_s", "tpot_s", "jct_s")


@dataclass(frozen=True)
class TraceSource:
    """Lengths sampled from a trace (bundled name or file path)."""

    trace: str
    columns: dict[str, str] | None = None


@dataclass(frozen=True)
class FixedSource:
    """Every request has the same prompt and output length (InferMax §4 synthetic workloads)."""

    prompt: int
    output: int


@dataclass(frozen=True)
class UniformSource:
    """Prompt and output lengths uniform over inclusive integer ranges ``(lo, hi)``."""

    prompt: tuple[int, int]
    output: tuple[int, int]


Source = TraceSource | FixedSource | UniformSource


@dataclass(frozen=True)
class ArrivalSpec:
    """Arrival process: ``poisson`` (rate), ``gamma`` (rate, cv), ``trace``, ``offline`` or
    ``closed-batches`` (batch_size)."""

    process: str
    rate: float | None = None
    cv: float | None = None
    batch_size: int | None = None


@dataclass(frozen=True)
class StreamSpec:
    """One stream of requests sharing a source, an arrival process, a class and SLOs."""

    name: str
    request_class: RequestClass
    source: Source
    arrival: ArrivalSpec
    num_requests: int
    slo: SLO = field(default_factory=SLO)
    max_tokens: int | None = None
    start_s: float = 0.0


@dataclass(frozen=True)
class WorkloadSpec:
    """A named list of streams; ``origin`` (file name) prefixes error messages."""

    name: str
    streams: list[StreamSpec]
    description: str = ""
    origin: str = "<workload>"


# --------------------------------------------------------------------------------------------
# loading
# --------------------------------------------------------------------------------------------
def _workload_dir() -> Any:
    return resources.files("sloserve") / "data" / "workloads"


def list_workloads() -> dict[str, str]:
    """Named workload specs shipped with sloserve: name -> one-line description."""
    out: dict[str, str] = {}
    for entry in sorted(_workload_dir().iterdir(), key=lambda e: e.name):
        if entry.name.endswith(".yaml"):
            name = entry.name.removesuffix(".yaml")
            data = yaml.safe_load(entry.read_text(encoding="utf-8")) or {}
            out[name] = str(data.get("description", "")) if isinstance(data, dict) else ""
    return out


def load_workload_spec(name_or_path: str) -> WorkloadSpec:
    """Load a workload spec: a shipped name (see ``list_workloads``) or the path of a YAML file."""
    name = str(name_or_path)
    bundled = _workload_dir() / f"{name}.yaml"
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
        data = yaml.safe_load(text)
    except yaml.YAMLError as exc:
        raise ConfigError(f"{origin}: invalid YAML: {exc}") from exc
    default = Path(origin).name.removesuffix(".yaml").removesuffix(".yml")
    return parse_workload_spec(data, origin=origin, base_dir=base_dir, default_name=default)


def parse_workload_spec(
    data: Any, *, origin: str = "<workload>", base_dir: Path | None = None,
    default_name: str = "workload",
) -> WorkloadSpec:
    """Validate a decoded spec (a dict as read from YAML) and return a ``WorkloadSpec``.

    Every problem raises ``ConfigError`` naming ``origin``, the stream (index and name) and the
    field, e.g. ``workload.yaml: streams[1] (batch): arrival.rate must be > 0, got -2``.
    """
    top = _Ctx(f"{origin}: ")
    if data is None:
        raise ConfigError(f"{origin}: empty workload spec")
    top.keys(top.mapping(data, "workload spec"), _SPEC_KEYS, "")
    name = data.get("name", default_name)
    if not isinstance(name, str) or not name:
        raise top.error("name", f"must be a non-empty string, got {_show(name)}")
    description = data.get("description", "")
    if not isinstance(description, str):
        raise top.error("description", f"must be a string, got {_show(description)}")
    streams_raw = data.get("streams")
    if not isinstance(streams_raw, list) or not streams_raw:
        raise top.error("streams", f"must be a non-empty list of streams, got {_show(streams_raw)}")
    streams: list[StreamSpec] = []
    for i, raw in enumerate(streams_raw):
        stream = _parse_stream(raw, i, origin, base_dir)
        if any(s.name == stream.name for s in streams):
            raise top.error(f"streams[{i}].name", f"{stream.name!r} is used by another stream")
        streams.append(stream)
    return WorkloadSpec(name, streams, description, origin)


# --------------------------------------------------------------------------------------------
# validation
# --------------------------------------------------------------------------------------------
class _Ctx:
    """Error-message prefix plus typed field readers."""

    def __init__(self, prefix: str) -> None:
        self.prefix = prefix

    def error(self, fld: str, msg: str) -> ConfigError:
        return ConfigError(f"{self.prefix}{fld} {msg}" if fld else f"{self.prefix}{msg}")

    def mapping(self, value: Any, fld: str) -> dict[str, Any]:
        if not isinstance(value, dict):
            raise self.error(fld, f"must be a mapping, got {_show(value)}")
        return value

    def keys(self, data: Mapping[str, Any], allowed: tuple[str, ...], parent: str) -> None:
        for key in data:
            if key not in allowed:
                where = f"{parent}.{key}" if parent else str(key)
                raise self.error("", f"unknown key {where!r}; valid: {', '.join(allowed)}")

    def integer(self, value: Any, fld: str, minimum: int) -> int:
        if isinstance(value, bool) or not isinstance(value, int):
            raise self.error(fld, f"must be an integer, got {_show(value)}")
        if value < minimum:
            raise self.error(fld, f"must be >= {minimum}, got {value}")
        return value

    def number(self, value: Any, fld: str, *, positive: bool) -> float:
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise self.error(fld, f"must be a number, got {_show(value)}")
        if not math.isfinite(value):
            raise self.error(fld, f"must be finite, got {value}")
        if positive and not value > 0:
            raise self.error(fld, f"must be > 0, got {value}")
        if not positive and value < 0:
            raise self.error(fld, f"must be >= 0, got {value}")
        return float(value)


def _show(value: Any) -> str:
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        return str(value)
    return repr(value)


def _parse_stream(raw: Any, i: int, origin: str, base_dir: Path | None) -> StreamSpec:
    ctx = _Ctx(f"{origin}: streams[{i}]: ")
    ctx.mapping(raw, "")
    name = raw.get("name", f"stream{i}")
    if not isinstance(name, str) or not name:
        raise ctx.error("name", f"must be a non-empty string, got {_show(name)}")
    ctx = _Ctx(f"{origin}: streams[{i}] ({name}): ")
    ctx.keys(raw, _STREAM_KEYS, "")

    cls_raw = raw.get("class", "rt")
    if not isinstance(cls_raw, str) or cls_raw.lower() not in ("rt", "be"):
        raise ctx.error("class", f"must be 'rt' or 'be', got {_show(cls_raw)}")
    if "source" not in raw:
        raise ctx.error("source", "is required: {trace: NAME_OR_PATH}, {fixed: ...} or "
                                  "{uniform: ...}")
    source = _parse_source(ctx, raw["source"], base_dir)
    if "arrival" not in raw:
        raise ctx.error("arrival", f"is required: {{process: ...}} with process one of "
                                   f"{', '.join(PROCESSES)}")
    arrival = _parse_arrival(ctx, raw["arrival"])
    if arrival.process == "trace" and not isinstance(source, TraceSource):
        raise ctx.error("arrival.process", "'trace' needs a trace source with arrival times")
    if "num_requests" not in raw:
        raise ctx.error("num_requests", "is required")
    num_requests = ctx.integer(raw["num_requests"], "num_requests", 1)
    slo = _parse_slo(ctx, raw.get("slo"))
    max_tokens = raw.get("max_tokens")
    if max_tokens is not None:
        max_tokens = ctx.integer(max_tokens, "max_tokens", 1)
    start_s = ctx.number(raw.get("start_s", 0.0), "start_s", positive=False)
    return StreamSpec(name, RequestClass(cls_raw.lower()), source, arrival, num_requests, slo,
                      max_tokens, start_s)


def _parse_source(ctx: _Ctx, raw: Any, base_dir: Path | None) -> Source:
    ctx.mapping(raw, "source")
    kinds = [k for k in ("trace", "fixed", "uniform") if k in raw]
    if len(kinds) != 1:
        raise ctx.error("source", f"must have exactly one of trace, fixed, uniform; got "
                                  f"{', '.join(map(str, raw)) or 'none'}")
    kind = kinds[0]
    ctx.keys(raw, ("trace", "columns") if kind == "trace" else (kind,), "source")
    if kind == "trace":
        return _parse_trace_source(ctx, raw, base_dir)
    body = ctx.mapping(raw[kind], f"source.{kind}")
    ctx.keys(body, ("prompt", "output"), f"source.{kind}")
    for role in ("prompt", "output"):
        if role not in body:
            raise ctx.error(f"source.{kind}.{role}", "is required")
    if kind == "fixed":
        return FixedSource(ctx.integer(body["prompt"], "source.fixed.prompt", 1),
                           ctx.integer(body["output"], "source.fixed.output", 1))
    ranges = []
    for role in ("prompt", "output"):
        fld, value = f"source.uniform.{role}", body[role]
        if not isinstance(value, list) or len(value) != 2:
            raise ctx.error(fld, f"must be a list [lo, hi], got {_show(value)}")
        lo, hi = ctx.integer(value[0], fld + "[0]", 1), ctx.integer(value[1], fld + "[1]", 1)
        if lo > hi:
            raise ctx.error(fld, f"must have lo <= hi, got [{lo}, {hi}]")
        ranges.append((lo, hi))
    return UniformSource(ranges[0], ranges[1])


def _parse_trace_source(ctx: _Ctx, raw: dict[str, Any], base_dir: Path | None) -> TraceSource:
    trace = raw["trace"]
    if not isinstance(trace, str) or not trace:
        raise ctx.error("source.trace", f"must be a trace name or path, got {_show(trace)}")
    columns = raw.get("columns")
    if trace in TRACES:
        if columns is not None:
            raise ctx.error("source.columns", f"applies only to trace files, not to the bundled "
                                              f"trace {trace!r}")
        return TraceSource(trace)
    path = Path(trace).expanduser()
    if base_dir is not None and not path.is_absolute() and (base_dir / path).is_file():
        path = base_dir / path
    if not path.is_file():
        if _looks_like_path(trace):
            raise ctx.error("source.trace", f"file {trace!r} not found")
        err = UnknownNameError("trace", trace, list(TRACES))
        err.args = (f"{ctx.prefix}source.trace: {err.args[0]}; or give the path of a trace file",)
        raise err
    if columns is not None:
        ctx.mapping(columns, "source.columns")
        ctx.keys(columns, ROLES + ("arrival_unit",), "source.columns")
        for key, value in columns.items():
            if not isinstance(value, str):
                raise ctx.error(f"source.columns.{key}", f"must be a string, got {_show(value)}")
        columns = dict(columns)
    return TraceSource(str(path), columns)


def _parse_arrival(ctx: _Ctx, raw: Any) -> ArrivalSpec:
    ctx.mapping(raw, "arrival")
    process = raw.get("process")
    if process not in PROCESSES:
        raise ctx.error("arrival.process", f"must be one of {', '.join(PROCESSES)}; got "
                                           f"{_show(process)}")
    ctx.keys(raw, ("process",) + _PROCESS_KEYS[process], "arrival")
    values: dict[str, float] = {}
    for key in _PROCESS_KEYS[process]:
        if key not in raw:
            raise ctx.error(f"arrival.{key}", f"is required for process {process!r}")
        values[key] = ctx.number(raw[key], f"arrival.{key}", positive=True)
    batch_size = values.get("batch_size")
    if batch_size is not None and batch_size != int(batch_size):
        raise ctx.error("arrival.batch_size", f"must be a whole number, got {_show(raw['batch_size'])}")
    return ArrivalSpec(process, values.get("rate"), values.get("cv"),
                       None if batch_size is None else int(batch_size))


def _parse_slo(ctx: _Ctx, raw: Any) -> SLO:
    if raw is None:
        return SLO()
    ctx.mapping(raw, "slo")
    ctx.keys(raw, _SLO_KEYS, "slo")
    values = {k: None if raw.get(k) is None else ctx.number(raw[k], f"slo.{k}", positive=True)
              for k in _SLO_KEYS}
    return SLO(**values)


def with_rt_rate(spec: WorkloadSpec, rate: float) -> WorkloadSpec:
    """``spec`` with every Poisson or gamma real-time stream at ``rate`` requests/s."""
    if not rate > 0:
        raise ConfigError(f"RT rate must be > 0, got {rate}")
    def settable(s: StreamSpec) -> bool:
        return s.request_class is RequestClass.RT and s.arrival.process in ("poisson", "gamma")

    if not any(settable(s) for s in spec.streams):
        raise ConfigError(f"workload {spec.name!r} has no Poisson or gamma RT stream to set the rate of")
    streams = [replace(s, arrival=replace(s.arrival, rate=rate)) if settable(s) else s for s in spec.streams]
    return replace(spec, streams=streams)
