"""Attention over the slot-addressed KV cache, behind one interface.

A step's tokens are flat (``[num_tokens]``, no batch dimension). Each sequence in the step owns a
contiguous range of them and reads its whole context (cached tokens + this step's) through its
token -> slot table, so any KV layout (paged, exact, bidirectional) works unchanged.

``TorchAttention`` is the reference: it gathers K/V by slot and applies an explicit causal mask whose
diagonal is offset by the tokens already cached. NOTE: SDPA's ``is_causal`` aligns the mask top-left,
which is wrong whenever the query is shorter than the context (chunked prefill, refill, decode).
Each prefill chunk gets its own call. Decodes (one query token each) are batched into padded calls,
grouped by context length (``AttentionMetadata.decode_groups``) so that padding stays a bounded share
of the work: the cost follows the sum of the context lengths, as the cost model's decode term does,
not batch x the longest context.

A layer may scale scores other than by 1/sqrt(head_dim) (``scale``: Gemma's query_pre_attn_scalar),
cap them (``softcap``: Gemma 2's, softcap * tanh(score / softcap) before the softmax), add a logit per
head to each query's softmax (``sinks``: gpt-oss's attention sinks, keys with no value that take a share
of the probability) and see only the last ``window`` positions (a sliding-window layer: the query at
position p reads keys p - window + 1 .. p, as transformers' sliding-window mask) or only those of its
``chunk`` (Llama 4's chunked local attention: the positions cut in chunks of ``chunk``, the query at p reads
keys p - p % chunk .. p, as transformers' chunked mask). NOTE: the reference gathers only those keys: the
KV outside a layer's window or chunk is never read. A layer may also bias its scores by distance (``alibi``: Press
et al.'s ALiBi, BLOOM's, MPT's, Falcon-RW's): a slope m_h per head, and the query at position p adds m_h (j - p) to
its score of key j, as vLLM's kernels do. NOTE: transformers adds m_h j (BLOOM, Falcon) or m_h (j - n + 1) (MPT), the
same softmax but for rounding: the distance keeps the biases of the nearest keys, which weigh most, exact.

``TritonAttention`` (``triton_attention``) runs the same function as Triton kernels on CUDA (and long
prompts with nothing cached as one dense causal call each, where its setting says so).
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable, Hashable
from dataclasses import dataclass, field, replace
from functools import cached_property
from typing import TYPE_CHECKING, NamedTuple

import torch
import torch.nn.functional as F

from sloserve.engine import fused_ops
from sloserve.engine.async_scheduling import index_tensor

if TYPE_CHECKING:
    from sloserve.engine.state_cache import StateMetadata


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


class DecodeGroup(NamedTuple):
    """Decodes batched into one padded attention call (``AttentionMetadata.decode_groups``)."""

    rows: torch.Tensor  # (b,) rows of the step's decode arrays
    token_index: torch.Tensor  # (b,) flat token of each
    slots: torch.Tensor  # (b, L) context slots, L the group's longest context
    mask: torch.Tensor  # (b, 1, 1, L) True on real context tokens, False on padding


# A decode group's padded work (its size x its longest context) stays within this factor of its real
# work (the sum of its context lengths).
DECODE_PAD_LIMIT = 1.25


@dataclass
class AttentionMetadata:
    """Where the step's tokens go and what each sequence reads. Built once per step, used by every layer."""

    slot_mapping: torch.Tensor  # (num_tokens,) slot each token's K/V is written to
    prefills: list[PrefillSeq]
    decode_token_index: torch.Tensor  # (num_decodes,) position of each decode token in the flat step
    decode_slots: torch.Tensor  # (num_decodes, >= max_context) slot table; entries past a context: any slot
    decode_context_lens: torch.Tensor  # (num_decodes,) context tokens (cached + the new one)
    # the requests' states, for a model with Mamba-2 or short-convolution layers (engine/state_cache.py)
    states: StateMetadata | None = None
    _local: dict[tuple[int | None, int | None], list[DecodeGroup]] = field(default_factory=dict, repr=False)
    _fresh: dict[int, tuple[list[PrefillSeq], PackedPrefills | None]] = field(default_factory=dict, repr=False)
    _apart: dict[Hashable, tuple[list[PrefillSeq], AttentionMetadata]] = field(default_factory=dict, repr=False)

    @cached_property
    def decode_groups(self) -> list[DecodeGroup]:
        """The decodes split into groups of similar context length for padded batching, longest
        first. Built once per step (with each group's slots and mask), shared by the layers."""
        lengths = self.decode_context_lens.tolist()
        order = sorted(range(len(lengths)), key=lengths.__getitem__, reverse=True)
        groups: list[tuple[list[int], int]] = []
        work = 0
        for row in order:
            n = lengths[row]
            if groups:
                members, longest = groups[-1]
                # NOTE: rows come longest first, so a group's first row sets its padded length.
                if longest * (len(members) + 1) <= DECODE_PAD_LIMIT * (work + n):
                    members.append(row)
                    work += n
                    continue
            groups.append(([row], n))
            work = n
        device = self.decode_context_lens.device
        out = []
        for members, longest in groups:
            rows = torch.tensor(members, dtype=torch.int64, device=device)
            valid = torch.arange(longest, device=device) < self.decode_context_lens[rows].unsqueeze(1)  # (b, L)
            out.append(
                DecodeGroup(
                    rows, self.decode_token_index[rows], self.decode_slots[rows, :longest], valid[:, None, None, :]
                )
            )
        return out

    def local_decode_groups(self, window: int | None, chunk: int | None) -> list[DecodeGroup]:
        """``decode_groups`` that read only the context tokens each decode sees: its last ``window`` (a
        sliding-window layer's) or those of its ``chunk`` (a chunked layer's; one of the two), built once per
        step and layer kind."""
        groups = self._local.get((window, chunk))
        if groups is None:
            groups = []
            for batch in self.decode_groups:
                lengths = self.decode_context_lens[batch.rows]  # (b,) the decode sits at position length - 1
                longest = batch.slots.shape[1]
                first = (lengths - window).clamp(min=0) if window else (lengths - 1) // chunk * chunk  # (b,)
                offsets = torch.arange(min(window or chunk, longest), device=lengths.device)  # (W,)
                index = first[:, None] + offsets  # (b, W) context positions read
                valid = index < lengths[:, None]
                slots = batch.slots.gather(1, index.clamp(max=longest - 1))
                groups.append(DecodeGroup(batch.rows, batch.token_index, slots, valid[:, None, None, :]))
            self._local[(window, chunk)] = groups
        return groups

    @cached_property
    def packed_prefills(self) -> PackedPrefills:
        """``prefills`` packed (built by the first layer that asks, shared by the others)."""
        return pack_prefills(self.prefills, self.slot_mapping.device)

    def fresh_prefills(self, min_tokens: int) -> tuple[list[PrefillSeq], PackedPrefills | None]:
        """The prefills of at least ``min_tokens`` tokens with nothing cached before them (their
        context is this step's own tokens: a dense causal attention each), and the others packed (None
        when there are none). Built once per step and threshold, shared by the layers."""
        split = self._fresh.get(min_tokens)
        if split is None:
            fresh, others = [], []
            for seq in self.prefills:
                nothing_cached = seq.context_slots.numel() == seq.query_len
                (fresh if nothing_cached and seq.query_len >= min_tokens else others).append(seq)
            packed = pack_prefills(others, self.slot_mapping.device) if others else None
            split = self._fresh[min_tokens] = (fresh, packed)
        return split

    def prefills_apart(self, taken: Callable[[PrefillSeq], bool]) -> tuple[list[PrefillSeq], AttentionMetadata]:
        """(the prefills ``taken`` takes, this step's metadata without them): a layer attends to those itself and
        has the backend attend to the rest (MLA's prefills by head). The same decodes and slot mapping (the
        backend still writes every token's K/V); ``self`` when none is taken. Built once per step and
        ``taken`` (hashable: the layers' equal rules share it)."""
        split = self._apart.get(taken)
        if split is None:
            mine = [seq for seq in self.prefills if taken(seq)]
            if not mine:
                split = ([], self)
            else:
                rest = replace(self, prefills=[seq for seq in self.prefills if not taken(seq)], _fresh={}, _apart={})
                if "decode_groups" in self.__dict__:  # (the same decodes: their groups once a step)
                    rest.__dict__["decode_groups"] = self.decode_groups
                split = (mine, rest)
            self._apart[taken] = split
        return split


