"""Attention over the slot-addressed KV cache, behind one interface.

A step's tokens are flat (``[num_tokens]``, no batch dimension). Each sequence in the step owns a
contiguous range of them and reads its whole context (cached tokens + this step's) through its
token -> slot table, so any KV layout (paged, exact, bidirectional) works unchanged.

``TorchAttention`` is the reference: it gathers K/V by slot and applies an explicit causal mask whose
diagonal is offset by the tokens already cached. NOTE: SDPA's ``is_causal`` aligns the mask top-left,
which is wrong whenever the query is shorter than the context (chunked prefill, refill, decode).
Decodes (one query token each) are batched into one padded call; each prefill chunk gets its own.

``TritonAttention`` (``triton_attention``) runs the same function as two Triton kernels on CUDA.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable
from dataclasses import dataclass
from functools import cached_property

import torch
import torch.nn.functional as F

from sloserve.core.errors import ConfigError


@dataclass
class PrefillSeq:
    """A sequence processing more than one token this step."""

    query_start: int  # first of its tokens in the flat step
    query_len: int  # tokens it processes (c)
    context_slots: torch.Tensor  # (query_len + num_computed,) slot of every context token, in order


@dataclass
class PackedPrefills:
    """A step's prefills as flat tensors, for kernels that run all of them in one launch."""

    query_starts: torch.Tensor  # (P,) first flat token of each prefill
    query_lens: torch.Tensor  # (P,) tokens it processes (c)
    context_lens: torch.Tensor  # (P,) context tokens (n: the first n - c were cached)
    slot_starts: torch.Tensor  # (P,) where its context slots begin in `slots`
    slots: torch.Tensor  # (sum of n,) every prefill's context slots, one prefill after another
    max_query_len: int


@dataclass
class AttentionMetadata:
    """Where the step's tokens go and what each sequence reads. Built once per step, used by every layer."""

    slot_mapping: torch.Tensor  # (num_tokens,) slot each token's K/V is written to
    prefills: list[PrefillSeq]
    decode_token_index: torch.Tensor  # (num_decodes,) position of each decode token in the flat step
    decode_slots: torch.Tensor  # (num_decodes, max_context) slot table, padded with slot 0
    decode_context_lens: torch.Tensor  # (num_decodes,) context tokens (cached + the new one)

    @cached_property
    def packed_prefills(self) -> PackedPrefills:
        """``prefills`` packed (built by the first layer that asks, shared by the others)."""
        device = self.slot_mapping.device
        context_lens = [seq.context_slots.numel() for seq in self.prefills]
        slot_starts = [0]
        for n in context_lens[:-1]:
            slot_starts.append(slot_starts[-1] + n)
        starts = [seq.query_start for seq in self.prefills]
        lens = [seq.query_len for seq in self.prefills]

        def tensor(values: list[int]) -> torch.Tensor:
            return torch.tensor(values, dtype=torch.int64, device=device)

        return PackedPrefills(
            query_starts=tensor(starts),
            query_lens=tensor(lens),
            context_lens=tensor(context_lens),
            slot_starts=tensor(slot_starts),
            slots=torch.cat([seq.context_slots.to(torch.int64) for seq in self.prefills]),
            max_query_len=max(lens),
        )


class AttentionBackend(ABC):
    """Writes this step's K/V into the cache and returns attention outputs for every token."""

    name = "backend"

    @abstractmethod
    def forward(
        self,
        q: torch.Tensor,  # (num_tokens, num_heads, head_dim)
        k: torch.Tensor,  # (num_tokens, num_kv_heads, head_dim)
        v: torch.Tensor,  # (num_tokens, num_kv_heads, head_dim)
        k_cache: torch.Tensor,  # (num_slots, num_kv_heads, head_dim) this layer's K
        v_cache: torch.Tensor,  # (num_slots, num_kv_heads, head_dim) this layer's V
        meta: AttentionMetadata,
    ) -> torch.Tensor:  # (num_tokens, num_heads, head_dim)
        ...


def write_kv(
    k: torch.Tensor,  # (num_tokens, num_kv_heads, head_dim)
    v: torch.Tensor,  # (num_tokens, num_kv_heads, head_dim)
    k_cache: torch.Tensor,  # (num_slots, num_kv_heads, head_dim)
    v_cache: torch.Tensor,  # (num_slots, num_kv_heads, head_dim)
    meta: AttentionMetadata,
) -> None:
    """Store this step's K/V at the slots the KV manager assigned (every backend does this first)."""
    k_cache[meta.slot_mapping] = k
    v_cache[meta.slot_mapping] = v


def _expand_kv(x: torch.Tensor, group: int) -> torch.Tensor:
    """(..., num_kv_heads, head_dim) -> (..., num_heads, head_dim) for grouped-query attention."""
    return x if group == 1 else x.repeat_interleave(group, dim=-2)


class TorchAttention(AttentionBackend):
    """PyTorch reference backend: gather by slot, explicit offset causal mask, SDPA. Runs everywhere."""

    name = "torch"

    def forward(self, q, k, v, k_cache, v_cache, meta):
        write_kv(k, v, k_cache, v_cache, meta)
        out = torch.empty_like(q)
        group = q.shape[1] // k.shape[1]
        for seq in meta.prefills:
            s, c = seq.query_start, seq.query_len
            n = seq.context_slots.numel()  # context length; the first n - c tokens were cached
            keys = _expand_kv(k_cache[seq.context_slots], group).transpose(0, 1)  # (nh, n, hd)
            values = _expand_kv(v_cache[seq.context_slots], group).transpose(0, 1)  # (nh, n, hd)
            query = q[s : s + c].transpose(0, 1)  # (nh, c, hd)
            # Query i sits at position n - c + i and sees keys 0..n - c + i (bottom-right causal).
            rows = torch.arange(c, device=q.device).unsqueeze(1) + (n - c)
            mask = torch.arange(n, device=q.device).unsqueeze(0) <= rows  # (c, n)
            out[s : s + c] = F.scaled_dot_product_attention(query, keys, values, attn_mask=mask).transpose(0, 1)
        if meta.decode_token_index.numel():
            idx = meta.decode_token_index
            keys = _expand_kv(k_cache[meta.decode_slots], group).permute(0, 2, 1, 3)  # (B, nh, L, hd)
            values = _expand_kv(v_cache[meta.decode_slots], group).permute(0, 2, 1, 3)  # (B, nh, L, hd)
            query = q[idx].unsqueeze(2)  # (B, nh, 1, hd)
            length = meta.decode_slots.shape[1]
            valid = torch.arange(length, device=q.device).unsqueeze(0) < meta.decode_context_lens.unsqueeze(1)
            mask = valid[:, None, None, :]  # (B, 1, 1, L): padding slots are masked out
            out[idx] = F.scaled_dot_product_attention(query, keys, values, attn_mask=mask).squeeze(2)
        return out


def _triton() -> AttentionBackend:
    try:
        from sloserve.engine.triton_attention import TritonAttention
    except ImportError as e:
        raise ConfigError(
            f"attention backend 'triton' needs the triton package ({e}); CUDA builds of torch bring it"
        ) from e
    return TritonAttention()


def triton_available() -> bool:
    """Whether the ``triton`` backend can be built here (the package imports)."""
    try:
        import triton  # noqa: F401
    except ImportError:
        return False
    return True


# name -> factory. The loader's "auto" picks triton on CUDA when it is installed, torch elsewhere.
BACKENDS: dict[str, Callable[[], AttentionBackend]] = {"torch": TorchAttention, "triton": _triton}
