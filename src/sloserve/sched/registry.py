"""Scheduler registry: names, presets and ``--set key=value`` options."""

from __future__ import annotations

import dataclasses
import functools
import typing
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

from sloserve.core.errors import ConfigError, UnknownNameError
from sloserve.cost.base import CostModel
from sloserve.kv.registry import KV_MANAGERS
from sloserve.predict import LengthPredictor, NoisyOraclePredictor, make_predictor
from sloserve.sched.base import Scheduler
from sloserve.sched.bros import BrosConfig, BrosScheduler, RoundRobinScheduler
from sloserve.sched.econoserve import EconoServeConfig, EconoServeScheduler
from sloserve.sched.fastserve import FastServeConfig, FastServeScheduler
from sloserve.sched.multires import MultiResConfig, MultiResScheduler
from sloserve.sched.rank import RankConfig, RankScheduler
from sloserve.sched.srtf import SrtfConfig, SrtfScheduler
from sloserve.sched.unified import UnifiedConfig, UnifiedScheduler
from sloserve.workload.traces import load_trace


@dataclass(frozen=True)
class SchedulerSpec:
    """A registered policy: its class, config dataclass and the preset's config values."""

    name: str
    description: str
    scheduler_cls: Callable[..., Scheduler]
    config_cls: type
    defaults: Mapping[str, Any] = field(default_factory=dict)
    needs_cost_model: bool = False  # the policy estimates batch times itself (BROS)


SCHEDULERS: dict[str, SchedulerSpec] = {}


def register(spec: SchedulerSpec) -> None:
    SCHEDULERS[spec.name] = spec


_VLLM = dict(priority="prefill_first", hybrid_batching=False, chunked_prefill=False)
_SARATHI = dict(priority="decode_first", hybrid_batching=True, chunked_prefill=True, prefill_token_budget=512)

# InferMax Table 1: (name, description, knobs). P defaults to C (4096 for Llama-2-7B).
_TABLE1 = [
    ("vllm", "vLLM v0: prefill-first, no hybrid batches, paged KV, evict the latest-admitted (InferMax §3.1)", _VLLM),
    ("vllm_hy", "vLLM with hybrid batches (InferMax Table 1)", dict(_VLLM, hybrid_batching=True)),
    ("sarathi", "Sarathi-Serve: decode-first, hybrid batches, chunked prefill with budget P=512", _SARATHI),
    ("sarathi_pc", "Sarathi with P = C (InferMax Table 1: SARATHI_P=C)", dict(_SARATHI, prefill_token_budget=None)),
    ("sarathi_nocp", "Sarathi without chunked prefill, P = C (InferMax Table 1)",
     dict(_SARATHI, chunked_prefill=False, prefill_token_budget=None)),
    ("sarathi_nohy", "Sarathi without hybrid batches or chunked prefill, P = C (InferMax Table 1)",
     dict(_SARATHI, hybrid_batching=False, chunked_prefill=False, prefill_token_budget=None)),
]
for _name, _description, _knobs in _TABLE1:
    register(SchedulerSpec(_name, _description, UnifiedScheduler, UnifiedConfig, _knobs))
    # Eviction-free variant: reserve I + O - 1 at admission (hypothetical: the oracle knows O).
    register(
        SchedulerSpec(
            f"{_name}_ef",
            f"{_name}, eviction-free: reserves I + O - 1 at admission (oracle output lengths; InferMax §4.1)",
            UnifiedScheduler,
            UnifiedConfig,
            dict(_knobs, reservation="predicted", predictor="oracle", kv_manager="exact"),
        )
    )
