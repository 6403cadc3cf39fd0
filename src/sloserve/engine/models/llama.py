"""The Llama family (Llama-2/3, Mistral-style grouped-query attention), Qwen2/2.5 (QKV biases) and
Qwen3 (an RMSNorm of each query and key head, ``q_norm`` and ``k_norm``, before the rotary embedding).

Token-major: inputs are flat ``[num_tokens]`` ids with their positions; there is no batch dimension.
Parameter names follow the HF checkpoints (``model.layers.N.self_attn.q_proj.weight``...), so a
safetensors file loads by name.
"""

from __future__ import annotations

import dataclasses
import math

import torch
import torch.nn.functional as F
from torch import nn

from sloserve.checkpoint.model_config import ModelConfig
from sloserve.checkpoint.model_types import UNGATED_SHARED_EXPERTS
from sloserve.core.errors import ConfigError
from sloserve.engine import fused_ops
from sloserve.engine.attention import AttentionBackend, AttentionMetadata
from sloserve.engine.kv_cache import layer_caches
from sloserve.engine.models.mamba1 import Mamba1Mixer
from sloserve.engine.models.mamba2 import Mamba2Mixer
from sloserve.engine.models.moe import DeepseekMoE, GptOssMoE, SparseMoE


class RMSNorm(nn.Module):
    """RMSNorm as one ``F.rms_norm`` call (torch's ``_fused_rms_norm`` op, accumulating in float32).

    NOTE: HF rounds the normalized activations to the model's dtype before scaling by the weight;
    the fused kernel rounds once, after. Equal in float32 (the CPU tests); in bf16 within a rounding.
    """

    def __init__(self, size: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # (T, H)
        return F.rms_norm(x, self.weight.shape, self.weight, self.eps)

    def add_and_norm(self, x: torch.Tensor, residual: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(this norm of ``x + residual``, ``x + residual``), each (T, H): a layer's output joins the
        residual stream and the next part's input is normalized from it, one kernel on CUDA
        (``fused_ops.add_rms_norm``)."""
        return fused_ops.add_rms_norm(x, residual, self.weight, self.eps)


class AddAndNorm:
    """RMSNorm's ``add_and_norm`` for another norm (a module of one input), so that a layer of it in Llama's
    outline runs as Llama's, on piecewise graphs too (Gemma 1, StarCoder2, StableLM, OLMo 1, Nemotron)."""

    def add_and_norm(self, x: torch.Tensor, residual: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(this norm of ``x + residual``, ``x + residual``), each (T, H)."""
        summed = x + residual
        return self(summed), summed


class LayerNorm(AddAndNorm, nn.LayerNorm):
    """``nn.LayerNorm`` (a weight and a bias) in Llama's outline (StarCoder2, StableLM)."""

    def __init__(self, size: int, eps: float) -> None:
        super().__init__(size, eps=eps)


class MergedParts:
    """A module whose weight (and bias) rows are several checkpoint tensors': ``parts`` names them in row order, each
    with its rows."""

    parts: dict[str, int]

    def checkpoint_views(self) -> dict[str, torch.Tensor]:
        """``{"q_proj.weight": rows of the weight, ...}``: views that share the merged storage."""
        views, start = {}, 0
        for name, rows in self.parts.items():
            views[f"{name}.weight"] = self.weight[start : start + rows]
            if self.bias is not None:
                views[f"{name}.bias"] = self.bias[start : start + rows]
            start += rows
        return views


class MergedLinear(MergedParts, nn.Linear):
    """Several projections of one input as one matmul (vLLM merges Q/K/V and gate/up this way):
    fewer kernel launches per layer. ``parts`` names the checkpoint's projections in row order; each
    loads into its rows of the merged weight (``checkpoint_views``)."""

    def __init__(self, in_features: int, parts: dict[str, int], bias: bool) -> None:
        super().__init__(in_features, sum(parts.values()), bias=bias)
        self.parts = parts


def qkv_projection(config: ModelConfig) -> MergedLinear:
    """An attention's Q, K and V projections as one (the checkpoint's ``q_proj``, ``k_proj``, ``v_proj``)."""
    hd, nh, nkv = config.head_dim, config.num_attention_heads, config.num_key_value_heads
    parts = {"q_proj": nh * hd, "k_proj": nkv * hd, "v_proj": nkv * hd}
    return MergedLinear(config.hidden_size, parts, bias=config.attention_bias)


def rope_inv_freq(config: ModelConfig, long_factors: bool = False) -> torch.Tensor:
    """(rotary_dim / 2,) inverse frequencies, with linear, Llama-3, YaRN or LongRoPE scaling applied (or a
    GGUF file's frequency factors, llama.cpp's form of Llama 3's). ``long_factors``: LongRoPE's long ones."""
    dim = config.rotary_dim
    exponents = torch.arange(0, dim, 2, dtype=torch.int64).float() / dim  # (rotary_dim / 2,)
    inv_freq = 1.0 / (config.rope_theta**exponents)
    scaling = config.rope_scaling
    if scaling is None:
        return inv_freq
    kind = scaling.get("rope_type", scaling.get("type"))
    if kind == "longrope":  # each frequency slowed by its factor (rescale factors lambda_i of LongRoPE)
        factors = torch.tensor(scaling["long_factor" if long_factors else "short_factor"], dtype=torch.float32)
        return 1.0 / (factors * config.rope_theta**exponents)  # NOTE: transformers' order of operations
    if kind == "frequency_factors":  # each wavelength stretched by its factor, as llama.cpp's rope does
        return inv_freq / torch.tensor(scaling["factors"], dtype=torch.float32)  # NOTE: one a frequency
    if kind == "proportional":  # (LFM3's full layers: the first partial_rotary_factor of the pairs turn, at the
        # whole head's frequencies; the others do not turn at all: frequency 0)
        turned = int(scaling.get("partial_rotary_factor", 1.0) * config.head_dim // 2)
        inv_freq = torch.cat((inv_freq[:turned], torch.zeros(len(inv_freq) - turned)))
        return inv_freq / float(scaling.get("factor", 1.0))
    if kind == "yarn":
        return yarn_inv_freq(config, inv_freq)
    factor = float(scaling["factor"])
    if kind == "linear":
        return inv_freq / factor
    # Llama 3.1: long wavelengths slowed by ``factor``, short ones kept, a smooth ramp in between.
    low, high = float(scaling["low_freq_factor"]), float(scaling["high_freq_factor"])
    old_len = float(scaling["original_max_position_embeddings"])
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > old_len / low, inv_freq / factor, inv_freq)
    smooth = (old_len / wavelen - low) / (high - low)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    medium = (wavelen >= old_len / high) & (wavelen <= old_len / low)
    return torch.where(medium, smoothed, scaled)


def yarn_factor(config: ModelConfig) -> float:
    """YaRN's context extension s: ``factor``, or the context over the pretrained one where not given."""
    scaling = config.rope_scaling or {}
    factor = scaling.get("factor")
    return float(factor or config.max_position_embeddings / scaling["original_max_position_embeddings"])


def yarn_inv_freq(config: ModelConfig, inv_freq: torch.Tensor) -> torch.Tensor:
    """YaRN (Peng et al. 2023, "NTK-by-parts"), as transformers computes it: frequencies that turn more
    than ``beta_fast`` times over the pretrained context are kept (extrapolated), those that turn fewer
    than ``beta_slow`` times divided by the factor (interpolated), a linear ramp over the dimensions
    between."""
    scaling = config.rope_scaling or {}
    dim, base = config.rotary_dim, config.rope_theta  # (transformers': the dimensions it turns)
    old_len = float(scaling["original_max_position_embeddings"])
    beta_fast, beta_slow = scaling.get("beta_fast") or 32, scaling.get("beta_slow") or 1

    def dimension_of(rotations: float) -> float:  # the dimension that turns ``rotations`` times over old_len
        return dim * math.log(old_len / (rotations * 2 * math.pi)) / (2 * math.log(base))

    low, high = dimension_of(beta_fast), dimension_of(beta_slow)
    if scaling.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001  # NOTE: transformers' guard against a zero-width ramp
    ramp = ((torch.arange(dim // 2, dtype=torch.float32) - low) / (high - low)).clamp(0, 1)
    extrapolated = 1 - ramp  # (hd / 2,): 1 where the frequency is kept
    return inv_freq / yarn_factor(config) * ramp + inv_freq * extrapolated


def rope_attention_factor(config: ModelConfig, long_factors: bool = False) -> float:
    """The factor YaRN and LongRoPE scale cos and sin by (so the attention logits by its square):
    ``attention_factor``, else YaRN's 0.1 ln(s) + 1 (with DeepSeek's ``mscale``/``mscale_all_dim`` where
    given) or LongRoPE's sqrt(1 + ln(s) / ln(L)), s the context over the pretrained one L; Phi-3.5-MoE's its
    ``short_mscale`` or ``long_mscale`` (with ``long_factors``), as transformers' Phimoe reads them; 1 for the
    others."""
    scaling = config.rope_scaling or {}
    kind = scaling.get("rope_type", scaling.get("type"))
    if kind not in ("yarn", "longrope"):
        return 1.0
    if config.model_type == "phimoe" and kind == "longrope":
        return float(scaling["long_mscale" if long_factors else "short_mscale"])
    if scaling.get("attention_factor") is not None:
        return float(scaling["attention_factor"])
    if kind == "longrope":  # NOTE: the same for the short and the long factors, as in transformers and vLLM
        original = scaling["original_max_position_embeddings"]
        factor = scaling.get("factor") or config.max_position_embeddings / original
        return 1.0 if factor <= 1 else math.sqrt(1 + math.log(factor) / math.log(original))
    factor = yarn_factor(config)

    def mscale(scale: float) -> float:
        return 1.0 if factor <= 1 else 0.1 * scale * math.log(factor) + 1.0

    if scaling.get("mscale") and scaling.get("mscale_all_dim"):
        return mscale(scaling["mscale"]) / mscale(scaling["mscale_all_dim"])
    return mscale(1.0)


class Rotary(nn.Module):
    """Rotary position embedding (rotate-half layout), cos/sin tables built once per device and
    gathered once per step for every layer."""

    table_dtype: torch.dtype | None = None  # (the dtype of a step's tables; None: the model's)

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.config = config
        self._tables: tuple[torch.Tensor, torch.Tensor] | None = None
        scaling = config.rope_scaling or {}
        # LongRoPE: the long factors wherever the served context exceeds the pretrained one, at every
        # position, as vLLM chooses them (``serve_context``; until an engine says: the model's whole context).
        # NOTE: transformers switches per forward call, by the longest position in it, so a sequence that
        # grows past the pretrained context holds keys rotated by both; vLLM and llama.cpp keep one set.
        self.pretrained_context = scaling.get("original_max_position_embeddings") if _is_longrope(config) else None
        self.long_factors = (
            self.pretrained_context is not None and config.max_position_embeddings > self.pretrained_context
        )
        self.served_context: int | None = None
        # A model none of whose layers rotates (Nemotron-H's, Granite 4.0-H's, Mamba's) keeps no tables: its steps'
        # cos and sin are zeros of their shape, read by no layer (a GGUF file's context of 2**20 would hold 512 MB)
        self.unused = config.rotary_table_rows == 1 and not any(
            config.layer_rotates(i) for i in range(config.num_hidden_layers)
        )

    def serve_context(self, max_model_len: int) -> None:
        """An engine serves contexts of ``max_model_len`` tokens with this model: the tables hold the positions of
        the longest context an engine of it serves (not all of the model's: Llama 4 Scout's 10M would take 10 GB),
        LongRoPE's factors those for it. A model serves one choice of factors: another engine's that needs the other
        ones is a ConfigError."""
        if self.pretrained_context is not None:
            long_factors = max_model_len > self.pretrained_context
            if self.served_context is not None and long_factors != self.long_factors:
                raise ConfigError(
                    f"{self.config.name}: this loaded model serves contexts of {self.served_context} tokens with "
                    f"LongRoPE's {'long' if self.long_factors else 'short'} factors (its pretrained context: "
                    f"{self.pretrained_context}); max_model_len {max_model_len} needs the other ones: load it again"
                )
            if long_factors != self.long_factors:
                self._tables = None
            self.long_factors = long_factors
        if self._tables is not None and self._tables[0].shape[0] < max_model_len:
            self._tables = None
        self.served_context = max(self.served_context or 0, max_model_len)

    def tables(self, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
        """(cos, sin), each (positions, rotary_dim) float32: of the served positions (``serve_context``; all of the
        model's until an engine says)."""
        if self._tables is None or self._tables[0].device != device:
            inv_freq = rope_inv_freq(self.config, self.long_factors).to(device)
            rows = 1 if self.unused else self.served_context or self.config.max_position_embeddings
            positions = torch.arange(rows, device=device).float()
            freqs = torch.outer(positions, inv_freq)  # (max_pos, rotary_dim / 2)
            emb = torch.cat((freqs, freqs), dim=-1)  # (max_pos, rotary_dim)
            scale = rope_attention_factor(self.config, self.long_factors)
            self._tables = (emb.cos() * scale, emb.sin() * scale)
        return self._tables

    def for_positions(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """(cos, sin), each (T, 1, rotary_dim), of this step's positions; with Llama 4's attention scaling
        (Ministral 3), (T, 2, rotary_dim): the queries' tables (scaled by their positions' factor) then the
        keys'. NOTE: scaling q's rotated halves by s is scaling the rotated q by s (a whole head turns)."""
        if self.unused:
            zeros = torch.zeros(positions.shape[0], 1, self.config.rotary_dim, dtype=dtype, device=positions.device)
            return zeros, zeros
        cos, sin = self.tables(positions.device)
        cos, sin = cos[positions].unsqueeze(1), sin[positions].unsqueeze(1)  # (T, 1, rotary_dim) float32
        beta = self.config.llama4_scaling_beta
        if beta is not None:
            original = self.config.rope_scaling["original_max_position_embeddings"]
            scale = 1 + beta * torch.log(1 + torch.floor(positions / original))  # (T,)
            cos, sin = (torch.cat((t * scale[:, None, None], t), dim=1) for t in (cos, sin))
        return cos.to(dtype), sin.to(dtype)


def _is_longrope(config: ModelConfig) -> bool:
    scaling = config.rope_scaling or {}
    return scaling.get("rope_type", scaling.get("type")) == "longrope"


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x: (T, heads, hd); cos, sin: (T, 1, rotary_dim), rotary_dim <= hd: the leading dimensions of each head
    turn, the rest pass through (Phi-4 mini's partial rotary). One fused kernel on CUDA (``fused_ops``)."""
    rotary_dim = cos.shape[-1]
    if rotary_dim == x.shape[-1]:
        return fused_ops.rotary(x, cos, sin)
    return torch.cat((fused_ops.rotary(x[..., :rotary_dim], cos, sin), x[..., rotary_dim:]), dim=-1)


class LlamaAttention(nn.Module):
    """The attention's projections (``project``, ``o_proj``) and its backend; the decoder layer calls
    them in turn (``before_attention``, ``after_attention``). ``window``: the positions layer ``layer``
    sees (Mistral 7B v0.1's sliding window; None: all); ``chunk``: the chunks' length where it sees only the
    positions of its own (Llama 4's; None: not chunked)."""

    def __init__(self, config: ModelConfig, backend: AttentionBackend, layer: int) -> None:
        super().__init__()
        hd, nh, nkv = config.head_dim, config.num_attention_heads, config.num_key_value_heads
        self.num_heads, self.num_kv_heads, self.head_dim = nh, nkv, hd
        self.qkv_proj = qkv_projection(config)
        self.o_proj = nn.Linear(nh * hd, config.hidden_size, bias=config.attention_output_bias)
        # gpt-oss: a logit per head that joins each query's softmax (None: none)
        self.sinks = nn.Parameter(torch.empty(nh)) if config.attention_sinks else None
        # Qwen3 normalizes each query and key head; OLMo 2, 3 and OLMoE the whole projections (heads x hd)
        self.qk_norm, self.qk_norm_whole = config.qk_norm, config.qk_norm_whole_projection
        self.qk_norm_after_rotary = config.qk_norm_after_rotary  # (Hunyuan's: the rotated heads normalized)
        if config.qk_norm:
            self.q_norm = RMSNorm(nh * hd if self.qk_norm_whole else hd, config.norm_eps)
            self.k_norm = RMSNorm(nkv * hd if self.qk_norm_whole else hd, config.norm_eps)
        self.clip_qkv = config.clip_qkv  # (OLMoE's option: q, k and v clamped to [-clip, clip] after the norms)
        self.window, self.chunk = config.layer_window(layer), config.layer_chunk(layer)
        self.rotates = config.layer_rotates(layer)  # NOTE: SmolLM3's every fourth layer has no position embedding
        self.scale = config.attention_multiplier  # (None: head_dim ** -0.5; Granite's its own)
        self.backend = backend

    def project(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor):
        """The attention's inputs: (q, k, v), (T, nh, hd), (T, nkv, hd), (T, nkv, hd), rotated."""
        t, nh, nkv, hd = x.shape[0], self.num_heads, self.num_kv_heads, self.head_dim
        qkv = self.qkv_proj(x)  # (T, (nh + 2 nkv) hd)
        if self.qk_norm_whole:
            q, k, v = qkv.split((nh * hd, nkv * hd, nkv * hd), dim=1)
            qkv = torch.cat((self.q_norm(q), self.k_norm(k), v), dim=1)
        if self.clip_qkv is not None:
            qkv = qkv.clamp(-self.clip_qkv, self.clip_qkv)
        qkv = qkv.view(t, nh + 2 * nkv, hd)  # (T, nh + 2 nkv, hd)
        qk = qkv[:, : nh + nkv]  # (T, nh + nkv, hd)
        if self.qk_norm and not self.qk_norm_whole and not self.qk_norm_after_rotary:
            qk = self._norm_heads(qk)
        if self.rotates and cos.shape[1] == 2:  # the queries' tables scaled (Ministral 3: ``Rotary``)
            q, k = qk[:, :nh], qk[:, nh:]
            qk = torch.cat((apply_rotary(q, cos[:, :1], sin[:, :1]), apply_rotary(k, cos[:, 1:], sin[:, 1:])), dim=1)
        elif self.rotates:
            qk = apply_rotary(qk, cos, sin)  # Q and K rotated together
        if self.qk_norm_after_rotary:
            qk = self._norm_heads(qk)
        return qk[:, :nh], qk[:, nh:], qkv[:, nh + nkv :]

    def _norm_heads(self, qk: torch.Tensor) -> torch.Tensor:  # (T, nh + nkv, hd): each query and key head normalized
        nh = self.num_heads
        return torch.cat((self.q_norm(qk[:, :nh]), self.k_norm(qk[:, nh:])), dim=1)

    def attend(self, q, k, v, k_cache, v_cache, meta) -> torch.Tensor:
        """The backend's attention of (q, k, v) with this layer's scale, window or chunk, and sinks: (T, nh, hd)."""
        return self.backend.forward(
            q, k, v, k_cache, v_cache, meta, scale=self.scale, window=self.window, sinks=self.sinks, chunk=self.chunk
        )

    def output(self, attended: torch.Tensor) -> torch.Tensor:  # (T, nh, hd) -> (T, H)
        """The output projection of the heads' attention."""
        return self.o_proj(attended.reshape(attended.shape[0], -1))

    def forward(self, x, cos, sin, k_cache, v_cache, meta) -> torch.Tensor:  # (T, H) normalized -> (T, H)
        """The whole attention (``project``, ``attend``, ``output``), for layers that are not cut at it."""
        return self.output(self.attend(*self.project(x, cos, sin), k_cache, v_cache, meta))


class LlamaMLP(nn.Module):
    def __init__(self, config: ModelConfig, intermediate_size: int | None = None) -> None:
        super().__init__()
        h, i, bias = config.hidden_size, intermediate_size or config.intermediate_size, config.mlp_bias
        self.intermediate_size = i
        self.gate_up_proj = MergedLinear(h, {"gate_proj": i, "up_proj": i}, bias=bias)
        self.down_proj = nn.Linear(i, h, bias=bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(fused_ops.silu_and_mul(self.gate_up_proj(x)))  # (T, 2 I) -> (T, I) -> (T, H)


def past_the_layers(key: str, config: ModelConfig) -> bool:
    """Whether the checkpoint tensor ``key`` is of a layer past the model's: DeepSeek-V3's and GLM-4.5's
    multi-token-prediction layers, which the engine does not read (vLLM serves them without)."""
    layer = key.split(".")[2] if key.startswith("model.layers.") else None
    return layer is not None and layer.isdigit() and int(layer) >= config.num_hidden_layers


def mlp(config: ModelConfig, layer: int) -> nn.Module:
    """Layer ``layer``'s MLP: dense, or a mixture of experts (with Qwen2-MoE's gated shared expert, Granite 4.0's
    ungated one, DeepSeek's, GLM-4.5's and ERNIE 4.5's ungated ones: those routed as DeepSeek's, ``topk_method``)."""
    if not config.layer_is_moe(layer):
        return LlamaMLP(config)
    if config.model_type == "gpt_oss":
        return GptOssMoE(config)
    shared = config.moe["shared_expert_intermediate_size"]
    shared_experts = LlamaMLP(config, shared) if shared else None
    if "topk_method" in config.moe:
        return DeepseekMoE(config, shared_experts)
    return SparseMoE(config, shared_experts, shared_expert_gated=config.model_type not in UNGATED_SHARED_EXPERTS)


def mamba_mixer(config: ModelConfig, layer: int) -> nn.Module:
    """Layer ``layer``'s state space mixer: Mamba's (Jamba's, ``mamba1``) or Mamba-2's."""
    return (Mamba1Mixer if config.mamba.get("version") == 1 else Mamba2Mixer)(config, layer)


class LlamaDecoderLayer(nn.Module):
    """A norm, attention, a norm, the MLP; the norms of ``norm_class`` (one with ``add_and_norm``), the
    attention ``make_attention``'s (one with ``project``, ``attend`` and ``output``), the MLP ``make_mlp``'s
    (StarCoder2's layers are these with LayerNorms and a two-matrix MLP, DeepSeek-V2's with its attention
    and experts)."""

    norm_class: type[nn.Module] = RMSNorm

    def __init__(self, config: ModelConfig, backend: AttentionBackend, layer: int) -> None:
        super().__init__()
        # (a Mamba layer, Granite 4.0-H's: its mixer in attention's place; Falcon-H1's: beside it, ``forward``)
        self.mamba = mamba_mixer(config, layer) if config.layer_is_mamba(layer) else None
        attends = config.layer_has_kv(layer)
        self.self_attn = self.make_attention(config, backend, layer) if attends else None
        self.mlp = self.make_mlp(config, layer)
        self.input_layernorm = self.norm_class(config.hidden_size, config.norm_eps)
        self.post_attention_layernorm = self.norm_class(config.hidden_size, config.norm_eps)
        self.residual_multiplier = config.residual_multiplier

    def make_attention(self, config: ModelConfig, backend: AttentionBackend, layer: int) -> nn.Module:
        return LlamaAttention(config, backend, layer)

    def make_mlp(self, config: ModelConfig, layer: int) -> nn.Module:
        return mlp(config, layer)

    def forward(self, x, residual, cos, sin, k_cache, v_cache, meta):
        """``x``: the layer before's MLP output, not yet in the residual stream ``residual`` (None for the
        first layer: ``x`` is the embeddings). Returns this layer's MLP output and the stream before it.

        NOTE: vLLM's layout: each output joins the stream in the norm after it (``add_and_norm``), so
        the sums are HF's ``x + attn(norm(x))`` and ``x + mlp(norm(x))``, bit for bit on the PyTorch path.
        A Mamba layer mixes with its mixer (``meta.states``'s states) instead, and has no caches; Falcon-H1's layer
        adds its attention's output to its mixer's, both of the same normalized input."""
        if self.mamba is not None:
            h, residual = self._input_norm(x, residual)
            mixed = self.mamba(h, meta.states)
            if self.self_attn is not None:
                mixed = mixed + self.self_attn(h, cos, sin, k_cache, v_cache, meta)
            return self._after_mixing(mixed, residual)
        q, k, v, residual = self.before_attention(x, residual, cos, sin)
        attended = self.self_attn.attend(q, k, v, k_cache, v_cache, meta)  # (T, nh, hd)
        return self.after_attention(attended, residual)

    def _input_norm(self, x: torch.Tensor, residual: torch.Tensor | None):
        """(the input norm of the stream with ``x`` in it, that stream)."""
        if residual is None:
            return self.input_layernorm(x), x
        return self.input_layernorm.add_and_norm(x, residual)

    # The layer's two halves around the attention call (piecewise CUDA graphs capture them apart).
    def before_attention(self, x, residual, cos, sin):
        """(q, k, v, the residual stream with ``x`` in it)."""
        h, residual = self._input_norm(x, residual)
        return (*self.self_attn.project(h, cos, sin), residual)

    def after_attention(self, attended: torch.Tensor, residual: torch.Tensor):
        """(this layer's MLP output, the residual stream before it) from the attention's output (T, nh, hd)."""
        return self._after_mixing(self.self_attn.output(attended), residual)

    def _after_mixing(self, attended: torch.Tensor, residual: torch.Tensor):
        """(this layer's MLP output, the residual stream before it) from its attention's (or mixer's) output (T, H).
        NOTE: each output scaled by residual_multiplier before it joins the stream (Granite's; 1 elsewhere)."""
        if self.residual_multiplier != 1.0:
            attended = attended * self.residual_multiplier
        h, residual = self.post_attention_layernorm.add_and_norm(attended, residual)
        out = self.mlp(h)
        return (out * self.residual_multiplier if self.residual_multiplier != 1.0 else out), residual


class LlamaModel(nn.Module):
    """The embeddings, the layers (``layer_class``) and the final norm (``norm_class``)."""

    layer_class: type[nn.Module] = LlamaDecoderLayer
    norm_class: type[nn.Module] = RMSNorm

    def __init__(self, config: ModelConfig, backend: AttentionBackend) -> None:
        super().__init__()
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(self.layer_class(config, backend, i) for i in range(config.num_hidden_layers))
        self.norm = self.norm_class(config.hidden_size, config.norm_eps)


class LlamaForCausalLM(nn.Module):
    """``forward`` returns the final hidden states ``(T, H)``; ``compute_logits`` the vocabulary scores.
    A model of the same outline with other layers (Gemma 3) subclasses it with its own ``model_class``."""

    model_class: type[nn.Module] = LlamaModel
    # Its forward pass is ``embed``, then each layer's ``before_attention``, attention and
    # ``after_attention``, then the final norm: the pieces ``PiecewiseGraphs`` captures.
    supports_piecewise_graphs = True

    def __init__(self, config: ModelConfig, backend: AttentionBackend) -> None:
        super().__init__()
        self.config = config
        self.model = self.model_class(config, backend)
        if config.has_request_states:  # (a state layer's prefills run request by request: no pieces)
            self.supports_piecewise_graphs = False
        # each layer's index in the KV cache (None: a Mamba layer's or an MLP's, with none), found once
        self.kv_layer_indices = [config.kv_layer_index(i) for i in range(config.num_hidden_layers)]
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        if config.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight
        self.rotary = Rotary(config)
        # The sliding layers' own rotary embedding where the config gives them one (Gemma 3's base of 10,000;
        # OLMo 3's, unscaled); None: they share the model's
        self.local_rotary = (
            None
            if config.rope_local_theta is None
            else Rotary(dataclasses.replace(config, rope_theta=config.rope_local_theta, rope_scaling=None))
        )

    def layer_rotary_tables(
        self, positions: torch.Tensor, dtype: torch.dtype
    ) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """Each layer's (cos, sin) (``Rotary.for_positions``): the sliding layers' from ``local_rotary`` where the
        model has one, the others' (or all) from ``rotary``, each table gathered once."""
        tables = self.rotary.for_positions(positions, dtype)
        local = tables if self.local_rotary is None else self.local_rotary.for_positions(positions, dtype)
        return [
            local if getattr(layer.self_attn, "window", None) is not None else tables for layer in self.model.layers
        ]

    def forward(
        self,
        input_ids: torch.Tensor,  # (T,)
        positions: torch.Tensor,  # (T,)
        kv_cache: torch.Tensor,  # (2, layers, num_slots, nkv, hd)
        meta: AttentionMetadata,
    ) -> torch.Tensor:  # (T, H)
        x, cos, sin = self.embed(input_ids, positions)
        residual = None
        for layer, index in zip(self.model.layers, self.kv_layer_indices, strict=True):
            caches = (None, None) if index is None else layer_caches(kv_cache, index)
            x, residual = layer(x, residual, cos, sin, *caches, meta)
        return self.model.norm.add_and_norm(x, residual)[0]

    def embed(self, input_ids: torch.Tensor, positions: torch.Tensor):
        """(the tokens' embeddings (T, H), the rotary cos and sin (T, 1 | 2, rotary_dim) each: ``Rotary.for_positions``,
        shared by the layers)."""
        x = self.model.embed_tokens(input_ids)
        if self.config.embedding_multiplier != 1.0:  # (Granite's)
            x = x * self.config.embedding_multiplier
        return (x, *self.rotary.for_positions(positions, x.dtype))

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:  # (N, H) -> (N, vocab)
        """The vocabulary scores: divided by ``logits_scaling`` (Granite's), capped by tanh at
        ``final_logit_softcapping`` where the config says (Gemma 2's and 3's, nanochat's)."""
        logits = self.lm_head(hidden)
        if self.config.logits_scaling != 1.0:
            logits = logits / self.config.logits_scaling
        cap = self.config.final_logit_softcapping
        return logits if cap is None else torch.tanh(logits / cap) * cap


class StreamLayersForCausalLM(LlamaForCausalLM):
    """A model whose layers each take the residual stream and return it, ``layer(x, cos, sin, k_cache, v_cache,
    meta)``: their norms sit where Llama's add-and-norm after each sublayer (and the piecewise graphs cut
    there) cannot put them: between a sublayer and the stream (Gemma, OLMo 2 and 3, EXAONE 4, GLM-4-0414), or
    one norm for sublayers in parallel (Cohere)."""

    supports_piecewise_graphs = False

    def embeddings(self, input_ids: torch.Tensor) -> torch.Tensor:  # (T,) -> (T, H)
        return self.model.embed_tokens(input_ids)

    def forward(
        self,
        input_ids: torch.Tensor,  # (T,)
        positions: torch.Tensor,  # (T,)
        kv_cache: torch.Tensor,  # (2, layers, num_slots, nkv, hd)
        meta: AttentionMetadata,
    ) -> torch.Tensor:  # (T, H)
        x = self.embeddings(input_ids)
        tables = self.layer_rotary_tables(positions, x.dtype)
        for layer, index, (cos, sin) in zip(self.model.layers, self.kv_layer_indices, tables, strict=True):
            caches = (None, None) if index is None else layer_caches(kv_cache, index)  # (LFM3's convolutions: none)
            x = layer(x, cos, sin, *caches, meta)
        return self.model.norm(x)
