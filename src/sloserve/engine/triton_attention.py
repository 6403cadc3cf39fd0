"""Triton attention over the slot-addressed KV cache: the engine's backend on CUDA.

Two kernels read K/V through the token -> slot table, so every KV layout (paged, exact, pipelined,
bidirectional) works unchanged, as with the PyTorch reference (``attention.TorchAttention``):

- ``_decode_kernel``: one program per (decode sequence, KV head, split of its context). It loads the
  query rows of every head that shares that KV head (grouped-query attention: the K/V tile is read
  once for the group; in blocks of ``BLOCK_H`` heads where the group's accumulator would outgrow a
  128-wide head's, ``TILE_NUMBERS``: MLA's 128 heads on one 512-wide latent) and walks its share of
  the context in tiles of ``BLOCK_N`` slots with an online softmax (running max ``m``, running sum
  ``l``, rescaled accumulator), as FlashAttention does.
  With one split it writes the output; with several (flash decoding: a few long contexts would
  otherwise leave most of the GPU idle, one program per KV head walking thousands of tokens) each
  split writes its unnormalized sums, and ``_combine_splits_kernel`` merges them, rescaling each
  split's sums by ``exp2(m_split - m_max)`` (``decode_splits`` picks how many); or, with
  ``COMBINE_IN_KERNEL`` (SLOSERVE_COMBINE_SPLITS_IN_KERNEL=1), the last split of a (decode, block of heads)
  to finish merges them itself, found by an atomic count (``SplitCounters``): one launch fewer a layer.
- ``_prefill_kernel``: one program per (prefill sequence, tile of ``BLOCK_M`` query tokens, head).
  A chunk of ``c`` tokens after ``n - c`` cached ones sits at positions ``n - c .. n - 1`` and query
  ``i`` sees keys ``0 .. n - c + i`` (the bottom-right causal mask of chunked prefill); key tiles
  past the tile's last position are not read, and tiles before its first position (every key
  visible to every row) skip the mask, so only the tiles on the diagonal pay for it.

A sliding-window layer (``window``: Gemma 3's local layers) reads from the first tile that holds a key
inside the window: the decode kernel from ``context_len - window``, the prefill kernel from its
tile's first row's window, with every tile masked; a chunked layer (``chunk``: Llama 4's local layers, a
query at p sees p - p % chunk .. p) from its chunk's start, the same way. gpt-oss's sinks (``SINKS``: a logit
per head in each query's softmax, with no value) start the running sums as a key would (m = the sink, l = 1): in
the prefill kernel, and in the first split of a decode. ALiBi's slopes (``ALIBI``: BLOOM's, MPT's) add m_h (j - p)
to the score of key j at query position p, after the scale, as the reference does.

A keys-only cache (``value_dim``: DeepSeek's multi-head latent attention, whose values are its keys'
first 512 numbers, the latent c_KV, with the rotated key k_R's 64 after them) is read once a tile, as keys
and as values: the query and key rows in two parts (``_load_query``: the value's numbers and the tail, each
padded to a power of two, 512 + 64 rather than 1,024), the value's part of the key tile reused as V.

Both accumulate in float32 and take float32 dots in IEEE precision (Triton's default for float32
is tf32, about 3e-4 relative error, which would make the engine's float32 tests inexact).

A step with prefills beside decodes (Sarathi's mixed step) may launch its prefill attention on a second CUDA
stream (``SideStream``, SLOSERVE_OVERLAP_ATTENTION=1), first, so that the decode kernel's programs, bound by
reading their KV, take the multiprocessors the prefill's programs, bound by their dots, leave: POD-Attention's
overlap (Kamath et al., ASPLOS'25) from two launches instead of one fused kernel. The prefill kernel is launched
there with smaller tiles (``OVERLAP_PREFILL_LAUNCH``), so that a decode program fits on a multiprocessor beside
its programs: the same attention, its sums taken in another order (within rounding of the one-stream output).

NOTE: on the CPU these kernels run only under Triton's interpreter (``TRITON_INTERPRET=1`` in the
environment before triton is imported): that is how the tests check them against the reference on
machines without a GPU. The engine picks this backend for CUDA devices (``attention_backend="auto"``).
"""

from __future__ import annotations

import contextlib
import functools
import math
import os
from typing import Literal

import torch
import torch.nn.functional as F
import triton
import triton.language as tl
from torch.nn.attention import SDPBackend, sdpa_kernel

from sloserve.core.errors import ConfigError
from sloserve.engine.attention import AttentionBackend, write_kv
from sloserve.engine.switches import switch