def pack_prefills(prefills: list[PrefillSeq], device: torch.device) -> PackedPrefills:
    """``prefills`` (at least one) as flat tensors."""
    context_lens = [seq.context_slots.numel() for seq in prefills]
    slot_starts = [0]
    for n in context_lens[:-1]:
        slot_starts.append(slot_starts[-1] + n)
    lens = [seq.query_len for seq in prefills]

    def tensor(values: list[int]) -> torch.Tensor:
        return index_tensor(values, device)

    return PackedPrefills(
        query_starts=tensor([seq.query_start for seq in prefills]),
        query_lens=tensor(lens),
        context_lens=tensor(context_lens),
        slot_starts=tensor(slot_starts),
        slots=torch.cat([seq.context_slots.to(torch.int64) for seq in prefills]),
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
        scale: float | None = None,
        window: int | None = None,
        softcap: float | None = None,
        sinks: torch.Tensor | None = None,  # (num_heads,)
        value_dim: int | None = None,
        chunk: int | None = None,
        alibi: torch.Tensor | None = None,  # (num_heads,) float32
    ) -> torch.Tensor:  # (num_tokens, num_heads, head_dim | value_dim)
        """``scale``: of the scores (None: 1/sqrt(head_dim)); ``window``: the positions a query sees,
        its own included (None: every earlier one); ``chunk``: the length of the chunks the positions are cut
        in, a query seeing the earlier positions of its own only (None: not cut; never with a window);
        ``softcap``: scaled scores capped to (-softcap, softcap) by softcap * tanh(score / softcap) (None: not);
        ``sinks``: a logit per head that joins the softmax of each of its queries' scores, with no value (None:
        none); ``value_dim``: keys-only attention (MLA's latent): ``v`` and ``v_cache`` are None and a key's
        first ``value_dim`` numbers are its value, so the outputs have ``value_dim`` numbers a head (None: ``v``'s
        values); ``alibi``: each head's ALiBi slope m_h, the query at position p adding m_h (j - p) to its score
        of key j (None: no bias; never with a window or chunks)."""