register(
    SchedulerSpec(
        "infermax",
        "InferMax §6: Sarathi groups with P = C, keep long running requests and evict the shortest, "
        "admit only if prompt + a histogram estimate of the output fits in free KV",
        UnifiedScheduler,
        UnifiedConfig,
        # NOTE: §6 says "reserve the estimated maximum memory usage in (3)": we read it as CANALLOCATE's
        # M check with m_reserve = I + estimate - 1 (reservation=predicted_check); holding it
        # (reservation=predicted, kv_manager=exact) is the other reading, 2.4% slower on §6's trace.
        dict(
            _SARATHI,
            prefill_token_budget=None,
            eviction_victim="shortest",
            reservation="predicted_check",
            predictor="histogram",
        ),
    )
)
for _name, _by, _predictor in (("rank_org", "arrival", "none"), ("rank_i", "input", "none"),
                               ("rank_o", "output", "oracle")):
    register(
        SchedulerSpec(
            _name,
            f"InferMax §4.6: one group ordered by {_by}{' (oracle output lengths)' if _by == 'output' else ''}, "
            "hybrid batches, chunked prefill with P = C, evict lower-ranked requests",
            RankScheduler,
            RankConfig,
            dict(rank_by=_by, predictor=_predictor),
        )
    )
register(
    SchedulerSpec(
        "vllm_priority",
        "vLLM with priority (BROS's baseline): real-time requests admitted before best-effort ones, "
        "best-effort ones evicted first",
        UnifiedScheduler,
        UnifiedConfig,
        dict(_VLLM, class_priority=True),
    )
)
register(
    SchedulerSpec(
        "bros",
        "BROS: RT requests by residual time to their token deadline under a cost-model check, then BE "
        "requests filling or replacing slack RT ones; adaptive batch size; bidirectional KV blocks; "
        "progressive dropping by swap-out",
        BrosScheduler,
        BrosConfig,
        dict(kv_manager="bidirectional", dropping="swap"),
        needs_cost_model=True,
    )
)
register(
    SchedulerSpec(
        "bros_nobicache",
        "BROS without bidirectional blocks: paged KV, evictions by recompute (the paper's ablation)",
        BrosScheduler,
        BrosConfig,
        needs_cost_model=True,
    )
)
register(
    SchedulerSpec(
        "rr",
        "BROS's RR baseline: RT and BE FCFS queues served in turn, one class per iteration",
        RoundRobinScheduler,
        BrosConfig,
    )
)
register(
    SchedulerSpec(
        "orca",
        "ORCA: iteration-level batching of at most 8 requests, max allocation (prompt + max_tokens)",
        UnifiedScheduler,
        UnifiedConfig,
        dict(
            priority="decode_first",
            hybrid_batching=True,
            chunked_prefill=False,
            max_num_seqs=8,
            kv_manager="max",
            watermark=0.0,
        ),
    )
)

# --- EconoServe's baselines (papers/econoserve.md §2.1) ----------------------------------------------
register(
    SchedulerSpec(
        "srtf",
        "EconoServe's SRTF: iteration-level shortest remaining (predicted) output first, batches of at most "
        "8, max allocation; unchosen requests keep their KV (oracle output lengths)",
        SrtfScheduler,
        SrtfConfig,
    )
)
register(
    SchedulerSpec(
        "fastserve",
        "FastServe: skip-join multi-level feedback queue (5 levels, quanta doubling from one decode "
        "iteration), batches of at most 8, max allocation",
        FastServeScheduler,
        FastServeConfig,
        needs_cost_model=True,
    )
)
register(
    SchedulerSpec(
        "multires",
        "EconoServe's MultiRes: running requests decode on; waiting ones picked one by one by the least "
        "Euclidean distance of (tokens, KV) demand to the room left (O(n^2)), exact allocation (oracle)",
        MultiResScheduler,
        MultiResConfig,
    )
)


