"""Turn a ``WorkloadSpec`` into a seeded, sorted list of ``Request`` objects.

Sampling (per stream, from its own child of ``np.random.SeedSequence(seed)``, so adding a stream
or changing one stream's arrival process leaves the other draws unchanged):

* trace arrivals: ``num_requests`` consecutive trace rows from a seeded random start row, times
  rebased to 0 (wrapping around with back-to-back copies when the trace is too short; Mooncake's
  3 s buckets are jittered), see ``arrivals.trace_replay``;
* any other process: trace rows drawn uniformly without replacement (with replacement when more
  requests than rows are asked for); fixed or uniform lengths for synthetic sources.

Lengths are clipped to the model context: prompt <= context_len - 1, then output <= context_len -
prompt. ``max_tokens`` is the stream's cap (or context_len - prompt), never above context_len -
prompt; an output longer than the cap is truncated to it (a real server stops there), so
``max_tokens >= true_output_tokens`` always holds.

A request's class, priority, SLO and max_tokens are its stream's, or, for a trace row that records
them (a request log), the row's, except those the stream was given (``StreamSpec.settings_given``).
"""

from __future__ import annotations

import functools
import math
import warnings
import zlib
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, NamedTuple

import numpy as np

from sloserve.core.errors import ConfigError
from sloserve.core.prefix import SegmentedPrompt
from sloserve.core.request import SLO, Request, RequestClass
from sloserve.workload import arrivals
from sloserve.workload.limits import MAX_LENGTH_TOKENS
from sloserve.workload.spec import (
    ArrivalSpec,
    ConversationSource,
    FixedSource,
    LogNormalSource,
    Source,
    StreamSpec,
    TraceSource,
    UniformSource,
    WorkloadSpec,
    trace_source,
)
from sloserve.workload.traces import TRACES, RecordedSettings, TraceData, load_trace


def _lognormal(mean_std: tuple[float, float], n: int, rng: np.random.Generator) -> np.ndarray:
    """``n`` lengths from the log-normal with this mean and standard deviation (moments matched:
    sigma^2 = ln(1 + (std/mean)^2), mu = ln(mean) - sigma^2/2), rounded, in 1..MAX_LENGTH_TOKENS (a
    heavy tail's draw can pass any integer: the context clips it later)."""
    mean, std = mean_std
    sigma2 = np.log1p((std / mean) ** 2)
    draws = rng.lognormal(np.log(mean) - sigma2 / 2, np.sqrt(sigma2), size=n)
    return np.clip(np.rint(draws), 1, MAX_LENGTH_TOKENS).astype(np.int64)


@dataclass
class Workload:
    """Requests sorted by arrival, ids 0..N-1 in that order, plus what clipping changed."""

    name: str
    requests: list[Request]
    num_clipped: int = 0
    clipped_details: str = ""
    # Closed-loop batches (arrival process closed-batches): per stream, its batches in order. Only
    # the first batch has an arrival time; later ones have arrival_time = inf until the simulator
    # releases each when every request of the batch before it has finished.
    chains: list[list[list[Request]]] = field(default_factory=list)

    def __len__(self) -> int:
        return len(self.requests)

    @property
    def duration_s(self) -> float:
        """Arrival time of the last request (0 for an empty or offline workload)."""
        return self.requests[-1].arrival_time if self.requests else 0.0


