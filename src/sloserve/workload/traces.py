"""LLM request traces: prompt/output token lengths and, for some, real arrival times.

Bundled traces (gzip copies of public files, see ``NOTICE`` and ``data/traces/README.md``) are
loaded by name; any other CSV or JSONL file is loaded by path with an optional column mapping.
Nothing is ever fetched at run time.

User files (``.csv``, ``.csv.gz``, ``.jsonl``, ``.jsonl.gz``; gzip is detected by content):

* ``columns`` maps ``prompt``, ``output`` and (optionally) ``arrival`` to column names (CSV header
  names or JSONL keys). Unmapped roles use the first default name present, compared
  case-insensitively: see ``DEFAULT_COLUMNS``. An optional ``arrival_unit`` (``"s"`` or ``"ms"``)
  sets the unit of a numeric arrival column.
* Token counts must be integers >= 1 (prompt and output alike).
* Arrival values are numbers or ISO-8601 date-times (e.g. the Azure ``TIMESTAMP``
  ``2023-11-16 18:17:03.9799600``). Numbers are seconds, except a JSONL key named ``timestamp``,
  which is milliseconds as in the Mooncake traces. Times are rebased so that the first request
  arrives at 0; rows that are not in time order are sorted by arrival (stably).
* A JSONL key ``hash_ids`` (Mooncake's; map another with ``columns: {hash_ids: KEY}``) gives each
  prompt's prefix structure: one content id per segment of ``hash_block_tokens`` tokens (a mapping
  key, default 512 as Mooncake's), the last one possibly partial; equal ids mean equal tokens there
  and before. A prompt of n tokens has exactly ceil(n / hash_block_tokens) ids.
* What each request was served with, as ``serve --request-log`` records it (optional; each may be
  null, missing from a JSONL row or an empty CSV cell: left to the stream): ``request_class`` (``rt``
  or ``be``), ``priority`` (an integer), ``slo_ttft_s``, ``slo_tpot_s``, ``slo_jct_s`` (seconds > 0)
  and ``max_tokens`` (an integer >= 1). A replay gives each request its row's values, except where
  its stream sets its own (``RecordedSettings``).
"""

from __future__ import annotations

import collections
import csv
import functools
import gzip
import io
import itertools
import json
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from importlib import resources
from pathlib import Path
from typing import Any

import numpy as np

from sloserve.core.errors import ConfigError, UnknownNameError
from sloserve.core.request import SLO, RequestClass
from sloserve.workload.limits import MAX_LENGTH_TOKENS, MAX_PRIORITY

# What a request was served with (the request log's keys): each role is a column of its own name
SETTING_ROLES = ("request_class", "priority", "slo_ttft_s", "slo_tpot_s", "slo_jct_s", "max_tokens")
ROLES = ("prompt", "output", "arrival", "hash_ids", *SETTING_ROLES)
OPTIONAL_ROLES = ("arrival", "hash_ids", *SETTING_ROLES)
DEFAULT_COLUMNS: dict[str, tuple[str, ...]] = {
    "prompt": ("num_prefill_tokens", "prompt_tokens", "input_length", "ContextTokens", "prompt", "input"),
    "output": ("num_decode_tokens", "output_tokens", "output_length", "GeneratedTokens", "output"),
    "arrival": ("arrived_at", "arrival_s", "timestamp", "arrival"),
    "hash_ids": ("hash_ids",),
    **{role: (role,) for role in SETTING_ROLES},
}
MAPPING_KEYS = ("arrival_unit", "hash_block_tokens")  # column-mapping keys that are settings, not roles
MOONCAKE_BLOCK_TOKENS = 512
_SUFFIXES = ".csv, .csv.gz, .jsonl, .jsonl.gz"


@dataclass(frozen=True)
class RecordedSettings:
    """What one request of a trace was served with (a request log's line); None where the row leaves
    it to the stream. A stream that sets one itself (a spec's ``class``, ``priority``, ``slo`` or
    ``max_tokens``; ``--slo-*`` or ``--max-tokens``) replaces the row's for every request."""

    request_class: RequestClass | None = None
    priority: int | None = None
    slo: SLO | None = None  # None: the row has no SLO column with a value
    max_tokens: int | None = None


