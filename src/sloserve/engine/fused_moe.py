"""A mixture of experts' tokens through two grouped matmul kernels on the device (vLLM's fused MoE).

Why: the reference (``models.moe.by_expert``) groups the (token, choice) pairs by expert on the host: it
waits for the device to count them, then runs each expert that has tokens as its own matmuls, so a layer
costs a device sync and three or four kernels an expert (a decode step of Qwen3-30B-A3B: 48 syncs, and
its 8 x batch choices spread over up to 128 experts a layer), and a CUDA graph cannot replay it.

How (``fused_experts``): ``align_by_expert`` sorts the pairs by expert with tensor ops of fixed shapes
(no sync), each expert's run padded to a multiple of ``BLOCK_M`` pairs with a pair id past the last (which
no program reads or writes), and names each block's expert. ``_expert_matmul_kernel`` then runs one
program per (block of ``BLOCK_M`` pairs, ``BLOCK_N`` outputs): it gathers the block's rows of its input,
multiplies them by its expert's weight and writes each pair's row of the output. The first call takes
the tokens' rows of x through the experts' gate and up projections (T k rows of 2 I), the activation
runs on those rows, and the second call takes them through the down projections, scaling each by its
routing weight; each token's k rows are then summed. Blocks past the padded pairs return at once (the
grid covers the most the padding can take, so it is fixed for a CUDA graph).

NOTE: accumulates in float32 and rounds each projection's output to the model's dtype, as the reference's
matmuls do; the routing weight multiplies the float32 sum (the reference's multiplies the rounded
output) and the k rows are summed at once, not one by one into the output: the same function, rounded
otherwise, so equal to the reference to the dtype's rounding (to about 1e-7 in float32: the tests'
greedy tokens are transformers').

Used on CUDA with the Triton attention backend unless ``SLOSERVE_FUSED_MOE=0`` (``load_model``; an H200 ran
its tests and timed it on 2026-12-04), which also lets a mixture of experts run in CUDA graphs. The tests
run the kernel on the CPU in Triton's interpreter (``SLOSERVE_FUSED_MOE=1`` there).
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import triton
import triton.language as tl

# Tiles: pairs a block (fewer when the pairs an expert average few, as in a decode step: less padding),
# outputs and inputs a step. NOTE: vLLM's default configs' sizes, not tuned here.
SMALL_BLOCK_M, LARGE_BLOCK_M = 16, 64
BLOCK_N, BLOCK_K = 64, 32


@triton.jit
def _expert_matmul_kernel(
    a_ptr,  # (rows, K) the inputs: the tokens' (A_BY_TOKEN: pair p reads row p // TOP_K) or the pairs' own
    weight_ptr,  # (E, N, K) by its strides: each expert's weight, outputs x inputs
    bias_ptr,  # (E, N) each expert's bias (HAS_BIAS)
    out_ptr,  # (T k, N) each pair's output row
    pairs_ptr,  # (capacity,) the pairs sorted by expert, each expert's run padded with num_pairs
    block_experts_ptr,  # (capacity / BLOCK_M,) the expert of each block of BLOCK_M pairs
    num_padded_ptr,  # (1,) the pairs of every expert's run, padding included
    routing_weights_ptr,  # (T k,) float32 each pair's weight (WEIGHTED)
    num_pairs,  # T k
    N,
    K,
    stride_a_row,
    stride_weight_expert,
    stride_weight_n,
    stride_weight_k,
    stride_bias_expert,
    stride_out_row,
    TOP_K: tl.constexpr,
    A_BY_TOKEN: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    WEIGHTED: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    INPUT_PRECISION: tl.constexpr,
):
    block = tl.program_id(0)
    if block * BLOCK_M >= tl.load(num_padded_ptr):  # (past every expert's run)
        return
    pairs = tl.load(pairs_ptr + block * BLOCK_M + tl.arange(0, BLOCK_M))  # (BLOCK_M,)
    pair_ok = pairs < num_pairs  # (padding: num_pairs)
    rows = pairs // TOP_K if A_BY_TOKEN else pairs
    expert = tl.load(block_experts_ptr + block)
    n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    n_ok = n < N
    weight_rows = weight_ptr + expert * stride_weight_expert + n[None, :] * stride_weight_n  # (1, BLOCK_N)
    acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    for start in range(0, K, BLOCK_K):
        k = start + tl.arange(0, BLOCK_K)
        k_ok = k < K
        a = tl.load(a_ptr + rows[:, None] * stride_a_row + k[None, :], mask=pair_ok[:, None] & k_ok[None, :], other=0.0)
        w = tl.load(weight_rows + k[:, None] * stride_weight_k, mask=k_ok[:, None] & n_ok[None, :], other=0.0)
        acc = tl.dot(a, w, acc, input_precision=INPUT_PRECISION)  # (BLOCK_M, BLOCK_N) += (M, K) x (K, N)
    if HAS_BIAS:
        acc += tl.load(bias_ptr + expert * stride_bias_expert + n, mask=n_ok, other=0.0).to(tl.float32)[None, :]
    if WEIGHTED:
        acc *= tl.load(routing_weights_ptr + pairs, mask=pair_ok, other=0.0)[:, None]
    out = out_ptr + pairs[:, None] * stride_out_row + n[None, :]
    tl.store(out, acc.to(out_ptr.dtype.element_ty), mask=pair_ok[:, None] & n_ok[None, :])


def block_m_for(num_pairs: int, num_experts: int) -> int:
    """Pairs a block: ``SMALL_BLOCK_M`` while the pairs average at most that many an expert, else
    ``LARGE_BLOCK_M``."""
    return SMALL_BLOCK_M if num_pairs <= SMALL_BLOCK_M * num_experts else LARGE_BLOCK_M


def align_by_expert(
    experts: torch.Tensor,  # (T, k) each token's experts
    num_experts: int,
    block_m: int,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(pairs (capacity,), block_experts (capacity / block_m,), num_padded (1,)): the (token, choice) pairs
    ``t k + j`` sorted by expert, each expert's run padded to a multiple of ``block_m`` with ``T k`` (no
    pair); the expert of each block of ``block_m`` (blocks past ``num_padded``: any); how many of ``pairs``
    the runs take. Tensor ops of shapes fixed by T, k and E only: no wait for the device, and a CUDA graph
    replays it."""
    flat = experts.flatten()  # (P,) P = T k
    num_pairs, device = flat.numel(), flat.device
    # NOTE: not torch.bincount, whose output's size (the largest id) the host would wait for on CUDA
    counts = torch.zeros(num_experts, dtype=torch.int64, device=device).index_add_(0, flat, torch.ones_like(flat))
    padded = (counts + block_m - 1) // block_m * block_m  # (E,)
    run_ends = padded.cumsum(0)  # (E,) where each expert's padded run ends
    order = flat.argsort(stable=True)  # (P,) the pairs grouped by expert
    by_expert = flat[order]
    first = counts.cumsum(0) - counts  # (E,) each expert's first place in `order`
    rank = torch.arange(num_pairs, device=device) - first[by_expert]  # (P,) each pair's place in its run
    # Every run pads fewer than block_m pairs, and no pair needs more than a block of its own
    capacity = -(-min(num_pairs + num_experts * (block_m - 1), num_pairs * block_m) // block_m) * block_m
    pairs = torch.full((capacity,), num_pairs, dtype=torch.int64, device=device)
    pairs[run_ends[by_expert] - padded[by_expert] + rank] = order
    block_starts = torch.arange(0, capacity, block_m, device=device)  # (capacity / block_m,)
    block_experts = torch.searchsorted(run_ends, block_starts, right=True).clamp(max=num_experts - 1)
    return pairs, block_experts, run_ends[-1:]


def expert_matmul(
    inputs: torch.Tensor,  # (T, K) the tokens' rows (by_token) or (T k, K) the pairs' own, rows contiguous
    weight: torch.Tensor,  # (E, N, K), read by its strides (a transposed view too)
    bias: torch.Tensor | None,  # (E, N)
    routing: tuple[torch.Tensor, torch.Tensor, torch.Tensor],  # align_by_expert's
    top_k: int,
    block_m: int,
    by_token: bool,
    routing_weights: torch.Tensor | None = None,  # (T k,) float32: each output row scaled by its pair's
) -> torch.Tensor:  # (T k, N)
    """Each pair's row of ``inputs`` (its token's where ``by_token``) times its expert's ``weight``
    (as ``F.linear``), plus its bias, times its routing weight: one launch for every expert."""
    pairs, block_experts, num_padded = routing
    assert inputs.stride(-1) == 1
    num_pairs = inputs.shape[0] * top_k if by_token else inputs.shape[0]
    _, n, k = weight.shape  # (E, N, K)
    out = inputs.new_empty((num_pairs, n))
    grid = (block_experts.numel(), triton.cdiv(n, BLOCK_N))
    _expert_matmul_kernel[grid](
        inputs,
        weight,
        inputs if bias is None else bias,  # (unread without a bias)
        out,
        pairs,
        block_experts,
        num_padded,
        out if routing_weights is None else routing_weights,  # (unread unweighted)
        num_pairs,
        n,
        k,
        inputs.stride(0),
        weight.stride(0),
        weight.stride(1),
        weight.stride(2),
        0 if bias is None else bias.stride(0),
        out.stride(0),
        TOP_K=top_k,
        A_BY_TOKEN=by_token,
        HAS_BIAS=bias is not None,
        WEIGHTED=routing_weights is not None,
        BLOCK_M=block_m,
        BLOCK_N=BLOCK_N,
        BLOCK_K=BLOCK_K,
        INPUT_PRECISION="ieee" if inputs.dtype == torch.float32 else "tf32",
    )
    return out


def fused_experts(
    x: torch.Tensor,  # (T, H)
    experts: torch.Tensor,  # (T, k) each token's experts
    weights: torch.Tensor,  # (T, k) their routing weights
    gate_up: torch.Tensor,  # (E, 2 I, H) by its strides: each expert's gate and up projections
    down: torch.Tensor,  # (E, H, I) by its strides
    activation: Callable[[torch.Tensor], torch.Tensor],  # (P, 2 I) -> (P, I)
    gate_up_bias: torch.Tensor | None = None,  # (E, 2 I)
    down_bias: torch.Tensor | None = None,  # (E, H)
) -> torch.Tensor:  # (T, H)
    """Each token's weighted sum of its experts' outputs, down(activation(gate_up(x))), as
    ``models.moe.by_expert`` computes it, in two grouped matmuls (module docstring)."""
    num_tokens, top_k = experts.shape
    num_pairs, num_experts = num_tokens * top_k, gate_up.shape[0]
    block_m = block_m_for(num_pairs, num_experts)
    routing = align_by_expert(experts, num_experts, block_m)
    x = x if x.stride(-1) == 1 else x.contiguous()
    hidden = expert_matmul(x, gate_up, gate_up_bias, routing, top_k, block_m, by_token=True)  # (P, 2 I)
    activated = activation(hidden)  # (P, I)
    activated = activated if activated.stride(-1) == 1 else activated.contiguous()
    routing_weights = weights.flatten().float()  # (P,)
    out = expert_matmul(activated, down, down_bias, routing, top_k, block_m, False, routing_weights)  # (P, H)
    return out.view(num_tokens, top_k, -1).sum(dim=1)