def build_workload(
    spec: WorkloadSpec,
    *,
    seed: int,
    context_len: int,
    num_requests: int | None = None,
    rate_scale: float | None = None,
) -> Workload:
    """Sample the requests of ``spec``. Deterministic for a given ``seed``.

    ``num_requests`` overrides the total request count, split over the streams in proportion to
    their own counts (largest remainder, ties to the earlier stream). ``rate_scale`` multiplies the
    load: Poisson/gamma rates are multiplied by it and trace timestamps divided by it (streams'
    ``start_s`` offsets are not scaled).
    Requests are ordered by arrival time, ties by stream order then sample order.
    """
    _check_int("seed", seed, 0)
    _check_int("context_len", context_len, 2)
    if num_requests is not None:
        _check_int("num_requests", num_requests, 1)
    if rate_scale is not None and (
        isinstance(rate_scale, bool)
        or not isinstance(rate_scale, (int, float))
        or not math.isfinite(rate_scale)
        or not rate_scale > 0
    ):
        raise ConfigError(f"rate_scale must be > 0, got {rate_scale!r}")
    rows = _sample_streams(spec, _split(spec, num_requests), seed, rate_scale or 1.0, context_len)
    t, p, o = rows.t, rows.p, rows.o

    prompt_clipped = p > context_len - 1
    p = np.minimum(p, context_len - 1)
    output_clipped = p + o > context_len
    o = np.minimum(o, context_len - p)
    clipped = prompt_clipped | output_clipped
    max_tokens = np.minimum(rows.caps, context_len - p)
    capped = o > max_tokens
    o = np.minimum(o, max_tokens)

    order = np.lexsort((rows.sample, rows.sid, t))
    settings, contents = rows.settings, rows.contents
    requests = [
        Request(
            request_id=rid,
            arrival_time=at,
            num_prompt_tokens=pi,
            true_output_tokens=oi,
            max_tokens=mi,
            request_class=settings[k].request_class,
            slo=settings[k].slo,
            prompt_blocks=None if contents[k] is None else contents[k](pi, oi),
            think_time_s=th,
            priority=settings[k].priority,
        )
        for rid, (k, at, pi, oi, mi, th) in enumerate(
            zip(
                order.tolist(),
                t[order].tolist(),
                p[order].tolist(),
                o[order].tolist(),
                max_tokens[order].tolist(),
                rows.think[order].tolist(),
            )
        )
    ]
    requests_by_row = [None] * len(requests)  # row k of the unsorted arrays -> its Request
    for rid, k in enumerate(order.tolist()):
        requests_by_row[k] = requests[rid]
    details = _details(spec, rows.sid, clipped, prompt_clipped, output_clipped, capped, context_len)
    return Workload(spec.name, requests, int(clipped.sum()), details, _chains(spec, rows, requests_by_row))


@dataclass
class _Rows:
    """The sampled requests of every stream, a row each, streams one after another (not yet in arrival order)."""

    t: np.ndarray  # arrival, s
    p: np.ndarray  # prompt tokens
    o: np.ndarray  # output tokens
    sid: np.ndarray  # the stream's index
    think: np.ndarray  # the think time before it (a conversation's turn), s
    session: np.ndarray  # its conversation (a conversation's turn)
    sample: np.ndarray  # its place among its stream's
    caps: np.ndarray  # max_tokens (the context where none)
    settings: list[_Settings]
    contents: list[Callable[[int, int], SegmentedPrompt] | None]  # its prompt's content


def _sample_streams(spec: WorkloadSpec, counts: list[int], seed: int, rate_scale: float, context_len: int) -> _Rows:
    """``counts[i]`` requests of each stream, each stream from its own child of ``SeedSequence(seed)``."""
    children = np.random.SeedSequence(seed).spawn(len(spec.streams))
    times, prompts, outputs, stream_ids, caps, thinks, sessions = [], [], [], [], [], [], []
    settings: list[_Settings] = []
    contents: list[Callable[[int, int], SegmentedPrompt] | None] = []
    for i, (stream, n, child) in enumerate(zip(spec.streams, counts, children)):
        len_seed, arr_seed = child.spawn(2)
        prefix = f"{spec.origin}: streams[{i}] ({stream.name}): "
        rngs = np.random.default_rng(len_seed), np.random.default_rng(arr_seed)
        try:
            if isinstance(stream.source, ConversationSource):
                sampled = _sample_conversations(stream, n, *rngs, rate_scale, context_len, i)
            else:
                sampled = _sample(stream, n, *rngs, rate_scale, prefix)
        except ConfigError as exc:
            if str(exc).startswith(prefix):
                raise
            exc.args = (prefix + str(exc),)
            raise
        contents.extend(sampled.contents)
        times.append(sampled.t + stream.start_s)
        prompts.append(sampled.p)
        outputs.append(sampled.o)
        thinks.append(sampled.think)
        sessions.append(sampled.session)
        stream_ids.append(np.full(n, i, dtype=np.int64))
        if any(r is not None for r in sampled.recorded):
            rows = [_request_settings(stream, recorded) for recorded in sampled.recorded]
        else:
            rows = [_request_settings(stream, None)] * n
        settings.extend(rows)
        caps.append(np.array([row.max_tokens or context_len for row in rows], dtype=np.int64))
    return _Rows(
        t=np.concatenate(times) if times else np.zeros(0),
        p=np.concatenate(prompts).astype(np.int64),
        o=np.concatenate(outputs).astype(np.int64),
        sid=np.concatenate(stream_ids),
        think=np.concatenate(thinks),
        session=np.concatenate(sessions),
        sample=np.concatenate([np.arange(n, dtype=np.int64) for n in counts]),
        caps=np.concatenate(caps),
        settings=settings,
        contents=contents,
    )