@dataclass(frozen=True, eq=False)
class TraceData:
    """A parsed trace. Arrays are read-only; ``arrival_s`` is None when the trace has no times.

    ``arrival_s`` holds float64 seconds from the first request (so ``arrival_s[0] == 0``), sorted
    non-decreasing. ``arrival_quantum_s`` > 0 means the timestamps are bucketed to that width
    (replay jitters each arrival uniformly inside ``[t, t + quantum)``).
    """

    name: str
    prompt_tokens: np.ndarray
    output_tokens: np.ndarray
    arrival_s: np.ndarray | None
    source: str
    license: str
    arrival_quantum_s: float = 0.0
    # Per row, its prompt's segment content ids (prefix caching), or None when the trace has none.
    hash_ids: tuple[tuple[int, ...], ...] | None = None
    hash_block_tokens: int = 512
    # Per row, what the request was served with, or None when the trace has none of SETTING_ROLES.
    recorded: tuple[RecordedSettings, ...] | None = None

    def __len__(self) -> int:
        return len(self.prompt_tokens)

    @property
    def duration_s(self) -> float | None:
        """Time from the first to the last arrival (None without arrivals)."""
        if self.arrival_s is None:
            return None
        return float(self.arrival_s[-1] - self.arrival_s[0])


@dataclass(frozen=True)
class TraceInfo:
    """Registry entry of a bundled trace."""

    description: str
    file: str
    source: str
    license: str
    columns: dict[str, str] = field(default_factory=dict)
    arrival_quantum_s: float = 0.0


_VIDUR = "microsoft/vidur@7d475133 data/processed_traces/"
_ETALON = "project-etalon/etalon@d5f18de1 data/processed_traces/"
_AZURE = "Azure/AzurePublicDataset@b469a113 data/"
_MOONCAKE = "kvcache-ai/Mooncake@3b5a5941 FAST25-release/traces/"

TRACES: dict[str, TraceInfo] = {
    "sharegpt": TraceInfo(
        "ShareGPT, 10k validation requests (Llama-2 tokens); short prompts, no arrival times",
        "sharegpt_val_10k_llama2.csv.gz",
        "AKafakA/vidur_opt_scheduler@20bdc49d data/trace_data/sharegpt/sharegpt_val_10k_llama2.csv",
        "MIT",
    ),
    "sharegpt-8k": TraceInfo(
        "ShareGPT conversations filtered to <= 8192 tokens (Llama-2 tokens), no arrival times",
        "sharegpt_8k_filtered_stats_llama2_tokenizer.csv.gz",
        _ETALON + "sharegpt_8k_filtered_stats_llama2_tokenizer.csv",
        "Apache-2.0",
    ),
    "bwb": TraceInfo(
        "Bilingual Web Book document translation, <= 4096 tokens, long outputs, no arrival times",
        "bwb_stats_llama2_tokenizer_filtered_v2.csv.gz",
        _ETALON + "bwb_stats_llama2_tokenizer_filtered_v2.csv",
        "Apache-2.0",
    ),
    "arxiv": TraceInfo(
        "arXiv summarization, <= 4096 tokens, long prompts, no arrival times",
        "arxiv_summarization_stats_llama2_tokenizer_filtered_v2.csv.gz",
        _VIDUR + "arxiv_summarization_stats_llama2_tokenizer_filtered_v2.csv",
        "MIT",
    ),
    "azure-conv": TraceInfo(
        "Azure LLM inference 2023, conversation service: real arrivals, 1 h, 5.5 req/s",
        "AzureLLMInferenceTrace_conv.csv.gz",
        _AZURE + "AzureLLMInferenceTrace_conv.csv",
        "CC-BY-4.0 (cite Patel et al., Splitwise, ISCA 2024)",
        {"prompt": "ContextTokens", "output": "GeneratedTokens", "arrival": "TIMESTAMP"},
    ),
    "azure-code": TraceInfo(
        "Azure LLM inference 2023, coding service: real arrivals, 1 h, 2.6 req/s, very bursty",
        "AzureLLMInferenceTrace_code.csv.gz",
        _AZURE + "AzureLLMInferenceTrace_code.csv",
        "CC-BY-4.0 (cite Patel et al., Splitwise, ISCA 2024)",
        {"prompt": "ContextTokens", "output": "GeneratedTokens", "arrival": "TIMESTAMP"},
    ),
    "mooncake-conv": TraceInfo(
        "Mooncake (Kimi) conversation trace: real arrivals in 3 s buckets, very long prompts, shared prefixes",
        "conversation_trace.jsonl.gz",
        _MOONCAKE + "conversation_trace.jsonl",
        "Apache-2.0",
        {"prompt": "input_length", "output": "output_length", "arrival": "timestamp", "hash_ids": "hash_ids"},
        arrival_quantum_s=3.0,
    ),
    "mooncake-synthetic": TraceInfo(
        "Mooncake synthetic trace: Poisson arrivals, 3.9 req/s, very long prompts, shared prefixes",
        "synthetic_trace.jsonl.gz",
        _MOONCAKE + "synthetic_trace.jsonl",
        "Apache-2.0",
        {"prompt": "input_length", "output": "output_length", "arrival": "timestamp", "hash_ids": "hash_ids"},
    ),
}