# log2(e): the kernels use exp2, so scores are scaled by softmax_scale * LOG2E.
LOG2E = 1.4426950408889634
# tl.dot needs every dimension >= 16.
MIN_DOT_DIM = 16
# A program's float32 accumulator (query rows or heads x a value's numbers) holds at most this many numbers,
# and its K and V tiles at most twice as many: the default tiles' for 128-wide heads (64 x 128). Wider heads
# get fewer rows and keys a tile (a 512-wide MLA latent: 16 query rows or heads and 32 keys, as vLLM's MLA
# decode kernel takes), so that their tiles fit in registers and shared memory as a 128-wide head's do.
# NOTE: chosen by reasoning, not timed (no GPU run has timed a head wider than 128).
TILE_NUMBERS = 64 * 128
# Flash decoding (``decode_splits``): split the contexts until the decode programs fill every
# multiprocessor this many times over, with at least MIN_SPLIT_TOKENS context tokens a split (below
# that the partial sums' writes and the combine cost more than the parallelism gains), and at most
# MAX_SPLITS splits. NOTE: chosen by reasoning, not tuned: vLLM's paged attention v2 splits at 512
# tokens; the split count here follows the GPU's size instead, so one long context at batch 1 also
# spreads over the GPU. benchmarks/engine_speed.py times them against one split.
WAVES = 2
MIN_SPLIT_TOKENS = 256
MAX_SPLITS = 64
# A prefill launched beside the decodes (``overlap_prefill_decode``) reads 32 keys a tile, its loads in 2 stages, in
# at most 192 registers a thread. NOTE: launched as by default (64 x 64 tiles, 3 stages: 254 registers a thread on
# sm_90) two prefill programs hold every register of a Hopper multiprocessor and no decode program (105-121 registers
# a thread) starts beside them until they end; at 64 x 32 and 2 stages (186 with Triton 3.9, 192 with 3.6) one does
# (benchmarks/kernel_resources.py; benchmarks/RESULTS.md). The cap keeps that room whatever the compiler's choice:
# two programs of 4 warps at 192 leave 16,384 of the 65,536 registers, a decode program's of 4 warps at 128.
OVERLAP_PREFILL_LAUNCH = {"BLOCK_N": 32, "num_stages": 2, "maxnreg": 192}
# The rows of the decode kernel's merge of its own splits (``COMBINE_IN_KERNEL``), at least: the splits padded,
# masked (weight 0). NOTE: with 4 or 8 rows ptxas gave the whole decode kernel 150-152 registers a thread instead
# of 118-120, a program fewer a multiprocessor (benchmarks/kernel_resources.py, Triton 3.9, sm_90)
MIN_MERGE_ROWS = 16
# The engine's default: splits picked by ``decode_splits`` unless SLOSERVE_DECODE_SPLITS says a number
# (1: flash decoding off). Checked against the reference and timed on an H200 (2026-11-29: 8 decodes of
# 32K contexts 2.2x as fast as one split; benchmarks/RESULTS.md).
_SPLITS_SETTING = os.environ.get("SLOSERVE_DECODE_SPLITS", "auto")
# A prompt of at least this many tokens with nothing cached before it attends to this step's own K/V
# only: it runs as one causal ``scaled_dot_product_attention`` call (cuDNN's or FlashAttention on CUDA:
# contiguous K/V, no slot gather, tiles tuned for the GPU) instead of the prefill kernel, unless
# SLOSERVE_DENSE_PREFILL=0. NOTE: written for issue 43's prefill MFU goal; on an H200 (2026-12-04, cuDNN's
# first) dense was 10% slower than the kernel at 1,024 tokens and 2-8% faster at 4-8K (``engine_speed.py``'s
# prefill rows, hence 4,096, the smallest size it was faster at; 3-7% on 2026-11-29, FlashAttention's), and
# its engine-level token tests passed there (benchmarks/RESULTS.md).
DENSE_PREFILL_MIN_TOKENS = 4096
# The SDPA backend a dense prefill asks for first (``_dense_causal``; the others follow, the fused ones
# first, so a shape it cannot take runs as before): SLOSERVE_DENSE_PREFILL_SDPA "cudnn" (cuDNN's fused
# attention), "flash" (FlashAttention 2, torch's own first choice), "torch" (torch's order), or "auto" (the
# default): cuDNN on Hopper (compute capability 9.x), torch's order elsewhere. NOTE: chosen without a GPU,
# after transformers' measurements (huggingface/transformers#48163: cuDNN 1.7-2.3x FlashAttention 2's speed
# on Hopper in training shapes, slower on Ampere and Blackwell); ``benchmarks/engine_speed.py``'s prefill
# rows time both.
SDPA_PREFERENCES = {
    "cudnn": (SDPBackend.CUDNN_ATTENTION,),
    "flash": (SDPBackend.FLASH_ATTENTION,),
    "torch": (),
}
_SDPA_SETTING = os.environ.get("SLOSERVE_DENSE_PREFILL_SDPA", "auto")
# The backends after the preferred one: torch's default order (FlashAttention, memory-efficient, math,
# cuDNN) with the math kernel last, as the slowest
_TORCH_SDPA_ORDER = (
    SDPBackend.FLASH_ATTENTION,
    SDPBackend.EFFICIENT_ATTENTION,
    SDPBackend.CUDNN_ATTENTION,
    SDPBackend.MATH,
)


def sdpa_preference(setting: str, compute_capability: tuple[int, int] | None) -> tuple[SDPBackend, ...]:
    """The SDPA backends a dense prefill asks for first under ``setting`` (SLOSERVE_DENSE_PREFILL_SDPA's
    value) on a GPU of ``compute_capability`` (None: no GPU, where torch's CPU kernels run as they are)."""
    if setting != "auto" and setting not in SDPA_PREFERENCES:
        choices = ", ".join(["auto", *SDPA_PREFERENCES])
        raise ConfigError(f"SLOSERVE_DENSE_PREFILL_SDPA must be one of {choices}, got {setting!r}")
    if compute_capability is None:
        return ()
    if setting == "auto":
        return SDPA_PREFERENCES["cudnn" if compute_capability[0] == 9 else "torch"]
    return SDPA_PREFERENCES[setting]


@triton.jit
def _load_query(q_ptr, row_offsets, rows_ok, HEAD_DIM, VALUE_DIM, VALUE_DIM_PAD, TAIL_PAD):
    """A program's query rows at ``row_offsets`` (M,): (their first ``VALUE_DIM`` numbers (M, VALUE_DIM_PAD),
    the rest (M, TAIL_PAD), each part's offsets and which are inside the head). Without a tail (``TAIL_PAD``
    0: the values as wide as the keys), the rest is the first part again, never read."""
    d = tl.arange(0, VALUE_DIM_PAD)
    d_ok = d < VALUE_DIM
    q = tl.load(q_ptr + row_offsets[:, None] + d[None, :], mask=rows_ok[:, None] & d_ok[None, :], other=0.0)
    if TAIL_PAD > 0:
        d_tail = VALUE_DIM + tl.arange(0, TAIL_PAD)
        d_tail_ok = d_tail < HEAD_DIM
        q_tail = tl.load(
            q_ptr + row_offsets[:, None] + d_tail[None, :], mask=rows_ok[:, None] & d_tail_ok[None, :], other=0.0
        )
    else:
        d_tail, d_tail_ok, q_tail = d, d_ok, q
    return q, q_tail, d, d_ok, d_tail, d_tail_ok