def _chains(spec: WorkloadSpec, rows: _Rows, requests_by_row: list[Request]) -> list[list[list[Request]]]:
    """The requests released one batch after another: a conversation's turns (each its own batch, in turn order),
    a closed-batches stream's batches (in sample order)."""
    chains = []
    for i, stream in enumerate(spec.streams):
        if isinstance(stream.source, ConversationSource):  # a session's turns, one at a time
            turns: dict[int, list[Request]] = {}
            for k in np.flatnonzero(rows.sid == i).tolist():  # rows in turn order within a session
                turns.setdefault(int(rows.session[k]), []).append(requests_by_row[k])
            chains.extend([[r] for r in turns[s]] for s in sorted(turns))
            continue
        if stream.arrival.process != "closed-batches":
            continue
        members = sorted((rows.sample[k], requests_by_row[k]) for k in range(len(requests_by_row)) if rows.sid[k] == i)
        in_order = [r for _, r in members]
        size = stream.arrival.batch_size or len(in_order)
        chains.append([in_order[j : j + size] for j in range(0, len(in_order), size)])
    return chains


def workload_from_trace(
    trace: str,
    *,
    num_requests: int,
    seed: int,
    context_len: int,
    rate: float | None = None,
    burstiness_cv: float | None = None,
    trace_arrivals: bool = False,
    offline: bool = False,
    request_class: str | None = None,
    slo: SLO | Mapping[str, float | None] | None = None,
    max_tokens: int | None = None,
    columns: Mapping[str, str] | None = None,
) -> Workload:
    """One stream from a trace, as the CLI's ``--trace NAME`` with exactly one of ``--rate R``
    (Poisson; gamma with ``burstiness_cv``), ``--trace-arrivals`` or ``--offline``. ``request_class``,
    ``slo`` and ``max_tokens`` apply to every request when given; otherwise a request takes what its
    row records (a request log), else rt, no SLO, no cap."""
    chosen = [
        flag
        for flag, on in (
            ("rate (--rate)", rate is not None),
            ("trace_arrivals (--trace-arrivals)", trace_arrivals),
            ("offline (--offline)", offline),
        )
        if on
    ]
    if len(chosen) != 1:
        raise ConfigError(
            "give exactly one of rate (--rate), trace_arrivals (--trace-arrivals) or offline "
            f"(--offline); got {', '.join(chosen) or 'none'}"
        )
    if burstiness_cv is not None and rate is None:
        raise ConfigError("burstiness_cv (--burstiness) needs a rate (--rate)")
    load_trace(trace, columns)  # unknown name or bad file: the loader's own message
    arrival = _arrival(rate, burstiness_cv, offline)
    label = trace if trace in TRACES else Path(trace).name
    origin = f"--trace {trace}"
    source = trace_source(trace, dict(columns) if columns else None, f"{origin}: streams[0] ({label}): ")
    stream = _one_stream(label, request_class, source, arrival, num_requests, slo, max_tokens, origin)
    spec = WorkloadSpec(f"{label}@{_arrival_label(arrival)}", [stream], origin=origin)
    return build_workload(spec, seed=seed, context_len=context_len)