# --------------------------------------------------------------------------------------------
# public API
# --------------------------------------------------------------------------------------------
def load_trace(name_or_path: str, columns: Mapping[str, str] | None = None) -> TraceData:
    """Load a bundled trace by name (see ``TRACES``) or a user CSV/JSONL file by path.

    ``columns`` (paths only) maps ``prompt``/``output``/``arrival`` to column names and may set
    ``arrival_unit`` to ``"s"`` or ``"ms"``. Raises ``UnknownNameError`` for an unknown name that is
    not an existing file and ``ConfigError`` for any unusable file, column or value.
    """
    name = str(name_or_path)
    if name in TRACES:
        if columns:
            raise ConfigError(f"trace {name!r} is bundled; a column mapping applies only to trace files")
        return _load_bundled(name)
    path = Path(name).expanduser()
    if path.is_file():
        return _load_file(path, dict(columns) if columns else {})
    if path.exists():
        raise ConfigError(f"trace {name}: not a file")
    if looks_like_path(name):
        raise ConfigError(f"trace file {name} not found")
    err = UnknownNameError("trace", name, list(TRACES))
    err.args = (f"{err.args[0]}; or give the path of a {_SUFFIXES} file",)
    raise err


def trace_summary(name_or_path: str, columns: Mapping[str, str] | None = None) -> dict[str, Any]:
    """Statistics of a trace for ``sloserve traces``: row count, prompt/output mean, p50, p99, max,
    when the trace has arrival times, its duration and mean rate (rows / duration), and when it records
    what its requests were served with (a request log), the rows of each class and priority and those
    with an SLO; when it has hash ids, ``prefix_shared``."""
    trace = load_trace(name_or_path, columns)
    out: dict[str, Any] = {"name": trace.name, "rows": len(trace)}
    for role, arr in (("prompt", trace.prompt_tokens), ("output", trace.output_tokens)):
        p50, p99 = np.percentile(arr, [50, 99])
        out[f"{role}_mean"] = float(arr.mean())
        out[f"{role}_p50"] = float(p50)
        out[f"{role}_p99"] = float(p99)
        out[f"{role}_max"] = int(arr.max())
    duration = trace.duration_s
    out["has_arrivals"] = duration is not None
    out["duration_s"] = duration
    out["rate_rps"] = len(trace) / duration if duration else None
    out["arrival_quantum_s"] = trace.arrival_quantum_s
    out["source"] = trace.source
    out["license"] = trace.license
    out["recorded"] = None if trace.recorded is None else _recorded_summary(trace.recorded)
    out["prefix_shared"] = None if trace.hash_ids is None else prefix_shared(trace)
    return out


def prefix_shared(trace: TraceData) -> float:
    """The share of the prompt tokens that an earlier row's prompt had too (its hash ids in order:
    equal ids mean equal tokens there and before), at the trace's segment granularity: what a prefix
    cache that never evicts could find, with whole segments."""
    assert trace.hash_ids is not None
    seen: set[int] = set()
    shared = 0
    for ids, prompt in zip(trace.hash_ids, trace.prompt_tokens.tolist(), strict=True):
        found = next((k for k, segment in enumerate(ids) if segment not in seen), len(ids))
        shared += min(found * trace.hash_block_tokens, prompt)
        seen.update(ids)
    return shared / int(trace.prompt_tokens.sum())