@triton.jit
def _attend_tile(
    q,  # (M, D) query rows: the numbers that meet the values' (all of a head's, or MLA's latent)
    q_tail,  # (M, DT) the rest of the query rows (TAIL: MLA's rotated part)
    acc,  # (M, D) float32 running sum of probabilities x values (unnormalized)
    m_i,  # (M,) running max score (log2 units)
    l_i,  # (M,) running sum of exp2(score - m_i)
    k_cache_ptr,
    v_cache_ptr,
    slots,  # (BLOCK_N,) slots of this tile's context tokens
    n_ok,  # (BLOCK_N,) tokens inside the context
    visible,  # (M, BLOCK_N) or (1, BLOCK_N): which scores count
    kv_head,
    d,  # (D,) head-dim offsets
    d_ok,  # (D,) offsets inside the value's numbers
    d_tail,  # (DT,) offsets of the keys' numbers past the value's (TAIL)
    d_tail_ok,  # (DT,) those inside the head
    stride_k_slot,
    stride_k_head,
    stride_v_slot,
    stride_v_head,
    qk_scale,
    softcap_log2,  # with SOFTCAP: softcap * log2(e), and qk_scale is the softmax scale / softcap
    alibi_log2,  # (M,) with ALIBI: each row's ALiBi slope, log2 units
    query_positions,  # (M,) with ALIBI: each row's position
    key_positions,  # (BLOCK_N,) with ALIBI: the tile's keys' positions
    INPUT_PRECISION: tl.constexpr,
    MASKED: tl.constexpr,  # False: every key of the tile is in the context and visible to every row
    SOFTCAP: tl.constexpr,  # scores capped: softcap * tanh(score / softcap) (Gemma 2)
    VALUES_IN_KEYS: tl.constexpr,  # the values are the keys' first D numbers (MLA): v_cache is not read
    TAIL: tl.constexpr,  # the keys have numbers past the values' (d_tail)
    ALIBI: tl.constexpr,  # scores biased by distance: m (key position - query position) (BLOOM, MPT)
):
    """One tile of context for both kernels: scores against its keys, then the online-softmax update
    (rescale what was summed so far by exp2(old max - new max)). Returns (acc, m_i, l_i).
    An unmasked tile (``MASKED=False``) skips the context and visibility masks."""
    if MASKED:
        kv_mask = n_ok[:, None] & d_ok[None, :]
    else:
        kv_mask = d_ok[None, :]
    key_rows = k_cache_ptr + slots[:, None] * stride_k_slot + kv_head * stride_k_head  # (BLOCK_N, 1)
    k = tl.load(key_rows + d[None, :], mask=kv_mask, other=0.0)  # (BLOCK_N, D)
    s = tl.dot(q, tl.trans(k), input_precision=INPUT_PRECISION)  # (M, BLOCK_N)
    if TAIL:
        tail_mask = (n_ok[:, None] & d_tail_ok[None, :]) if MASKED else d_tail_ok[None, :]
        k_tail = tl.load(key_rows + d_tail[None, :], mask=tail_mask, other=0.0)  # (BLOCK_N, DT)
        s += tl.dot(q_tail, tl.trans(k_tail), input_precision=INPUT_PRECISION)
    s = s * qk_scale
    if SOFTCAP:  # tanh(x) = 2 sigmoid(2x) - 1 (log2 units after)
        s = (2.0 * tl.sigmoid(2.0 * s) - 1.0) * softcap_log2
    if ALIBI:
        s += alibi_log2[:, None] * (key_positions[None, :] - query_positions[:, None]).to(tl.float32)
    if MASKED:
        s = tl.where(visible, s, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(s, 1))
    if MASKED:
        # NOTE: a row may see no key of a tile yet (within a sliding window, the first tiles of a
        # row whose window starts later): its max stays -inf, and exp2(-inf - -inf) would be NaN.
        # Shifting by 0 instead gives it p = 0 and alpha = 0 (its sums are still 0).
        m_shift = tl.where(m_new == float("-inf"), 0.0, m_new)
    else:
        m_shift = m_new
    p = tl.exp2(s - m_shift[:, None])
    alpha = tl.exp2(m_i - m_shift)
    l_i = l_i * alpha + tl.sum(p, 1)
    if VALUES_IN_KEYS:
        v = k  # (the tile read once, as keys and as values)
    else:
        v = tl.load(
            v_cache_ptr + slots[:, None] * stride_v_slot + kv_head * stride_v_head + d[None, :],
            mask=kv_mask,
            other=0.0,
        )  # (BLOCK_N, D)
    acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=INPUT_PRECISION)
    return acc, m_new, l_i