# --- EconoServe (papers/econoserve.md §3-§4) and SyncCoupled (§2.2) -----------------------------------
_ECONOSERVE_D = dict(time_synced=False, ordering=False, pipelining=False, kv_manager="exact")
_ECONOSERVE = dict(time_synced=True, ordering=True, pipelining=True, kv_manager="pipelined")
for _name, _description, _knobs in [
    ("econoserve-d", "EconoServe-D (UnsyncDecoupled): PT and GT queues, PTs fill the TFS and GTs the KV "
     "every iteration, FCFS, exact allocation of predicted RL + padding", _ECONOSERVE_D),
    ("econoserve-sd", "EconoServe-SD (SyncDecoupled): + time-synced GT groups by predicted RL, admitted "
     "when a group completes", dict(_ECONOSERVE_D, time_synced=True)),
    ("econoserve-sdo", "EconoServe-SDO: + ordering by deadline, occupied KV and length with binary search",
     dict(_ECONOSERVE_D, time_synced=True, ordering=True)),
    ("econoserve", "EconoServe: SDO + KV-cache pipelining (GTs hosted in the unused half of others' "
     "regions); noisy RL predictions at the paper's ShareGPT accuracy", _ECONOSERVE),
    ("econoserve-oracle", "EconoServe with the true response lengths (no padding needed)",
     dict(_ECONOSERVE, predictor="oracle", padding=0.0)),
    ("synccoupled", "SyncCoupled (EconoServe §2.2): requests grouped by predicted RL, each allocated "
     "prompt + RL, groups admitted when a group completes; no PT joins between", dict(
         _ECONOSERVE_D, decoupled=False, time_synced=True)),
]:  # fmt: skip
    register(SchedulerSpec(_name, _description, EconoServeScheduler, EconoServeConfig, _knobs, needs_cost_model=True))


def scheduler_names() -> list[str]:
    return sorted(SCHEDULERS)


def parse_set_options(pairs: list[str] | tuple[str, ...]) -> dict[str, str]:
    """``["a=1", "b=x"]`` -> ``{"a": "1", "b": "x"}``."""
    options: dict[str, str] = {}
    for pair in pairs:
        key, sep, value = pair.partition("=")
        if not sep or not key.strip():
            raise ConfigError(f"--set expects key=value, got {pair!r}")
        options[key.strip()] = value.strip()
    return options


# pydantic's error types of a --set value -> what the message says was expected
_EXPECTED = {"int_parsing": "an integer", "int_from_float": "an integer", "int_type": "an integer",
             "float_parsing": "a number", "float_type": "a number", "bool_parsing": "true or false",
             "bool_type": "true or false", "string_type": "a string"}  # fmt: skip


@functools.cache
def _adapter(annotation: Any) -> Any:
    """pydantic's validator of a config field's type (a ``TypeAdapter``)."""
    # NOTE: imported here: pydantic loads only when a run has --set options, not for every run.
    import pydantic

    return pydantic.TypeAdapter(annotation)


def _coerce(scheduler: str, key: str, value: Any, annotation: Any) -> Any:
    """Convert a ``--set`` string (or check a value) to the config field's type with pydantic (lax
    mode: "8" is 8, "yes" is True), or raise a ConfigError naming the option and what it expects."""
    where = f"scheduler {scheduler}: option {key}={value!r}"
    if isinstance(value, str) and value.strip().lower() == "none" and type(None) in typing.get_args(annotation):
        return None
    from pydantic import ValidationError

    try:
        return _adapter(annotation).validate_python(value.strip() if isinstance(value, str) else value)
    except ValidationError as e:
        error = e.errors()[0]
        if error["type"] == "literal_error":
            choices = [a for a in typing.get_args(annotation) if a is not type(None)]
            choices = typing.get_args(choices[0]) if typing.get_origin(choices[0]) is typing.Literal else choices
            raise ConfigError(f"{where}: expected one of {', '.join(map(str, choices))}") from None
        expected = _EXPECTED.get(error["type"])
        raise ConfigError(f"{where}: {'expected ' + expected if expected else error['msg']}") from None


def build_config(name: str, options: Mapping[str, Any] | None = None) -> Any:
    """The preset's config for ``name`` with ``options`` applied (strings are converted)."""
    spec = get_spec(name)
    hints = typing.get_type_hints(spec.config_cls)
    values = dict(spec.defaults)
    for key, value in (options or {}).items():
        if key not in hints:
            raise ConfigError(f"scheduler {name} has no option {key!r}; valid: {', '.join(sorted(hints))}")
        values[key] = _coerce(name, key, value, hints[key])
    return spec.config_cls(**values)