def _recorded_summary(recorded: Sequence[RecordedSettings]) -> dict[str, Any]:
    """How many rows record each class and priority, and an SLO ("-": left to the stream)."""
    classes = collections.Counter("-" if r.request_class is None else r.request_class.value for r in recorded)
    priorities = collections.Counter("-" if r.priority is None else str(r.priority) for r in recorded)
    return {
        "classes": dict(sorted(classes.items())),
        "priorities": dict(sorted(priorities.items(), key=lambda kv: (1, 0) if kv[0] == "-" else (0, int(kv[0])))),
        "with_slo": sum(r.slo is not None for r in recorded),
    }


# --------------------------------------------------------------------------------------------
# loading
# --------------------------------------------------------------------------------------------
@functools.cache
def _load_bundled(name: str) -> TraceData:
    info = TRACES[name]
    resource = resources.files("sloserve") / "data" / "traces" / info.file
    raw = resource.read_bytes()
    fmt = "jsonl" if ".jsonl" in info.file else "csv"
    return _parse(
        raw,
        label=f"{name} ({info.file})",
        fmt=fmt,
        columns=info.columns,
        name=name,
        source=info.source,
        license=info.license,
        quantum=info.arrival_quantum_s,
    )


def _load_file(path: Path, columns: dict[str, str]) -> TraceData:
    lower = path.name.lower().removesuffix(".gz")
    if lower.endswith(".csv"):
        fmt = "csv"
    elif lower.endswith((".jsonl", ".ndjson")):
        fmt = "jsonl"
    else:
        raise ConfigError(f"{path}: unsupported trace file type; use {_SUFFIXES}")
    try:
        raw = path.read_bytes()
    except OSError as exc:
        raise ConfigError(f"{path}: cannot read: {exc.strerror or exc}") from exc
    return _parse(
        raw,
        label=str(path),
        fmt=fmt,
        columns=columns,
        name=path.name,
        source=str(path),
        license="user-supplied",
        quantum=0.0,
    )


def looks_like_path(name: str) -> bool:
    """Whether a trace name the user gave is meant as a file (a folder in it, or a trace file's suffix)."""
    lower = name.lower()
    return "/" in name or "\\" in name or lower.endswith((".csv", ".jsonl", ".gz", ".ndjson"))


def _parse(
    raw: bytes,
    *,
    label: str,
    fmt: str,
    columns: Mapping[str, str],
    name: str,
    source: str,
    license: str,
    quantum: float,
) -> TraceData:
    if raw[:2] == b"\x1f\x8b":
        try:
            raw = gzip.decompress(raw)
        except (OSError, EOFError) as exc:
            raise ConfigError(f"{label}: corrupt gzip data: {exc}") from exc
    try:
        text = raw.decode("utf-8-sig")
    except UnicodeDecodeError as exc:
        raise ConfigError(f"{label}: not UTF-8 text ({exc.reason} at byte {exc.start})") from exc

    columns = dict(columns)
    unit = columns.pop("arrival_unit", None)
    block_tokens = columns.pop("hash_block_tokens", MOONCAKE_BLOCK_TOKENS)
    unknown = sorted(set(columns) - set(ROLES))
    if unknown:
        raise ConfigError(
            f"{label}: unknown column role(s) {', '.join(map(repr, unknown))} in the column "
            f"mapping; valid: {', '.join(ROLES + MAPPING_KEYS)}"
        )
    if unit not in (None, "s", "ms"):
        raise ConfigError(f"{label}: arrival_unit must be 's' or 'ms', got {unit!r}")
    try:
        block_tokens = int(block_tokens)
    except ValueError:
        block_tokens = 0
    if block_tokens < 1:
        raise ConfigError(f"{label}: hash_block_tokens must be an integer >= 1, got {block_tokens!r}")

    reader = _read_csv if fmt == "csv" else _read_jsonl
    values, lines, names = reader(text, label, columns)
    if not lines:
        raise ConfigError(f"{label}: no data rows")

    prompt = _int_column(values["prompt"], lines, label, names["prompt"], "prompt")
    output = _int_column(values["output"], lines, label, names["output"], "output")
    hash_ids = None
    if "hash_ids" in values:
        hash_ids = _hash_ids_column(values["hash_ids"], prompt, lines, label, names["hash_ids"], block_tokens)
    recorded = _recorded_settings(values, lines, label, names)
    arrival = None
    if "arrival" in values:
        if unit is None:
            unit = "ms" if fmt == "jsonl" and names["arrival"].lower() == "timestamp" else "s"
        arrival = _time_column(values["arrival"], lines, label, names["arrival"], unit)
        if np.any(arrival[1:] < arrival[:-1]):
            order = np.argsort(arrival, kind="stable")
            arrival, prompt, output = arrival[order], prompt[order], output[order]
            if hash_ids is not None:
                hash_ids = tuple(hash_ids[k] for k in order.tolist())
            if recorded is not None:
                recorded = tuple(recorded[k] for k in order.tolist())
        arrival = arrival - arrival[0]
        arrival.flags.writeable = False
    prompt.flags.writeable = False
    output.flags.writeable = False
    return TraceData(name, prompt, output, arrival, source, license, quantum, hash_ids, block_tokens, recorded)


