"""Scheduler registry: a policy registers under a name with its config class and preset values
(``register``); ``make_scheduler`` builds it by name with ``--set key=value`` options. The presets
themselves are in sched/presets.py; a new policy registers in one call (docs/schedulers.md)."""

from __future__ import annotations

import dataclasses
import functools
import typing
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

from sloserve.core.errors import ConfigError, UnknownNameError
from sloserve.cost.base import CostModel
from sloserve.cost.specs import STATE_SLOTS
from sloserve.kv.cached_states import CachedStates
from sloserve.kv.registry import KV_MANAGERS
from sloserve.predict import predictor_from_config
from sloserve.sched.base import Scheduler

# The KV managers any policy works with; BROS's bidirectional and EconoServe's pipelined managers
# need their policies' cooperation, and those policies' specs name them.
GENERIC_KV_MANAGERS = ("paged", "max", "exact")


@dataclass(frozen=True)
class SchedulerSpec:
    """A registered policy: its class, config dataclass and the preset's config values."""

    name: str
    description: str
    scheduler_cls: Callable[..., Scheduler]
    config_cls: type
    defaults: Mapping[str, Any] = field(default_factory=dict)
    needs_cost_model: bool = False  # the policy estimates batch times itself (BROS)
    kv_managers: tuple[str, ...] = GENERIC_KV_MANAGERS  # the config's kv_manager values it works with


SCHEDULERS: dict[str, SchedulerSpec] = {}


def register(spec: SchedulerSpec) -> None:
    SCHEDULERS[spec.name] = spec


def scheduler_names() -> list[str]:
    return sorted(SCHEDULERS)


def parse_set_options(pairs: list[str] | tuple[str, ...]) -> dict[str, str]:
    """``["a=1", "b=x"]`` -> ``{"a": "1", "b": "x"}``; a key given twice is refused (which would win is
    not what its writer meant to ask)."""
    options: dict[str, str] = {}
    for pair in pairs:
        key, sep, value = pair.partition("=")
        key = key.strip()
        if not sep or not key:
            raise ConfigError(f"--set expects key=value, got {pair!r}")
        if key in options:
            raise ConfigError(f"--set {key} is given twice ({options[key]!r}, then {value.strip()!r})")
        options[key] = value.strip()
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
    # NOTE: a preset's prefill budget above the token budget the caller set (Sarathi's P = 512 under C = 256) is
    # capped at it, as vLLM's chunks are at max_num_batched_tokens; a budget the caller set is checked as set
    budget, tokens = values.get("prefill_token_budget"), values.get("max_num_batched_tokens")
    if "prefill_token_budget" not in (options or {}) and None not in (budget, tokens) and budget > tokens:
        values["prefill_token_budget"] = tokens
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
    enable_prefix_caching: bool = False,
    max_requests: int | None = None,
) -> Scheduler:
    """Build a registered scheduler over a fresh KV cache of ``kv_capacity_tokens`` token slots, its
    full blocks shared between requests with ``enable_prefix_caching``. ``kv_bytes_per_token`` (the
    model's) prices the copies of a policy that moves KV to CPU memory; it may be 0 only for one
    that never does. ``max_requests``: a model whose layers keep states for that many requests at most (state
    layers' slots: ``KVCacheManager.max_requests``), with prefix caching as many saved states (``CachedStates``);
    None: no such bound."""
    spec = get_spec(name)
    config = build_config(name, options)
    config.resolve(max_model_len)
    if config.block_size < 1:  # (every policy's KV is counted in blocks)
        raise ConfigError(f"scheduler {name}: block_size must be >= 1, got {config.block_size}")
    if spec.needs_cost_model and cost_model is None:
        raise ConfigError(f"scheduler {name} estimates batch times and needs a cost model")
    if config.kv_manager not in KV_MANAGERS:
        raise UnknownNameError("KV manager", config.kv_manager, list(KV_MANAGERS))
    if config.kv_manager not in spec.kv_managers:
        raise ConfigError(
            f"scheduler {name}: kv_manager {config.kv_manager} does not work with it; valid: {', '.join(spec.kv_managers)}"
        )
    if kv_capacity_tokens < config.block_size:
        raise ConfigError(f"KV capacity {kv_capacity_tokens} tokens is below one block of {config.block_size} tokens")
    # (before swap space is asked for: a model of no attention, 0 KV bytes a token, hears of its states)
    if max_requests is not None:
        _check_request_states(name, config)
    if getattr(config, "preemption_mode", "recompute") == "swap" and swap_space_tokens < config.block_size:
        # NOTE: an error, not a silent recompute: a run asked to swap would otherwise measure recomputation
        raise ConfigError(
            f"scheduler {name}: preemption_mode=swap needs CPU swap space, and there is {swap_space_tokens} tokens' "
            "worth: give --swap-space-gib > 0 (simulate, run) or swap_space_tokens, or --set preemption_mode=recompute"
        )
    swaps = getattr(config, "preemption_mode", "recompute") == "swap"
    if kv_bytes_per_token <= 0 and (swaps or KV_MANAGERS[config.kv_manager].copies_kv_to_cpu):
        # NOTE: one physics: every run that moves KV over the host link is charged for it
        what = "preemption_mode=swap" if swaps else f"kv_manager {config.kv_manager}"
        raise ConfigError(
            f"scheduler {name}: {what} copies KV between GPU and CPU memory, and its copies take time only "
            "with the model's KV bytes per token: give kv_bytes_per_token > 0"
        )
    if enable_prefix_caching and not supports_prefix_caching(name, options):
        raise ConfigError(
            f"scheduler {name} does not support prefix caching (its policy does not look the cache up, or its "
            "KV manager does not share blocks): give --no-enable-prefix-caching"
        )
    caching = {"enable_prefix_caching": True} if enable_prefix_caching else {}
    kv = KV_MANAGERS[config.kv_manager](
        kv_capacity_tokens // config.block_size,
        config.block_size,
        kv_bytes_per_token=kv_bytes_per_token,
        num_cpu_blocks=swap_space_tokens // config.block_size,
        **caching,
    )
    kv.max_requests = max_requests
    if max_requests is not None and enable_prefix_caching:
        kv.cached_states = CachedStates(saved_state_entries(max_requests, enable_prefix_caching))
    extra = {"cost_model": cost_model} if spec.needs_cost_model else {}
    scheduler = spec.scheduler_cls(kv, config, predictor_from_config(config), **extra)
    scheduler.name = name
    return scheduler