def synthetic_workload(
    prompt: int,
    output: int,
    num_requests: int,
    *,
    context_len: int,
    seed: int = 0,
    rate: float | None = None,
    burstiness_cv: float | None = None,
    request_class: str = "rt",
    slo: SLO | Mapping[str, float | None] | None = None,
    max_tokens: int | None = None,
) -> Workload:
    """``num_requests`` requests with fixed prompt and output lengths (InferMax §4). Offline (all
    at time 0) unless a ``rate`` is given (Poisson, or gamma with ``burstiness_cv``)."""
    if burstiness_cv is not None and rate is None:
        raise ConfigError("burstiness_cv (--burstiness) needs a rate (--rate)")
    arrival = _arrival(rate, burstiness_cv, rate is None)
    label, origin = f"fixed-{prompt}-{output}", "synthetic workload"
    for role, value in (("prompt", prompt), ("output", output)):
        _check_field(origin, label, f"source.fixed.{role}", value, integer=True)
    source = FixedSource(prompt, output)
    stream = _one_stream(label, request_class, source, arrival, num_requests, slo, max_tokens, origin)
    spec = WorkloadSpec(f"{label}@{_arrival_label(arrival)}", [stream], origin=origin)
    return build_workload(spec, seed=seed, context_len=context_len)


# --------------------------------------------------------------------------------------------
# helpers
# --------------------------------------------------------------------------------------------
class _Sample(NamedTuple):
    """One stream's rows: arrival times (inf: released by the turn before), prompt and output lengths,
    each prompt's content (a function of its clipped lengths; None: unknown), think times,
    conversation sessions (-1: none) and what each row's request was served with (None: not recorded)."""

    t: np.ndarray
    p: np.ndarray
    o: np.ndarray
    contents: list[Callable[[int, int], SegmentedPrompt] | None]
    think: np.ndarray
    session: np.ndarray
    recorded: list[RecordedSettings | None]


class _Settings(NamedTuple):
    """What a request is served with (max_tokens None: as many as the context holds)."""

    request_class: RequestClass
    priority: int
    slo: SLO
    max_tokens: int | None


def _request_settings(stream: StreamSpec, recorded: RecordedSettings | None) -> _Settings:
    """A request's settings: its trace row's where the row records one and the stream was not given
    its own, else the stream's."""

    def pick(name: str) -> Any:
        row = None if recorded is None else getattr(recorded, name)
        return getattr(stream, name) if row is None or name in stream.settings_given else row

    return _Settings(pick("request_class"), pick("priority"), pick("slo"), pick("max_tokens"))


def _sample(
    stream: StreamSpec,
    n: int,
    rng_len: np.random.Generator,
    rng_arr: np.random.Generator,
    rate_scale: float,
    prefix: str,
) -> _Sample:
    """The rows of a stream of independent requests (lengths unclipped)."""
    proc = stream.arrival
    src = stream.source
    trace, rows = None, None
    if isinstance(src, TraceSource):
        trace = load_trace(src.trace, src.columns)
        if proc.process == "trace" and trace.arrival_s is None:
            raise ConfigError(
                f"{prefix}arrival.process 'trace' needs arrival times, but trace "
                f"{src.trace!r} has none; use poisson, gamma or offline"
            )
        if n > len(trace):
            how = "its rows replayed back to back" if proc.process == "trace" else "rows drawn with replacement"
            _warn_repeats(src.trace, n, len(trace), how)
        if proc.process == "trace":
            t, rows = arrivals.trace_replay(trace.arrival_s, n, rng_arr, trace.arrival_quantum_s)
            return _independent(t / rate_scale, trace.prompt_tokens[rows], trace.output_tokens[rows], trace, rows)
        rows = rng_len.choice(len(trace), size=n, replace=n > len(trace))
        p, o = trace.prompt_tokens[rows], trace.output_tokens[rows]
    elif isinstance(src, FixedSource):
        p, o = np.full(n, src.prompt, dtype=np.int64), np.full(n, src.output, dtype=np.int64)
    elif isinstance(src, UniformSource):
        p = rng_len.integers(src.prompt[0], src.prompt[1] + 1, size=n, dtype=np.int64)
        o = rng_len.integers(src.output[0], src.output[1] + 1, size=n, dtype=np.int64)
    elif isinstance(src, LogNormalSource):
        p, o = _lognormal(src.prompt, n, rng_len), _lognormal(src.output, n, rng_len)
    else:  # pragma: no cover - spec parsing rules this out
        raise ConfigError(f"{prefix}unknown source {src!r}")
    t = _arrivals(proc, n, rng_arr, rate_scale)
    if t is None:
        raise ConfigError(f"{prefix}arrival.process {proc.process!r} needs a trace source")
    return _independent(t, p, o, trace, rows)


