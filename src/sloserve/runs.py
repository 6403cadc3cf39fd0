"""One simulation from the options the commands share: the workload (``--trace`` or ``--workload``),
the system (model, GPU, tensor parallelism, replicas, disaggregation) and a scheduler.

``simulate``, ``compare``, ``sweep`` and ``plan`` build their runs here, and so do their parallel
tasks (``sloserve.parallel``): a run on a Ray worker rebuilds the same workload from the same
``SimOptions`` and seed, so it is the run the command would have done itself."""

from __future__ import annotations

import dataclasses
import functools
import math
import sys
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from sloserve.checkpoint import model_spec
from sloserve.core.errors import ConfigError
from sloserve.core.request import SLO
from sloserve.workload.limits import MAX_ARRIVAL_CV, MAX_LENGTH_TOKENS, MAX_NUM_REQUESTS


@dataclass(frozen=True)
class SimOptions:
    """The workload and system options of the simulating commands, named as their flags (``--rate``:
    ``rate``), with the CLI's defaults."""

    # --- the workload: --trace (with one of --rate, --trace-arrivals, --offline) or --workload --------
    trace: str | None = None
    workload: str | None = None
    columns: str | None = None  # a user trace's column mapping, "prompt=in,output=out"
    rate: float | None = None  # Poisson requests/s
    burstiness: float | None = None  # gamma arrivals' coefficient of variation
    trace_arrivals: bool = False
    offline: bool = False
    num_requests: int | None = None
    max_tokens: int | None = None
    slo_ttft: float | None = None  # seconds
    slo_tpot: float | None = None
    slo_jct: float | None = None
    rt_rate: float | None = None  # a --workload's real-time rate
    seed: int = 0
    # --- the system ------------------------------------------------------------------------------
    model: str = "llama-2-7b"
    gpu: str = "a100"
    num_gpus: int = 1  # tensor parallelism
    max_model_len: int | None = None
    cost_model: str | None = None
    kv_capacity_tokens: int | None = None  # default: from the GPU's memory
    memory_utilization: float = 0.9
    swap_space_gib: float = 4.0
    replicas: int = 1
    router: str = "round-robin"
    disaggregate: str | None = None  # "P:D" prefill:decode replicas
    link_gbps: float = 100.0
    # None: on when the workload's prompts carry prefix structure and the scheduler supports it.
    enable_prefix_caching: bool | None = None
    no_fast_path: bool = False

    @classmethod
    def of_workload(cls, flags: dict[str, Any]) -> SimOptions:
        """The workload options among a command's flags, the system's left at their defaults (for
        ``sloserve run``, whose system is the engine's)."""
        return cls(**{name: flags[name] for name in WORKLOAD_FLAGS})


# The fields of SimOptions that describe the workload (the rest describe the system).
WORKLOAD_FLAGS = (
    "trace",
    "workload",
    "columns",
    "rate",
    "burstiness",
    "trace_arrivals",
    "offline",
    "num_requests",
    "max_tokens",
    "slo_ttft",
    "slo_tpot",
    "slo_jct",
    "rt_rate",
    "seed",
)


@dataclass
class Setup:
    """Everything a run needs besides the scheduler and the arrival rate."""

    model: Any
    gpu: Any
    cost_model: Any
    kv_capacity_tokens: int
    swap_space_tokens: int
    options: SimOptions

    def kv_capacity_for(self, state_slots: int | None) -> int:
        """The KV cache's tokens where a run keeps ``state_slots`` requests' states (a model with state layers:
        its scheduler's slots, and as many saved ones with prefix caching; ``kv_capacity_tokens`` leaves room for
        ``STATE_SLOTS``): the rest of the memory is the KV cache's, as the engine's default cache does. As given
        where --kv-capacity-tokens set it."""
        from sloserve.cost import kv_capacity_tokens

        if state_slots is None or self.options.kv_capacity_tokens is not None:
            return self.kv_capacity_tokens
        o = self.options
        return kv_capacity_tokens(
            self.model, self.gpu, num_gpus=o.num_gpus, memory_utilization=o.memory_utilization, state_slots=state_slots
        )

    def make_workload(self, rate: float | None = None):
        """The workload, with ``rate`` overriding --rate (for sweeps)."""
        return make_workload_from_options(self.options, self.model.max_context_len, rate)


