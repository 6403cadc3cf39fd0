"""The registered schedulers: InferMax's Table 1 presets of the unified Algorithm 1 and their
eviction-free variants, InferMax §6 and §4.6, BROS and its baselines, ORCA, EconoServe, its ablations
and its baselines. Each is one ``register`` call (sched/registry.py) naming a policy class, its config
and the preset's values; ``sloserve schedulers`` lists them."""

from __future__ import annotations

from sloserve.sched.bros import BrosConfig, BrosScheduler, RoundRobinScheduler
from sloserve.sched.econoserve import EconoServeConfig, EconoServeScheduler
from sloserve.sched.fastserve import FastServeConfig, FastServeScheduler
from sloserve.sched.multires import MultiResConfig, MultiResScheduler
from sloserve.sched.rank import RankConfig, RankScheduler
from sloserve.sched.registry import GENERIC_KV_MANAGERS, SchedulerSpec, register
from sloserve.sched.srtf import SrtfConfig, SrtfScheduler
from sloserve.sched.unified import UnifiedConfig, UnifiedScheduler

# NOTE: only BROS protects a step's batch from being overwritten and carries the bidirectional
# manager's checkpoint/restore copies in its output; only EconoServe hosts GTs in the pipelined one.
_BROS_KV = (*GENERIC_KV_MANAGERS, "bidirectional")
_ECONOSERVE_KV = (*GENERIC_KV_MANAGERS, "pipelined")

_VLLM = dict(priority="prefill_first", hybrid_batching=False, chunked_prefill=False)
_SARATHI = dict(priority="decode_first", hybrid_batching=True, chunked_prefill=True, prefill_token_budget=512)

# InferMax Table 1: (name, description, knobs). P defaults to C (4096 for Llama-2-7B).
_TABLE1 = [
    ("vllm", "vLLM v0: prefill-first, no hybrid batches, paged KV, evict the latest-admitted (InferMax §3.1)", _VLLM),
    ("vllm_hy", "vLLM with hybrid batches (InferMax Table 1)", dict(_VLLM, hybrid_batching=True)),
    ("sarathi", "Sarathi-Serve: decode-first, hybrid batches, chunked prefill with budget P=512", _SARATHI),
    ("sarathi_pc", "Sarathi with P = C (InferMax Table 1: SARATHI_P=C)", dict(_SARATHI, prefill_token_budget=None)),
    (
        "sarathi_nocp",
        "Sarathi without chunked prefill, P = C (InferMax Table 1)",
        dict(_SARATHI, chunked_prefill=False, prefill_token_budget=None),
    ),
    (
        "sarathi_nohy",
        "Sarathi without hybrid batches or chunked prefill, P = C (InferMax Table 1)",
        dict(_SARATHI, hybrid_batching=False, chunked_prefill=False, prefill_token_budget=None),
    ),
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
for _name, _by, _predictor in (
    ("rank_org", "arrival", "none"),
    ("rank_i", "input", "none"),
    ("rank_o", "output", "oracle"),
):
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
        kv_managers=_BROS_KV,
    )
)
register(
    SchedulerSpec(
        "bros_nobicache",
        "BROS without bidirectional blocks: paged KV, evictions by recompute (the paper's ablation)",
        BrosScheduler,
        BrosConfig,
        needs_cost_model=True,
        kv_managers=_BROS_KV,
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
    (
        "econoserve-d",
        "EconoServe-D (UnsyncDecoupled): PT and GT queues, PTs fill the TFS and GTs the KV "
        "every iteration, FCFS, exact allocation of predicted RL + padding",
        _ECONOSERVE_D,
    ),
    (
        "econoserve-sd",
        "EconoServe-SD (SyncDecoupled): + time-synced GT groups by predicted RL, admitted when a group completes",
        dict(_ECONOSERVE_D, time_synced=True),
    ),
    (
        "econoserve-sdo",
        "EconoServe-SDO: + ordering by deadline, occupied KV and length with binary search",
        dict(_ECONOSERVE_D, time_synced=True, ordering=True),
    ),
    (
        "econoserve",
        "EconoServe: SDO + KV-cache pipelining (GTs hosted in the unused half of others' "
        "regions); noisy RL predictions at the paper's ShareGPT accuracy",
        _ECONOSERVE,
    ),
    (
        "econoserve-oracle",
        "EconoServe with the true response lengths (no padding needed)",
        dict(_ECONOSERVE, predictor="oracle", padding=0.0),
    ),
    (
        "synccoupled",
        "SyncCoupled (EconoServe §2.2): requests grouped by predicted RL, each allocated "
        "prompt + RL, groups admitted when a group completes; no PT joins between",
        dict(_ECONOSERVE_D, decoupled=False, time_synced=True),
    ),
]:
    register(
        SchedulerSpec(
            _name,
            _description,
            EconoServeScheduler,
            EconoServeConfig,
            _knobs,
            needs_cost_model=True,
            kv_managers=_ECONOSERVE_KV,
        )
    )