@triton.jit
def _decode_kernel(
    q_ptr,  # (T, nh, hd)
    k_cache_ptr,  # (num_slots, nkv, hd)
    v_cache_ptr,  # (num_slots, nkv, vd) (VALUES_IN_KEYS: unread)
    out_ptr,  # (T, nh, vd): written when NUM_SPLITS == 1
    split_acc_ptr,  # (B, nh, NUM_SPLITS, vd) float32: each split's unnormalized sum (NUM_SPLITS > 1)
    split_max_ptr,  # (B, nh, NUM_SPLITS) float32: its running max m (log2 units)
    split_sum_ptr,  # (B, nh, NUM_SPLITS) float32: its sum l of exp2(score - m)
    splits_done_ptr,  # (B * programs along axis 1,) int32 zeros: the splits done of each (COMBINE_IN_KERNEL only)
    token_index_ptr,  # (B,) flat token of each decode
    sinks_ptr,  # (nh,) float32 each head's sink logit, log2 units (SINKS only)
    alibi_ptr,  # (nh,) float32 each head's ALiBi slope, log2 units (ALIBI only)
    slot_table_ptr,  # (B, max_context) slot of each context token, padded
    context_lens_ptr,  # (B,)
    stride_q_token,
    stride_q_head,
    stride_k_slot,
    stride_k_head,
    stride_v_slot,
    stride_v_head,
    stride_o_token,
    stride_o_head,
    stride_table_row,
    qk_scale,  # softmax scale * log2(e) (with SOFTCAP: softmax scale / softcap)
    window,  # positions a query sees, its own included (0: all)
    chunk,  # the chunks' length: a query sees its own chunk's keys only (0: not chunked)
    softcap_log2,  # softcap * log2(e) (SOFTCAP only)
    GROUP: tl.constexpr,  # query heads per KV head
    BLOCK_H: tl.constexpr,  # of them in one program: a power of two >= 16
    HEAD_DIM: tl.constexpr,  # a query's and a key's numbers (hd)
    VALUE_DIM: tl.constexpr,  # a value's and an output's (vd: hd, or a keys-only cache's first vd)
    VALUE_DIM_PAD: tl.constexpr,  # power of two >= 16
    TAIL_PAD: tl.constexpr,  # hd - vd rounded up to a power of two >= 16; 0 when hd == vd
    BLOCK_N: tl.constexpr,
    NUM_SPLITS: tl.constexpr,  # partitions of each context, one program each
    SPLITS_PAD: tl.constexpr,  # the merge's rows: NUM_SPLITS rounded up to a power of two >= MIN_MERGE_ROWS
    COMBINE_IN_KERNEL: tl.constexpr,  # the last split to finish merges the splits (NUM_SPLITS > 1)
    INPUT_PRECISION: tl.constexpr,
    SOFTCAP: tl.constexpr,
    SINKS: tl.constexpr,  # a logit per head joins the softmax (gpt-oss)
    VALUES_IN_KEYS: tl.constexpr,
    ALIBI: tl.constexpr,  # scores biased by distance (BLOOM, MPT)
):
    seq = tl.program_id(0)
    head_blocks = tl.cdiv(GROUP, BLOCK_H)
    kv_head = tl.program_id(1) // head_blocks
    split = tl.program_id(2)
    token = tl.load(token_index_ptr + seq)
    context_len = tl.load(context_lens_ptr + seq)
    g = tl.program_id(1) % head_blocks * BLOCK_H + tl.arange(0, BLOCK_H)  # (BLOCK_H,) of the group's heads
    g_ok = g < GROUP
    heads = kv_head * GROUP + g
    q, q_tail, d, d_ok, d_tail, d_tail_ok = _load_query(
        q_ptr, token * stride_q_token + heads * stride_q_head, g_ok, HEAD_DIM, VALUE_DIM, VALUE_DIM_PAD, TAIL_PAD
    )  # (BLOCK_H, VALUE_DIM_PAD), (BLOCK_H, TAIL_PAD)
    if SINKS:  # the sink, a key with no value, starts split 0's sums: m = its logit, l = exp2(0) = 1
        m_i = tl.load(sinks_ptr + heads, mask=g_ok, other=float("-inf"))
        m_i = tl.where(split == 0, m_i, float("-inf"))
        l_i = tl.where(m_i == float("-inf"), 0.0, 1.0)
    else:
        m_i = tl.full([BLOCK_H], float("-inf"), tl.float32)
        l_i = tl.zeros([BLOCK_H], tl.float32)
    acc = tl.zeros([BLOCK_H, VALUE_DIM_PAD], tl.float32)
    alibi_log2 = tl.zeros([BLOCK_H], tl.float32)  # (each head's slope)
    if ALIBI:
        alibi_log2 += tl.load(alibi_ptr + heads, mask=g_ok, other=0.0)
    query_positions = tl.zeros([BLOCK_H], tl.int32) + context_len - 1  # (the decode's, each head)
    # A sliding window: the keys before context_len - window are not read; a chunk: those before the
    # chunk of the decode's position, context_len - 1
    lo = tl.where(window > 0, tl.maximum(context_len - window, 0), 0)
    lo = tl.where(chunk > 0, (context_len - 1) // tl.maximum(chunk, 1) * chunk, lo)
    # This split's tiles: the context from lo's tile on, cut into NUM_SPLITS runs of whole tiles.
    # NOTE: split 0 always holds the first tile, so every decode's combined sum l is > 0; a split past
    # a short context reads nothing and leaves m = -inf, l = 0 (a weight of 0 when combined).
    first = lo // BLOCK_N * BLOCK_N
    split_len = tl.cdiv(tl.cdiv(context_len - first, NUM_SPLITS), BLOCK_N) * BLOCK_N
    start_at = first + split * split_len
    end_at = tl.minimum(start_at + split_len, context_len)
    for start in range(start_at, end_at, BLOCK_N):
        n = start + tl.arange(0, BLOCK_N)
        n_ok = (n < context_len) & (n >= lo)
        slots = tl.load(slot_table_ptr + seq * stride_table_row + n, mask=n_ok, other=0)  # (BLOCK_N,)
        acc, m_i, l_i = _attend_tile(
            q,
            q_tail,
            acc,
            m_i,
            l_i,
            k_cache_ptr,
            v_cache_ptr,
            slots,
            n_ok,
            n_ok[None, :],
            kv_head,
            d,
            d_ok,
            d_tail,
            d_tail_ok,
            stride_k_slot,
            stride_k_head,
            stride_v_slot,
            stride_v_head,
            qk_scale,
            softcap_log2,
            alibi_log2,
            query_positions,
            n,
            INPUT_PRECISION,
            True,
            SOFTCAP,
            VALUES_IN_KEYS,
            TAIL_PAD > 0,
            ALIBI,
        )
    store_ok = g_ok[:, None] & d_ok[None, :]
    if NUM_SPLITS == 1:
        # NOTE: every decode sees at least its own token, so l_i > 0 on the rows that are stored.
        out = acc / tl.where(g_ok, l_i, 1.0)[:, None]
        o_offsets = token * stride_o_token + heads[:, None] * stride_o_head + d[None, :]
        tl.store(out_ptr + o_offsets, out.to(out_ptr.dtype.element_ty), mask=store_ok)
    else:
        num_heads = tl.num_programs(1) // head_blocks * GROUP
        row = (seq * num_heads + heads) * NUM_SPLITS + split  # (BLOCK_H,) in (B, nh, S)
        tl.store(split_acc_ptr + row[:, None] * VALUE_DIM + d[None, :], acc, mask=store_ok)
        tl.store(split_max_ptr + row, m_i, mask=g_ok)
        tl.store(split_sum_ptr + row, l_i, mask=g_ok)
        if COMBINE_IN_KERNEL:
            # Count this split done: every thread's stores above come first (the barrier), and the count's
            # release makes them visible to whichever program counts last, whose acquire reads them.
            tl.debug_barrier()
            counter = splits_done_ptr + seq * tl.num_programs(1) + tl.program_id(1)
            done = tl.atomic_add(counter, 1, sem="acq_rel", scope="gpu")
            if done == NUM_SPLITS - 1:  # the last of this (decode, block of heads) merges its splits
                tl.store(counter, 0)  # NOTE: zero again for the next launch (the counters are reused)
                first_g = tl.program_id(1) % head_blocks * BLOCK_H
                for i in range(0, tl.minimum(BLOCK_H, GROUP - first_g)):
                    head = kv_head * GROUP + first_g + i
                    _merge_splits(
                        out_ptr + token * stride_o_token + head * stride_o_head,
                        split_acc_ptr,
                        split_max_ptr,
                        split_sum_ptr,
                        (seq * num_heads + head) * NUM_SPLITS,
                        VALUE_DIM,
                        VALUE_DIM_PAD,
                        NUM_SPLITS,
                        SPLITS_PAD,
                        ".cg",  # NOTE: past the L1 cache, which is not kept coherent with other programs' stores
                    )


@triton.jit
def _merge_splits(
    out_ptr,  # (vd,) one output row: a decode's head
    split_acc_ptr,  # (B, nh, NUM_SPLITS, vd) float32
    split_max_ptr,  # (B, nh, NUM_SPLITS) float32
    split_sum_ptr,  # (B, nh, NUM_SPLITS) float32
    first_row,  # that head's first split's row, (seq * nh + head) * NUM_SPLITS
    VALUE_DIM: tl.constexpr,
    VALUE_DIM_PAD: tl.constexpr,
    NUM_SPLITS: tl.constexpr,
    SPLITS_PAD: tl.constexpr,
    CACHE: tl.constexpr,  # the loads' cache modifier
):
    """A decode head's splits' softmax sums merged as one online-softmax step, out = sum_s w_s acc_s /
    sum_s w_s l_s with w_s = exp2(m_s - max_s m_s)."""
    s = tl.arange(0, SPLITS_PAD)
    d = tl.arange(0, VALUE_DIM_PAD)
    s_ok = s < NUM_SPLITS
    d_ok = d < VALUE_DIM
    row = first_row + s  # (SPLITS_PAD,)
    m = tl.load(split_max_ptr + row, mask=s_ok, other=float("-inf"), cache_modifier=CACHE)  # (SPLITS_PAD,)
    l = tl.load(split_sum_ptr + row, mask=s_ok, other=0.0, cache_modifier=CACHE)
    acc = tl.load(
        split_acc_ptr + row[:, None] * VALUE_DIM + d[None, :],
        mask=s_ok[:, None] & d_ok[None, :],
        other=0.0,
        cache_modifier=CACHE,
    )  # (SPLITS_PAD, VALUE_DIM_PAD)
    m_max = tl.max(m, 0)  # finite: split 0 read at least the decode's own token
    w = tl.exp2(m - m_max)  # (SPLITS_PAD,) 0 for the splits that read nothing
    out = tl.sum(w[:, None] * acc, 0) / tl.sum(w * l, 0)  # (VALUE_DIM_PAD,)
    tl.store(out_ptr + d, out.to(out_ptr.dtype.element_ty), mask=d_ok)


@triton.jit
def _combine_splits_kernel(
    out_ptr,  # (T, nh, vd)
    split_acc_ptr,  # (B, nh, NUM_SPLITS, vd) float32
    split_max_ptr,  # (B, nh, NUM_SPLITS) float32
    split_sum_ptr,  # (B, nh, NUM_SPLITS) float32
    token_index_ptr,  # (B,)
    stride_o_token,
    stride_o_head,
    VALUE_DIM: tl.constexpr,
    VALUE_DIM_PAD: tl.constexpr,
    NUM_SPLITS: tl.constexpr,
    SPLITS_PAD: tl.constexpr,  # NUM_SPLITS rounded up to a power of two
):
    """One program per (decode, query head): its splits merged (``_merge_splits``)."""
    seq = tl.program_id(0)
    head = tl.program_id(1)
    token = tl.load(token_index_ptr + seq)
    _merge_splits(
        out_ptr + token * stride_o_token + head * stride_o_head,
        split_acc_ptr,
        split_max_ptr,
        split_sum_ptr,
        (seq * tl.num_programs(1) + head) * NUM_SPLITS,
        VALUE_DIM,
        VALUE_DIM_PAD,
        NUM_SPLITS,
        SPLITS_PAD,
        "",
    )


@triton.jit
def _prefill_kernel(
    q_ptr,  # (T, nh, hd)
    k_cache_ptr,  # (num_slots, nkv, hd)
    v_cache_ptr,  # (num_slots, nkv, vd) (VALUES_IN_KEYS: unread)
    out_ptr,  # (T, nh, vd)
    query_starts_ptr,  # (P,) first flat token of each prefill
    query_lens_ptr,  # (P,) tokens it processes (c)
    context_lens_ptr,  # (P,) context tokens (n = cached + c)
    slot_starts_ptr,  # (P,) where its context slots begin in slots_ptr
    slots_ptr,  # (sum n,) context slots of every prefill, one after another
    sinks_ptr,  # (nh,) float32 each head's sink logit, log2 units (SINKS only)
    alibi_ptr,  # (nh,) float32 each head's ALiBi slope, log2 units (ALIBI only)
    stride_q_token,
    stride_q_head,
    stride_k_slot,
    stride_k_head,
    stride_v_slot,
    stride_v_head,
    stride_o_token,
    stride_o_head,
    qk_scale,  # softmax scale * log2(e) (with SOFTCAP: softmax scale / softcap)
    window,  # positions a query sees, its own included (0: all)
    chunk,  # the chunks' length: a query sees its own chunk's keys only (0: not chunked)
    softcap_log2,  # softcap * log2(e) (SOFTCAP only)
    GROUP: tl.constexpr,  # query heads per KV head
    HEAD_DIM: tl.constexpr,  # (as in the decode kernel)
    VALUE_DIM: tl.constexpr,
    VALUE_DIM_PAD: tl.constexpr,
    TAIL_PAD: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    INPUT_PRECISION: tl.constexpr,
    SOFTCAP: tl.constexpr,
    SINKS: tl.constexpr,  # a logit per head joins the softmax (gpt-oss)
    VALUES_IN_KEYS: tl.constexpr,
    ALIBI: tl.constexpr,  # scores biased by distance (BLOOM, MPT)
):
    seq = tl.program_id(0)
    tile = tl.program_id(1)
    head = tl.program_id(2)
    kv_head = head // GROUP
    query_len = tl.load(query_lens_ptr + seq)
    query_start = tl.load(query_starts_ptr + seq)
    context_len = tl.load(context_lens_ptr + seq)
    slot_start = tl.load(slot_starts_ptr + seq)
    rows = tile * BLOCK_M + tl.arange(0, BLOCK_M)  # query index within the chunk
    rows_ok = rows < query_len
    q, q_tail, d, d_ok, d_tail, d_tail_ok = _load_query(
        q_ptr,
        (query_start + rows) * stride_q_token + head * stride_q_head,
        rows_ok,
        HEAD_DIM,
        VALUE_DIM,
        VALUE_DIM_PAD,
        TAIL_PAD,
    )  # (BLOCK_M, VALUE_DIM_PAD), (BLOCK_M, TAIL_PAD)
    positions = context_len - query_len + rows  # (BLOCK_M,) each query sees keys 0..position
    # Keys through the tile's last position; none for a tile past the chunk's end (the grid covers
    # the longest chunk of the step).
    end = tl.minimum(context_len, context_len - query_len + (tile + 1) * BLOCK_M)
    end = tl.where(tile * BLOCK_M < query_len, end, 0)
    # Keys 0 .. full - 1 (whole BLOCK_N tiles) are visible to every row of the tile: at most its first
    # row's position (FlashAttention-2's split of causal attention: only the tiles on the diagonal
    # need the causal mask). NOTE: full is a multiple of BLOCK_N and at most the context length (the
    # first row's position is inside the context), so the unmasked loads stay inside the slot list.
    full = tl.minimum((context_len - query_len + tile * BLOCK_M + 1) // BLOCK_N * BLOCK_N, end)
    # A sliding window or a chunk: keys before the first row's first are not read, and every tile is masked
    # (a key visible to the tile's last row may be out of its first row's window or chunk)
    first_row = context_len - query_len + tile * BLOCK_M
    first = tl.where(window > 0, tl.maximum(first_row - window + 1, 0), 0)
    first = tl.where(chunk > 0, first_row - first_row % tl.maximum(chunk, 1), first)
    first = first // BLOCK_N * BLOCK_N
    full = tl.where((window > 0) | (chunk > 0), first, full)
    if SINKS:  # the sink, a key with no value, starts the sums: m = its logit, l = exp2(0) = 1
        m_i = tl.full([BLOCK_M], 0.0, tl.float32) + tl.load(sinks_ptr + head)
        l_i = tl.full([BLOCK_M], 1.0, tl.float32)
    else:
        m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
        l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, VALUE_DIM_PAD], tl.float32)
    alibi_log2 = tl.zeros([BLOCK_M], tl.float32)  # (the head's slope, each row)
    if ALIBI:
        alibi_log2 += tl.load(alibi_ptr + head)
    for start in range(first, full, BLOCK_N):
        n = start + tl.arange(0, BLOCK_N)
        slots = tl.load(slots_ptr + slot_start + n)  # (BLOCK_N,) all inside the context
        acc, m_i, l_i = _attend_tile(
            q,
            q_tail,
            acc,
            m_i,
            l_i,
            k_cache_ptr,
            v_cache_ptr,
            slots,
            n,
            n,
            kv_head,
            d,
            d_ok,  # (masks unused)
            d_tail,
            d_tail_ok,
            stride_k_slot,
            stride_k_head,
            stride_v_slot,
            stride_v_head,
            qk_scale,
            softcap_log2,
            alibi_log2,
            positions,
            n,
            INPUT_PRECISION,
            False,
            SOFTCAP,
            VALUES_IN_KEYS,
            TAIL_PAD > 0,
            ALIBI,
        )
    for start in range(full, end, BLOCK_N):
        n = start + tl.arange(0, BLOCK_N)
        n_ok = n < context_len
        slots = tl.load(slots_ptr + slot_start + n, mask=n_ok, other=0)  # (BLOCK_N,)
        visible = (n[None, :] <= positions[:, None]) & n_ok[None, :]  # (BLOCK_M, BLOCK_N) causal
        visible &= (window == 0) | (n[None, :] > positions[:, None] - window)
        visible &= (chunk == 0) | (n[None, :] >= positions[:, None] - positions[:, None] % tl.maximum(chunk, 1))
        acc, m_i, l_i = _attend_tile(
            q,
            q_tail,
            acc,
            m_i,
            l_i,
            k_cache_ptr,
            v_cache_ptr,
            slots,
            n_ok,
            visible,
            kv_head,
            d,
            d_ok,
            d_tail,
            d_tail_ok,
            stride_k_slot,
            stride_k_head,
            stride_v_slot,
            stride_v_head,
            qk_scale,
            softcap_log2,
            alibi_log2,
            positions,
            n,
            INPUT_PRECISION,
            True,
            SOFTCAP,
            VALUES_IN_KEYS,
            TAIL_PAD > 0,
            ALIBI,
        )
    out = acc / tl.where(rows_ok, l_i, 1.0)[:, None]
    o_offsets = (query_start + rows)[:, None] * stride_o_token + head * stride_o_head + d[None, :]
    tl.store(out_ptr + o_offsets, out.to(out_ptr.dtype.element_ty), mask=rows_ok[:, None] & d_ok[None, :])