def _warn_repeats(trace: str, n: int, num_rows: int, how: str) -> None:
    """Say (on stderr, from the CLI) that ``n`` requests repeat a trace of ``num_rows`` rows."""
    warnings.warn(
        f"trace {trace} has {num_rows} row{'s' if num_rows != 1 else ''} and {n} requests were asked for: "
        f"requests repeat its rows ({how})",
        UserWarning,
        stacklevel=4,
    )


def _arrivals(proc: ArrivalSpec, n: int, rng_arr: np.random.Generator, rate_scale: float) -> np.ndarray | None:
    """``n`` arrival times of a process that needs no trace (None for ``trace``)."""
    if proc.process == "poisson":
        return arrivals.poisson(n, proc.rate * rate_scale, rng_arr)
    if proc.process == "gamma":
        return arrivals.gamma(n, proc.rate * rate_scale, proc.cv, rng_arr)
    if proc.process == "offline":
        return arrivals.offline(n)
    if proc.process == "closed-batches":
        # The first batch at the start; later ones are released by the simulator.
        return np.where(np.arange(n) < (proc.batch_size or n), 0.0, math.inf)
    return None


def _independent(
    t: np.ndarray, p: np.ndarray, o: np.ndarray, trace: TraceData | None, rows: np.ndarray | None
) -> _Sample:
    """The rows of independent requests, ``rows`` of ``trace`` (None: a synthetic source)."""
    n = len(p)
    recorded = [None] * n if trace is None or trace.recorded is None else [trace.recorded[k] for k in rows.tolist()]
    return _Sample(t, p, o, _prompt_contents(trace, rows, n), np.zeros(n), np.full(n, -1, dtype=np.int64), recorded)


def _prompt_contents(
    trace: TraceData | None, rows: np.ndarray | None, n: int
) -> list[Callable[[int, int], SegmentedPrompt] | None]:
    """Per request, its prompt's content from the trace's hash ids (in the trace's own namespace: ids
    of two traces never match), or None when the trace has no prefix structure."""
    if trace is None or rows is None or trace.hash_ids is None:
        return [None] * n
    namespace, size = zlib.crc32(trace.source.encode()), trace.hash_block_tokens
    return [functools.partial(_hashed_prompt, trace.hash_ids[k], size, namespace) for k in rows.tolist()]


def _hashed_prompt(ids: tuple[int, ...], size: int, namespace: int, prompt: int, _output: int) -> SegmentedPrompt:
    return SegmentedPrompt.uniform(ids, size, prompt, namespace)