def _resolve(header: Sequence[str], columns: Mapping[str, str], label: str) -> dict[str, str]:
    """Map each role to a header name: the user's choice (exact) or the first default present."""
    present = {h.lower(): h for h in header}
    names: dict[str, str] = {}
    for role in ROLES:
        if role in columns:
            chosen = columns[role]
            if chosen not in header:
                raise ConfigError(
                    f"{label}: column {chosen!r} (mapped to {role}) not found; columns present: {', '.join(header)}"
                )
            names[role] = chosen
            continue
        found = next((present[c.lower()] for c in DEFAULT_COLUMNS[role] if c.lower() in present), None)
        if found is not None:
            names[role] = found
        elif role not in OPTIONAL_ROLES:
            raise ConfigError(
                f"{label}: no {role}-length column (tried {', '.join(DEFAULT_COLUMNS[role])}); "
                f"columns present: {', '.join(header)}; map one with --columns {role}=NAME"
            )
    return names


def _read_csv(
    text: str, label: str, columns: Mapping[str, str]
) -> tuple[dict[str, list[Any]], list[int], dict[str, str]]:
    reader = csv.reader(io.StringIO(text))
    header: list[str] | None = None
    for row in reader:
        if any(cell.strip() for cell in row):
            header = [cell.strip() for cell in row]
            break
    if header is None:
        raise ConfigError(f"{label}: empty file (no header row)")
    names = _resolve(header, columns, label)
    index = {role: header.index(col) for role, col in names.items()}
    need = max(index.values()) + 1
    values: dict[str, list[Any]] = {role: [] for role in names}
    appenders = [(values[role].append, i) for role, i in index.items()]
    lines: list[int] = []
    for row in reader:
        if len(row) < need:
            if not any(cell.strip() for cell in row):
                continue  # blank line
            missing = next(r for r, i in index.items() if i >= len(row))
            raise ConfigError(
                f"{label}: line {reader.line_num}: column {names[missing]!r} is missing "
                f"(row has {len(row)} fields, header has {len(header)})"
            )
        for append, i in appenders:
            append(row[i])
        lines.append(reader.line_num)
    return values, lines, names


def _read_jsonl(
    text: str, label: str, columns: Mapping[str, str]
) -> tuple[dict[str, list[Any]], list[int], dict[str, str]]:
    numbered = [(lineno, line) for lineno, line in enumerate(text.splitlines(), start=1) if line.strip()]
    if not numbered:
        raise ConfigError(f"{label}: empty file (no JSON rows)")
    lines = [lineno for lineno, _ in numbered]
    # NOTE: every line in one call of the C decoder (Mooncake's 12k lines with their hash_ids: a
    # call per line cost as much again); a line that is not one JSON value is found line by line.
    try:
        objs = json.loads("[" + ",".join(line for _, line in numbered) + "]")
    except json.JSONDecodeError:
        objs = []
    if len(objs) != len(numbered):
        objs = [_json_line(line, lineno, label) for lineno, line in numbered]
    for obj, lineno in zip(objs, lines, strict=True):
        if type(obj) is not dict:
            raise ConfigError(f"{label}: line {lineno}: expected a JSON object, got {type(obj).__name__}")
    # NOTE: the first row names the columns, except the settings' (SETTING_ROLES): a row may leave one
    # out, as null, and the first row need not have it
    keys = list(objs[0])
    keys += sorted(k for k in set().union(*objs) - set(keys) if k in SETTING_ROLES or k in columns.values())
    names = _resolve(keys, columns, label)
    values: dict[str, list[Any]] = {}
    for role, key in names.items():
        if role in SETTING_ROLES:
            values[role] = [obj.get(key) for obj in objs]
            continue
        try:
            values[role] = [obj[key] for obj in objs]
        except KeyError:
            lineno, obj = next((n, o) for n, o in zip(lines, objs, strict=True) if key not in o)
            raise ConfigError(
                f"{label}: line {lineno}: column {key!r} is missing; keys present: {', '.join(obj)}"
            ) from None
    return values, lines, names