# Most KV tokens a simulation's pools may hold together (each replica's GPU pool and swap space):
# 1,700 replicas of llama-2-7b on an A100, or 20 times what the largest bundled GPU and model pair holds
# (qwen2.5-7b on 4 H200s, 9.4M). NOTE: a pool keeps a list of its free blocks: this many take 0.5 GB
# (vllm) to 2 GB (econoserve) of the host's memory before the first step; a hundred thousand
# replicas once took 24 GB and were killed.
MAX_SIMULATED_KV_TOKENS = 200_000_000


def check_rate(flag: str, value: float | None) -> None:
    """A ConfigError naming ``flag`` unless ``value`` is None or a finite rate > 0 (requests/s)."""
    if value is not None and not (value > 0 and math.isfinite(value)):
        raise ConfigError(f"{flag} must be a finite number > 0 (requests/s), got {value}")


def check_workload_options(o: SimOptions) -> None:
    """One ConfigError for options that are out of range or that the chosen source would ignore."""
    n = o.num_requests
    if n is not None and not 1 <= n <= MAX_NUM_REQUESTS:
        raise ConfigError(f"--num-requests must be in 1..{MAX_NUM_REQUESTS:,}, got {n:,}")
    for name in ("slo_ttft", "slo_tpot", "slo_jct"):
        value = getattr(o, name)
        if value is not None and not value > 0:
            raise ConfigError(f"--{name.replace('_', '-')} must be > 0 seconds, got {value}")
    if o.max_tokens is not None and not 1 <= o.max_tokens <= MAX_LENGTH_TOKENS:
        raise ConfigError(f"--max-tokens must be in 1..{MAX_LENGTH_TOKENS:,}, got {o.max_tokens:,}")
    check_rate("--rate", o.rate)
    check_rate("--rt-rate", o.rt_rate)
    if o.burstiness is not None and not 0 < o.burstiness <= MAX_ARRIVAL_CV:
        raise ConfigError(
            f"--burstiness (the arrivals' coefficient of variation) must be in (0, {MAX_ARRIVAL_CV:g}], "
            f"got {o.burstiness}"
        )
    if o.workload:
        if o.columns is not None:
            raise ConfigError(
                "--columns maps a --trace file's columns; a workload spec names its own sources (columns: in the spec)"
            )
        # NOTE: each of these was once ignored with --workload, silently
        spec_sets = {"slo_ttft": "slo", "slo_tpot": "slo", "slo_jct": "slo", "burstiness": "arrival (cv)",
                     "max_tokens": "max_tokens", "offline": "arrival", "trace_arrivals": "arrival"}  # fmt: skip
        for name, field in spec_sets.items():
            if getattr(o, name) not in (None, False):
                raise ConfigError(
                    f"--{name.replace('_', '-')} applies to --trace; a workload spec sets each stream's {field}"
                )
    elif o.rt_rate is not None:
        raise ConfigError("--rt-rate sets a --workload's RT rate; with --trace, use --rate")


def make_workload_from_options(o: SimOptions, context_len: int, rate: float | None = None):
    """The workload the --trace / --workload options describe, clipped to ``context_len``."""
    from sloserve.workload import build_workload, load_trace, with_rt_rate, workload_from_trace

    check_workload_options(o)
    if o.workload:
        from sloserve.workload.spec_yaml import load_workload_spec  # NOTE: loads pydantic: a spec run only

        if o.trace:
            raise ConfigError("give --trace or --workload, not both")
        if o.rate is not None:
            raise ConfigError("--rate applies to --trace; use --rt-rate to set a workload's RT rate")
        spec = load_workload_spec(o.workload)
        rt_rate = rate if rate is not None else o.rt_rate  # a sweep's rates are RT rates
        if rt_rate is not None:
            spec = with_rt_rate(spec, rt_rate)
        return build_workload(spec, seed=o.seed, context_len=context_len, num_requests=o.num_requests)
    if not o.trace:
        raise ConfigError("give --trace NAME|PATH or --workload SPEC")
    slo = {"ttft_s": o.slo_ttft, "tpot_s": o.slo_tpot, "jct_s": o.slo_jct}
    num_requests = o.num_requests
    if o.trace_arrivals:
        # NOTE: a replay takes the trace's rows as they are; more than it has repeats it back to back.
        trace = load_trace(o.trace, parse_columns(o.columns))
        if trace.arrival_s is None:
            raise ConfigError(
                f"--trace-arrivals: trace {o.trace!r} has no arrival times; give --rate (Poisson arrivals, gamma "
                "with --burstiness) or --offline"
            )
        rows = len(trace)
        if num_requests is None:
            num_requests = min(rows, 1000)
            if rows > num_requests:  # NOTE: a served day's log is longer: say that it is not all replayed
                print(
                    f"note: --trace-arrivals replays {num_requests:,} consecutive rows of the trace's {rows:,} (where "
                    f"they start follows --seed); --num-requests {rows} replays them all",
                    file=sys.stderr,
                )
        elif num_requests > rows:
            print(
                f"note: the trace has {rows:,} rows; --trace-arrivals repeats it back to back for "
                f"{num_requests:,} requests",
                file=sys.stderr,
            )
    return workload_from_trace(
        o.trace,
        num_requests=num_requests or 1000,
        seed=o.seed,
        context_len=context_len,
        rate=rate if rate is not None else o.rate,
        burstiness_cv=o.burstiness,
        trace_arrivals=o.trace_arrivals,
        offline=o.offline,
        slo=SLO(**slo) if any(v is not None for v in slo.values()) else None,
        max_tokens=o.max_tokens,
        columns=parse_columns(o.columns),
    )


