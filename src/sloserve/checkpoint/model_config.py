"""``ModelConfig``: the architecture numbers the engine needs, and the kinds of layer a model's
``layer_types`` may name (``SLIDING``, ``CHUNKED``, ``MAMBA``, ...)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from sloserve.checkpoint.model_types import (
    ARCHITECTURES,
    BIASED_ROUTINGS,
    DTYPE_BYTES,
    GATED_SHARED_EXPERTS,
    LAYER_NORMS,
    NORMS_PER_LAYER,
    OPT_POSITION_OFFSET,
    TWO_MATRIX_MLPS,
    WEIGHTLESS_NORMS,
)
from sloserve.core.errors import ConfigError
from sloserve.cost.specs import ModelSpec

# A layer type of ModelConfig.layer_types that sees only the last sliding_window positions
SLIDING = "sliding_attention"
CHUNKED = "chunked_attention"  # (Llama 4's: only the positions of its own chunk of attention_chunk_size)
MAMBA = "mamba"  # (a layer of Mamba-2's mixer: ``ModelConfig.mamba``)
MLP_LAYER = "mlp"  # (Nemotron-H's layers of an MLP alone)
MOE_LAYER = "moe"  # (Nemotron 3's layers of experts alone)
PARALLEL_HYBRID = "attention_and_mamba"  # (Falcon-H1's layers: attention and a Mamba-2 mixer side by side)
SHORT_CONV = "conv"  # (LFM2's layers of a gated short convolution: ``ModelConfig.short_conv``)
LINEAR_ATTENTION = "linear_attention"  # (Qwen3-Next's layers of gated DeltaNet: ``ModelConfig.gated_delta_net``)


@dataclass(frozen=True)
class ModelConfig:
    """The architecture numbers the engine needs (names as in HF ``config.json``).

    ``model_type`` is the HF name (llama, mistral, qwen2, opt); ``architecture`` the module that runs
    it. ``rope_scaling`` is the HF dict (``rope_type`` default, linear, llama3, yarn or longrope; a GGUF
    file's ``frequency_factors``) or None.
    """

    model_type: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    max_position_embeddings: int
    norm_eps: float = 1e-5
    rope_theta: float = 10000.0
    rope_scaling: dict[str, Any] | None = None
    # Phi-4 mini: the rotary embedding turns the first partial_rotary_dim of each head (96 of 128), the
    # rest pass through (None: the whole head)
    partial_rotary_dim: int | None = None
    # GLM: the rotary embedding turns adjacent pairs of those dimensions (GPT-J's layout), not halves; the
    # engine loads its Q and K rows reordered so that its rotate-half computes the same scores
    rotary_interleaved: bool = False
    # Ministral 3 (Llama 4's attention scaling): a query at position p is scaled by
    # 1 + beta ln(1 + floor(p / the rope's original_max_position_embeddings)) (None: not)
    llama4_scaling_beta: float | None = None
    attention_bias: bool = False  # q/k/v biases (Qwen2: True)
    attention_output_bias: bool = False  # an o_proj bias (gpt-oss)
    # gpt-oss: a learned logit per head joins each query's softmax (a key with no value: "attention sinks")
    attention_sinks: bool = False
    qk_norm: bool = False  # an RMSNorm of each query and key head before the rotary embedding (Qwen3)
    # ... of the whole query and key projections (heads x head_dim) instead (OLMo 2, 3, OLMoE)
    qk_norm_whole_projection: bool = False
    qk_norm_after_rotary: bool = False  # Hunyuan: each query and key head normalized after the rotary embedding
    # Llama 4: each rotated query and key head divided by its root mean square after the rotary embedding, no weight
    # (transformers' Llama4TextL2Norm)
    qk_unweighted_norm: bool = False
    clip_qkv: float | None = None  # OLMoE: q, k and v clamped to [-clip_qkv, clip_qkv] (None: not)
    # ALiBi (``engine/alibi.py``: BLOOM's, Falcon-RW's) in place of a rotary embedding: each head's scores biased by its
    # slope times the distance; its slopes Press et al.'s, or MPT's by alibi_bias_max (None: Press et al.'s)
    alibi: bool = False
    alibi_bias_max: float | None = None
    parallel_residual: bool = False  # GPT-NeoX: x + attn(ln1(x)) + mlp(ln2(x)), not one after the other
    mlp_bias: bool = False
    lm_head_bias: bool = False  # (Phi-1 to 2's; Phi-3.5-MoE's where its config says)
    hidden_act: str = "silu"
    tie_word_embeddings: bool = False
    # Gemma 3: scores scaled by query_pre_attn_scalar ** -0.5 (None: head_dim's); each layer's type
    # (SLIDING: it sees the last sliding_window positions, its rope base rope_local_theta; else all, at
    # rope_theta with rope_scaling); the final scores capped by tanh (None: not)
    query_pre_attn_scalar: float | None = None
    layer_types: tuple[str, ...] = ()
    sliding_window: int | None = None
    rope_local_theta: float | None = None
    # Llama 4: the layers of layer_types CHUNKED see only the positions of their own chunk of attention_chunk_size (a
    # query at position p: p - p % attention_chunk_size .. p); None: no chunked layer
    attention_chunk_size: int | None = None
    # Llama 4's attention temperature: the queries of the layers that do not rotate scaled by
    # 1 + attn_scale ln(1 + floor((p + 1) / floor_scale)) at position p (None: not scaled)
    attn_scale: float | None = None
    floor_scale: int = 8192
    final_logit_softcapping: float | None = None
    attn_logit_softcapping: float | None = None  # Gemma 2: scores capped by tanh (None: not)
    # SmolLM3: whether each layer rotates its queries and keys (its NoPE layers do not); empty: all do
    rotary_layers: tuple[bool, ...] = ()
    # Granite: the embeddings times embedding_multiplier, each layer's attention and MLP outputs times
    # residual_multiplier before they join the residual stream, scores scaled by attention_multiplier
    # (None: head_dim ** -0.5), the logits divided by logits_scaling
    embedding_multiplier: float = 1.0
    residual_multiplier: float = 1.0
    attention_multiplier: float | None = None
    logits_scaling: float = 1.0
    # A mixture of experts (Qwen3-MoE, Qwen2-MoE, Mixtral): num_experts, num_experts_per_tok,
    # moe_intermediate_size, norm_topk_prob, moe_layers (whether each layer's MLP is the experts; else a
    # dense one of intermediate_size) and shared_expert_intermediate_size (Qwen2-MoE's expert that every
    # token runs, gated; 0: none); None: every MLP dense
    moe: dict[str, Any] | None = None
    # DeepSeek-V2's multi-head latent attention: q_lora_rank (None: one query projection), kv_lora_rank (the
    # latent's size, d_c), qk_nope_head_dim, qk_rope_head_dim (d_h^R) and v_head_dim; None: not
    mla: dict[str, Any] | None = None
    # Mamba-2 mixers in place of attention in the layers whose layer_types entry is MAMBA (Granite 4.0-H, Bamba,
    # Nemotron-H), beside it in PARALLEL_HYBRID ones (Falcon-H1): n_heads, head_dim, n_groups, d_state, d_conv,
    # d_inner, chunk_size, conv_bias, proj_bias, out_proj_bias, rms_norm, norm_before_gate, time_step_limit. Mamba's
    # mixers (version 1: Jamba's, Mamba's, Falcon Mamba's): d_inner, d_state, d_conv, dt_rank, conv_bias, proj_bias and
    # the norms of the step, B and C (dt_bc_norms, dt_bc_norm_weights, dt_bc_norm_eps: None for norm_eps). A model of
    # Mamba layers alone: residual_in_fp32 too. None: none
    mamba: dict[str, Any] | None = None
    # LFM2's gated short convolutions in place of attention in the layers whose layer_types entry is SHORT_CONV:
    # width (its taps, the config's conv_L_cache) and bias (its projections' and convolution's); None: none
    short_conv: dict[str, Any] | None = None
    # Qwen3-Next's gated DeltaNet in place of attention in the layers whose layer_types entry is LINEAR_ATTENTION:
    # num_k_heads, num_v_heads (a multiple of them), head_k_dim, head_v_dim, width (its convolution's taps, the
    # config's linear_conv_kernel_dim), beta_scale (OLMo Hybrid's 2: beta in (0, 2)), norm_eps (its gated norm's
    # epsilon) and, for Kimi's KDA layers, channel_decay (a decay a key channel, its low-rank gates); None: none
    gated_delta_net: dict[str, Any] | None = None
    # OPT only
    word_embed_proj_dim: int | None = None
    do_layer_norm_before: bool = True
    enable_bias: bool = True
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = ()
    torch_dtype: str = "float32"
    name: str = "model"
    extra: dict[str, Any] = field(default_factory=dict, compare=False)

    def __post_init__(self) -> None:
        if self.model_type not in ARCHITECTURES:
            raise ConfigError(
                f"model {self.name}: unsupported architecture {self.model_type!r}; "
                f"supported: {', '.join(sorted(ARCHITECTURES))}"
            )
        for name in (
            "vocab_size",
            "hidden_size",
            "intermediate_size",
            "num_hidden_layers",
            "num_attention_heads",
            "num_key_value_heads",
            "head_dim",
            "max_position_embeddings",
        ):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ConfigError(f"model {self.name}: {name} must be a positive integer, got {value!r}")
        rotated = self.partial_rotary_dim
        if rotated is not None and not (0 < rotated <= self.head_dim and rotated % 2 == 0):
            raise ConfigError(
                f"model {self.name}: the rotary embedding turns {rotated} of a head's {self.head_dim} dimensions; "
                "it needs an even number of them"
            )
        if self.num_attention_heads % self.num_key_value_heads:
            raise ConfigError(
                f"model {self.name}: num_key_value_heads {self.num_key_value_heads} must divide "
                f"num_attention_heads {self.num_attention_heads}"
            )

    @property
    def architecture(self) -> str:
        return ARCHITECTURES[self.model_type]

    @property
    def rotary_dim(self) -> int:
        """The dimensions of a head the rotary embedding turns (the leading ones)."""
        return self.partial_rotary_dim or self.head_dim

    @property
    def is_moe(self) -> bool:
        return self.moe is not None

    @property
    def moe_experts_gated(self) -> bool:
        """Whether the experts are SwiGLU MLPs (``fused_moe``'s kernels run those): all but Nemotron-H's."""
        return self.model_type != "nemotron_h"

    @property
    def kv_cache_heads(self) -> int:
        """The heads of one token's K (and V) in the KV cache: MLA's one latent, else the KV heads."""
        return 1 if self.mla is not None else self.num_key_value_heads

    @property
    def kv_cache_head_dim(self) -> int:
        """The numbers of each: MLA's latent and rotated key [c_KV; k_R], else a head's."""
        return self.head_dim if self.mla is None else self.mla["kv_lora_rank"] + self.mla["qk_rope_head_dim"]

    @property
    def kv_cache_tensors(self) -> int:
        """The KV cache's tensors a token and layer: K and V (2), or MLA's keys alone (1: ``kv_cache_value_dim``)."""
        return 2 if self.kv_cache_value_dim is None else 1

    @property
    def attention_value_dim(self) -> int:
        """A head's attention output: MLA's values by head (``v_head_dim``), else ``head_dim``."""
        return self.head_dim if self.mla is None else self.mla["v_head_dim"]

    @property
    def kv_cache_value_dim(self) -> int | None:
        """MLA's: the cache holds keys only, and a key's first ``kv_lora_rank`` numbers (its latent c_KV) are
        its value; None where the cache holds values of their own."""
        return None if self.mla is None else self.mla["kv_lora_rank"]

    def layer_is_moe(self, layer: int) -> bool:
        """Whether layer ``layer``'s MLP is a mixture of experts."""
        return self.moe is not None and self.moe["moe_layers"][layer]

    def layer_rotates(self, layer: int) -> bool:
        """Whether layer ``layer`` applies the rotary embedding to its queries and keys."""
        return not self.rotary_layers or self.rotary_layers[layer]

    def layer_window(self, layer: int) -> int | None:
        """The positions layer ``layer`` sees (None: all of them)."""
        return self.sliding_window if self.layer_types and self.layer_types[layer] == SLIDING else None

    def layer_chunk(self, layer: int) -> int | None:
        """The length of the chunks whose positions alone a query of layer ``layer`` sees (None: not chunked)."""
        return self.attention_chunk_size if self.layer_types and self.layer_types[layer] == CHUNKED else None

    @property
    def rotary_table_rows(self) -> int:
        """The rows of the rotary tables a step's token has (``Rotary.for_positions``): 2 where the queries are scaled
        by position (Ministral 3's tables, the queries' then the keys'; Llama 4's, the rotation's then the unrotated
        layers' query scale), else 1."""
        return 1 if self.llama4_scaling_beta is None and self.attn_scale is None else 2

    def layer_is_mamba(self, layer: int) -> bool:
        """Whether layer ``layer`` mixes its tokens with a Mamba-2 mixer (instead of attention, or beside it:
        Falcon-H1's)."""
        return self.mamba is not None and self.layer_types[layer] in (MAMBA, PARALLEL_HYBRID)

    def layer_has_states(self, layer: int) -> bool:
        """Whether layer ``layer`` keeps a request's states from one step to the next (``engine/state_cache.py``):
        a Mamba-2 mixer's, a short convolution's or a gated DeltaNet's."""
        if self.layer_is_mamba(layer):
            return True
        kind = self.layer_types[layer] if self.layer_types else None
        return (self.short_conv is not None and kind == SHORT_CONV) or (
            self.gated_delta_net is not None and kind == LINEAR_ATTENTION
        )

    def layer_has_kv(self, layer: int) -> bool:
        """Whether layer ``layer`` attends (and has a KV cache): not a Mamba layer, nor a short convolution's, nor a
        gated DeltaNet's, nor Nemotron-H's MLP and experts' ones."""
        kinds = (MAMBA, MLP_LAYER, MOE_LAYER, SHORT_CONV, LINEAR_ATTENTION)
        return not self.layer_types or self.layer_types[layer] not in kinds

    def kv_layer_index(self, layer: int) -> int | None:
        """Layer ``layer``'s index among the layers with a KV cache (the attention layers); None for another."""
        if not self.layer_has_kv(layer):
            return None
        return sum(self.layer_has_kv(i) for i in range(layer))

    @property
    def num_kv_layers(self) -> int:
        """The layers with a KV cache: the attention layers."""
        return sum(self.layer_has_kv(i) for i in range(self.num_hidden_layers))

    @property
    def num_mamba_layers(self) -> int:
        """The layers of a Mamba-2 mixer (each with a request's states)."""
        return sum(self.layer_is_mamba(i) for i in range(self.num_hidden_layers))

    @property
    def has_request_states(self) -> bool:
        """Whether some layers keep a request's states (Mamba-2 mixers, short convolutions, gated DeltaNets): the
        engine keeps them in slots, one a running request (``StateCache``)."""
        return self.mamba is not None or self.short_conv is not None or self.gated_delta_net is not None

    def state_layer_index(self, layer: int) -> int:
        """Layer ``layer``'s place among the layers with states (its states' in ``StateCache``)."""
        return sum(self.layer_has_states(i) for i in range(layer))

    @property
    def num_state_layers(self) -> int:
        """The layers with states (``layer_has_states``)."""
        return self.state_layer_index(self.num_hidden_layers)

    @property
    def state_conv_dim(self) -> int:
        """The channels of the causal convolution a state layer runs (its last inputs are a request's state): a
        Mamba-2 mixer's x, B and C; a short convolution's hidden size; a gated DeltaNet's q, k and v."""
        if self.mamba is not None:
            return self.mamba_conv_dim
        if self.gated_delta_net is not None:
            net = self.gated_delta_net
            return 2 * net["num_k_heads"] * net["head_k_dim"] + net["num_v_heads"] * net["head_v_dim"]
        return self.hidden_size

    @property
    def state_conv_width(self) -> int:
        """That convolution's taps (Mamba-2's d_conv, LFM2's conv_L_cache, Qwen3-Next's linear_conv_kernel_dim)."""
        if self.mamba is not None:
            return self.mamba["d_conv"]
        return (self.gated_delta_net or self.short_conv)["width"]

    @property
    def state_recurrence_shape(self) -> tuple[int, int, int] | None:
        """A state layer's recurrent state of one request (float32), beside its convolution's: a Mamba-2 mixer's h of
        each head (n_heads, head_dim, d_state); a gated DeltaNet's S of each value head (num_v_heads, head_k_dim,
        head_v_dim); None for a short convolution (its convolution's alone)."""
        if self.mamba is not None and self.mamba.get("version") == 1:  # (Mamba's: a state of d_state a channel)
            return 1, self.mamba["d_inner"], self.mamba["d_state"]
        if self.mamba is not None:
            return self.mamba["n_heads"], self.mamba["head_dim"], self.mamba["d_state"]
        if self.gated_delta_net is not None:
            net = self.gated_delta_net
            return net["num_v_heads"], net["head_k_dim"], net["head_v_dim"]
        return None

    @property
    def mamba_conv_dim(self) -> int:
        """The channels a Mamba-2 mixer's convolution runs over: its x, B and C (d_inner + 2 n_groups d_state); Mamba's,
        its x (d_inner)."""
        if self.mamba.get("version") == 1:
            return self.mamba["d_inner"]
        return self.mamba["d_inner"] + 2 * self.mamba["n_groups"] * self.mamba["d_state"]

    @property
    def mamba_params(self) -> int:
        """A Mamba-2 mixer's parameters: in_proj, conv1d, dt_bias, A_log, D, the gated norm, out_proj; Mamba's:
        in_proj, conv1d, x_proj, dt_proj, A_log, D, the norms of the step, B and C, out_proj."""
        m, h, conv_dim = self.mamba, self.hidden_size, self.mamba_conv_dim
        if m.get("version") == 1:
            d, n, rank, bias = m["d_inner"], m["d_state"], m["dt_rank"], m["proj_bias"]
            in_out = 2 * h * d + 2 * d * bias + d * h + h * bias
            conv = d * m["d_conv"] + d * m["conv_bias"]
            return (
                in_out + conv + d * (rank + 2 * n) + rank * d + d + d * n + d + (rank + 2 * n) * m["dt_bc_norm_weights"]
            )
        in_proj = h * (m["d_inner"] + conv_dim + m["n_heads"]) + m["proj_bias"] * (
            m["d_inner"] + conv_dim + m["n_heads"]
        )
        conv = conv_dim * m["d_conv"] + conv_dim * m["conv_bias"]
        norm = m["d_inner"] * m["rms_norm"]
        return in_proj + conv + 3 * m["n_heads"] + norm + m["d_inner"] * h + m["out_proj_bias"] * h

    @property
    def gated_delta_net_params(self) -> int:
        """A gated DeltaNet's parameters: its input projection (q, k, v, the gate z, b and a), its convolution (no
        bias), dt_bias and A_log a value head, its gated norm (a head's width, shared), out_proj. Kimi's KDA: q, k,
        v, the convolution, the decay's low-rank projections (f_a, f_b) with dt_bias a channel and A_log a head,
        b_proj, the gate's low-rank projections (g_a, g_b), the norm, o_proj."""
        net, h = self.gated_delta_net, self.hidden_size
        value_dim = net["num_v_heads"] * net["head_v_dim"]
        if net.get("channel_decay"):
            heads, width = net["num_v_heads"], net["head_k_dim"]
            low_rank = 2 * (h * width + width * value_dim)  # (f_a, f_b; g_a, g_b)
            conv = self.state_conv_dim * (h + net["width"])
            return conv + low_rank + value_dim + heads + h * heads + width + value_dim * h
        in_proj = h * (self.state_conv_dim + value_dim + 2 * net["num_v_heads"])
        return in_proj + self.state_conv_dim * net["width"] + 2 * net["num_v_heads"] + net["head_v_dim"] + value_dim * h

    def request_state_bytes(self, dtype_bytes: float) -> int:
        """A request's states, every state layer's: its convolution's last inputs (``dtype_bytes`` a number) and its
        recurrent state (``state_recurrence_shape``, float32); 0 for a model without such layers."""
        if not self.has_request_states:
            return 0
        per_layer = self.state_conv_dim * (self.state_conv_width - 1) * dtype_bytes
        if self.state_recurrence_shape is not None:
            heads, rows, columns = self.state_recurrence_shape
            per_layer += heads * rows * columns * 4
        return int(self.num_state_layers * per_layer)

    @property
    def num_params(self) -> int:
        """Parameters of the engine's model of this shape (a tied LM head counted once)."""
        h, i, v, layers = self.hidden_size, self.intermediate_size, self.vocab_size, self.num_hidden_layers
        if self.architecture == "opt":
            proj = self.word_embed_proj_dim or h
            bias = int(self.enable_bias)
            # q, k, v, out projections and fc1, fc2 (with biases), two LayerNorms (weight and bias)
            layer = 4 * (h * h + bias * h) + (h * i + bias * i) + (i * h + bias * h) + 2 * 2 * h
            final_norm = 2 * h if self.do_layer_norm_before and not self.extra.get("remove_final_layer_norm") else 0
            embeddings = v * proj + (self.max_position_embeddings + OPT_POSITION_OFFSET) * h
            projections = 2 * proj * h if proj != h else 0
            lm_head = 0 if self.tie_word_embeddings else v * proj
            return embeddings + projections + layers * layer + final_norm + lm_head
        if self.architecture == "gpt2":  # c_attn and c_proj, c_fc and c_proj (with biases), two LayerNorms
            qkv = h + 2 * self.num_key_value_heads * self.head_dim  # (GPT-BigCode's: one KV head)
            layer = h * qkv + qkv + h * h + h + 2 * h * i + i + h + 2 * 2 * h
            embeddings = v * h + self.max_position_embeddings * h
            return embeddings + layers * layer + 2 * h + (0 if self.tie_word_embeddings else v * h)
        if self.mla is not None:
            return self._deepseek_num_params()
        if self.architecture in ("nemotron_h", "mamba"):  # a norm and one mixer a block
            q_width, kv_width = self.num_attention_heads * self.head_dim, self.num_key_value_heads * self.head_dim
            mixers = {
                MAMBA: self.mamba_params,
                "full_attention": 2 * h * q_width + 2 * h * kv_width,
                MLP_LAYER: 2 * h * i + (i + h if self.mlp_bias else 0),
            }
            if self.moe is not None:  # the router and its bias, two-matrix experts, the shared one
                e, moe_i = self.moe["num_experts"], self.moe["moe_intermediate_size"]
                mixers[MOE_LAYER] = e * h + e + e * 2 * h * moe_i + 2 * h * self.moe["shared_expert_intermediate_size"]
            blocks = sum(h + mixers[kind] for kind in self.layer_types)
            return v * h + blocks + h + (0 if self.tie_word_embeddings else v * h)
        if self.architecture == "gpt_neox":  # q/k/v and dense (biases where attention_bias), a two-matrix
            # MLP with biases, two LayerNorms a layer and a final one (weight and bias)
            layer = 4 * h * h + 4 * h * self.attention_bias + 2 * h * i + i + h + 2 * 2 * h
            return v * h + layers * layer + 2 * h + (0 if self.tie_word_embeddings else v * h)
        if self.architecture == "mpt":  # Wqkv and out_proj, a two-matrix MLP, two LayerNorms a layer and a final one,
            # no biases
            return v * h + layers * (4 * h * h + 2 * h * i + 2 * h) + h + (0 if self.tie_word_embeddings else v * h)
        if self.architecture == "falcon":  # query_key_value and dense, a two-matrix MLP (biases where bias), its norms
            qkv, bias = h + 2 * self.num_key_value_heads * self.head_dim, self.attention_bias
            norms = 2 * 2 * h if self.extra["falcon_norms"] != "input" else 2 * h
            layer = h * qkv + h * h + 2 * h * i + bias * (qkv + h + i + h) + norms
            embedding_norm = 2 * h if self.extra["embedding_norm"] else 0  # (BLOOM's)
            return v * h + embedding_norm + layers * layer + 2 * h + (0 if self.tie_word_embeddings else v * h)
        q_width, kv_width = self.num_attention_heads * self.head_dim, self.num_key_value_heads * self.head_dim
        attention = h * q_width + 2 * h * kv_width + q_width * h
        if self.attention_bias:
            attention += q_width + 2 * kv_width
        if self.qk_norm:
            attention += q_width + kv_width if self.qk_norm_whole_projection else 2 * self.head_dim
        attention += h * self.attention_output_bias + self.num_attention_heads * self.attention_sinks
        attention += h * q_width * (self.architecture in ("qwen3_next", "afmoe"))  # (the gate of each head's output)
        if self.model_type in TWO_MATRIX_MLPS:  # up, down
            mlp = 2 * h * i + (i + h if self.mlp_bias else 0)
            mlp += 4 * (self.model_type == "apertus")  # (xIELU's alpha_p, alpha_n, beta and eps)
        else:  # gate, up, down
            mlp = 3 * h * i + (2 * i + h if self.mlp_bias else 0)
        # (a LayerNorm's bias; OLMo 1's norms: no weight)
        norm = 2 * h if self.model_type in LAYER_NORMS else 0 if self.model_type in WEIGHTLESS_NORMS else h
        norms = NORMS_PER_LAYER.get(self.model_type, NORMS_PER_LAYER.get(self.architecture, 2))  # (by type, else arch)
        layer = attention + mlp + norms * norm
        total = v * h + layers * layer + norm + (0 if self.tie_word_embeddings else v * h)
        total += v * self.lm_head_bias
        if self.moe is not None:  # a MoE layer: the router and every expert instead of the dense MLP
            experts = self.moe["num_experts"] * (h + 3 * h * self.moe["moe_intermediate_size"])
            if self.moe["shared_expert_intermediate_size"]:  # and the shared experts (Qwen2-MoE's with a gate)
                gated = self.model_type in GATED_SHARED_EXPERTS  # (its gate: a row of h)
                experts += 3 * h * self.moe["shared_expert_intermediate_size"] + h * gated
            if self.moe.get("topk_method") in BIASED_ROUTINGS:  # (the router's bias: GLM-4.5's, ERNIE 4.5's)
                experts += self.moe["num_experts"]
            if "swiglu_limit" in self.moe:  # gpt-oss: the router's and the experts' biases
                experts += self.moe["num_experts"] * (1 + 2 * self.moe["moe_intermediate_size"] + h)
            total += sum(self.moe["moe_layers"]) * (experts - mlp)
        if self.mamba is not None:  # a Mamba layer: the mixer instead of the attention (Falcon-H1's: beside it)
            total += (
                self.num_mamba_layers * self.mamba_params - (self.num_hidden_layers - self.num_kv_layers) * attention
            )
        if self.short_conv is not None:  # a short convolution's layer: in_proj (B, C, x), its taps, out_proj
            bias = self.short_conv["bias"]
            conv = 3 * h * h + h * self.short_conv["width"] + h * h + bias * (3 * h + h + h)
            total += (self.num_hidden_layers - self.num_kv_layers) * (conv - attention)
        if self.gated_delta_net is not None:  # a gated DeltaNet's layer instead of attention
            total += (self.num_hidden_layers - self.num_kv_layers) * (self.gated_delta_net_params - attention)
        if self.model_type == "lfm3":  # (its norms of each operator's and MLP's output; each head's gate)
            total += self.extra["use_sandwich_norm"] * layers * 2 * h
            total += self.extra["use_attention_gate"] * self.num_kv_layers * h * self.num_attention_heads
        if self.model_type == "hyperclovax":  # (its norms of each part's output)
            total += self.extra["use_post_norm"] * layers * 2 * h
        return total

    def _deepseek_num_params(self) -> int:
        """DeepSeek-V2's and V3's: MLA's projections and norms, dense MLPs before ``moe_layers`` start, then the
        router, the experts and the shared ones."""
        h, v, nh, mla, moe = self.hidden_size, self.vocab_size, self.num_attention_heads, self.mla, self.moe
        qk = mla["qk_nope_head_dim"] + mla["qk_rope_head_dim"]
        q = h * nh * qk if mla["q_lora_rank"] is None else (h + 1 + nh * qk) * mla["q_lora_rank"]
        latent = mla["kv_lora_rank"]
        kv = (
            h * (latent + mla["qk_rope_head_dim"])
            + latent
            + latent * nh * (mla["qk_nope_head_dim"] + mla["v_head_dim"])
        )
        bias = (mla["q_lora_rank"] or 0) + latent + mla["qk_rope_head_dim"] + h if self.attention_bias else 0
        attention = q + kv + nh * mla["v_head_dim"] * h + bias
        dense = 3 * h * self.intermediate_size
        experts = 0 if moe is None else moe["num_experts"] * (h + 3 * h * moe["moe_intermediate_size"])
        experts += 0 if moe is None or moe["topk_method"] != "noaux_tc" else moe["num_experts"]  # (V3's router bias)
        experts += 0 if moe is None else 3 * h * moe["shared_expert_intermediate_size"]
        mlps = sum(experts if self.layer_is_moe(i) else dense for i in range(self.num_hidden_layers))
        mixers = self.num_kv_layers * attention  # (Kimi Linear's KDA layers: no MLA)
        mixers += 0 if self.gated_delta_net is None else self.num_state_layers * self.gated_delta_net_params
        total = v * h + self.num_hidden_layers * 2 * h + mixers + mlps + h
        return total + (0 if self.tie_word_embeddings else v * h)

    def spec(self) -> ModelSpec:
        """The simulator's view of this model (``simulate --model`` with a directory or ``random:NAME``).

        A mixture of experts: all its parameters in memory, a token's experts in its compute, and the experts a
        step's tokens reach in the weights it reads (``ModelSpec.num_experts``...: the roofline's)."""
        two_matrices = self.model_type in TWO_MATRIX_MLPS or self.architecture in ("falcon", "gpt2", "mpt")
        mlp_kind = "relu" if two_matrices else "gated"  # (two matrices, whatever their activation)
        extra = {}  # (the fields a dense model with Llama's attention leaves at 0)
        if self.moe is not None:  # (each routed expert's SwiGLU; gpt-oss's with its biases)
            h, inner, moe = self.hidden_size, self.moe["moe_intermediate_size"], self.moe
            matrices = 3 if self.moe_experts_gated else 2  # (gate, up, down; Nemotron-H's up and down)
            per_expert = matrices * h * inner + (2 * inner + h if "swiglu_limit" in moe else 0)
            extra.update(
                num_experts=moe["num_experts"],
                experts_per_token=moe["num_experts_per_tok"],
                expert_params=sum(moe["moe_layers"]) * moe["num_experts"] * per_expert,
            )
        if self.mla is not None:  # (prefills by head: the engine's ``PrefillsByHead``)
            mla, nh = self.mla, self.num_attention_heads
            up_projection = 2 * mla["kv_lora_rank"] * nh * (mla["qk_nope_head_dim"] + mla["v_head_dim"])
            extra.update(
                prefill_head_dim=self.head_dim, prefill_kv_flops_per_token=self.num_hidden_layers * up_projection
            )
        # Sliding-window and chunked layers: their count and W (the longer, were a model to have both)
        windows = [self.layer_window(i) or self.layer_chunk(i) for i in range(self.num_hidden_layers)]
        windows = [w for w in windows if w]
        if windows:
            extra.update(window_layers=len(windows), window_tokens=max(windows))
        return ModelSpec(
            name=self.name,
            num_layers=self.num_hidden_layers,
            hidden_size=self.hidden_size,
            num_attention_heads=self.num_attention_heads,
            num_kv_heads=self.kv_cache_heads,
            head_dim=self.kv_cache_head_dim,  # NOTE: MLA's attention runs on its latent, 576 wide (V2)
            keys_only_kv=self.kv_cache_tensors == 1,  # (MLA's values are its keys' latent)
            kv_layers=self.num_kv_layers,  # (0: a model of no attention, Mamba's: its requests' states hold them)
            state_bytes_per_sequence=self.request_state_bytes(DTYPE_BYTES.get(self.torch_dtype, 2)),
            **extra,
            intermediate_size=self.intermediate_size,
            vocab_size=self.vocab_size,
            num_params=self.num_params,
            max_context_len=self.max_position_embeddings,
            dtype_bytes=DTYPE_BYTES.get(self.torch_dtype, 2),
            mlp_kind=mlp_kind,
            tied_embeddings=self.tie_word_embeddings,
        )