class SideStream:
    """A second CUDA stream, of the highest priority, for work that may run beside what the current stream
    launches next: ``beside`` runs its block's launches there, after everything the current stream launched
    before it; ``join`` makes the current stream wait for them.

    NOTE: a tensor the current stream made and the side stream reads or writes (the step's queries, the
    output) needs no ``record_stream``: the current stream joins before the caller returns, so its later
    work, the only work that could be given the tensor's memory once it is freed, comes after the side
    stream's. What the side stream makes in its block is its own pool's, reused only by its later work."""

    def __init__(self) -> None:
        self._streams: dict[torch.device, torch.cuda.Stream] = {}  # made at the first use on each device

    @contextlib.contextmanager
    def beside(self, device: torch.device):
        stream = self._streams.get(device)
        if stream is None:
            # NOTE: -1 asks for the highest priority (torch maps it into the device's range): a program of
            # this stream is dispatched before the current stream's waiting ones as multiprocessors free up
            stream = self._streams[device] = torch.cuda.Stream(device, priority=-1)
        stream.wait_stream(torch.cuda.current_stream(device))
        with torch.cuda.stream(stream):
            yield

    def join(self, device: torch.device) -> None:
        torch.cuda.current_stream(device).wait_stream(self._streams[device])


class SplitCounters:
    """Zeroed int32 counters on each device, one per decode program's (decode, block of heads), for the decode
    kernel's last split to find itself (``COMBINE_IN_KERNEL``). The kernel leaves them zero again, so one
    tensor serves every launch; it is made anew, larger, only when a launch needs more.

    NOTE: every tensor made is kept for the backend's life: a CUDA graph captured with one replays on it after
    a larger one has replaced it. None is made during a capture, which would record its zeroing, not run it:
    the warm-up runs before each capture (``cuda_graphs.capture_graph``) make the one it needs."""

    def __init__(self) -> None:
        self._latest: dict[torch.device, torch.Tensor] = {}
        self._made: list[torch.Tensor] = []

    def zeros(self, count: int, device: torch.device) -> torch.Tensor:
        """At least ``count`` counters on ``device``, all zero between launches."""
        counters = self._latest.get(device)
        if counters is None or counters.numel() < count:
            if device.type == "cuda" and torch.cuda.is_current_stream_capturing():
                raise RuntimeError(
                    f"{count} split counters needed in a CUDA graph's capture; a warm-up run must make them first"
                )
            size = max(count, 2 * (0 if counters is None else counters.numel()))
            counters = self._latest[device] = torch.zeros(size, dtype=torch.int32, device=device)
            self._made.append(counters)
        return counters


