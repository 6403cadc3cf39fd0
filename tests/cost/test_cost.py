"""Cost models: linear (InferMax), roofline, fitting, presets, specs and KV capacity."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from sloserve.checkpoint.config import from_hf_config
from sloserve.core.errors import ConfigError, UnknownNameError
from sloserve.cost import (
    GPUS,
    MODELS,
    BatchShape,
    LinearCoefficients,
    LinearCostModel,
    ModelSpec,
    RooflineCostModel,
    build_cost_model,
    fit_linear,
    fit_linear_shapes,
    get_gpu,
    get_model,
    get_preset,
    gpu_of_device,
    kv_capacity_tokens,
    list_presets,
    load_preset,
    save_preset,
)
from sloserve.cost.base import advance_shape
from sloserve.cost.fit import CSV_COLUMNS
from sloserve.cost.linear import COEFFICIENT_NAMES
from sloserve.cost.profile_grid import ProfileGrid

L7 = get_preset("llama-2-7b-a100")
L70 = get_preset("llama-3-70b-4xa100")
# Qwen/Qwen3-30B-A3B's config.json: 48 layers of 128 experts (768 wide), 8 a token
QWEN3_30B_A3B = from_hf_config(
    {"model_type": "qwen3_moe", "vocab_size": 151936, "hidden_size": 2048, "intermediate_size": 6144,
     "num_hidden_layers": 48, "num_attention_heads": 32, "num_key_value_heads": 4, "head_dim": 128,
     "max_position_embeddings": 40960, "num_experts": 128, "num_experts_per_tok": 8, "moe_intermediate_size": 768,
     "norm_topk_prob": True, "torch_dtype": "bfloat16", "tie_word_embeddings": False},
    "qwen3-30b-a3b",
).spec()  # fmt: skip


DEEPSEEK_V2_LITE = from_hf_config(
    {"model_type": "deepseek_v2", "vocab_size": 102400, "hidden_size": 2048, "intermediate_size": 10944,
     "moe_intermediate_size": 1408, "num_hidden_layers": 27, "num_attention_heads": 16, "num_key_value_heads": 16,
     "n_routed_experts": 64, "n_shared_experts": 2, "num_experts_per_tok": 6, "first_k_dense_replace": 1,
     "kv_lora_rank": 512, "q_lora_rank": None, "qk_nope_head_dim": 128, "qk_rope_head_dim": 64, "v_head_dim": 128,
     "max_position_embeddings": 163840, "topk_method": "greedy", "torch_dtype": "bfloat16"},
    "deepseek-v2-lite",
).spec()  # fmt: skip


# mistralai/Mistral-7B-v0.1's config.json: every layer sees the last 4,096 positions
MISTRAL_7B_V01 = from_hf_config(
    {"model_type": "mistral", "vocab_size": 32000, "hidden_size": 4096, "intermediate_size": 14336,
     "num_hidden_layers": 32, "num_attention_heads": 32, "num_key_value_heads": 8, "max_position_embeddings": 32768,
     "sliding_window": 4096, "rope_theta": 10000.0, "torch_dtype": "bfloat16"},
    "mistral-7b-v0.1",
).spec()  # fmt: skip
# google/gemma-3-27b-it's text_config: five layers of six see the last 1,024 positions
GEMMA_3_27B = from_hf_config(
    {"model_type": "gemma3_text", "vocab_size": 262208, "hidden_size": 5376, "intermediate_size": 21504,
     "num_hidden_layers": 62, "num_attention_heads": 32, "num_key_value_heads": 16, "head_dim": 128,
     "max_position_embeddings": 131072, "sliding_window": 1024, "query_pre_attn_scalar": 168,
     "rope_scaling": {"rope_type": "linear", "factor": 8.0}, "torch_dtype": "bfloat16"},
    "gemma-3-27b",
).spec()  # fmt: skip


def prefill_shape(
    chunks: list[tuple[int, int]], num_decode: int = 0, decode_kv: int = 0, longest: int = 0
) -> BatchShape:
    """Shape of a batch with prefill chunks given as (c, m) pairs plus some decodes (``longest``: the
    longest decode's context)."""
    return BatchShape(
        num_decode=num_decode,
        decode_kv_tokens=decode_kv,
        num_prefill=len(chunks),
        prefill_tokens=sum(c for c, _ in chunks),
        prefill_attention_work=sum(c * c + 2 * m * c for c, m in chunks),
        prefill_context_tokens=sum(m for _, m in chunks),
        decode_max_kv_tokens=longest,
    )


# ---------------------------------------------------------------- linear model


def test_linear_decode_batch_matches_hand_computation() -> None:
    # per layer: a_d*100000 + b_d + s_d*200 = 0.8513 + 0.01921 + 0.148 = 1.01851 ms
    #            a_o*200 + b_o = 0.382 + 0.06486 = 0.44686 ms; x 32 layers = 46.89184 ms
    t = LinearCostModel(L7).batch_time(BatchShape(200, 100_000))
    assert t.decode_attention_s == pytest.approx(1.01851 * 32e-3, rel=1e-12)
    assert t.non_attention_s == pytest.approx(0.44686 * 32e-3, rel=1e-12)
    assert t.prefill_attention_s == 0.0 and t.swap_s == 0.0
    assert t.total_s == pytest.approx(0.04689184, rel=1e-12)
    # 70B: (1.222e-6*1e5 + 0.081 + 3.92e-4*200) + (0.002*200 + 0.159) = 0.8406 ms x 80 layers
    assert LinearCostModel(L70).batch_time(BatchShape(200, 100_000)).total_s == pytest.approx(0.067248, rel=1e-12)


def test_linear_prefill_batch_matches_hand_computation() -> None:
    shape = prefill_shape([(1000, 0), (500, 0)])  # sum(c^2) = 1.25e6, n_p = 2, tokens = 1500
    t = LinearCostModel(L7).batch_time(shape)
    prefill_ms = 1.6773e-07 * 1.25e6 + 0.0926 + 0.001534 * 2  # = 0.3053305
    other_ms = 0.00191 * 1500 + 0.06486  # = 2.92986
    assert t.prefill_attention_s == pytest.approx(0.3053305 * 32e-3, rel=1e-12)
    assert t.non_attention_s == pytest.approx(other_ms * 32e-3, rel=1e-12)
    assert t.decode_attention_s == 0.0
    assert t.total_s == pytest.approx((prefill_ms + other_ms) * 32e-3, rel=1e-12)
    assert t.total_s == pytest.approx(0.103526096, rel=1e-12)


def test_linear_hybrid_batch_matches_hand_computation() -> None:
    # 10 decodes reading 20000 KV tokens; one chunk of c=512 after m=1024 computed tokens
    shape = prefill_shape([(512, 1024)], num_decode=10, decode_kv=20_000)
    assert shape.prefill_attention_work == 512**2 + 2 * 1024 * 512
    t = LinearCostModel(L7).batch_time(shape)
    decode_ms = 8.513e-06 * 20_000 + 0.01921 + 0.00074 * 10
    prefill_ms = 1.6773e-07 * 1_310_720 + 0.0926 + 0.001534 * 1 + 9.224e-06 * 1024
    other_ms = 0.00191 * 522 + 0.06486
    assert t.decode_attention_s == pytest.approx(decode_ms * 32e-3, rel=1e-12)
    assert t.prefill_attention_s == pytest.approx(prefill_ms * 32e-3, rel=1e-12)
    assert t.total_s == pytest.approx((decode_ms + prefill_ms + other_ms) * 32e-3, rel=1e-12)
    assert t.total_s == pytest.approx(
        t.non_attention_s + t.decode_attention_s + t.prefill_attention_s + t.swap_s, rel=1e-15
    )


def test_linear_empty_batch_and_swap() -> None:
    model = LinearCostModel(L7)
    assert model.batch_time(BatchShape()).total_s == 0.0
    swap = model.batch_time(BatchShape(swap_bytes=25_000_000_000))
    assert swap.swap_s == pytest.approx(1.0) and swap.total_s == pytest.approx(1.0)
    assert LinearCostModel(L7, swap_bandwidth=50e9).batch_time(BatchShape(swap_bytes=10**9)).swap_s == 0.02


def test_knee_flattens_the_non_attention_part_below_it() -> None:
    """other = a_o * max(tokens, knee) + b_o: a step of fewer tokens than the knee pays for the knee's."""
    knee, straight = LinearCostModel(L7_KNEE), LinearCostModel(L7)
    for tokens in (1, 64, 150):
        assert knee.batch_time(BatchShape(tokens, 100 * tokens)).non_attention_s == pytest.approx(
            (L7.a_o * 150 + L7.b_o) * 32 / 1000
        )
    for tokens in (151, 1000):  # above the knee it is InferMax's line
        shape = prefill_shape([(tokens, 0)])
        assert knee.batch_time(shape).total_s == straight.batch_time(shape).total_s
    assert knee.batch_time(BatchShape()).total_s == 0.0  # an empty step still costs nothing


def test_floors_lift_short_steps_only() -> None:
    """step = max(floor, work), the floor by kind of step: with a prefill floor_p, else floor_d; the
    time below the floor counts as non-attention, so the parts still add up."""
    floored, straight = LinearCostModel(L7_FLOOR), LinearCostModel(L7)
    for shape, floor in (
        (BatchShape(1, 100), 0.3),
        (prefill_shape([(32, 0)]), 1.5),
        (prefill_shape([(512, 0)], 4, 400), 1.5),
    ):
        got = floored.batch_time(shape)
        assert got.total_s == pytest.approx(floor * 32 / 1000)
        assert got.decode_attention_s == straight.batch_time(shape).decode_attention_s
        assert got.non_attention_s + got.decode_attention_s + got.prefill_attention_s == pytest.approx(got.total_s)
    for shape in (BatchShape(256, 256_000), prefill_shape([(4096, 0)])):  # above their floors: InferMax's line
        assert floored.batch_time(shape) == straight.batch_time(shape)
    swap = floored.batch_time(BatchShape(1, 100, swap_bytes=25_000_000))  # the swap adds to the floored step
    assert swap.total_s == pytest.approx(0.3 * 32 / 1000 + 0.001)
    assert floored.batch_time(BatchShape()).total_s == 0.0  # an empty step still costs nothing
    # A repeated step below its floor is no arithmetic series; above it, the straight line's.
    assert floored.step_increment(BatchShape(1, 100)) is None
    assert floored.step_increment(BatchShape(256, 256_000)) == straight.step_increment(BatchShape(256, 256_000))


def test_the_host_share_adds_to_every_step_after_the_floor() -> None:
    """h_s per step and h_r per scheduled request (decodes and prompts), on top of the floored work,
    counted as non-attention; an empty step still costs nothing, and a repeated step's increment is
    unchanged (the host's share is the same each step of a stretch)."""
    hosted, floored = LinearCostModel(L7_HOST), LinearCostModel(L7_FLOOR)
    for shape, requests in (
        (BatchShape(1, 100), 1),
        (BatchShape(256, 256_000), 256),
        (prefill_shape([(32, 0)], 4, 400), 5),
    ):
        host_s = (0.4 + 0.02 * requests) / 1000
        got, base = hosted.batch_time(shape), floored.batch_time(shape)
        assert got.total_s == pytest.approx(base.total_s + host_s, rel=1e-12)
        assert got.non_attention_s == pytest.approx(base.non_attention_s + host_s, rel=1e-12)
        assert got.decode_attention_s == base.decode_attention_s
        assert hosted.step_increment(shape) == floored.step_increment(shape)
    assert hosted.batch_time(BatchShape()).total_s == 0.0


def test_an_overlapped_host_share_is_one_more_floor() -> None:
    """With async scheduling the host prepares a step while the GPU runs the one before: a step takes
    the longer of its (floored) work and the host's share, not their sum; a repeated step on that floor
    is no arithmetic series, above it the same as without a host's share."""
    overlapped, floored = LinearCostModel(L7_ASYNC), LinearCostModel(L7_FLOOR)
    host_bound = []
    for shape, requests in (
        (BatchShape(1, 100), 1),
        (BatchShape(64, 10_000), 64),  # above its own floor (9.6 ms), below the host's 13.3 ms
        (BatchShape(256, 256_000), 256),
        (prefill_shape([(32, 0)], 4, 400), 5),
    ):
        host_s = (12 + 0.02 * requests) / 1000
        got, base = overlapped.batch_time(shape), floored.batch_time(shape)
        assert got.total_s == pytest.approx(max(base.total_s, host_s), rel=1e-12)
        assert got.decode_attention_s == base.decode_attention_s
        host_bound.append(base.total_s <= host_s)
        assert (overlapped.step_increment(shape) is None) == (host_bound[-1] or floored.step_increment(shape) is None)
    assert host_bound == [True, True, False, False]  # (a step with a prefill: over its own floor, 48 ms)
    assert overlapped.batch_time(BatchShape()).total_s == 0.0


def test_linear_coefficients_validation() -> None:
    with pytest.raises(ConfigError, match="coefficient a_d"):
        LinearCoefficients(**{**L7.as_dict(), "a_d": -1.0})
    with pytest.raises(ConfigError, match="num_layers"):
        LinearCoefficients(**{**L7.as_dict(), "num_layers": 0})
    with pytest.raises(ConfigError, match="knee_tokens must be a non-negative finite number, got -1"):
        LinearCoefficients(**{**L7.as_dict(), "knee_tokens": -1})
    with pytest.raises(ConfigError, match="coefficient floor_p must be a non-negative finite number, got nan"):
        LinearCoefficients(**{**L7.as_dict(), "floor_p": float("nan")})
    with pytest.raises(ConfigError, match="host_overlapped must be true or false, got 1"):
        LinearCoefficients(**{**L7.as_dict(), "host_overlapped": 1})
    with pytest.raises(ConfigError, match="swap_bandwidth"):
        LinearCostModel(L7, swap_bandwidth=0)


L7_KNEE = LinearCoefficients(**{**L7.as_dict(), "knee_tokens": 150.0, "name": "llama-2-7b-knee"})
# A charge per token of the longest decode context (ms per layer), of the size fitted on an H200.
L7_WALK = LinearCoefficients(**{**L7.as_dict(), "w_d": 1.5e-5, "name": "llama-2-7b-walk"})
# Floors (ms per layer) under which a 1-token decode (0.09) and a 512-token prompt (1.18) fall.
L7_FLOOR = LinearCoefficients(**{**L7.as_dict(), "floor_p": 1.5, "floor_d": 0.3, "name": "llama-2-7b-floor"})
# Floors and the host's share (ms per layer): 0.4 ms a step + 0.02 ms a request over 32 layers.
L7_HOST = LinearCoefficients(**{**L7_FLOOR.as_dict(), "h_s": 0.4 / 32, "h_r": 0.02 / 32, "name": "llama-2-7b-host"})
# The host's share of an engine that schedules asynchronously, overlapped with the GPU's work: 12 ms a
# step + 0.02 ms a request, above a small decode step's work and below a large one's.
L7_ASYNC = LinearCoefficients(
    **{**L7_FLOOR.as_dict(), "h_s": 12 / 32, "h_r": 0.02 / 32, "host_overlapped": True, "name": "llama-2-7b-async"}
)

COST_MODELS = [
    LinearCostModel(L7),
    LinearCostModel(L70),
    LinearCostModel(L7_KNEE),
    LinearCostModel(L7_FLOOR),
    LinearCostModel(L7_WALK),
    LinearCostModel(L7_HOST),
    LinearCostModel(L7_ASYNC),
    RooflineCostModel(get_model("llama-2-7b"), get_gpu("a100")),
    RooflineCostModel(get_model("llama-3-70b"), get_gpu("a100"), num_gpus=4),
    RooflineCostModel(get_model("qwen2.5-7b"), get_gpu("h100"), num_gpus=2),
    RooflineCostModel(QWEN3_30B_A3B, get_gpu("h100")),  # (the weights a step reads follow its tokens)
    RooflineCostModel(GEMMA_3_27B, get_gpu("h200")),  # (52 of its 62 layers read at most 1,024 keys a query)
]


@settings(max_examples=150, deadline=None)
@given(
    which=st.integers(0, len(COST_MODELS) - 1),
    num_decode=st.integers(0, 2048),
    kv=st.integers(0, 20_000_000),
    longest=st.integers(0, 100_000),
    steps=st.integers(0, 400),
)
def test_decode_times_match_batch_time(which: int, num_decode: int, kv: int, longest: int, steps: int) -> None:
    model = COST_MODELS[which]
    kv, longest = (kv, min(longest, kv)) if num_decode else (0, 0)
    fast = model.decode_times(num_decode, kv, steps, longest)
    assert fast.shape == (steps,) and fast.dtype == np.float64
    shape = BatchShape(num_decode, kv, decode_max_kv_tokens=longest)
    slow = np.array([model.batch_time(advance_shape(shape, k)).total_s for k in range(steps)])
    np.testing.assert_allclose(fast, slow, rtol=1e-12, atol=0)


@settings(max_examples=150, deadline=None)
@given(
    which=st.integers(0, len(COST_MODELS) - 1),
    decodes=st.lists(st.tuples(st.integers(0, 1024), st.integers(0, 5_000_000)), max_size=20),
    chunks=st.lists(st.tuples(st.integers(1, 4096), st.integers(0, 100_000)), max_size=3),
    swap_bytes=st.sampled_from([0, 1, 123_456_789]),
    overlapped=st.booleans(),
    longest=st.integers(0, 100_000),
)
def test_step_seconds_with_decodes_is_step_seconds_bit_for_bit(which, decodes, chunks, swap_bytes, overlapped, longest):
    """BROS prices a batch's prefixes at once (sched/bros.py): each element must be what
    ``step_seconds`` says, to the last bit (a decision at a tie must not depend on which was asked)."""
    model = COST_MODELS[which]
    base = BatchShape.of(chunks, [])._replace(
        swap_bytes=swap_bytes, swap_overlapped=overlapped, decode_max_kv_tokens=longest
    )
    num_decode = np.array([n for n, _ in decodes], dtype=np.int64)
    kv = np.array([k if n else 0 for n, k in decodes], dtype=np.int64)
    fast = model.step_seconds_with_decodes(base, num_decode, kv)
    slow = [
        model.step_seconds(base._replace(num_decode=int(n), decode_kv_tokens=int(k))) for n, k in zip(num_decode, kv)
    ]
    assert fast.dtype == np.float64 and fast.tolist() == slow
    default = super(type(model), model).step_seconds_with_decodes(base, num_decode, kv)  # the loop
    assert default.tolist() == slow


@settings(max_examples=150, deadline=None)
@given(
    which=st.integers(0, len(COST_MODELS) - 1),
    num_decode=st.integers(0, 1024),
    kv=st.integers(0, 5_000_000),
    chunk=st.integers(0, 4096),
    context=st.integers(0, 100_000),
    steps=st.integers(1, 100),
    longest=st.integers(0, 100_000),
)
def test_repeated_steps_match_batch_time(which, num_decode, kv, chunk, context, steps, longest) -> None:
    """step_times / step_increment of a step of decodes and one chunk equal batch_time of the shape
    advanced k steps (the simulator's chunk stretches rely on it)."""
    model = COST_MODELS[which]
    kv, longest = (kv, min(longest, kv)) if num_decode else (0, 0)
    context = context if chunk else 0
    shape = BatchShape(
        num_decode,
        kv,
        1 if chunk else 0,
        chunk,
        chunk * chunk + 2 * context * chunk,
        context,
        decode_max_kv_tokens=longest,
    )
    slow = np.array([model.batch_time(advance_shape(shape, k)).total_s for k in range(steps)])
    np.testing.assert_allclose(model.step_times(shape, steps), slow, rtol=1e-12, atol=0)
    increment = model.step_increment(shape)
    if isinstance(model, LinearCostModel):  # None only for a step on its floor
        c = model.coefficients
        floor_s = (c.floor_p if chunk else c.floor_d) * c.num_layers / 1000
        host_s = (c.h_s + c.h_r * (num_decode + (1 if chunk else 0))) * c.num_layers / 1000
        floor_s = max(floor_s, host_s) if c.host_overlapped else floor_s + host_s  # one more floor, or on top
        assert increment is not None or slow[0] <= floor_s * (1 + 1e-12)
    if increment is not None:
        np.testing.assert_allclose(slow[0] + increment * np.arange(steps), slow, rtol=1e-12, atol=0)


@settings(max_examples=150, deadline=None)
@given(
    which=st.integers(0, len(COST_MODELS) - 1),
    num_decode=st.integers(0, 1024),
    kv=st.integers(0, 5_000_000),
    chunks=st.lists(st.tuples(st.integers(1, 4096), st.integers(0, 100_000)), max_size=4),
    swap_bytes=st.sampled_from([0, 1, 123_456_789]),
    overlapped=st.booleans(),
)
def test_step_seconds_is_the_breakdown_total(which, num_decode, kv, chunks, swap_bytes, overlapped) -> None:
    """The simulator's clock (step_seconds) advances by exactly batch_time's total: the parts' sum,
    or with overlapped copies the longer of compute and swap."""
    model = COST_MODELS[which]
    shape = prefill_shape(chunks, num_decode, kv if num_decode else 0)._replace(
        swap_bytes=swap_bytes, swap_overlapped=overlapped
    )
    t = model.batch_time(shape)
    assert model.step_seconds(shape) == t.total_s
    compute = t.non_attention_s + t.decode_attention_s + t.prefill_attention_s
    assert t.total_s == pytest.approx(max(compute, t.swap_s) if overlapped else compute + t.swap_s, rel=1e-12)


def test_swap_bandwidth_grows_with_tensor_parallelism() -> None:
    """Each GPU of a tensor-parallel replica copies its shard of the KV over its own PCIe link."""
    spec, gpu = get_model("llama-3-70b"), get_gpu("a100")
    for cost_model in (None, "roofline"):
        one = build_cost_model(get_model("llama-2-7b"), gpu, num_gpus=1, cost_model=cost_model)
        four = build_cost_model(spec, gpu, num_gpus=4, cost_model=cost_model)
        assert four.swap_bandwidth == pytest.approx(4 * one.swap_bandwidth)


def test_advance_shape_refuses_what_does_not_repeat() -> None:
    with pytest.raises(ValueError, match="at most one prefill chunk"):
        advance_shape(BatchShape(4, 100, 2, 64, 64 * 64 * 2, 0), 3)


# ---------------------------------------------------------------- roofline


def test_roofline_monotone_in_tokens_and_kv() -> None:
    model = RooflineCostModel(get_model("llama-2-7b"), get_gpu("a100"))
    decode = [model.batch_time(BatchShape(b, 1000 * b)).total_s for b in (1, 8, 64, 256, 1024, 4096)]
    assert all(x <= y for x, y in zip(decode, decode[1:])) and decode[-1] > decode[0]
    kv = [model.batch_time(BatchShape(64, m)).total_s for m in (0, 10**4, 10**5, 10**6)]
    assert all(x < y for x, y in zip(kv, kv[1:]))
    prefill = [model.batch_time(prefill_shape([(c, 0)])).total_s for c in (16, 256, 1024, 4096)]
    assert all(x <= y for x, y in zip(prefill, prefill[1:])) and prefill[-1] > prefill[0]
    chunk = [model.batch_time(prefill_shape([(512, m)])).total_s for m in (0, 2048, 8192)]
    assert all(x < y for x, y in zip(chunk, chunk[1:]))


def test_roofline_small_decode_batch_is_weight_bandwidth_bound() -> None:
    spec, gpu = get_model("llama-2-7b"), get_gpu("a100-80gb")
    model = RooflineCostModel(spec, gpu)
    t = model.batch_time(BatchShape(1, 100))
    weights_s = spec.weight_bytes / (gpu.hbm_bandwidth * model.bandwidth_efficiency)
    # every weight except the input embedding is read once: ~8.1 ms at 80% of 2,039 GB/s
    assert t.total_s - model.step_overhead_s == pytest.approx(weights_s, rel=0.03)
    assert t.decode_attention_s < 0.01 * t.total_s
    # a big prefill is compute bound: ~2 * params * tokens / (peak * efficiency)
    p = model.batch_time(prefill_shape([(4096, 0)]))
    flops_s = 2 * spec.layer_params * 4096 / (gpu.peak_flops * model.compute_efficiency)
    assert p.non_attention_s == pytest.approx(flops_s + model.step_overhead_s, rel=0.02)


def test_roofline_runs_a_mixture_of_experts_on_the_experts_its_tokens_reach() -> None:
    """Qwen3-30B-A3B: a token's FLOPs are its 3.3B active parameters'; a step reads the experts its tokens
    reach, E (1 - (1 - k / E)^T) a layer (a Monte-Carlo of uniform top-8 routing agrees): a decode at batch 1
    costs what a dense model of its active parameters does, and the weights read grow to all 30.5B."""
    spec, gpu = QWEN3_30B_A3B, get_gpu("h100")
    assert spec.num_params == 30_532_122_624 and spec.expert_params == 48 * 128 * 3 * 2048 * 768
    assert spec.active_layer_params + spec.embedding_params == pytest.approx(3.353e9, rel=1e-3)
    rng = np.random.default_rng(0)
    for tokens in (1, 4, 16, 64):
        picks = np.argsort(rng.random((2000, tokens, 128)), axis=-1)[..., :8]  # (trials, T, k) distinct a token
        reached = np.mean([len(np.unique(trial)) for trial in picks])
        assert spec.experts_reached(tokens) == pytest.approx(reached, rel=0.01)
    counts = np.arange(1, 5000)
    assert [spec.layer_params_read(int(t)) for t in counts] == spec.layer_params_read(counts).tolist()  # (bits)
    model = RooflineCostModel(spec, gpu)
    active = spec.num_params - round(spec.expert_params * (1 - 8 / 128))
    dense = dataclasses.replace(spec, num_params=active, num_experts=0, experts_per_token=0, expert_params=0)
    one = BatchShape(1, 100)
    assert model.batch_time(one).total_s == pytest.approx(RooflineCostModel(dense, gpu).batch_time(one).total_s)
    rate = gpu.hbm_bandwidth * model.bandwidth_efficiency
    reads = [model.batch_time(BatchShape(b, 0)).non_attention_s - model.step_overhead_s for b in (1, 4, 16, 64)]
    assert all(x < y for x, y in zip(reads, reads[1:]))
    assert reads[-1] * rate == pytest.approx(spec.layer_params_read(64) * 2 + 151936 * 2048 * 2)
    every_weight = (spec.num_params - 151936 * 2048) * 2  # (but the input embedding's, gathered)
    assert reads[-1] < every_weight / rate < 1.02 * reads[-1]  # (64 tokens reach 98% of the experts)
    prefill = model.batch_time(prefill_shape([(8192, 0)])).non_attention_s  # compute-bound: the active FLOPs
    flops = 2 * spec.active_layer_params * 8192 + 2 * 151936 * 2048
    assert prefill == pytest.approx(flops / (gpu.peak_flops * model.compute_efficiency) + model.step_overhead_s)


def test_roofline_prices_mlas_prefills_in_the_cheaper_form() -> None:
    """DeepSeek-V2-Lite: a long prompt's attention by head (192 numbers a head, after 2 d_c nh (d_h + d_v) FLOPs
    a context token and layer expand its latent), 2.6x fewer FLOPs than over the 576-wide latent at 4K tokens; a
    short chunk after a long context stays over the latent, as the engine takes them (``PrefillsByHead``)."""
    spec, gpu = DEEPSEEK_V2_LITE, get_gpu("h100")
    assert (spec.head_dim, spec.prefill_head_dim) == (576, 192)
    assert spec.prefill_kv_flops_per_token == 27 * 2 * 512 * 16 * (128 + 128)
    latent_only = dataclasses.replace(spec, prefill_head_dim=0, prefill_kv_flops_per_token=0)
    model, over_latent = RooflineCostModel(spec, gpu), RooflineCostModel(latent_only, gpu)
    rate = gpu.peak_flops * model.compute_efficiency
    prompt = prefill_shape([(4096, 0)])
    by_head_flops = 2 * 27 * 16 * 192 * 4096**2 + spec.prefill_kv_flops_per_token * 4096
    assert model.batch_time(prompt).prefill_attention_s == pytest.approx(by_head_flops / rate)
    assert over_latent.batch_time(prompt).prefill_attention_s == pytest.approx(2 * 27 * 16 * 576 * 4096**2 / rate)
    ratio = over_latent.batch_time(prompt).prefill_attention_s / model.batch_time(prompt).prefill_attention_s
    assert ratio == pytest.approx(2.58, abs=0.01)
    chunk = prefill_shape([(512, 16384)])  # (each of the 16,896 context tokens expanded)
    by_head_flops = 2 * 27 * 16 * 192 * (512**2 + 2 * 512 * 16384) + spec.prefill_kv_flops_per_token * 16896
    assert model.batch_time(chunk).prefill_attention_s == pytest.approx(by_head_flops / rate)
    chunk = prefill_shape([(64, 8192)])
    assert model.batch_time(chunk).prefill_attention_s == over_latent.batch_time(chunk).prefill_attention_s
    with pytest.raises(ConfigError, match="prefill_head_dim and prefill_kv_flops_per_token are both 0 or both"):
        dataclasses.replace(spec, prefill_kv_flops_per_token=0)


def test_a_mixture_of_experts_spec_is_checked() -> None:
    base = QWEN3_30B_A3B.__dict__
    with pytest.raises(ConfigError, match="num_experts, experts_per_token and expert_params are all 0 or all"):
        ModelSpec(**{**base, "experts_per_token": 0})
    with pytest.raises(ConfigError, match="experts_per_token 129 must be at most num_experts 128"):
        ModelSpec(**{**base, "experts_per_token": 129})
    with pytest.raises(ConfigError, match="expert_params must be an integer >= 0, got -1"):
        ModelSpec(**{**base, "expert_params": -1})


def test_a_models_windowed_layers_are_in_its_spec() -> None:
    """Sliding-window and chunked layers, counted from each layer's type; gpt-oss-20b's and Llama 4 Scout's
    config.json (their parameter counts: gpt-oss-20b's released checkpoint's)."""
    assert (MISTRAL_7B_V01.num_params, MISTRAL_7B_V01.window_layers, MISTRAL_7B_V01.window_tokens) == (
        7_241_732_096, 32, 4096)  # fmt: skip
    assert (GEMMA_3_27B.attention_layers, GEMMA_3_27B.window_layers, GEMMA_3_27B.window_tokens) == (62, 52, 1024)
    yarn = {"rope_type": "yarn", "factor": 32.0, "beta_fast": 32.0, "beta_slow": 1.0, "truncate": False,
            "original_max_position_embeddings": 4096}  # fmt: skip
    gpt_oss = from_hf_config(
        {"model_type": "gpt_oss", "vocab_size": 201088, "hidden_size": 2880, "intermediate_size": 2880,
         "num_hidden_layers": 24, "num_attention_heads": 64, "num_key_value_heads": 8, "head_dim": 64,
         "max_position_embeddings": 131072, "sliding_window": 128, "num_local_experts": 32, "num_experts_per_tok": 4,
         "layer_types": ["sliding_attention", "full_attention"] * 12, "rope_theta": 150000, "rope_scaling": yarn,
         "torch_dtype": "bfloat16"},
        "gpt-oss-20b",
    ).spec()  # fmt: skip
    assert (gpt_oss.num_params, gpt_oss.window_layers, gpt_oss.window_tokens) == (20_914_757_184, 12, 128)
    llama3 = {"rope_type": "llama3", "factor": 16.0, "low_freq_factor": 1.0, "high_freq_factor": 1.0,
              "original_max_position_embeddings": 8192}  # fmt: skip
    scout = from_hf_config(
        {"model_type": "llama4_text", "vocab_size": 202048, "hidden_size": 5120, "intermediate_size": 8192,
         "intermediate_size_mlp": 16384, "num_hidden_layers": 48, "num_attention_heads": 40, "num_key_value_heads": 8,
         "head_dim": 128, "max_position_embeddings": 10485760, "num_local_experts": 16, "num_experts_per_tok": 1,
         "interleave_moe_layer_step": 1, "attention_chunk_size": 8192, "rope_theta": 500000.0, "use_qk_norm": True,
         "rope_scaling": llama3, "torch_dtype": "bfloat16"},
        "llama-4-scout",
    ).spec()  # fmt: skip
    assert (scout.window_layers, scout.window_tokens) == (36, 8192)  # (every fourth layer global, unrotated)
    assert (get_model("llama-3-8b").window_layers, get_model("llama-3-8b").window_tokens) == (0, 0)
    base = MISTRAL_7B_V01.__dict__
    with pytest.raises(ConfigError, match="window_layers and window_tokens are both 0 or both positive"):
        ModelSpec(**{**base, "window_tokens": 0})
    with pytest.raises(ConfigError, match="window_layers 33 exceeds the 32 attention layers"):
        ModelSpec(**{**base, "window_layers": 33})
    with pytest.raises(ConfigError, match="window_tokens must be an integer >= 0, got -1"):
        ModelSpec(**{**base, "window_tokens": -1})
    with pytest.raises(ConfigError, match="windowed layers beside a second form of prefill attention"):
        ModelSpec(**{**DEEPSEEK_V2_LITE.__dict__, "window_layers": 1, "window_tokens": 4096})


def test_roofline_reads_at_most_a_window_of_keys_in_a_windowed_layer() -> None:
    """Mistral 7B v0.1 (every layer windowed, W = 4,096): a decode step's attention stops growing once every
    request is past its window, and equals a full-attention model's while every one is within it; so does a
    prefill chunk's. Gemma 3 27B (52 of 62 layers at W = 1,024), batch 8 at 32K contexts: 10 layers read every
    key, 52 layers 1,024 a request, 5.3x fewer bytes than every layer reading all of them."""
    gpu = get_gpu("h200")
    windowed = RooflineCostModel(MISTRAL_7B_V01, gpu)
    full = RooflineCostModel(dataclasses.replace(MISTRAL_7B_V01, window_layers=0, window_tokens=0), gpu)

    def decode_s(model: RooflineCostModel, contexts: list[int]) -> float:
        return model.batch_time(BatchShape.of([], contexts)).decode_attention_s

    def prefill_s(model: RooflineCostModel, chunks: list[tuple[int, int]]) -> float:
        return model.batch_time(BatchShape.of(chunks, [])).prefill_attention_s

    past = [decode_s(windowed, [m] * 8) for m in (4095, 8000, 32000)]
    assert past[0] == past[1] == past[2] < decode_s(full, [8000] * 8)
    for contexts in ([0] * 8, [4095] * 8, [100, 4095, 2000]):  # (within the window: every key, as full attention)
        assert decode_s(windowed, contexts) == decode_s(full, contexts)
    # (past and within at once: the bound, above the keys read, below full attention's)
    mixed, keys_read = decode_s(windowed, [100, 20000]), 101 + 4096
    assert decode_s(windowed, [4095, 4095]) >= mixed > keys_read / (2 * 4096) * decode_s(windowed, [4095, 4095])
    assert mixed < decode_s(full, [100, 20000])
    chunks_past = [prefill_s(windowed, [(512, m)]) for m in (4095, 10000, 30000)]
    assert chunks_past[0] == chunks_past[1] == chunks_past[2] < prefill_s(full, [(512, 10000)])
    # (a short chunk is memory-bound: past its window it reads the window's last W - 1 keys and its own)
    assert prefill_s(windowed, [(16, 4095)]) == prefill_s(windowed, [(16, 4096)]) == prefill_s(windowed, [(16, 30000)])
    for chunks in ([(512, 0)], [(2048, 2048)], [(64, 4000), (4096, 0)]):  # (every query within its window)
        assert prefill_s(windowed, chunks) == prefill_s(full, chunks)
    # a long prompt is compute-bound: a query past the first 4,096 positions sees 4,096 keys, not all of them
    rate = gpu.peak_flops * windowed.compute_efficiency
    prompt = 32 * 32 * 128 * 2 * ((2 * 4096 - 1) * 16384)  # (work (2W - 1) c: c W pairs, as c^2 + 2mc counts them)
    assert prefill_s(windowed, [(16384, 4095)]) == pytest.approx(prompt / rate)
    assert prefill_s(full, [(16384, 4095)]) == pytest.approx(32 * 32 * 128 * 2 * (16384**2 + 2 * 4095 * 16384) / rate)

    gemma = RooflineCostModel(GEMMA_3_27B, gpu)
    gemma_full = RooflineCostModel(dataclasses.replace(GEMMA_3_27B, window_layers=0, window_tokens=0), gpu)
    layer_token_bytes = 2 * 16 * 128 * 2  # (K and V, 16 heads of 128, bf16)
    bytes_read = layer_token_bytes * (10 * 8 * 32768 + 52 * 8 * 1024)
    assert decode_s(gemma, [32767] * 8) == pytest.approx(bytes_read / (gpu.hbm_bandwidth * gemma.bandwidth_efficiency))
    assert decode_s(gemma_full, [32767] * 8) / decode_s(gemma, [32767] * 8) == pytest.approx(5.33, abs=0.01)


@settings(max_examples=200, deadline=None)
@given(contexts=st.lists(st.integers(0, 20_000), min_size=1, max_size=64))
def test_a_windowed_decode_step_is_priced_between_the_keys_it_reads_and_full_attention(contexts) -> None:
    """Mistral 7B v0.1 (every layer windowed at 4,096): a decode of m cached tokens reads min(m + 1, W) keys, what a
    full-attention decode of min(m, W - 1) reads. The step's price lies between the two steps of full attention,
    on those contexts and on the real ones, and is the first where every request is on one side of W."""
    gpu = get_gpu("h200")
    windowed = RooflineCostModel(MISTRAL_7B_V01, gpu).batch_time(BatchShape.of([], contexts)).decode_attention_s
    full = RooflineCostModel(dataclasses.replace(MISTRAL_7B_V01, window_layers=0, window_tokens=0), gpu)
    seen = [min(m, 4095) for m in contexts]
    keys_read = full.batch_time(BatchShape.of([], seen)).decode_attention_s
    assert keys_read * (1 - 1e-12) <= windowed <= full.batch_time(BatchShape.of([], contexts)).decode_attention_s
    if all(m >= 4095 for m in contexts) or all(m < 4095 for m in contexts):
        assert windowed == pytest.approx(keys_read, rel=1e-12)


def test_roofline_tensor_parallel_and_swap() -> None:
    spec, gpu = get_model("llama-3-70b"), get_gpu("a100")
    tp4 = RooflineCostModel(spec, gpu, num_gpus=4)
    tp8 = RooflineCostModel(spec, gpu, num_gpus=8)
    shape = prefill_shape([(2048, 0)], num_decode=64, decode_kv=64 * 2000)
    assert tp8.batch_time(shape).total_s < tp4.batch_time(shape).total_s
    no_comm = RooflineCostModel(spec, gpu, num_gpus=4, allreduce_latency_s=0.0)
    assert no_comm.batch_time(shape).total_s < tp4.batch_time(shape).total_s
    assert tp4.batch_time(BatchShape(swap_bytes=int(4 * 25.6e9))).swap_s == pytest.approx(1.0)  # 4 links
    assert tp4.batch_time(BatchShape()).total_s == 0.0
    with pytest.raises(ConfigError, match="tensor parallel degree 3"):
        RooflineCostModel(spec, gpu, num_gpus=3)
    with pytest.raises(ConfigError, match="compute_efficiency"):
        RooflineCostModel(spec, gpu, compute_efficiency=1.5)


# ---------------------------------------------------------------- fitting


def random_shapes(rng: np.random.Generator, n: int) -> list[BatchShape]:
    """A mix of decode-only, prefill-only and hybrid steps."""
    shapes = []
    for i in range(n):
        kind = i % 3
        num_decode = 0 if kind == 1 else int(rng.integers(1, 256))
        decode_kv = num_decode * int(rng.integers(1, 3000)) if num_decode else 0
        # The longest context: at least the mean, at most all of it.
        longest = (
            int(rng.integers(-(-decode_kv // num_decode), min(decode_kv, 4 * decode_kv // num_decode) + 1))
            if num_decode
            else 0
        )
        chunks = []
        if kind != 0:
            chunks = [
                (int(rng.integers(1, 2048)), int(rng.integers(0, 4096)) * int(rng.integers(0, 2)))
                for _ in range(int(rng.integers(1, 5)))
            ]
        shapes.append(prefill_shape(chunks, num_decode, decode_kv, longest))
    return shapes


@pytest.mark.parametrize("form", ["knee", "floor"])
def test_fit_recovers_coefficients_from_noiseless_data(form) -> None:
    rng = np.random.default_rng(7)
    shapes = random_shapes(rng, 120)
    truth = LinearCostModel(L7)
    times = [truth.batch_time(s).total_s for s in shapes]
    fitted, report = fit_linear_shapes(shapes, times, num_layers=32, name="refit", form=form)
    for key in COEFFICIENT_NAMES:
        assert getattr(fitted, key) == pytest.approx(getattr(L7, key), rel=1e-6), key
    assert fitted.knee_tokens == 0  # a straight line fits: the knee form adds no knee
    assert fitted.num_layers == 32 and fitted.name == "refit"
    # Nothing charged for the longest context (the floor form's solver leaves ~1e-15), and no floor.
    assert fitted.w_d == pytest.approx(0, abs=1e-12)
    assert fitted.floor_p == fitted.floor_d == 0.0
    assert report.n_rows == 120 and report.rank == 10 and report.unidentified == ()
    assert report.mean_rel_error < 1e-9 and report.max_rel_error < 1e-9


def test_fit_finds_the_knee_of_noiseless_data() -> None:
    shapes = random_shapes(np.random.default_rng(5), 200)
    shapes += [BatchShape(b, 300 * b) for b in (1, 8, 32, 64, 100, 128, 200, 256)]  # decodes across the knee
    times = [LinearCostModel(L7_KNEE).batch_time(s).total_s for s in shapes]
    fitted, report = fit_linear_shapes(shapes, times, num_layers=32, form="knee")
    assert fitted.knee_tokens == pytest.approx(150, rel=0.02)
    assert report.max_rel_error < 0.01
    straight, straight_report = fit_linear_shapes(shapes, times, num_layers=32, form="infermax")
    assert straight.knee_tokens == 0 and straight_report.max_rel_error > 0.05
    with pytest.raises(ConfigError, match="form must be one of knee, floor, infermax, got 'curvy'"):
        fit_linear_shapes(shapes, times, num_layers=32, form="curvy")


def test_fit_finds_the_longest_context_charge() -> None:
    """Where decode batches are lopsided (one long context among short ones), the knee form finds w_d;
    InferMax's nine coefficients alone cannot tell such a batch from an even one."""
    rng = np.random.default_rng(11)
    shapes = random_shapes(rng, 150)
    times = [LinearCostModel(L7_WALK).batch_time(s).total_s for s in shapes]
    fitted, report = fit_linear_shapes(shapes, times, num_layers=32, form="knee")
    assert fitted.w_d == pytest.approx(1.5e-5, rel=1e-4) and report.max_rel_error < 1e-6
    straight, straight_report = fit_linear_shapes(shapes, times, num_layers=32, form="infermax")
    assert straight.w_d == 0 and straight_report.max_rel_error > 1e-3


def test_linear_model_charges_the_longest_decode_context() -> None:
    """decode attention = a_d * sum m + w_d * max m + b_d + s_d * B, per layer."""
    walk, straight = LinearCostModel(L7_WALK), LinearCostModel(L7)
    lopsided = BatchShape.of([], [10, 10, 10, 4000])
    assert lopsided.decode_max_kv_tokens == 4000 and lopsided.decode_kv_tokens == 4030
    extra = walk.batch_time(lopsided).decode_attention_s - straight.batch_time(lopsided).decode_attention_s
    assert extra == pytest.approx(1.5e-5 * 4000 * 32 / 1000)
    assert walk.step_increment(lopsided) - straight.step_increment(lopsided) == pytest.approx(1.5e-5 * 32 / 1000)


def test_fit_finds_the_floors_of_noiseless_data() -> None:
    """The floor form recovers both floors and the line above them; the knee form cannot bend that way."""
    shapes = random_shapes(np.random.default_rng(3), 200)
    shapes += [BatchShape(b, 50 * b) for b in (1, 2, 4, 8)]  # decodes on the decode floor
    shapes += [prefill_shape([(c, 0)]) for c in (16, 64, 256, 512)]  # prompts on the prefill floor
    times = [LinearCostModel(L7_FLOOR).batch_time(s).total_s for s in shapes]
    fitted, report = fit_linear_shapes(shapes, times, num_layers=32, form="floor")
    assert fitted.floor_p == pytest.approx(1.5, rel=1e-3) and fitted.floor_d == pytest.approx(0.3, rel=1e-3)
    assert report.max_rel_error < 1e-3  # (a knee among the floored steps changes nothing: it may be > 0)
    _, knee_report = fit_linear_shapes(shapes, times, num_layers=32, form="knee")
    assert knee_report.max_rel_error > 0.1
    # Straight data: a floor no step sits on is 0, not some value below every step.
    straight = [LinearCostModel(L7).batch_time(s).total_s for s in shapes]
    refit, refit_report = fit_linear_shapes(shapes, straight, num_layers=32, form="floor")
    assert refit.floor_p == refit.floor_d == 0.0 and refit_report.max_rel_error < 1e-6


def test_one_knee_fit_serves_vllm_and_sarathi() -> None:
    """Issue 29: a fit over whole prompts, chunks and decodes, simulated under vLLM and under
    Sarathi-Serve, stays within 5% of the model it was fitted to (a roofline, a GPU's shape:
    memory-bound below a batch size, compute-bound above); InferMax's straight line does not."""
    from sloserve.metrics.summary import request_table
    from sloserve.sched import make_scheduler
    from sloserve.sim import simulate
    from sloserve.workload import workload_from_trace

    model, gpu = get_model("llama-2-7b"), get_gpu("a100")
    capacity = kv_capacity_tokens(model, gpu)
    reference = RooflineCostModel(model, gpu)
    shapes = [BatchShape.of(*batch) for batch in ProfileGrid().shapes(4096, capacity)]  # `profile`'s grid
    times = [reference.batch_time(s).total_s for s in shapes]

    def mean_latencies(cost, scheduler: str) -> np.ndarray:  # mean TTFT, TPOT, JCT
        workload = workload_from_trace("sharegpt", num_requests=400, seed=0, context_len=4096, rate=6.0)
        simulate(
            workload.requests, lambda: make_scheduler(scheduler, kv_capacity_tokens=capacity, max_model_len=4096), cost
        )
        table = request_table(workload.requests)
        return np.array([np.nanmean(table[k]) for k in ("ttft_s", "tpot_s", "jct_s")])

    worst = {}
    for form in ("knee", "infermax"):
        fit = LinearCostModel(fit_linear_shapes(shapes, times, num_layers=32, form=form).coefficients)
        worst[form] = max(
            np.abs(mean_latencies(fit, s) / mean_latencies(reference, s) - 1).max() for s in ("vllm", "sarathi")
        )
    assert worst["knee"] < 0.05 < worst["infermax"], worst


def test_fit_with_noise_reports_error_and_stays_non_negative() -> None:
    rng = np.random.default_rng(11)
    shapes = random_shapes(rng, 300)
    truth = LinearCostModel(L70)
    times = [truth.batch_time(s).total_s * (1 + 0.05 * rng.standard_normal()) for s in shapes]
    fitted, report = fit_linear_shapes(shapes, times, num_layers=80)
    assert 0.01 < report.mean_rel_error < 0.1
    assert report.max_rel_error > report.mean_rel_error
    assert all(getattr(fitted, key) >= 0 for key in COEFFICIENT_NAMES)
    assert fitted.a_o == pytest.approx(L70.a_o, rel=0.1)  # the dominant term is still found


@pytest.mark.parametrize("form", ["knee", "floor"])
def test_fit_decode_only_data_leaves_prefill_terms_unidentified(form) -> None:
    """... and w_d where the shapes do not give the longest context (profiles written before it), and
    the floor of steps with a prefill."""
    shapes = [BatchShape(b, b * 500 + k) for b in (1, 4, 16, 64, 128) for k in (0, 999, 5000)]
    times = [LinearCostModel(L7).batch_time(s).total_s for s in shapes]
    fitted, report = fit_linear_shapes(shapes, times, num_layers=32, form=form)
    expected = {"a_p", "b_p", "s_p", "m_p", "w_d"} | ({"floor_p"} if form == "floor" else set())
    assert set(report.unidentified) == expected
    assert fitted.a_p == fitted.b_p == fitted.s_p == fitted.m_p == 0.0
    assert report.rank == 3  # with decodes only, b_d = b_o and s_d = a_o coincide
    assert report.max_rel_error < 1e-9


def write_csv(path: Path, shapes: list[BatchShape], times: list[float]) -> Path:
    lines = [",".join(CSV_COLUMNS)]
    for s, t in zip(shapes, times):
        lines.append(",".join(str(getattr(s, c)) for c in CSV_COLUMNS[:-1]) + f",{t!r}")
    path.write_text("\n".join(lines) + "\n")
    return path


def test_fit_csv_save_load_and_build(tmp_path: Path) -> None:
    shapes = random_shapes(np.random.default_rng(3), 60)
    times = [LinearCostModel(L7).batch_time(s).total_s for s in shapes]
    csv_path = write_csv(tmp_path / "my-a100.csv", shapes, times)
    fitted, report = fit_linear(csv_path, num_layers=32)
    assert fitted.name == "my-a100" and report.n_rows == 60
    assert fitted.a_d == pytest.approx(L7.a_d, rel=1e-6)
    preset_path = tmp_path / "my-a100.json"
    save_preset(fitted, preset_path, extra={"fit": report._asdict()})
    assert load_preset(preset_path) == fitted
    model = build_cost_model(get_model("llama-2-7b"), get_gpu("a100"), cost_model=str(preset_path))
    assert isinstance(model, LinearCostModel) and model.coefficients == fitted


def test_bad_csv_errors_name_the_problem(tmp_path: Path) -> None:
    good_row = "4,4000,1,100,10000,0,0.01"
    header = ",".join(CSV_COLUMNS)

    def fit(text: str) -> None:
        path = tmp_path / "p.csv"
        path.write_text(text)
        fit_linear(path, num_layers=32)

    with pytest.raises(ConfigError, match=r"missing column\(s\) time_s; present: num_decode"):
        fit(",".join(CSV_COLUMNS[:-1]) + "\n1,2,3,4,5,6\n")
    with pytest.raises(ConfigError, match=r"p\.csv, line 3, column prefill_tokens: 'abc' is not a number"):
        fit("\n".join([header, good_row, "4,4000,1,abc,10000,0,0.01"]) + "\n")
    with pytest.raises(ConfigError, match=r"line 2, column decode_kv_tokens: '-5' must be a non-negative"):
        fit("\n".join([header, "4,-5,1,100,10000,0,0.01"]) + "\n")
    with pytest.raises(ConfigError, match=r"line 2, column time_s"):
        fit("\n".join([header, "4,4000,1,100,10000,0,0"]) + "\n")
    with pytest.raises(ConfigError, match=r"3 data rows, need at least 9"):
        fit("\n".join([header, good_row, good_row, good_row]) + "\n")
    with pytest.raises(ConfigError, match=r"line 2: 6 fields, the header has 7"):
        fit("\n".join([header, "4,4000,1,100,10000,0"]) + "\n")
    with pytest.raises(ConfigError, match=r"column prefill_tokens: '100' with num_prefill 0"):
        fit("\n".join([header, "4,4000,0,100,0,0,0.01"]) + "\n")
    with pytest.raises(ConfigError, match="empty file"):
        fit("")
    with pytest.raises(ConfigError, match="cannot open"):
        fit_linear(tmp_path / "missing.csv", num_layers=32)
    with pytest.raises(ConfigError, match=r"line 2, column decode_max_kv_tokens: '4001' is more than decode_kv_tokens"):
        fit("\n".join([header + ",decode_max_kv_tokens", good_row + ",4001"]) + "\n")
    # at the extremes: 1e300 s crashed LAPACK (a double free), 1e-300 s fitted steps that take no time and
    # the simulator divided by zero, a count of 1e300 reached numpy as a Python int
    for time_s in ("1e300", "1e-300", "3601"):
        with pytest.raises(ConfigError, match=rf"column time_s: '{time_s}' is not a measured step time \(seconds"):
            fit("\n".join([header, good_row, f"4,4000,1,100,10000,0,{time_s}"]) + "\n")
    with pytest.raises(ConfigError, match=r"line 2, column num_decode: '1e300' is over 1e\+15"):
        fit("\n".join([header, "1e300,4000,1,100,10000,0,0.01"]) + "\n")


def test_profile_csv_keeps_the_longest_decode_context(tmp_path: Path) -> None:
    """`sloserve profile` writes each batch's longest decode context; files without the column still read."""
    from sloserve.cost.fit import read_profile_csv, write_profile_csv

    shapes = random_shapes(np.random.default_rng(2), 30)
    times = [LinearCostModel(L7_WALK).batch_time(s).total_s for s in shapes]
    write_profile_csv(shapes, times, tmp_path / "p.csv")
    assert read_profile_csv(tmp_path / "p.csv") == (shapes, times)
    old = tmp_path / "old.csv"  # as written before the column existed
    old.write_text("\n".join(line.rpartition(",")[0] for line in (tmp_path / "p.csv").read_text().splitlines()) + "\n")
    assert read_profile_csv(old)[0] == [s._replace(decode_max_kv_tokens=0) for s in shapes]


def test_a_cost_model_to_run_with_has_steps_that_take_time(tmp_path: Path) -> None:
    """All zeros (or a fit on decodes alone, for prefills) once made the simulator divide by zero; the
    file still loads, for a look at it, but not as a --cost-model."""
    from sloserve.cost import linear_coefficients

    L7.check_steps_take_time()
    path = tmp_path / "zeros.json"
    save_preset(LinearCoefficients(**{**L7.as_dict(), **dict.fromkeys(COEFFICIENT_NAMES, 0.0), "name": "zeros"}), path)
    assert load_preset(path).a_o == 0.0
    with pytest.raises(ConfigError, match=r"'zeros': a decode step of one request takes 0 s, not from 1e-09 to 3600 s"):
        linear_coefficients(str(path))
    no_prefill = {**L7.as_dict(), "a_p": 0.0, "b_p": 0.0, "s_p": 0.0, "m_p": 0.0, "a_o": 0.0, "b_o": 0.0, "b_d": 1.0}
    with pytest.raises(ConfigError, match="a prefill step of one token takes 0 s"):
        LinearCoefficients(**no_prefill).check_steps_take_time()
    with pytest.raises(ConfigError, match="a prefill step of one token takes 3.2e[+]298 s, not from"):
        LinearCoefficients(**{**L7.as_dict(), "a_p": 1e300}).check_steps_take_time()


def test_bad_preset_files(tmp_path: Path) -> None:
    path = tmp_path / "bad.json"
    path.write_text("{not json")
    with pytest.raises(ConfigError, match="not valid JSON"):
        load_preset(path)
    save_preset(L7, path)
    doc = json.loads(path.read_text())
    del doc["coefficients"]["m_p"]
    path.write_text(json.dumps(doc))
    with pytest.raises(ConfigError, match="coefficients missing m_p; present: a_p"):
        load_preset(path)
    doc["coefficients"]["m_p"] = "x"
    path.write_text(json.dumps(doc))
    with pytest.raises(ConfigError, match="coefficients.m_p must be a non-negative number"):
        load_preset(path)
    with pytest.raises(ConfigError, match="not found"):
        load_preset(tmp_path / "nope.json")
    save_preset(L7, path)
    doc = json.loads(path.read_text())
    doc["knee_tokens"] = "wide"
    path.write_text(json.dumps(doc))
    with pytest.raises(ConfigError, match="field 'knee_tokens' must be a non-negative number, got 'wide'"):
        load_preset(path)
    doc["knee_tokens"], doc["floor_d"] = 0, -2
    path.write_text(json.dumps(doc))
    with pytest.raises(ConfigError, match="field 'floor_d' must be a non-negative number, got -2"):
        load_preset(path)


def test_presets_keep_their_knee_and_files_without_one_have_none(tmp_path: Path) -> None:
    path = tmp_path / "knee.json"
    save_preset(L7_KNEE, path)
    assert load_preset(path) == L7_KNEE
    doc = json.loads(path.read_text())
    del doc["knee_tokens"]  # as written before the knee existed
    path.write_text(json.dumps(doc))
    assert load_preset(path).knee_tokens == 0.0
    save_preset(L7_FLOOR, path)
    assert load_preset(path) == L7_FLOOR
    doc = json.loads(path.read_text())
    del doc["floor_p"], doc["floor_d"]  # as written before the floors existed
    path.write_text(json.dumps(doc))
    assert load_preset(path) == dataclasses.replace(L7, name="llama-2-7b-floor")
    save_preset(L7_HOST, path)
    assert load_preset(path) == L7_HOST
    doc = json.loads(path.read_text())
    del doc["h_s"], doc["h_r"]  # as written before the host's share was priced
    path.write_text(json.dumps(doc))
    assert load_preset(path) == dataclasses.replace(L7_FLOOR, name="llama-2-7b-host")
    save_preset(L7_ASYNC, path)
    assert load_preset(path) == L7_ASYNC
    doc = json.loads(path.read_text())
    doc["host_overlapped"] = "yes"
    path.write_text(json.dumps(doc))
    with pytest.raises(ConfigError, match="field 'host_overlapped' must be true or false, got 'yes'"):
        load_preset(path)
    del doc["host_overlapped"]  # as written before async scheduling
    path.write_text(json.dumps(doc))
    assert load_preset(path) == dataclasses.replace(L7_ASYNC, host_overlapped=False)


# ---------------------------------------------------------------- build_cost_model, presets


def test_build_cost_model_choices(tmp_path: Path) -> None:
    a100 = get_gpu("a100")
    l7, l70 = get_model("llama-2-7b"), get_model("llama-3-70b")
    assert build_cost_model(l7, a100).coefficients == L7  # type: ignore[attr-defined]
    assert build_cost_model(l70, a100, num_gpus=4).coefficients == L70  # type: ignore[attr-defined]
    assert isinstance(build_cost_model(l7, a100, num_gpus=2), RooflineCostModel)
    assert isinstance(build_cost_model(l7, get_gpu("h100")), RooflineCostModel)
    assert isinstance(build_cost_model(l7, a100, cost_model="roofline"), RooflineCostModel)
    explicit = build_cost_model(get_model("llama-3-8b"), get_gpu("h100"), cost_model="llama-2-7b-a100")
    assert explicit.coefficients == L7  # type: ignore[attr-defined]
    with pytest.raises(UnknownNameError, match="llama-2-7b-a100, llama-3-70b-4xa100, roofline; or a path"):
        build_cost_model(l7, a100, cost_model="vidur")
    with pytest.raises(ConfigError, match="fitted for 32 layers but model llama-3-70b has 80"):
        build_cost_model(l70, a100, num_gpus=4, cost_model="llama-2-7b-a100")
    with pytest.raises(ConfigError, match="not found"):
        build_cost_model(l7, a100, cost_model=str(tmp_path / "profile.json"))
    assert list_presets() == ["llama-2-7b-a100", "llama-3-70b-4xa100"]


# ---------------------------------------------------------------- specs, KV capacity


def architecture_params(m: ModelSpec) -> int:
    """Parameter count from the config (Llama/Qwen layout; OPT with biases and learned positions)."""
    h, kv_width = m.hidden_size, m.num_kv_heads * m.head_dim
    if m.mlp_kind == "relu":  # OPT: biases everywhere, 2 LayerNorms per layer, 2 extra positions
        per_layer = 4 * (h * h + h) + 2 * h * m.intermediate_size + m.intermediate_size + h + 4 * h
        return m.num_layers * per_layer + 2 * h + m.vocab_size * h + (m.max_context_len + 2) * h
    per_layer = 2 * h * h + 2 * h * kv_width + 3 * h * m.intermediate_size + 2 * h
    if m.name.startswith("qwen"):
        per_layer += h + 2 * kv_width  # QKV biases
    return m.num_layers * per_layer + h + m.embedding_params


@pytest.mark.parametrize("name", sorted(MODELS))
def test_bundled_models_are_consistent(name: str) -> None:
    m = MODELS[name]
    assert m.num_params == architecture_params(m)
    assert m.hidden_size == m.num_attention_heads * m.head_dim


def test_specs_registry_and_validation() -> None:
    assert get_model("llama-2-7b").kv_bytes_per_token == 2 * 32 * 32 * 128 * 2 == 524_288
    assert get_model("llama-3-70b").kv_bytes_per_token == 2 * 80 * 8 * 128 * 2
    assert get_gpu("a100") is GPUS["a100-80gb"] and get_gpu("H100").hbm_bandwidth == 3.35e12
    with pytest.raises(UnknownNameError, match="unknown model 'gpt-5'; valid: llama-2-13b"):
        get_model("gpt-5")
    with pytest.raises(UnknownNameError, match="a100-40gb"):
        get_gpu("v100")
    base = get_model("llama-2-7b")
    with pytest.raises(ConfigError, match="num_layers must be a positive integer, got 0"):
        ModelSpec(**{**base.__dict__, "num_layers": 0})
    with pytest.raises(ConfigError, match="mlp_kind"):
        ModelSpec(**{**base.__dict__, "mlp_kind": "moe"})


def test_kv_capacity() -> None:
    a100 = get_gpu("a100")
    l7 = get_model("llama-2-7b")
    tokens = kv_capacity_tokens(l7, a100)
    assert 100_000 <= tokens <= 115_000  # InferMax uses M = 100K
    exact = kv_capacity_tokens(l7, a100, activation_reserve_bytes=0)
    assert exact == int((80e9 * 0.9 - l7.weight_bytes) // 524_288)
    assert kv_capacity_tokens(get_model("llama-3-70b"), a100, num_gpus=4) > 400_000
    with pytest.raises(
        ConfigError,
        match=r"^model llama-2-70b \(138 GB of weights\) does not fit on 1x a100-80gb at memory "
        r"utilization 0.9 \(72 GB\); use more GPUs or a bigger GPU$",
    ):
        kv_capacity_tokens(get_model("llama-2-70b"), a100)
    with pytest.raises(ConfigError, match="leaves no room for KV"):
        kv_capacity_tokens(l7, get_gpu("a30"), memory_utilization=0.6)
    with pytest.raises(ConfigError, match="memory_utilization"):
        kv_capacity_tokens(l7, a100, memory_utilization=1.2)


def test_each_gpu_prices_a_small_decode_by_its_memory_bandwidth_and_holds_what_its_memory_holds() -> None:
    """Llama-3-8B decoding one request reads its weights: the roofline's step on each GPU, NVIDIA's and AMD's,
    HBM's and GDDR6's, is their bytes at that GPU's bandwidth (an L4's 300 GB/s: 27x a B200's time). Llama-3-70B
    fits no single L4, L40S or H200; a B200's 180 GB hold it and some KV, an MI300X's 192 more."""
    spec = get_model("llama-3-8b")
    times = {}
    for name in ("b200", "mi300x", "h200", "h100", "a100", "h100-pcie", "l40s", "l4"):
        gpu = get_gpu(name)
        model = RooflineCostModel(spec, gpu)
        step = model.batch_time(BatchShape(1, 0)).total_s - model.step_overhead_s
        reads = spec.layer_params_read(1) + spec.vocab_size * spec.hidden_size  # (the input embedding: gathered)
        assert step == pytest.approx(reads * 2 / (gpu.hbm_bandwidth * model.bandwidth_efficiency), rel=1e-3)
        times[name] = step
    assert list(times.values()) == sorted(times.values())
    assert times["l4"] / times["b200"] == pytest.approx(8000 / 300)
    big = get_model("llama-3-70b")  # (141 GB of weights)
    for name in ("l4", "l40s", "h200"):
        with pytest.raises(ConfigError, match=f"does not fit on 1x {name} at memory utilization 0.9"):
            kv_capacity_tokens(big, get_gpu(name))
    assert 0 < kv_capacity_tokens(big, get_gpu("b200")) < kv_capacity_tokens(big, get_gpu("mi300x"))
    assert get_gpu("hgx-b200") is get_gpu("b200")


def test_a_device_is_known_by_the_name_it_reports_and_a_variant_with_other_peaks_is_not() -> None:
    """The names CUDA gives the bundled GPUs (spaces and case as nvidia-smi may print them) find their specs, so a
    benchmark on the machine of the run takes its peaks; an H100 NVL or an A100 80GB PCIe, whose peaks differ
    from their siblings', and a CPU find none."""
    assert gpu_of_device("NVIDIA H100 80GB HBM3") is get_gpu("h100")
    assert gpu_of_device("NVIDIA H200") is get_gpu("h200")
    assert gpu_of_device("  nvidia  H100 PCIe ") is get_gpu("h100-pcie")
    assert gpu_of_device("NVIDIA A100-SXM4-40GB") is get_gpu("a100-40gb")
    assert gpu_of_device("AMD Instinct MI300X") is get_gpu("mi300x")
    for name in ("NVIDIA H100 NVL", "NVIDIA H200 NVL", "NVIDIA A100 80GB PCIe", "cpu", ""):
        assert gpu_of_device(name) is None
    assert gpu_of_device("NVIDIA H100 80GB HBM3").hbm_bandwidth < gpu_of_device("NVIDIA H200").hbm_bandwidth


def test_profile_grid_has_lopsided_decode_batches() -> None:
    """One long context among short ones, as live batches have (their longest context is 2-8x their
    mean), so that a fit can tell w_d from a_d: the spread batches reach only twice the mean."""
    decodes = [lens for prefills, lens in ProfileGrid().shapes(1024, 200_000) if lens and not prefills]
    for b in (2, 4, 16, 256):
        assert [128] * (b - 1) + [1023] in decodes  # the shortest grid context, and the longest the context allows
    spread = [lens for lens in decodes if lens[-1] != 1023]
    assert spread and all(max(lens) <= 2 * sum(lens) / len(lens) + 1 for lens in spread)


def test_the_cli_offers_the_fit_forms_and_default_of_cost_fit():
    """The CLI spells out cost.fit's forms (importing it would load scipy for every command)."""
    from sloserve import cli
    from sloserve.cost.fit import DEFAULT_FORM, FORMS

    assert cli.DEFAULT_FIT_FORM == DEFAULT_FORM and sorted(cli.FIT_FORMS) == sorted(FORMS)