def _sample_conversations(
    stream: StreamSpec,
    n: int,
    rng_len: np.random.Generator,
    rng_arr: np.random.Generator,
    rate_scale: float,
    context_len: int,
    stream_index: int,
) -> _Sample:
    """``n`` turns of sessions (``ConversationSource``), session by session: a turn's message and answer
    lengths are a trace row's prompt and output (the answer capped at the stream's max_tokens); turn k's
    prompt is the system prompt, the k - 1 turns before with their answers, and its message. Content
    ids: 0 for the system prompt, then one per message and per answer, in the stream's namespace."""
    source = stream.source
    trace = load_trace(source.trace, source.columns)
    cap = stream.max_tokens or context_len
    system = source.system_prompt_tokens
    if system >= context_len - 1:
        raise ConfigError(
            f"source.conversations.system_prompt_tokens {system} leaves no room in the model's context of {context_len}"
        )
    p, o, think, session, contents = [], [], [], [], []
    next_id, num_sessions = 1, 0
    while len(p) < n:
        ids, ends = ([0], [system]) if system else ([], [])
        history = system
        for turn in range(int(rng_len.integers(source.turns[0], source.turns[1] + 1))):
            row = int(rng_len.integers(len(trace)))
            message, answer = int(trace.prompt_tokens[row]), min(int(trace.output_tokens[row]), cap)
            prompt = history + message
            if turn and prompt + answer > context_len:
                break  # the session ends here; a first turn too long is clipped like any request
            ids += [next_id, next_id + 1]
            ends += [prompt, prompt + answer]
            next_id += 2
            p.append(prompt)
            o.append(answer)
            think.append(source.think_time_s if turn else 0.0)
            session.append(num_sessions)
            contents.append(functools.partial(_conversation_prompt, tuple(ids), tuple(ends), stream_index))
            history = prompt + answer
            if len(p) == n:
                break
        num_sessions += 1
    session_arr = np.asarray(session, dtype=np.int64)
    first_turn = np.r_[True, session_arr[1:] != session_arr[:-1]]
    starts = _arrivals(stream.arrival, num_sessions, rng_arr, rate_scale)
    t = np.where(first_turn, starts[session_arr], math.inf)  # later turns: released by the turn before
    # NOTE: a turn's lengths come from a trace row; what that row's request was served with does not
    # carry over to a turn of another conversation
    return _Sample(t, np.asarray(p), np.asarray(o), contents, np.asarray(think), session_arr, [None] * len(p))


def _conversation_prompt(
    ids: tuple[int, ...], ends: tuple[int, ...], namespace: int, prompt: int, output: int
) -> SegmentedPrompt:
    """A turn's content: its prompt and the answer it gets, so the next turn finds the answer's blocks
    (a first turn clipped to the context keeps its ids over its clipped lengths)."""
    ends = (*ends[:-2], prompt, prompt + output) if len(ends) >= 2 else ends
    return SegmentedPrompt(ids, ends, prompt + output, namespace)


def _split(spec: WorkloadSpec, total: int | None) -> list[int]:
    counts = [s.num_requests for s in spec.streams]
    if total is None:
        return counts
    weight = sum(counts)
    shares = [total * c / weight for c in counts]
    out = [math.floor(x) for x in shares]
    by_remainder = sorted(range(len(counts)), key=lambda i: (-(shares[i] - out[i]), i))
    for i in by_remainder[: total - sum(out)]:
        out[i] += 1
    return out


def _details(
    spec: WorkloadSpec,
    sid: np.ndarray,
    clipped: np.ndarray,
    prompt_clipped: np.ndarray,
    output_clipped: np.ndarray,
    capped: np.ndarray,
    context_len: int,
) -> str:
    parts = []
    if clipped.any():
        text = (
            f"{int(clipped.sum())} of {len(clipped)} requests clipped to context_len "
            f"{context_len} ({int(prompt_clipped.sum())} prompts cut to {context_len - 1} "
            f"tokens, {int(output_clipped.sum())} outputs cut to fit)"
        )
        if len(spec.streams) > 1:
            per = ", ".join(f"{s.name}: {int(clipped[sid == i].sum())}" for i, s in enumerate(spec.streams))
            text += f"; per stream: {per}"
        parts.append(text)
    if capped.any():
        per = ", ".join(
            f"{s.name}: {int(capped[sid == i].sum())}" for i, s in enumerate(spec.streams) if capped[sid == i].any()
        )
        parts.append(f"{int(capped.sum())} outputs truncated to their max_tokens ({per})")
    return "; ".join(parts)