def _json_line(line: str, lineno: int, label: str) -> Any:
    try:
        return json.loads(line)
    except json.JSONDecodeError as exc:
        raise ConfigError(f"{label}: line {lineno}: invalid JSON: {exc.msg}") from exc


# --------------------------------------------------------------------------------------------
# value conversion: vectorised fast path, row-by-row scan only to name the first bad value
# --------------------------------------------------------------------------------------------
def _int_column(values: list[Any], lines: list[int], label: str, column: str, role: str) -> np.ndarray:
    try:
        arr = np.asarray(values, dtype=np.float64)
    except (ValueError, TypeError):
        arr = None
    if arr is not None and np.all(arr >= 1) and np.all(arr == np.floor(arr)) and np.all(arr <= MAX_LENGTH_TOKENS):
        return arr.astype(np.int64)
    for value, line in zip(values, lines):
        number = _number(value)
        where = f"{label}: line {line}: column {column!r}"
        if number is None or not math.isfinite(number) or number != math.floor(number):
            raise ConfigError(f"{where}: {role} length {_show(value)} is not an integer")
        if not 1 <= number <= MAX_LENGTH_TOKENS:
            raise ConfigError(f"{where}: {role} length must be in 1..{MAX_LENGTH_TOKENS:,}, got {_show(value)}")
    raise AssertionError("unreachable: the fast check failed, so some row is bad")  # pragma: no cover


