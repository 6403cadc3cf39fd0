"""The PyTorch reference attention against attention written out from its definition, and its decode
groups (padded batching bounded by DECODE_PAD_LIMIT)."""

from __future__ import annotations

import math

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

torch = pytest.importorskip("torch")

from attention_steps import make_step  # noqa: E402
from sloserve.engine.attention import DECODE_PAD_LIMIT, AttentionMetadata, TorchAttention  # noqa: E402


def attention_by_definition(
    q, k, v, k_cache, v_cache, meta: AttentionMetadata, window: int | None = None, chunk: int | None = None
) -> torch.Tensor:
    """softmax(q K^T / sqrt(d)) V per sequence and head, one query token at a time, in float64:
    query i of a c-token chunk over n context tokens sits at position p = n - c + i and sees keys 0..p (within a
    ``window``: p - window + 1..p; within ``chunk``s: p // chunk * chunk..p); head h reads KV head
    h // (heads per KV head)."""
    k_cache, v_cache = k_cache.clone(), v_cache.clone()
    k_cache[meta.slot_mapping], v_cache[meta.slot_mapping] = k, v
    group = q.shape[1] // k.shape[1]
    seqs = [(s.query_start, s.query_len, s.context_slots) for s in meta.prefills]
    for row, index in enumerate(meta.decode_token_index.tolist()):
        seqs.append((index, 1, meta.decode_slots[row, : int(meta.decode_context_lens[row])]))
    out = torch.full_like(q, math.nan)
    for start, c, context in seqs:
        n = context.numel()
        for i in range(c):
            p = n - c + i
            first = max(0, p - window + 1) if window else p // chunk * chunk if chunk else 0
            for h in range(q.shape[1]):
                keys, values = (
                    k_cache[context[first : p + 1], h // group],
                    v_cache[context[first : p + 1], h // group],
                )
                weights = torch.softmax(keys @ q[start + i, h] / math.sqrt(q.shape[2]), dim=0)
                out[start + i, h] = weights @ values
    return out


@settings(max_examples=15, deadline=None)
@given(
    heads=st.sampled_from([(4, 2), (4, 4), (6, 1)]),
    prefills=st.lists(st.tuples(st.integers(0, 40), st.integers(2, 12)), max_size=2),
    decodes=st.lists(st.integers(0, 120), max_size=12),
    seed=st.integers(0, 2**16),
)
def test_reference_is_attention_by_definition(heads, prefills, decodes, seed):
    """Any mix of chunks after cached context and decodes of any lengths (several decode groups)."""
    if not prefills and not decodes:
        return
    step = make_step(torch.Generator().manual_seed(seed), *heads, 8, prefills, decodes, num_slots=1800)
    q, k, v, k_cache, v_cache, meta = step
    expected = attention_by_definition(*step)
    out = TorchAttention().forward(q, k, v, k_cache, v_cache, meta)
    assert torch.allclose(out, expected, rtol=1e-10, atol=1e-12)


@settings(max_examples=25, deadline=None)
@given(
    prefills=st.lists(st.tuples(st.integers(0, 40), st.integers(1, 12)), max_size=2),
    decodes=st.lists(st.integers(0, 60), max_size=8),
    local=st.tuples(st.sampled_from(["window", "chunk"]), st.integers(1, 20)),
    seed=st.integers(0, 2**16),
)
def test_sliding_windows_and_chunks_are_attention_by_definition(prefills, decodes, local, seed):
    """A sliding-window layer's queries see their last ``window`` positions; a chunked layer's (Llama 4's local
    layers) the earlier positions of their own chunk: chunks after cached context and decodes, each position in
    a chunk or window of any length."""
    if not prefills and not decodes:
        return
    step = make_step(torch.Generator().manual_seed(seed), 4, 2, 8, prefills, decodes, num_slots=1200)
    q, k, v, k_cache, v_cache, meta = step
    option = {local[0]: local[1]}
    expected = attention_by_definition(*step, **option)
    out = TorchAttention().forward(q, k, v, k_cache, v_cache, meta, **option)
    assert torch.allclose(out, expected, rtol=1e-10, atol=1e-12)


@settings(max_examples=200, deadline=None)
@given(st.lists(st.integers(1, 5000), min_size=1, max_size=300))
def test_decode_groups_cover_every_decode_once_with_bounded_padding(lengths):
    meta = AttentionMetadata(
        slot_mapping=torch.zeros(0, dtype=torch.int64),
        prefills=[],
        decode_token_index=torch.arange(len(lengths)),
        decode_slots=torch.zeros(len(lengths), max(lengths), dtype=torch.int64),
        decode_context_lens=torch.tensor(lengths),
    )
    rows = []
    for group in meta.decode_groups:
        longest = group.slots.shape[1]
        members = [lengths[r] for r in group.rows.tolist()]
        assert longest == max(members)
        assert longest * len(members) <= DECODE_PAD_LIMIT * sum(members)
        rows += group.rows.tolist()
    assert sorted(rows) == list(range(len(lengths)))


def test_equal_lengths_make_one_group():
    meta = AttentionMetadata(
        slot_mapping=torch.zeros(0, dtype=torch.int64),
        prefills=[],
        decode_token_index=torch.arange(64),
        decode_slots=torch.zeros(64, 300, dtype=torch.int64),
        decode_context_lens=torch.full((64,), 300),
    )
    assert [tuple(group.slots.shape) for group in meta.decode_groups] == [(64, 300)]
