"""DeepSeek-V2 (``deepseek_v2``: V2-Lite 16B, V2 and V2.5 236B) and DeepSeek-V3's outline (``deepseek_v3``:
Moonlight 16B, DeepSeek-V3 and R1, Kimi K2): Llama's layers with multi-head latent attention (MLA) and,
after the first ``first_k_dense_replace`` layers, a mixture of experts beside shared experts (DeepSeek-V2
§2.1, §2.2; V3's experts chosen by sigmoid scores plus a bias, DeepSeek-V3 §2.1.2). HF parameter names.

MLA (§2.1): a token's keys and values come from one compressed latent c_KV (``kv_lora_rank``, d_c: 512) and
one rotated key k_R shared by every head (``qk_rope_head_dim``, d_h^R: 64): head i's key is [W_UK_i c_KV;
k_R] and its value W_UV_i c_KV (``kv_b_proj`` holds W_UK and W_UV). The KV cache holds [c_KV; k_R] alone
(576 numbers a token and layer, where keys and values by head would hold heads x (192 + 128)), and the
attention runs on it, W_UK absorbed into the queries and W_UV applied to the heads' outputs (§2.1.2): the
scores q_C,i^T W_UK_i c_KV + q_R,i^T k_R, the output W_UV_i sum_j p_ij c_KV,j. As every query head reads
the one latent, the backends see multi-query attention of 576-dim keys whose first 512 numbers are their
values (``value_dim``): the cache holds keys only (``KVCacheTensor``), 1/8.9 of V2-Lite's keys and values
by head (16 heads), 1/71 of V2's (128 heads). The absorbed scores equal transformers' (which expands the
latent to keys and values by head) up to the order of the sums. A long prefill attends by head instead
(``PrefillsByHead``: its context's latents up-projected, as transformers and vLLM's prefills do), where
that costs fewer FLOPs: a (query, key) pair 768 of them, not the latent's 2,176.

NOTE: DeepSeek's checkpoints rotate adjacent pairs of q_R and k_R (transformers' complex product; V3's where
``rope_interleave``); their rows load reordered to halves (``checkpoint_tensor``), so that the engine's
rotate-half gives the same scores. A V3 checkpoint's multi-token-prediction layers (past
``num_hidden_layers``) are not read, as vLLM serves it without them.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from sloserve.checkpoint.model_config import ModelConfig
from sloserve.engine.attention import AttentionBackend, PrefillSeq, attend, causal_mask, gather_kv
from sloserve.engine.models.llama import (
    LlamaDecoderLayer,
    LlamaForCausalLM,
    LlamaModel,
    RMSNorm,
    apply_rotary,
    past_the_layers,
)

# transformers' DeepseekV2RMSNorm default: the latents' norms do not take the config's rms_norm_eps
LATENT_NORM_EPS = 1e-6
# A prefill's keys and values by head stay within this many numbers (a layer's at a time; else it attends
# over the latent): 1 GiB in bf16, V2-Lite's 87K context tokens (16 heads, 192 + 192 numbers a head), V2's 11K
BY_HEAD_MAX_NUMBERS = 1 << 29


@dataclass(frozen=True)
class PrefillsByHead:
    """Which prefills MLA attends to by head (its keys and values up-projected from the context's latents,
    §2.1.1's form, as transformers computes and vLLM's prefills run) rather than over the latent (§2.1.2):
    those where it takes fewer FLOPs and its keys and values stay within ``max_numbers``.

    NOTE: our rule, by arithmetic: over the latent a (query, key) pair and head costs 2 (d_c + d_h^R) + 2 d_c
    FLOPs (2,176 for V2's 512 + 64), by head 4 (d_h + d_h^R) (768: the values padded to the keys' 192, as
    SDPA's fast kernels need equal widths), but by head each context token's keys and values are first
    up-projected, 2 d_c (d_h + d_v) FLOPs a head (262,144). A prompt with nothing cached goes by head from
    372 tokens (c (c + 1) / 2 pairs), a chunk after 4K cached tokens from 191 (187 after 32K); decodes and
    shorter chunks stay on the latent. vLLM takes every prefill by head."""

    saved_flops_per_pair: int  # a (query, key) pair's, a head: over the latent minus by head
    flops_per_key: int  # a context token's keys and values up-projected, a head
    numbers_per_key: int  # a context token's keys and values by head, every head
    max_numbers: int = BY_HEAD_MAX_NUMBERS

    @classmethod
    def of(cls, nh: int, latent_dim: int, nope_dim: int, rope_dim: int, v_dim: int) -> PrefillsByHead:
        qk = nope_dim + rope_dim
        over_latent, by_head = 2 * (latent_dim + rope_dim) + 2 * latent_dim, 4 * qk
        return cls(over_latent - by_head, 2 * latent_dim * (nope_dim + v_dim), nh * 2 * qk)

    def __call__(self, seq: PrefillSeq) -> bool:
        c, n = seq.query_len, seq.context_slots.numel()  # this step's tokens, the context they read (cached + c)
        pairs = c * (n - c) + c * (c + 1) // 2  # causal (query, key) pairs
        return (
            pairs * self.saved_flops_per_pair > n * self.flops_per_key and n * self.numbers_per_key <= self.max_numbers
        )


class MultiHeadLatentAttention(nn.Module):
    """MLA (module docstring): ``project`` gives the queries by head and the token's latent as its key (the
    cache's entry), ``attend`` each head's values, over the latent with the up-projections absorbed or, for
    the prefills ``prefills_by_head`` takes, by head; ``output`` the output projection."""

    def __init__(self, config: ModelConfig, backend: AttentionBackend, layer: int) -> None:
        super().__init__()
        h, nh, mla, bias = config.hidden_size, config.num_attention_heads, config.mla, config.attention_bias
        self.num_heads, self.q_lora_rank = nh, mla["q_lora_rank"]
        self.nope_dim, self.rope_dim = mla["qk_nope_head_dim"], mla["qk_rope_head_dim"]  # d_h, d_h^R
        self.latent_dim, self.v_dim = mla["kv_lora_rank"], mla["v_head_dim"]  # d_c, d_h (values)
        qk = self.nope_dim + self.rope_dim
        if self.q_lora_rank is None:
            self.q_proj = nn.Linear(h, nh * qk, bias=False)
        else:  # the queries through a latent of their own (d_c': q_lora_rank), V2's
            self.q_a_proj = nn.Linear(h, self.q_lora_rank, bias=bias)
            self.q_a_layernorm = RMSNorm(self.q_lora_rank, LATENT_NORM_EPS)
            self.q_b_proj = nn.Linear(self.q_lora_rank, nh * qk, bias=False)
        self.kv_a_proj_with_mqa = nn.Linear(h, self.latent_dim + self.rope_dim, bias=bias)  # W_DKV and W_KR
        self.kv_a_layernorm = RMSNorm(self.latent_dim, LATENT_NORM_EPS)
        self.kv_b_proj = nn.Linear(self.latent_dim, nh * (self.nope_dim + self.v_dim), bias=False)  # W_UK, W_UV
        self.o_proj = nn.Linear(nh * self.v_dim, h, bias=bias)
        self.scale = qk**-0.5 * yarn_softmax_scale(config) ** 2
        self.prefills_by_head = PrefillsByHead.of(nh, self.latent_dim, self.nope_dim, self.rope_dim, self.v_dim)
        self.rotates = config.layer_rotates(layer)  # (Kimi Linear's: q_R and k_R as they are, no position embedding)
        self.backend = backend

    def _up_projections(self) -> tuple[torch.Tensor, torch.Tensor]:
        """(W_UK (nh, d_h, d_c), W_UV (nh, d_h values, d_c)): views of ``kv_b_proj``'s weight."""
        weight = self.kv_b_proj.weight.view(self.num_heads, self.nope_dim + self.v_dim, self.latent_dim)
        return weight[:, : self.nope_dim], weight[:, self.nope_dim :]

    def project(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor):
        """(queries (T, nh, d_h + d_h^R), the latent as the key (T, 1, d_c + d_h^R), None: no values of its own),
        rotated."""
        t, nh = x.shape[0], self.num_heads
        q = self.q_proj(x) if self.q_lora_rank is None else self.q_b_proj(self.q_a_layernorm(self.q_a_proj(x)))
        q_nope, q_rope = q.view(t, nh, -1).split((self.nope_dim, self.rope_dim), dim=-1)  # (T, nh, d_h), (T, nh, d_h^R)
        compressed = self.kv_a_proj_with_mqa(x)  # (T, d_c + d_h^R)
        latent, k_rope = compressed.split((self.latent_dim, self.rope_dim), dim=-1)  # (T, d_c), (T, d_h^R)
        scaled = cos.shape[1] == 2  # (Llama 4's query scale s, Mistral Small 4's: the queries' tables first)
        q_cos, q_sin, cos, sin = cos[:, :1], sin[:, :1], cos[:, -1:], sin[:, -1:]  # (T, 1, d_h^R) each
        if scaled:  # the queries' tables are the keys' times s (``Rotary``): they turn q_R scaled by s; q_C is
            # scaled by s too, the length of a (cos, sin) pair of those tables
            q_nope = q_nope * torch.sqrt(q_cos[..., :1] ** 2 + q_sin[..., :1] ** 2)
        k_rope = k_rope[:, None]  # (T, 1, d_h^R)
        if self.rotates:
            q_rope, k_rope = apply_rotary(q_rope, q_cos, q_sin), apply_rotary(k_rope, cos, sin)
        q = torch.cat((q_nope, q_rope), dim=-1)  # (T, nh, d_h + d_h^R)
        kv = torch.cat((self.kv_a_layernorm(latent)[:, None], k_rope), dim=-1)
        return q, kv, None  # (T, 1, d_c + d_h^R) the cache's entry

    def attend(self, q, k, v, k_cache, v_cache, meta) -> torch.Tensor:
        """Each head's values (T, nh, d_h values): the backend's attention over the latents (each key's c_KV its
        value), W_UK absorbed into the queries and W_UV applied to the weighted latents (§2.1.2); the prefills
        ``prefills_by_head`` takes by head (``_attend_by_head``), after the backend has cached their latents."""
        by_head, meta = meta.prefills_apart(self.prefills_by_head)
        w_uk, w_uv = self._up_projections()
        q_nope, q_rope = q.split((self.nope_dim, self.rope_dim), dim=-1)
        q_latent = torch.cat((torch.einsum("thn,hnc->thc", q_nope, w_uk), q_rope), dim=-1)  # (T, nh, d_c + d_h^R)
        weighted = self.backend.forward(
            q_latent, k, v, k_cache, v_cache, meta, scale=self.scale, value_dim=self.latent_dim
        )  # (T, nh, d_c)
        values = torch.einsum("thc,hvc->thv", weighted, w_uv)  # (T, nh, d_h values)
        for seq in by_head:
            rows = slice(seq.query_start, seq.query_start + seq.query_len)
            values[rows] = self._attend_by_head(q[rows], k_cache, seq.context_slots)
        return values

    def _attend_by_head(self, q: torch.Tensor, k_cache: torch.Tensor, context_slots: torch.Tensor) -> torch.Tensor:
        """One prefill's attention by head: q (c, nh, d_h + d_h^R) over its context's n cached entries, their
        latents up-projected to keys and values by head -> (c, nh, d_h values)."""
        c, n = q.shape[0], context_slots.numel()
        latent, k_rope = gather_kv(k_cache, context_slots)[:, 0].split((self.latent_dim, self.rope_dim), dim=-1)
        up = self.kv_b_proj(latent).view(n, self.num_heads, self.nope_dim + self.v_dim)  # (n, nh, d_h + d_v)
        k_nope, values = up.split((self.nope_dim, self.v_dim), dim=-1)
        keys = torch.cat((k_nope, k_rope[:, None].expand(n, self.num_heads, self.rope_dim)), dim=-1)  # (n, nh, qk)
        # (the values padded to the keys' width: SDPA's flash kernels take equal widths only)
        values = F.pad(values, (0, keys.shape[-1] - self.v_dim))  # (n, nh, qk)
        mask = None if n == c else causal_mask(c, n, q.device)  # (None: nothing cached, causal top-left)
        heads_first = [x.transpose(0, 1)[None] for x in (q, keys, values)]  # (1, nh, c | n, qk)
        out = attend(*heads_first, mask, self.scale, None)  # (1, nh, c, qk)
        return out[0, ..., : self.v_dim].transpose(0, 1)

    def output(self, values: torch.Tensor) -> torch.Tensor:  # (T, nh, d_h values) -> (T, H)
        """The output projection of the heads' values."""
        return self.o_proj(values.reshape(values.shape[0], -1))


def yarn_softmax_scale(config: ModelConfig) -> float:
    """DeepSeek's YaRN factor of the softmax scale (0.1 mscale_all_dim ln s + 1, squared by the caller), 1
    without it (transformers' ``yarn_apply_mscale``)."""
    scaling = config.rope_scaling or {}
    factor, mscale_all_dim = scaling.get("factor") or 1.0, scaling.get("mscale_all_dim")
    if scaling.get("rope_type", scaling.get("type")) != "yarn" or not mscale_all_dim or factor <= 1:
        return 1.0
    return 0.1 * mscale_all_dim * math.log(factor) + 1.0


class DeepseekV2DecoderLayer(LlamaDecoderLayer):
    """Llama's layer with MLA; its MLPs (dense, then DeepSeek's experts: ``moe.DeepseekMoE``) Llama's ``mlp``."""

    def make_attention(self, config: ModelConfig, backend: AttentionBackend, layer: int) -> nn.Module:
        return MultiHeadLatentAttention(config, backend, layer)


class DeepseekV2Model(LlamaModel):
    layer_class = DeepseekV2DecoderLayer


class DeepseekV2ForCausalLM(LlamaForCausalLM):
    model_class = DeepseekV2Model


def checkpoint_tensor(key: str, tensor: torch.Tensor, config: ModelConfig) -> tuple[str, torch.Tensor] | None:
    """A DeepSeek checkpoint's tensor as the engine holds it: the rows of q_R (the last d_h^R of each query
    head) and of k_R (the last d_h^R of ``kv_a_proj_with_mqa``) from adjacent pairs to halves; None for a
    multi-token-prediction layer's (past the model's layers)."""
    if past_the_layers(key, config):
        return None
    mla = config.mla
    rope = mla["qk_rope_head_dim"]
    if not mla["rope_interleave"]:
        return key, tensor
    if key.endswith(("self_attn.q_proj.weight", "self_attn.q_b_proj.weight")):
        tensor = _pairs_as_halves(tensor, mla["qk_nope_head_dim"] + rope, rope)
    elif key.endswith(("self_attn.kv_a_proj_with_mqa.weight", "self_attn.kv_a_proj_with_mqa.bias")):
        tensor = _pairs_as_halves(tensor, mla["kv_lora_rank"] + rope, rope)
    return key, tensor


def _pairs_as_halves(tensor: torch.Tensor, block: int, rope: int) -> torch.Tensor:
    """``tensor``'s rows in blocks of ``block``, each block's last ``rope`` rows reordered from adjacent pairs
    (2i, 2i + 1) to halves (i, i + rope / 2)."""
    tail = torch.cat((torch.arange(0, rope, 2), torch.arange(1, rope, 2))) + block - rope
    order = torch.cat((torch.arange(block - rope), tail))  # (block,)
    blocks = tensor.shape[0] // block
    rows = (torch.arange(blocks)[:, None] * block + order[None, :]).flatten()
    return tensor[rows.to(tensor.device)]
