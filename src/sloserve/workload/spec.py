"""Workload specs: streams of requests (a length source, an arrival process, a class and SLOs),
read from YAML and validated field by field by ``spec_yaml.py`` (pydantic models, errors in our words).

A spec file looks like::

    name: mixed-rt-be
    description: one line shown by ``sloserve workloads``
    streams:
      - name: chat                     # optional, default stream<i>; unique
        class: rt                      # rt | be (default rt)
        source: {trace: sharegpt}      # or {trace: PATH, columns: {prompt: P, output: O}}
                                       # or {fixed: {prompt: 1024, output: 128}}
                                       # or {uniform: {prompt: [512, 1024], output: [32, 128]}}
                                       # or {lognormal: {prompt: [MEAN, STD], output: [MEAN, STD]}}
                                       # or {conversations: {trace: sharegpt, turns: [2, 6],
                                       #     think_time_s: 5, system_prompt_tokens: 600}}
        arrival: {process: poisson, rate: 8}   # | {process: gamma, rate: 8, cv: 2}
                                               # | {process: trace} | {process: offline}
        num_requests: 1000
        slo: {ttft_s: 0.4, tpot_s: 0.2}        # optional: ttft_s, tpot_s, jct_s
        max_tokens: 512                # optional output cap (default: context_len - prompt)
        start_s: 0                     # optional offset added to this stream's arrivals
        priority: 0                    # optional, vLLM's (the lower, the sooner)

A trace that records what each request was served with (``serve --request-log``: its class,
priority, SLO and max_tokens) gives each request its row's, except for those the stream sets.

A relative trace path is looked up next to the spec file first, then in the working directory.
Building a workload from a spec lives in ``sloserve.workload.build``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field, replace
from importlib import resources
from pathlib import Path
from typing import Any

from sloserve.core.errors import ConfigError, UnknownNameError
from sloserve.core.request import SLO, RequestClass
from sloserve.core.yaml_loader import load_yaml
from sloserve.workload.traces import MAPPING_KEYS, ROLES, TRACES, looks_like_path

PROCESSES = ("poisson", "gamma", "trace", "offline", "closed-batches")
# closed-batches: the stream's requests in batches of batch_size; the first arrives at start_s, each
# next one when every request of the previous batch has finished (BROS §7.1's best-effort jobs).


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


@dataclass(frozen=True)
class LogNormalSource:
    """Prompt and output lengths log-normal with the given ``(mean, std)`` in tokens (rounded, at
    least 1): a workload from a dataset's published statistics when its rows cannot be shipped
    (BROS's LMSYS-Chat-1M: prompt 90.5 +- 148.5, output 237 +- 228)."""

    prompt: tuple[float, float]
    output: tuple[float, float]


@dataclass(frozen=True)
class ConversationSource:
    """Multi-turn sessions: each has ``turns`` (inclusive range) turns, and turn k's prompt resends
    the system prompt (``system_prompt_tokens``, one shared by every session of the stream), turns
    1..k-1 and their answers, then the new message. Message and answer lengths are a trace's prompt
    and output lengths. Turn 1 arrives by the stream's arrival process (sessions per second); turn
    k + 1 ``think_time_s`` after turn k's answer ends (closed loop per session). A session ends early at
    the first turn whose prompt and answer exceed the model's context. ``num_requests`` counts turns."""

    trace: str
    columns: dict[str, str] | None
    turns: tuple[int, int]
    think_time_s: float = 0.0
    system_prompt_tokens: int = 0


Source = TraceSource | FixedSource | UniformSource | LogNormalSource | ConversationSource


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
    priority: int = 0  # vLLM's request priority (the lower, the sooner; waiting_order=priority)
    # The settings the stream was given (of request_class, priority, slo, max_tokens): they apply to
    # every request; the others are defaults, below what a trace row recorded (traces.RecordedSettings)
    settings_given: frozenset[str] = frozenset()


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
def bundled_workloads_dir() -> Any:
    """The folder of the workload specs shipped with sloserve (``sloserve workloads``)."""
    return resources.files("sloserve") / "data" / "workloads"


def list_workloads() -> dict[str, str]:
    """Named workload specs shipped with sloserve: name -> one-line description."""
    out: dict[str, str] = {}
    for entry in sorted(bundled_workloads_dir().iterdir(), key=lambda e: e.name):
        if entry.name.endswith(".yaml"):
            name = entry.name.removesuffix(".yaml")
            data = load_yaml(entry.read_text(encoding="utf-8")) or {}
            out[name] = str(data.get("description", "")) if isinstance(data, dict) else ""
    return out


def with_rt_rate(spec: WorkloadSpec, rate: float) -> WorkloadSpec:
    """``spec`` with every Poisson or gamma real-time stream at ``rate`` requests/s."""
    if not (rate > 0 and math.isfinite(rate)):
        raise ConfigError(f"RT rate must be a finite number > 0, got {rate}")

    def settable(s: StreamSpec) -> bool:
        return s.request_class is RequestClass.RT and s.arrival.process in ("poisson", "gamma")

    if not any(settable(s) for s in spec.streams):
        raise ConfigError(f"workload {spec.name!r} has no Poisson or gamma RT stream to set the rate of")
    streams = [replace(s, arrival=replace(s.arrival, rate=rate)) if settable(s) else s for s in spec.streams]
    return replace(spec, streams=streams)


def trace_source(trace: str, columns: dict[str, str] | None, label: str, base_dir: Path | None = None) -> TraceSource:
    """A stream's ``{trace: NAME_OR_PATH, columns: ...}`` source: a bundled name, or a file looked up
    next to the spec (``base_dir``) first, then in the working directory. ``label`` prefixes errors
    (``"wl.yaml: streams[0] (chat): "``)."""
    if trace in TRACES:
        if columns is not None:
            raise ConfigError(f"{label}source.columns applies only to trace files, not to the bundled trace {trace!r}")
        return TraceSource(trace)
    path = Path(trace).expanduser()
    if base_dir is not None and not path.is_absolute() and (base_dir / path).is_file():
        path = base_dir / path
    if not path.is_file():
        if looks_like_path(trace):
            raise ConfigError(f"{label}source.trace file {trace!r} not found")
        err = UnknownNameError("trace", trace, list(TRACES))
        err.args = (f"{label}source.trace: {err.args[0]}; or give the path of a trace file",)
        raise err
    for key in columns or {}:
        if key not in ROLES + MAPPING_KEYS:
            raise ConfigError(f"{label}unknown key 'source.columns.{key}'; valid: {', '.join(ROLES + MAPPING_KEYS)}")
    return TraceSource(str(path), columns)