def write_kv(
    k: torch.Tensor,  # (num_tokens, num_kv_heads, head_dim)
    v: torch.Tensor | None,  # (num_tokens, num_kv_heads, head_dim); None: keys only (``value_dim``)
    k_cache: torch.Tensor,  # (num_slots, num_kv_heads, head_dim)
    v_cache: torch.Tensor | None,  # (num_slots, num_kv_heads, head_dim)
    meta: AttentionMetadata,
) -> None:
    """Store this step's K/V at the slots the KV manager assigned (every backend does this first): one
    kernel for both on CUDA with the fused kernels on (``fused_ops.write_kv``), two index copies else.

    NOTE: no two tokens share a slot (but padding rows, which all write the pad slot), so the copy is
    deterministic."""
    fused_ops.write_kv(k, v, k_cache, v_cache, meta.slot_mapping)


def gather_kv(cache: torch.Tensor, slots: torch.Tensor) -> torch.Tensor:
    """``cache`` rows at ``slots`` (any shape): (*slots.shape, num_kv_heads, head_dim)."""
    return cache.index_select(0, slots.reshape(-1)).view(*slots.shape, *cache.shape[1:])


WRITTEN_SCORES_PER_CALL = 1 << 24  # (64 MB of float32 scores)


def attend(
    query, keys, values, mask, scale: float | None, softcap: float | None, sinks=None, bias=None
) -> torch.Tensor:
    """SDPA of ``query`` (..., q, hd) over ``keys``/``values`` (..., k, hd) where ``mask`` (broadcast to
    (..., q, k); None: causal, top-left) is true; with ``softcap``, ``sinks`` (broadcast to (..., q, 1): the
    logit of a key with no value, in each row's softmax) or ``bias`` (float32, broadcast to (..., q, k): added to
    the scaled, capped scores), written out: SDPA can neither cap nor sink, and takes a bias in the query's dtype
    only."""
    if softcap is None and sinks is None and bias is None:
        if mask is None:
            return F.scaled_dot_product_attention(query, keys, values, is_causal=True, scale=scale)
        return F.scaled_dot_product_attention(query, keys, values, attn_mask=mask, scale=scale)
    scale = query.shape[-1] ** -0.5 if scale is None else scale
    if mask is None:
        mask = torch.ones(query.shape[-2], keys.shape[-2], dtype=torch.bool, device=query.device).tril()
    # NOTE: the scores of at most WRITTEN_SCORES_PER_CALL (query, key) pairs at once: a long prompt's whole
    # matrix would not fit (8K tokens, 8 heads: 2 GB of float32)
    heads = query[..., 0, 0].numel()
    rows = max(1, WRITTEN_SCORES_PER_CALL // max(1, heads * keys.shape[-2]))
    out = []
    for start in range(0, query.shape[-2], rows):
        scores = query[..., start : start + rows, :] @ keys.transpose(-1, -2) * scale  # (..., rows, k)
        if softcap is not None:
            scores = torch.tanh(scores / softcap) * softcap
        visible = mask if mask.shape[-2] == 1 else mask[..., start : start + rows, :]  # (a decode's: one row)
        scores = scores.masked_fill(~visible, float("-inf")).float()
        if bias is not None:
            scores += bias if bias.shape[-2] == 1 else bias[..., start : start + rows, :]
        if sinks is None:
            probs = torch.softmax(scores, dim=-1)
        else:  # the sink's column joins the softmax, then is dropped
            sink = (sinks if sinks.shape[-2] == 1 else sinks[..., start : start + rows, :]).float()
            probs = torch.softmax(torch.cat((scores, sink.expand(*scores.shape[:-1], 1)), dim=-1), dim=-1)[..., :-1]
        out.append(probs.to(values.dtype) @ values)
    return torch.cat(out, dim=-2)


def first_visible(position: int, window: int | None, chunk: int | None) -> int:
    """The first key a query at ``position`` sees: within a ``window`` position - window + 1, within a ``chunk``
    its chunk's first position, else 0."""
    if window is not None:
        return max(0, position - window + 1)
    return 0 if chunk is None else position - position % chunk


def causal_mask(
    query_len: int,
    context_len: int,
    device: torch.device,
    first: int = 0,
    window: int | None = None,
    chunk: int | None = None,
) -> torch.Tensor:  # (c, n - first) bool
    """Which of a context's keys ``first`` .. n - 1 each of its last c tokens sees: query i sits at position
    n - c + i and sees keys 0 .. n - c + i (bottom-right causal), within a ``window`` the last ``window`` of them,
    within a ``chunk`` those of its chunk."""
    c, n = query_len, context_len
    rows = torch.arange(c, device=device).unsqueeze(1) + (n - c)  # (c, 1)
    positions = torch.arange(first, n, device=device).unsqueeze(0)  # (1, n - first)
    mask = positions <= rows
    if window is not None:
        mask &= positions > rows - window
    if chunk is not None:
        mask &= positions >= rows - rows % chunk
    return mask


def alibi_bias(slopes: torch.Tensor, query_positions: torch.Tensor, key_positions: torch.Tensor) -> torch.Tensor:
    """ALiBi's biases, m_h (j - p): ``slopes`` (nh,) float32, ``query_positions`` (..., q), ``key_positions`` (..., k)
    -> (..., nh, q, k) float32."""
    distance = key_positions.unsqueeze(-2) - query_positions.unsqueeze(-1)  # (..., q, k)
    return slopes.view(-1, 1, 1) * distance.unsqueeze(-3).float()


def _expand_kv(x: torch.Tensor, group: int) -> torch.Tensor:
    """(..., num_kv_heads, head_dim) -> (..., num_heads, head_dim) for grouped-query attention."""
    return x if group == 1 else x.repeat_interleave(group, dim=-2)


class TorchAttention(AttentionBackend):
    """PyTorch reference backend: gather by slot, explicit offset causal mask, SDPA. Runs everywhere."""

    name = "torch"

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
        local = window is not None or chunk is not None
        assert alibi is None or not local, "ALiBi with a window or chunks"
        out = q.new_empty((*q.shape[:2], value_dim or v_cache.shape[-1]))
        group = q.shape[1] // k.shape[1]
        nkv = k.shape[1]
        head_sinks = None if sinks is None else sinks.view(1, -1, 1, 1)  # (1, nh, 1, 1): a prefill's heads
        group_sinks = None if sinks is None else sinks.view(1, nkv, group, 1)  # a decode's: (KV head, its queries)
        for seq in meta.prefills:
            s, c = seq.query_start, seq.query_len
            n = seq.context_slots.numel()  # context length; the first n - c tokens were cached
            # A window or a chunk: the keys before the first query's first are not read
            first = first_visible(n - c, window, chunk)
            slots = seq.context_slots[first:]
            # NOTE: 4-D inputs (a batch of one): on the CPU, SDPA takes its flash kernel for 4-D inputs
            # but the math path for 3-D ones, which builds the whole c x n score matrix (9x slower at
            # 1024 tokens, and slower still once the scores outgrow the cache).
            keys = _expand_kv(gather_kv(k_cache, slots), group).transpose(0, 1)[None]  # (1, nh, n - first, hd)
            if value_dim is None:
                values = _expand_kv(gather_kv(v_cache, slots), group).transpose(0, 1)[None]  # (1, nh, n - first, hd)
            else:  # (the keys' first numbers: gathered once)
                values = keys[..., :value_dim]
            query = q[s : s + c].transpose(0, 1)[None]  # (1, nh, c, hd)
            bias = None
            if alibi is not None:
                positions = torch.arange(n, device=q.device)
                bias = alibi_bias(alibi, positions[n - c :], positions)  # (nh, c, n)
            # Nothing cached (and no bias): both alignments agree, and SDPA skips masked tiles
            if n == c and not local and bias is None:
                attended = attend(query, keys, values, None, scale, softcap, head_sinks)
            else:
                mask = causal_mask(c, n, q.device, first, window, chunk)
                attended = attend(query, keys, values, mask, scale, softcap, head_sinks, bias)
            out[s : s + c] = attended[0].transpose(0, 1)
        for batch in meta.local_decode_groups(window, chunk) if local else meta.decode_groups:
            keys = gather_kv(k_cache, batch.slots).permute(0, 2, 1, 3)  # (b, nkv, L, hd)
            if value_dim is None:
                values = gather_kv(v_cache, batch.slots).permute(0, 2, 1, 3)  # (b, nkv, L, hd)
            else:
                values = keys[..., :value_dim]
            # GQA without copying K/V per query head: a group's `group` query heads are the "query
            # tokens" of one SDPA row against their KV head (head h reads KV head h // group).
            query = q[batch.token_index].view(-1, nkv, group, q.shape[2])  # (b, nkv, group, hd)
            bias = None
            if alibi is not None:  # (b, nh, 1, L) -> (b, nkv, group, L): a decode sits at its context's last position
                last = batch.mask.sum(-1).view(-1, 1) - 1  # (b, 1)
                key_positions = torch.arange(batch.slots.shape[1], device=q.device).expand(len(last), -1)
                bias = alibi_bias(alibi, last, key_positions).view(len(last), nkv, group, -1)
            attended = attend(query, keys, values, batch.mask, scale, softcap, group_sinks, bias)  # padding masked
            out[batch.token_index] = attended.flatten(1, 2)
        return out