def _hash_ids_column(
    values: list[Any], prompt: np.ndarray, lines: list[int], label: str, column: str, block_tokens: int
) -> tuple[tuple[int, ...], ...]:
    """Each row's segment content ids: a list of integers >= 0, ceil(prompt / block_tokens) of them.
    As for the other columns, the check runs over all rows at once (in C: Mooncake's conversation
    trace has 300k ids), and a row-by-row scan runs only to name the first bad line."""
    if all(type(v) is list for v in values):
        flat = list(itertools.chain.from_iterable(values))
        lengths = np.fromiter(map(len, values), dtype=np.int64, count=len(values))
        if (not flat or (set(map(type, flat)) == {int} and min(flat) >= 0)) and np.array_equal(
            lengths, -(-prompt // block_tokens)
        ):
            return tuple(map(tuple, values))
    for value, n, line in zip(values, prompt.tolist(), lines, strict=True):
        if not isinstance(value, list) or not all(type(x) is int and x >= 0 for x in value):
            raise ConfigError(
                f"{label}: line {line}: column {column!r}: expected a list of integers >= 0, got {_show(value)[:80]}"
            )
        if len(value) != -(-n // block_tokens):
            raise ConfigError(
                f"{label}: line {line}: column {column!r}: {len(value)} ids for a prompt of {n} tokens; "
                f"expected ceil({n} / {block_tokens}) = {-(-n // block_tokens)} (one per {block_tokens}-token block)"
            )
    raise AssertionError("unreachable: the fast check failed, so some row is bad")  # pragma: no cover


def _recorded_settings(
    values: dict[str, list[Any]], lines: list[int], label: str, names: Mapping[str, str]
) -> tuple[RecordedSettings, ...] | None:
    """Each row's ``RecordedSettings`` from the SETTING_ROLES columns the trace has (None: it has none).
    An empty value (JSON null, an empty CSV cell) leaves that setting to the stream."""
    if not any(role in values for role in SETTING_ROLES):
        return None
    columns: dict[str, list[Any]] = {role: [] for role in SETTING_ROLES}
    for role in SETTING_ROLES:
        if role not in values:
            columns[role] = [None] * len(lines)
            continue
        for value, line in zip(values[role], lines, strict=True):
            try:
                columns[role].append(_setting(role, value))
            except ValueError as exc:
                raise ConfigError(f"{label}: line {line}: column {names[role]!r}: {exc}") from None
    recorded = []
    for cls, priority, ttft, tpot, jct, max_tokens in zip(*columns.values(), strict=True):
        slo = None if ttft is None and tpot is None and jct is None else SLO(ttft, tpot, jct)
        recorded.append(RecordedSettings(cls, priority, slo, max_tokens))
    return tuple(recorded)


def _setting(role: str, value: Any) -> Any:
    """One SETTING_ROLES value (a JSON value or a CSV cell) as the request's setting, None if empty;
    ValueError naming what it must be."""
    if value is None or (isinstance(value, str) and not value.strip()):
        return None
    if role == "request_class":
        if isinstance(value, str) and value.strip().lower() in ("rt", "be"):
            return RequestClass(value.strip().lower())
        raise ValueError(f"request class must be 'rt' or 'be', got {_show(value)}")
    number = _number(value)
    if role in ("priority", "max_tokens"):
        if number is None or not math.isfinite(number) or number != math.floor(number):
            raise ValueError(f"{role} must be an integer, got {_show(value)}")
        if role == "max_tokens" and not 1 <= number <= MAX_LENGTH_TOKENS:
            raise ValueError(f"max_tokens must be in 1..{MAX_LENGTH_TOKENS:,}, got {_show(value)}")
        if role == "priority" and abs(number) > MAX_PRIORITY:
            raise ValueError(f"priority must be in -{MAX_PRIORITY:,}..{MAX_PRIORITY:,}, got {_show(value)}")
        return int(number)
    if number is None or not math.isfinite(number) or not number > 0:
        raise ValueError(f"{role} must be a number of seconds > 0, got {_show(value)}")
    return number


def _time_column(values: list[Any], lines: list[int], label: str, column: str, unit: str) -> np.ndarray:
    scale = 1e-3 if unit == "ms" else 1.0
    try:
        arr = np.asarray(values, dtype=np.float64)
    except (ValueError, TypeError):
        arr = None
    if arr is not None:
        if np.all(np.isfinite(arr)):
            return arr * scale
        line, value = next((ln, v) for ln, v, a in zip(lines, values, arr) if not math.isfinite(a))
        raise ConfigError(f"{label}: line {line}: column {column!r}: arrival {_show(value)} is not a finite number")
    # Date-times (e.g. Azure's TIMESTAMP with 7 fractional digits): parse at ns resolution.
    if all(isinstance(v, str) for v in values):
        try:
            stamps = np.asarray(values, dtype="datetime64[ns]")
        except ValueError:
            stamps = None
        if stamps is not None and not np.any(np.isnat(stamps)):
            ns = stamps.astype(np.int64)
            return (ns - ns.min()).astype(np.float64) * 1e-9
    for value, line in zip(values, lines):
        if _number(value) is None and not _is_datetime(value):
            raise ConfigError(
                f"{label}: line {line}: column {column!r}: arrival {_show(value)} is neither a "
                f"number ({unit}) nor an ISO-8601 date-time"
            )
    line, value = lines[0], values[0]
    raise ConfigError(f"{label}: column {column!r}: arrival times mix numbers and date-times (line {line}: {value!r})")


def _show(value: Any) -> str:
    """A value for an error message: numbers bare (``-2``), anything else quoted (``'abc'``)."""
    if isinstance(value, str) and value.strip() and _number(value) is not None:
        return value.strip()
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        return str(value)
    return repr(value)


def _number(value: Any) -> float | None:
    if isinstance(value, bool):
        return None
    if isinstance(value, (int, float)):
        return float(value)
    if isinstance(value, str):
        try:
            return float(value)
        except ValueError:
            return None
    return None


def _is_datetime(value: Any) -> bool:
    if not isinstance(value, str) or not value.strip():
        return False
    try:
        return not np.isnat(np.datetime64(value.strip(), "ns"))
    except ValueError:
        return False
