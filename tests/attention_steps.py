"""Random attention steps for the backends' tests: q/k/v, a KV cache and metadata over shuffled slots."""

from __future__ import annotations

import torch

from sloserve.engine.attention import AttentionMetadata, PrefillSeq


def make_step(
    gen: torch.Generator,
    num_heads: int,
    num_kv_heads: int,
    head_dim: int,
    prefills: list[tuple[int, int]],  # (cached tokens m, chunk tokens c)
    decodes: list[int],  # cached tokens of each decode
    num_slots: int,
):
    """A step's q/k/v, a KV cache of random values and metadata with shuffled (non-contiguous)
    slots, all float64 on the CPU."""
    num_tokens = sum(c for _, c in prefills) + len(decodes)
    perm = torch.randperm(num_slots, generator=gen)
    taken = 0

    def take(n: int) -> torch.Tensor:
        nonlocal taken
        taken += n
        return perm[taken - n : taken]

    def randn(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=gen, dtype=torch.float64)

    k_cache, v_cache = randn(num_slots, num_kv_heads, head_dim), randn(num_slots, num_kv_heads, head_dim)
    q = randn(num_tokens, num_heads, head_dim)
    k, v = randn(num_tokens, num_kv_heads, head_dim), randn(num_tokens, num_kv_heads, head_dim)
    written, seqs, flat = [], [], 0
    for m, c in prefills:
        context = take(m + c)
        seqs.append(PrefillSeq(flat, c, context))
        written.append(context[m:])
        flat += c
    index, tables = [], []
    for m in decodes:
        context = take(m + 1)
        tables.append(context)
        written.append(context[m:])
        index.append(flat)
        flat += 1
    table = torch.zeros(len(decodes), max((len(t) for t in tables), default=1), dtype=torch.int64)
    for row, context in enumerate(tables):
        table[row, : len(context)] = context
    meta = AttentionMetadata(
        slot_mapping=torch.cat(written),
        prefills=seqs,
        decode_token_index=torch.tensor(index, dtype=torch.int64),
        decode_slots=table,
        decode_context_lens=torch.tensor([len(t) for t in tables], dtype=torch.int64),
    )
    return q, k, v, k_cache, v_cache, meta