def parse_columns(text: str | None) -> dict[str, str] | None:
    if not text:
        return None
    columns = {}
    for part in text.split(","):
        key, sep, value = part.partition("=")
        if not sep:
            raise ConfigError(f"--columns expects key=column pairs, got {part!r}")
        if key.strip() in columns:
            raise ConfigError(f"--columns maps {key.strip()} twice ({columns[key.strip()]!r}, then {value.strip()!r})")
        columns[key.strip()] = value.strip()
    return columns


def setup_from_options(options: SimOptions) -> Setup:
    from sloserve.cost import build_cost_model, get_gpu, kv_capacity_tokens

    model, gpu = model_spec(options.model), get_gpu(options.gpu)
    if options.max_model_len is not None:
        if not 2 <= options.max_model_len <= MAX_LENGTH_TOKENS:
            raise ConfigError(f"--max-model-len must be in 2..{MAX_LENGTH_TOKENS:,}, got {options.max_model_len:,}")
        # (the engine refuses it, but for a model of no attention: no position embedding ends its context; a
        # simulation may ask "what if")
        if options.max_model_len > model.max_context_len and model.attention_layers:
            print(
                f"note: --max-model-len {options.max_model_len:,} is above {model.name}'s context of "
                f"{model.max_context_len:,} tokens; simulated as given",
                file=sys.stderr,
            )
        model = dataclasses.replace(model, max_context_len=options.max_model_len)
    for name in ("num_gpus", "replicas"):
        if getattr(options, name) < 1:
            raise ConfigError(f"--{name.replace('_', '-')} must be >= 1, got {getattr(options, name)}")
    if options.kv_capacity_tokens is not None:
        capacity = options.kv_capacity_tokens
        if not 1 <= capacity <= MAX_SIMULATED_KV_TOKENS:
            raise ConfigError(f"--kv-capacity-tokens must be in 1..{MAX_SIMULATED_KV_TOKENS:,}, got {capacity:,}")
    else:
        if not 0 < options.memory_utilization <= 1:
            raise ConfigError(f"--memory-utilization must be in (0, 1], got {options.memory_utilization}")
        capacity = kv_capacity_tokens(
            model, gpu, num_gpus=options.num_gpus, memory_utilization=options.memory_utilization
        )
    swap_gib = options.swap_space_gib
    if not (swap_gib >= 0 and math.isfinite(swap_gib)):
        raise ConfigError(f"--swap-space-gib must be a finite number >= 0, got {swap_gib}")
    # (a model of no attention has no KV to swap: its states stay, ``registry._check_request_states``)
    swap_tokens = int(swap_gib * 2**30 // model.kv_bytes_per_token) if model.kv_bytes_per_token else 0
    if swap_tokens > MAX_SIMULATED_KV_TOKENS:
        raise ConfigError(
            f"--swap-space-gib {swap_gib:g} holds more than {MAX_SIMULATED_KV_TOKENS:,} tokens of {model.name}'s "
            f"KV ({model.kv_bytes_per_token:,} bytes a token), the most a simulation's KV pools may hold"
        )
    num_prefill, num_decode = parse_disaggregation(options.disaggregate, options.link_gbps)
    num_replicas = num_prefill + num_decode or options.replicas
    # NOTE: a scheduler keeping fewer than STATE_SLOTS requests' states gets their memory as KV too
    # (``Setup.kv_capacity_for``): at most STATE_SLOTS states' worth above the capacity checked here
    if num_replicas * (capacity + swap_tokens) > MAX_SIMULATED_KV_TOKENS:
        fleet = f"--disaggregate {options.disaggregate}" if num_decode else f"--replicas {num_replicas:,}"
        raise ConfigError(
            f"{fleet}: {num_replicas:,} replicas x {capacity + swap_tokens:,} KV tokens ({capacity:,} on the GPU, "
            f"{swap_tokens:,} of swap space) is above the {MAX_SIMULATED_KV_TOKENS:,} a simulation's KV pools may "
            "hold; simulate fewer replicas, or less KV each (--kv-capacity-tokens, --swap-space-gib)"
        )
    cost = build_cost_model(model, gpu, num_gpus=options.num_gpus, cost_model=options.cost_model)
    return Setup(model, gpu, cost, capacity, swap_tokens, options)


def run_simulation(
    setup: Setup,
    scheduler: str,
    set_options: dict[str, str],
    workload,
    *,
    on_progress: Callable[[int], None] | None = None,
) -> dict:
    """Simulate ``workload`` (fresh copies of its requests) with ``scheduler``; returns the summary,
    with the requests and timeline under ``"_result"`` for writing (``public`` drops them)."""
    from sloserve.metrics import summarize
    from sloserve.sched import make_scheduler, supports_prefix_caching
    from sloserve.sched.registry import saved_state_entries, state_slots
    from sloserve.sim import simulate

    o = setup.options
    if "role" in set_options:  # NOTE: a prefill replica alone hands its requests to nobody
        raise ConfigError("--set role: a replica's role comes from --disaggregate P:D, not from --set")
    requests, chains = fresh_workload(workload)
    caching = o.enable_prefix_caching
    if caching is None:
        caching = any(r.prompt_blocks is not None for r in requests) and supports_prefix_caching(scheduler, set_options)
    # (a model with per-request states, state layers': as many requests at once as their slots, the engine's rule;
    # with prefix caching as many states saved at cached prefixes' ends, kv/cached_states.py)
    slots = state_slots(scheduler, set_options) if setup.model.state_bytes_per_sequence else None
    num_states = None if slots is None else slots + saved_state_entries(slots, caching)
    factory = functools.partial(
        make_scheduler,
        scheduler,
        kv_capacity_tokens=setup.kv_capacity_for(num_states),
        max_model_len=setup.model.max_context_len,
        kv_bytes_per_token=setup.model.kv_bytes_per_token,
        swap_space_tokens=setup.swap_space_tokens,
        options=set_options,
        cost_model=setup.cost_model,
        enable_prefix_caching=caching,
        max_requests=slots,
    )
    num_prefill, num_decode = parse_disaggregation(o.disaggregate, o.link_gbps)
    decode_factory = None
    if num_decode:
        factory, decode_factory = _disaggregated_factories(setup, scheduler, set_options, factory, slots is not None)
        decode_factory()
    factory()  # validate the options before running
    result = simulate(
        requests,
        factory,
        setup.cost_model,
        num_replicas=num_prefill or o.replicas,
        router=o.router,
        fast_path=not o.no_fast_path,
        on_progress=on_progress,
        make_decode_scheduler=decode_factory,
        num_decode_replicas=num_decode,
        link_bandwidth=o.link_gbps * 1e9 / 8,
        chains=chains,
    )
    summary = summarize(
        requests,
        result.timeline,
        kv_capacity_tokens=result.kv_capacity_tokens,
        sim_wall_s=result.sim_wall_s,
        num_allocation_failures=result.num_allocation_failures,
        swapped_bytes=result.swapped_bytes,
        num_replicas=result.num_replicas,
        policy_metrics=result.policy_metrics,
        extra={
            "scheduler": scheduler,
            "scheduler_options": set_options,
            "model": setup.model.name,
            "gpu": setup.gpu.name,
            "num_gpus": o.num_gpus,
            "cost_model": setup.cost_model.name,
            "enable_prefix_caching": caching,
            "workload": workload.name,
            "num_clipped": workload.num_clipped,
            "seed": o.seed,
            "sim_requests_per_wall_s": len(requests) / result.sim_wall_s if result.sim_wall_s else None,
            "disaggregation": {
                "prefill_replicas": num_prefill,
                "decode_replicas": num_decode,
                "link_gbps": o.link_gbps,
            }
            if num_decode
            else None,
            **result.extra,
        },
    )
    summary["_result"] = (requests, result.timeline)
    return summary


def _disaggregated_factories(
    setup: Setup, scheduler: str, set_options: dict[str, str], factory: Callable, keeps_states: bool
) -> tuple[Callable, Callable]:
    """The prefill and the decode replicas' schedulers of ``--disaggregate P:D`` (DistServe's), or a ConfigError
    where the model, the other options or the scheduler cannot run so."""
    from sloserve.sched import scheduler_names, supports_disaggregation

    o = setup.options
    if keeps_states:  # NOTE: the link carries KV; such a model's states would go with it
        raise ConfigError(
            f"--disaggregate {o.disaggregate}: {setup.model.name} keeps states in its Mamba-2 or short-convolution "
            "layers, and handing them to a decode replica is not simulated; simulate it without --disaggregate"
        )
    if o.replicas != 1:  # NOTE: --replicas was once ignored here, silently
        raise ConfigError(
            f"--replicas {o.replicas} and --disaggregate {o.disaggregate} both set the replicas: --disaggregate P:D "
            "alone runs P prefill and D decode replicas"
        )
    if not supports_disaggregation(scheduler):
        roles = [n for n in scheduler_names() if supports_disaggregation(n)]
        raise ConfigError(
            f"--disaggregate: scheduler {scheduler} cannot prefill for another replica; those that can: "
            f"{', '.join(roles)}"
        )
    prefill = functools.partial(factory, options={**set_options, "role": "prefill"})
    return prefill, functools.partial(prefill, options={**set_options, "role": "decode"})


def parse_disaggregation(text: str | None, link_gbps: float) -> tuple[int, int]:
    """``"P:D"`` -> (P, D); (0, 0) when not given."""
    if not text:
        return 0, 0
    try:
        num_prefill, num_decode = (int(x) for x in text.split(":"))
    except ValueError:
        raise ConfigError(f"--disaggregate expects P:D (prefill:decode replicas), got {text!r}") from None
    if num_prefill < 1 or num_decode < 1:
        raise ConfigError(f"--disaggregate needs >= 1 prefill and >= 1 decode replica, got {text!r}")
    if not link_gbps > 0:
        raise ConfigError(f"--link-gbps must be > 0, got {link_gbps}")
    return num_prefill, num_decode


def fresh_request(request):
    """A copy of a workload request with no progress, so each scheduler starts from scratch."""
    from sloserve.core.request import Request

    return Request(
        request_id=request.request_id,
        arrival_time=request.arrival_time,
        num_prompt_tokens=request.num_prompt_tokens,
        true_output_tokens=request.true_output_tokens,
        max_tokens=request.max_tokens,
        request_class=request.request_class,
        slo=request.slo,
        predicted_output_tokens=request.predicted_output_tokens,
        prompt_blocks=request.prompt_blocks,
        think_time_s=request.think_time_s,
        priority=request.priority,
    )


def fresh_workload(workload) -> tuple[list, list]:
    """Fresh copies of the workload's requests, and its closed-loop chains over those copies."""
    requests = [fresh_request(r) for r in workload.requests]
    by_id = {r.request_id: r for r in requests}
    chains = [[[by_id[r.request_id] for r in batch] for batch in chain] for chain in workload.chains]
    return requests, chains


def public(summary: dict) -> dict:
    """The summary without its private entries (``"_result"``): what JSON files and tasks carry."""
    return {k: v for k, v in summary.items() if not k.startswith("_")}


def simulate_options(
    options: SimOptions, scheduler: str, set_options: dict[str, str], rate: float | None = None
) -> dict:
    """Build the setup and workload from ``options`` (``rate`` overriding its rate) and simulate it
    with ``scheduler``: the public summary. One task of a parallel sweep or plan; deterministic."""
    setup = setup_from_options(options)
    return public(run_simulation(setup, scheduler, set_options, setup.make_workload(rate)))