def get_spec(name: str) -> SchedulerSpec:
    if name not in SCHEDULERS:
        raise UnknownNameError("scheduler", name, scheduler_names())
    return SCHEDULERS[name]


def make_scheduler(
    name: str,
    *,
    kv_capacity_tokens: int,
    max_model_len: int,
    kv_bytes_per_token: int = 0,
    swap_space_tokens: int = 0,
    options: Mapping[str, Any] | None = None,
    cost_model: CostModel | None = None,
) -> Scheduler:
    """Build a registered scheduler over a fresh KV cache of ``kv_capacity_tokens`` token slots."""
    spec = get_spec(name)
    config = build_config(name, options)
    config.resolve(max_model_len)
    if spec.needs_cost_model and cost_model is None:
        raise ConfigError(f"scheduler {name} estimates batch times and needs a cost model")
    if config.kv_manager not in KV_MANAGERS:
        raise UnknownNameError("KV manager", config.kv_manager, list(KV_MANAGERS))
    if config.kv_manager == "bidirectional" and spec.scheduler_cls is not BrosScheduler:
        # NOTE: only BROS protects a step's batch from being overwritten and carries the manager's
        # checkpoint/restore copies in its output.
        raise ConfigError(f"scheduler {name}: kv_manager bidirectional works with the BROS scheduler only")
    if config.kv_manager == "pipelined" and spec.scheduler_cls is not EconoServeScheduler:
        raise ConfigError(f"scheduler {name}: kv_manager pipelined works with the EconoServe schedulers only")
    if kv_capacity_tokens < config.block_size:
        raise ConfigError(
            f"KV capacity {kv_capacity_tokens} tokens is below one block of {config.block_size} tokens"
        )
    if getattr(config, "preemption_mode", "recompute") == "swap" and swap_space_tokens < config.block_size:
        # NOTE: an error, not a silent recompute: a run asked to swap would otherwise measure recomputation
        raise ConfigError(
            f"scheduler {name}: preemption_mode=swap needs CPU swap space, and there is {swap_space_tokens} tokens' "
            "worth: give --swap-space-gib > 0 (simulate, run) or swap_space_tokens, or --set preemption_mode=recompute"
        )
    kv = KV_MANAGERS[config.kv_manager](
        kv_capacity_tokens // config.block_size,
        config.block_size,
        kv_bytes_per_token=kv_bytes_per_token,
        num_cpu_blocks=swap_space_tokens // config.block_size,
    )
    extra = {"cost_model": cost_model} if spec.needs_cost_model else {}
    scheduler = spec.scheduler_cls(kv, config, _predictor(config), **extra)
    scheduler.name = name
    return scheduler


def _predictor(config: Any) -> LengthPredictor | None:
    name = getattr(config, "predictor", "none")
    if name == "none":
        return None
    if name == "histogram":
        return make_predictor(name, quantile=config.histogram_quantile)
    if name == "noisy-oracle":
        bucket = getattr(config, "predictor_bucket_tokens", 1)
        # NOTE: a bucketed predictor's accuracy depends on the lengths; it is calibrated on ShareGPT's
        # (the paper's accuracies are per trace; ShareGPT's is the default).
        lengths = load_trace("sharegpt").output_tokens.tolist() if bucket > 1 else None
        return NoisyOraclePredictor.from_accuracy(config.predictor_accuracy, config.predictor_padding,
                                                  seed=config.predictor_seed, bucket_tokens=bucket, lengths=lengths)  # fmt: skip
    return make_predictor(name)


def describe_options(name: str) -> dict[str, Any]:
    """The preset's full option values (for ``sloserve schedulers`` and summaries)."""
    return dataclasses.asdict(build_config(name))