def _pow2_at_least_16(x: int) -> int:
    return max(MIN_DOT_DIM, triton.next_power_of_2(x))


def _fit_tile(rows: int, numbers_a_row: int, budget: int = TILE_NUMBERS) -> int:
    """``rows`` (a power of two) halved until ``rows x numbers_a_row`` is within ``budget``, at least 16."""
    while rows > MIN_DOT_DIM and rows * numbers_a_row > budget:
        rows //= 2
    return rows


def _last_dim_contiguous(x: torch.Tensor) -> torch.Tensor:
    return x if x.stride(-1) == 1 else x.contiguous()


@functools.cache
def multiprocessors(device: torch.device) -> int:
    """Streaming multiprocessors of a CUDA device; on the CPU (Triton's interpreter), a small GPU's."""
    return torch.cuda.get_device_properties(device).multi_processor_count if device.type == "cuda" else 16


@functools.cache
def compute_capability(device: torch.device) -> tuple[int, int] | None:
    """A CUDA device's compute capability (9.x: Hopper); None on the CPU."""
    return torch.cuda.get_device_capability(device) if device.type == "cuda" else None


def decode_splits(num_decodes: int, num_kv_heads: int, max_context: int, multiprocessors: int) -> int:
    """How many splits of each context the decode kernel runs (flash decoding): 1 when the
    (decode, KV head) programs already fill the GPU ``WAVES`` times over; else enough splits to do so,
    at most one per ``MIN_SPLIT_TOKENS`` of ``max_context`` and at most ``MAX_SPLITS``. (``num_kv_heads``:
    the programs a decode's heads take, more than its KV heads where a group is cut in blocks: MLA's.)

    NOTE: ``max_context`` is the slot table's width, not the step's longest context, so a CUDA graph
    captured for one batch size keeps one split count whatever contexts it replays; a split that
    falls past a short context reads nothing."""
    programs = num_decodes * num_kv_heads
    wanted = -(-WAVES * multiprocessors // programs)
    return max(1, min(wanted, max_context // MIN_SPLIT_TOKENS, MAX_SPLITS))


def _dense_causal(
    q: torch.Tensor,  # (T, nh, hd) a prompt's queries, nothing cached before them
    k: torch.Tensor,  # (T, nkv, hd)
    v: torch.Tensor,  # (T, nkv, hd)
    scale: float,
    prefer: tuple[SDPBackend, ...] = (),
) -> torch.Tensor:  # (T, nh, hd)
    """Causal attention of a prompt over its own keys, as one SDPA call (query head h reads KV head
    h // group, as the kernels do), by the backends ``prefer`` names first if they take it
    (``sdpa_preference``). NOTE: SDPA's top-left causal mask is the right one here: the query and the
    context are the same T tokens."""
    group = q.shape[1] // k.shape[1]
    # NOTE: KV heads repeated rather than SDPA's enable_gqa, which not every SDPA backend takes (one
    # that does not would fall back to the math kernel: T x T scores in memory)
    if group > 1:
        k, v = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)  # (T, nh, hd)
    q, k, v = (x.transpose(0, 1).unsqueeze(0) for x in (q, k, v))  # (1, nh, T, hd)
    order = [*prefer, *(b for b in _TORCH_SDPA_ORDER if b not in prefer)]
    with sdpa_kernel(order, set_priority=True) if prefer else contextlib.nullcontext():
        return F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=scale)[0].transpose(0, 1)


class TritonAttention(AttentionBackend):
    """Triton kernels for CUDA: decode and prefill-with-context over the token -> slot table, GQA,
    online softmax. Same outputs as ``TorchAttention`` to rounding."""

    name = "triton"

    def __init__(
        self,
        block_m: int = 64,
        block_n: int = 64,
        num_decode_splits: int | None | Literal["env"] = "env",
        dense_prefill_min_tokens: int | None | Literal["env"] = "env",
        dense_prefill_sdpa: str = "env",
        overlap_prefill_decode: bool | Literal["env"] = "env",
        combine_splits_in_kernel: bool | Literal["env"] = "env",
        prefill_num_warps: int = 4,
        prefill_num_stages: int | None = None,
    ) -> None:
        # Tile sizes: query tokens per prefill program, context tokens per step of either kernel.
        # NOTE: FlashAttention-2's Triton defaults for head_dim 64-128; tune them on the GPU.
        self.block_m = block_m
        self.block_n = block_n
        # The prefill kernel's warps a program (Triton's default, 4: one warpgroup of Hopper's matmuls) and its
        # loads' pipeline stages (None: Triton's default, 3); a program's tile of query rows may grow with its
        # warps (``TILE_NUMBERS`` a warpgroup). benchmarks/prefill_attention.py times them on the GPU.
        self.prefill_num_warps = prefill_num_warps
        self.prefill_num_stages = prefill_num_stages
        # Splits of each decode's context: None picks them (``decode_splits``); 1 turns flash decoding
        # off; "env": SLOSERVE_DECODE_SPLITS ("auto" or a number; auto when unset). Read at each call, so a
        # CUDA graph keeps the count it was captured with.
        if num_decode_splits == "env":
            setting = _SPLITS_SETTING
            if setting != "auto" and not (setting.isdigit() and int(setting) >= 1):
                raise ConfigError(f"SLOSERVE_DECODE_SPLITS must be auto or a positive integer, got {setting!r}")
            num_decode_splits = None if setting == "auto" else int(setting)
        self.num_decode_splits = num_decode_splits
        # Prompts of at least this many tokens with nothing cached run dense (``_dense_causal``); None: none
        # do. "env": DENSE_PREFILL_MIN_TOKENS unless SLOSERVE_DENSE_PREFILL is 0, else None.
        if dense_prefill_min_tokens == "env":
            dense = switch("SLOSERVE_DENSE_PREFILL", default=True)
            dense_prefill_min_tokens = DENSE_PREFILL_MIN_TOKENS if dense else None
        self.dense_prefill_min_tokens = dense_prefill_min_tokens
        # The SDPA backend those ask for first: a SLOSERVE_DENSE_PREFILL_SDPA value ("env": that variable's,
        # "auto" when unset), resolved for the GPU at each dense prefill (``sdpa_preference``).
        if dense_prefill_sdpa == "env":
            dense_prefill_sdpa = _SDPA_SETTING
        sdpa_preference(dense_prefill_sdpa, None)  # (a bad value is an error here, as the engine is built)
        self.dense_prefill_sdpa = dense_prefill_sdpa
        # A step's prefill attention on a second stream, beside its decodes' (``SideStream``, on CUDA, where the
        # step is not being captured); "env": SLOSERVE_OVERLAP_ATTENTION (off unless 1: not timed on a GPU yet)
        if overlap_prefill_decode == "env":
            overlap_prefill_decode = switch("SLOSERVE_OVERLAP_ATTENTION")
        self.overlap_prefill_decode = overlap_prefill_decode
        self.side_stream = SideStream()
        # Split decodes merged by the decode kernel's last split to finish rather than by a second kernel
        # (``SplitCounters``); "env": SLOSERVE_COMBINE_SPLITS_IN_KERNEL (off unless 1: not timed on a GPU yet)
        if combine_splits_in_kernel == "env":
            combine_splits_in_kernel = switch("SLOSERVE_COMBINE_SPLITS_IN_KERNEL")
        self.combine_splits_in_kernel = combine_splits_in_kernel
        self.split_counters = SplitCounters()

    def tiles(self, value_dim: int, values_in_keys: bool = False) -> tuple[int, int]:
        """(BLOCK_M, BLOCK_N) as launched for values ``value_dim`` wide (``values_in_keys``: a keys-only cache's,
        whose tile is read once): ``block_m`` and ``block_n`` cut for wide heads (MLA's 512-wide latent, 256-wide
        heads) to a 128-wide head's size (``TILE_NUMBERS``; the query rows' a warpgroup of the prefill's warps)."""
        value_dim_pad = _pow2_at_least_16(value_dim)
        block_m = _fit_tile(self.block_m, value_dim_pad, TILE_NUMBERS * max(1, self.prefill_num_warps // 4))
        block_n = _fit_tile(self.block_n, value_dim_pad * (1 if values_in_keys else 2), 2 * TILE_NUMBERS)
        return block_m, block_n

    def prefill_launch(self, settings: dict, beside: bool) -> dict:
        """The prefill kernel's compile-time settings and launch options: ``settings`` (both kernels', BLOCK_N
        among them) with this backend's warps and stages; beside the decodes (``beside``), at most
        ``OVERLAP_PREFILL_LAUNCH``'s keys a tile, at its stages and under its cap on registers."""
        launch = {**settings, "num_warps": self.prefill_num_warps}
        if self.prefill_num_stages is not None:
            launch["num_stages"] = self.prefill_num_stages
        if beside:
            launch.update(OVERLAP_PREFILL_LAUNCH, BLOCK_N=min(settings["BLOCK_N"], OVERLAP_PREFILL_LAUNCH["BLOCK_N"]))
        return launch

    def forward(
        self,
        q,
        k,
        v,
        k_cache,
        v_cache,
        meta,
        scale=None,
        window=None,
        softcap=None,
        sinks=None,
        value_dim=None,
        chunk=None,
        alibi=None,
    ):
        write_kv(k, v, k_cache, v_cache, meta)
        q = _last_dim_contiguous(q)
        num_heads, head_dim = q.shape[1], q.shape[2]
        values_in_keys = value_dim is not None
        if values_in_keys:  # (the kernels read no V; its pointer and strides are the keys')
            v_cache = k_cache
        else:
            value_dim = head_dim
        out = torch.empty_like(q[..., :value_dim])  # (T, nh, vd)
        num_kv_heads = k_cache.shape[1]
        group = num_heads // num_kv_heads
        value_dim_pad = _pow2_at_least_16(value_dim)
        tail_pad = 0 if value_dim == head_dim else _pow2_at_least_16(head_dim - value_dim)
        block_m, block_n = self.tiles(value_dim, values_in_keys)
        softmax_scale = scale if scale is not None else 1 / math.sqrt(head_dim)
        # NOTE: capped scores are scaled to log2 units after the cap (softcap_log2), not before
        qk_scale = LOG2E * softmax_scale if softcap is None else softmax_scale / softcap
        softcap_log2 = 0.0 if softcap is None else softcap * LOG2E
        precision = "ieee" if q.dtype == torch.float32 else "tf32"  # tf32 only matters for float32
        fresh, packed = [], None
        # (SDPA has no cap, sinks, window or chunks; MLA's prefills keep the kernel, where its keys are read once)
        dense = self.dense_prefill_min_tokens is not None and window is None and softcap is None and sinks is None
        dense = dense and chunk is None and not values_in_keys and alibi is None
        sinks_log2 = out if sinks is None else sinks.float() * LOG2E  # (nh,) (unread without sinks)
        alibi_log2 = out if alibi is None else alibi.float() * LOG2E  # (nh,) (unread without ALiBi)
        if meta.prefills and dense:
            fresh, packed = meta.fresh_prefills(self.dense_prefill_min_tokens)
        elif meta.prefills:
            packed = meta.packed_prefills
        # Both kernels' strides (a token's and a head's) of the queries, the caches and the output
        strides = (*q.stride()[:2], *k_cache.stride()[:2], *v_cache.stride()[:2], *out.stride()[:2])
        # Both kernels' compile-time settings (each adds its own tiles)
        settings = dict(
            GROUP=group,
            HEAD_DIM=head_dim,
            VALUE_DIM=value_dim,
            VALUE_DIM_PAD=value_dim_pad,
            TAIL_PAD=tail_pad,
            BLOCK_N=block_n,
            INPUT_PRECISION=precision,
            SOFTCAP=softcap is not None,
            SINKS=sinks is not None,
            VALUES_IN_KEYS=values_in_keys,
            ALIBI=alibi is not None,
        )
        num_decodes = meta.decode_token_index.numel()
        beside = self.overlap_prefill_decode and meta.prefills and num_decodes and q.is_cuda
        beside = beside and not torch.cuda.is_current_stream_capturing()
        # NOTE: the prefills first: launched second, their programs would wait for a decode kernel that fills
        # the GPU with its own
        with self.side_stream.beside(q.device) if beside else contextlib.nullcontext():
            prefer = sdpa_preference(self.dense_prefill_sdpa, compute_capability(q.device)) if fresh else ()
            for seq in fresh:
                rows = slice(seq.query_start, seq.query_start + seq.query_len)
                out[rows] = _dense_causal(q[rows], k[rows], v[rows], softmax_scale, prefer)
            if packed is not None:
                grid = (packed.query_lens.numel(), triton.cdiv(packed.max_query_len, block_m), num_heads)
                _prefill_kernel[grid](
                    q,
                    k_cache,
                    v_cache,
                    out,
                    packed.query_starts,
                    packed.query_lens,
                    packed.context_lens,
                    packed.slot_starts,
                    packed.slots,
                    sinks_log2,
                    alibi_log2,
                    *strides,
                    qk_scale,
                    window or 0,
                    chunk or 0,
                    softcap_log2,
                    BLOCK_M=block_m,
                    **self.prefill_launch(settings, beside),
                )
        if num_decodes:
            table = meta.decode_slots
            block_h = _fit_tile(_pow2_at_least_16(group), value_dim_pad)
            head_programs = num_kv_heads * triton.cdiv(group, block_h)  # (a decode's, each split)
            splits = self.num_decode_splits or decode_splits(
                num_decodes, head_programs, table.shape[1], multiprocessors(q.device)
            )
            split_acc = split_max = split_sum = out  # unused with one split
            in_kernel = splits > 1 and self.combine_splits_in_kernel
            splits_done = self.split_counters.zeros(num_decodes * head_programs, q.device) if in_kernel else out
            if splits > 1:
                split_acc = torch.empty(
                    (num_decodes, num_heads, splits, value_dim), dtype=torch.float32, device=q.device
                )
                split_max = torch.empty((num_decodes, num_heads, splits), dtype=torch.float32, device=q.device)
                split_sum = torch.empty_like(split_max)
            _decode_kernel[(num_decodes, head_programs, splits)](
                q,
                k_cache,
                v_cache,
                out,
                split_acc,
                split_max,
                split_sum,
                splits_done,
                meta.decode_token_index,
                sinks_log2,
                alibi_log2,
                table,
                meta.decode_context_lens,
                *strides,
                table.stride(0),
                qk_scale,
                window or 0,
                chunk or 0,
                softcap_log2,
                BLOCK_H=block_h,
                NUM_SPLITS=splits,
                SPLITS_PAD=max(MIN_MERGE_ROWS, triton.next_power_of_2(splits)) if in_kernel else 1,
                COMBINE_IN_KERNEL=in_kernel,
                **settings,
            )
            if splits > 1 and not in_kernel:
                _combine_splits_kernel[(num_decodes, num_heads)](
                    out,
                    split_acc,
                    split_max,
                    split_sum,
                    meta.decode_token_index,
                    out.stride(0),
                    out.stride(1),
                    VALUE_DIM=value_dim,
                    VALUE_DIM_PAD=value_dim_pad,
                    NUM_SPLITS=splits,
                    SPLITS_PAD=triton.next_power_of_2(splits),
                )
        if beside:
            self.side_stream.join(q.device)
        return out