def _check_request_states(name: str, config: Any) -> None:
    """A ConfigError where a model's per-request states (Mamba-2's, short convolutions') could not follow its
    requests: a KV manager of its own tables (BROS's, EconoServe's pipelined), KV swapped to the CPU. (A prefix
    found cached starts from the states saved at its end: kv/cached_states.py.)"""
    if not KV_MANAGERS[config.kv_manager].supports_max_requests:
        raise ConfigError(
            f"scheduler {name}'s KV manager ({config.kv_manager}) does not run models with state layers "
            "(Mamba-2's, short convolutions'); vllm, sarathi, orca and the paged managers do"
        )
    if getattr(config, "preemption_mode", "recompute") == "swap":
        raise ConfigError(
            "preemption_mode=swap does not move the requests' states (Mamba-2's, short convolutions') to the CPU; use "
            "recompute"
        )


def state_slots(name: str, options: Mapping[str, Any] | None = None) -> int:
    """The requests a model with state layers (Mamba-2's, short convolutions') keeps states for under scheduler
    ``name``: its ``max_num_seqs``
    where it has one, at most ``STATE_SLOTS``."""
    return min(STATE_SLOTS, getattr(build_config(name, options), "max_num_seqs", STATE_SLOTS))


def saved_state_entries(num_slots: int, enable_prefix_caching: bool) -> int:
    """The states a model with state layers keeps saved at cached prefixes' ends (``kv/cached_states.py``) beside
    its ``num_slots`` requests' slots: as many as the slots with prefix caching, none without. The engine's state
    cache, the simulator's KV capacity and the KV manager's books all take their count from here."""
    return num_slots if enable_prefix_caching else 0


def supports_prefix_caching(name: str, options: Mapping[str, Any] | None = None) -> bool:
    """Whether the scheduler ``name`` (with ``options``) runs with prefix caching: its policy looks the
    cache up, and its KV manager is one that shares blocks (kv/manager.py)."""
    policy = get_spec(name).scheduler_cls
    kv_manager = KV_MANAGERS.get(build_config(name, options).kv_manager)
    return policy.supports_prefix_caching and kv_manager is not None and kv_manager.supports_prefix_caching


def supports_disaggregation(name: str) -> bool:
    """Whether the scheduler ``name`` runs disaggregated (``--disaggregate``: prefill and decode roles)."""
    return get_spec(name).scheduler_cls.supports_disaggregation


def describe_options(name: str) -> dict[str, Any]:
    """The preset's full option values (for ``sloserve schedulers`` and summaries)."""
    return dataclasses.asdict(build_config(name))