def _check_int(name: str, value: Any, minimum: int) -> None:
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < minimum:
        raise ConfigError(f"{name} must be an integer >= {minimum}, got {value!r}")


def _arrival(rate: float | None, cv: float | None, offline: bool) -> ArrivalSpec:
    if offline:
        return ArrivalSpec("offline")
    if rate is None:
        return ArrivalSpec("trace")
    return ArrivalSpec("poisson", rate) if cv is None else ArrivalSpec("gamma", rate, cv)


def _arrival_label(arrival: ArrivalSpec) -> str:
    if arrival.process == "poisson":
        return f"rate={arrival.rate:g}"
    if arrival.process == "gamma":
        return f"rate={arrival.rate:g},cv={arrival.cv:g}"
    return arrival.process


def _one_stream(
    name: str,
    request_class: str | None,
    source: Source,
    arrival: ArrivalSpec,
    num_requests: int,
    slo: SLO | Mapping[str, float | None] | None,
    max_tokens: int | None,
    origin: str,
) -> StreamSpec:
    """The one stream of ``workload_from_trace`` / ``synthetic_workload``, its fields checked with the
    messages a YAML spec gets (``spec_yaml.py``) but without loading pydantic for a plain trace run."""
    given = {key for key, value in (("request_class", request_class), ("slo", slo), ("max_tokens", max_tokens))
             if value is not None}  # fmt: skip
    request_class = request_class or "rt"
    if request_class not in ("rt", "be", "RT", "BE"):
        raise ConfigError(f"{origin}: streams[0] ({name}): class must be 'rt' or 'be', got {request_class!r}")
    _check_field(origin, name, "num_requests", num_requests, integer=True)
    if max_tokens is not None:
        _check_field(origin, name, "max_tokens", max_tokens, integer=True)
    for key in ("rate", "cv"):
        if getattr(arrival, key) is not None:
            _check_field(origin, name, f"arrival.{key}", getattr(arrival, key), integer=False)
    if isinstance(slo, Mapping):
        for key, value in slo.items():
            if key not in ("ttft_s", "tpot_s", "jct_s"):
                raise ConfigError(
                    f"{origin}: streams[0] ({name}): unknown key 'slo.{key}'; valid: ttft_s, tpot_s, jct_s"
                )
            if value is not None:
                _check_field(origin, name, f"slo.{key}", value, integer=False)
        slo = SLO(**slo)
    return StreamSpec(
        name,
        RequestClass(request_class.lower()),
        source,
        arrival,
        num_requests,
        slo or SLO(),
        max_tokens,
        settings_given=frozenset(given),
    )


def _check_field(origin: str, stream: str, field_path: str, value: Any, *, integer: bool) -> None:
    """A positive integer (``integer``) or a positive finite number, else a spec_yaml-style error."""
    prefix = f"{origin}: streams[0] ({stream}): {field_path} must be"
    if isinstance(value, bool) or not isinstance(value, (int, np.integer) if integer else (int, float, np.number)):
        raise ConfigError(f"{prefix} {'an integer' if integer else 'a number'}, got {value!r}")
    if integer and value < 1:
        raise ConfigError(f"{prefix} >= 1, got {value}")
    if not integer and not math.isfinite(value):
        raise ConfigError(f"{prefix} finite, got {value}")
    if not integer and not value > 0:
        raise ConfigError(f"{prefix} > 0, got {value}")


def synthetic_prompts(requests: Sequence[Request], vocab_size: int, seed: int) -> list[list[int]]:
    """Token ids of each request's prompt length (as the engine's ``run`` uses): random, except that a
    prompt with prefix structure (a trace's ``hash_ids``) gets the same tokens for the same ids, so a
    server with prefix caching finds exactly the blocks a simulation finds."""
    rng = np.random.default_rng(seed)
    return [
        r.prompt_blocks.token_ids(vocab_size, r.num_prompt_tokens)
        if r.prompt_blocks is not None
        else rng.integers(0, vocab_size, size=r.num_prompt_tokens).tolist()
        for r in requests
    ]
