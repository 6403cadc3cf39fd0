"""The ``ModelConfig`` of the model types whose config.json is not read as Llama's outline is: OPT, GPT-2,
GPT-NeoX, Falcon, MPT, DeepSeek's latent attention (and Kimi Linear's names), Nemotron-H, Mamba and
Gemma 3. ``config.from_hf_config`` calls them."""

from __future__ import annotations

import math
from typing import Any

from sloserve.checkpoint.config_values import check_positive_ints, json_float
from sloserve.checkpoint.layer_types import kimi_linear_layers, nemotron_h_kinds
from sloserve.checkpoint.model_config import LINEAR_ATTENTION, MAMBA, SLIDING, ModelConfig
from sloserve.checkpoint.model_types import DEEPSEEK_MLA_DEFAULTS, GPT2_ACTIVATIONS, MAMBA2_SIZES, MOE_TYPES
from sloserve.checkpoint.moe_config import nemotron_h_moe, read_moe
from sloserve.checkpoint.rope_config import config_rope_scaling, read_llama4_scaling_beta, read_rope_scaling
from sloserve.core.errors import ConfigError


def opt_config(raw: dict[str, Any], common: dict[str, Any], name: str, need) -> ModelConfig:
    """OPT's config: learned positions, LayerNorms (before or after each block), ReLU or GELU, the embeddings
    projected where ``word_embed_proj_dim`` differs from the hidden size."""
    if raw.get("activation_function", "relu") not in ("relu", "gelu"):
        raise ConfigError(f"{name}: OPT activation {raw.get('activation_function')!r} is not supported")
    hidden, heads = common["hidden_size"], common["num_attention_heads"]
    return ModelConfig(
        **common,
        intermediate_size=need("ffn_dim"),
        num_key_value_heads=heads,
        head_dim=hidden // heads,
        norm_eps=1e-5,
        hidden_act=raw.get("activation_function", "relu"),
        word_embed_proj_dim=raw.get("word_embed_proj_dim", hidden),
        do_layer_norm_before=bool(raw.get("do_layer_norm_before", True)),
        enable_bias=bool(raw.get("enable_bias", True)),
        extra={"remove_final_layer_norm": bool(raw.get("_remove_final_layer_norm", False))},
    )


def gpt_neox_config(raw: dict[str, Any], common: dict[str, Any], name: str, need) -> ModelConfig:
    """GPT-NeoX's config (transformers 5's ``rope_parameters``, or the Hub's ``rotary_pct`` and
    ``rotary_emb_base``; transformers' defaults 0.25 and 10,000)."""
    if raw.get("hidden_act", "gelu") != "gelu":
        raise ConfigError(f"{name}: GPT-NeoX hidden_act {raw.get('hidden_act')!r} is not supported (gelu)")
    rope = dict(raw.get("rope_parameters") or {})
    head_dim = common["hidden_size"] // common["num_attention_heads"]
    rotated = rope.get("partial_rotary_factor", raw.get("rotary_pct", 0.25))
    if not isinstance(rotated, (int, float)) or not 0 < rotated <= 1:
        raise ConfigError(f"{name}: rotary_pct must be in (0, 1], got {rotated!r}")
    rotary_dim = int(head_dim * rotated)
    return ModelConfig(
        **common,
        intermediate_size=need("intermediate_size"),
        num_key_value_heads=common["num_attention_heads"],
        head_dim=head_dim,
        norm_eps=float(raw.get("layer_norm_eps", 1e-5)),
        rope_theta=json_float(rope.get("rope_theta", raw.get("rotary_emb_base", 10000.0)), "rope_theta", name),
        rope_scaling=config_rope_scaling(raw, rope, name),
        partial_rotary_dim=rotary_dim if rotary_dim != head_dim else None,
        hidden_act="gelu",
        attention_bias=bool(raw.get("attention_bias", True)),
        parallel_residual=bool(raw.get("use_parallel_residual", True)),
    )


def falcon_config(raw: dict[str, Any], common: dict[str, Any], name: str) -> ModelConfig:
    """Falcon's config (``models/falcon.py``), transformers' FalconConfig defaults where it has none: its KV heads
    (``num_kv_heads`` with ``new_decoder_architecture``, one with ``multi_query``, else every head's), its norms,
    its MLP (4 x hidden), ALiBi where ``alibi``. BLOOM's (``bloom``): Falcon-RW's, as transformers' BloomConfig
    has it."""
    if common["model_type"] == "bloom":
        if raw.get("apply_residual_connection_post_layernorm"):
            raise ConfigError(f"{name}: apply_residual_connection_post_layernorm (the normed stream as the residual) "
                              "is not supported")  # fmt: skip
        raw = {**raw, "alibi": True, "bias": True, "multi_query": False, "parallel_attn": False,
               "new_decoder_architecture": False}  # fmt: skip
    if raw.get("activation", "gelu") != "gelu":
        raise ConfigError(f"{name}: Falcon activation {raw.get('activation')!r} is not supported (gelu)")
    hidden, heads = common["hidden_size"], common["num_attention_heads"]
    new, parallel = bool(raw.get("new_decoder_architecture", False)), bool(raw.get("parallel_attn", True))
    kv_heads = (raw.get("num_kv_heads") or heads) if new else 1 if raw.get("multi_query", True) else heads
    if hidden % heads or heads % kv_heads:
        raise ConfigError(
            f"{name}: num_attention_heads {heads} must divide hidden_size {hidden}, and num_kv_heads {kv_heads} "
            "divide them"
        )
    if new and not parallel:
        raise ConfigError(f"{name}: new_decoder_architecture without parallel_attn is not supported")
    if new and raw.get("num_ln_in_parallel_attn") in (None, 2):
        norms = "ln_attn, ln_mlp"
    else:
        norms = "input" if parallel else "input, post_attention"
    rope = dict(raw.get("rope_parameters") or {})
    bias, bloom = bool(raw.get("bias", False)), common["model_type"] == "bloom"
    return ModelConfig(
        **common,
        intermediate_size=raw.get("ffn_hidden_size") or 4 * hidden,
        num_key_value_heads=kv_heads,
        head_dim=hidden // heads,
        norm_eps=float(raw.get("layer_norm_epsilon") or 1e-5),
        rope_theta=json_float(rope.get("rope_theta", raw.get("rope_theta", 10000.0)), "rope_theta", name),
        rope_scaling=config_rope_scaling(raw, rope, name),
        hidden_act="gelu_pytorch_tanh" if bloom else "gelu",
        attention_bias=bias,
        attention_output_bias=bias,
        mlp_bias=bias,
        parallel_residual=parallel,
        alibi=bool(raw.get("alibi", False)),
        # (BLOOM: a LayerNorm of the embeddings)
        extra={"falcon_norms": norms, "embedding_norm": bloom},
    )


def mpt_config(raw: dict[str, Any], common: dict[str, Any], name: str) -> ModelConfig:
    """MPT's config (``models/mpt.py``), transformers' MptConfig defaults where it has none (``attn_config``'s too). What
    transformers' MPT does not read is refused rather than run otherwise than its checkpoints were trained."""
    attn = {"alibi": True, "alibi_bias_max": 8, "clip_qkv": None, "softmax_scale": None, "qk_ln": False,
            "prefix_lm": False, "attn_uses_sequence_id": False, "attn_type": "multihead_attention",
            **(raw.get("attn_config") or {})}  # fmt: skip
    refused = {
        "attn_config.alibi false (learned position embeddings)": not attn["alibi"],
        "no_bias false (biases)": not raw.get("no_bias", True),
        "attn_config.qk_ln (LayerNorms of the queries and keys)": attn["qk_ln"],
        "logit_scale": raw.get("logit_scale") is not None,
        "attn_config.prefix_lm": attn["prefix_lm"],
        "attn_config.attn_uses_sequence_id": attn["attn_uses_sequence_id"],
        f"attn_config.attn_type {attn['attn_type']!r}": attn["attn_type"] != "multihead_attention",
    }
    for setting, given in refused.items():
        if given:
            raise ConfigError(f"{name}: MPT's {setting} is not supported (transformers' MPT does not read it)")
    hidden, heads = common["hidden_size"], common["num_attention_heads"]
    if hidden % heads:
        raise ConfigError(f"{name}: n_heads {heads} must divide d_model {hidden}")
    check_positive_ints({"expansion_ratio": raw.get("expansion_ratio", 4)}, ("expansion_ratio",), name)
    # (0: no clamp, as transformers reads it)
    clip = json_float(attn["clip_qkv"], "attn_config.clip_qkv", name) if attn["clip_qkv"] else None
    return ModelConfig(
        **common,
        intermediate_size=raw.get("expansion_ratio", 4) * hidden,
        num_key_value_heads=heads,
        head_dim=hidden // heads,
        norm_eps=json_float(raw.get("layer_norm_epsilon", 1e-5), "layer_norm_epsilon", name),
        hidden_act="gelu",
        clip_qkv=clip,
        attention_multiplier=None if attn["softmax_scale"] is None else float(attn["softmax_scale"]),
        alibi=True,
        # (as MPT's own code reads it; transformers' always takes 8, which every released MPT says)
        alibi_bias_max=json_float(attn["alibi_bias_max"], "attn_config.alibi_bias_max", name),
    )


def deepseek_config(raw: dict[str, Any], common: dict[str, Any], name: str, need) -> ModelConfig:
    """DeepSeek-V2's and V3's config: the MLA sizes (``mla``), the experts (``read_moe``), transformers' defaults
    where it has none. NOTE: transformers' config.json says ``head_dim`` for the rotated part of a query (64)."""
    if raw["model_type"] == "minicpm3" and raw.get("v_head_dim") is None:  # (transformers' default)
        raw = {**raw, "v_head_dim": common["hidden_size"] // common["num_attention_heads"]}
    mla = {key: raw.get(key, default) for key, default in DEEPSEEK_MLA_DEFAULTS.items()}
    for key, value in mla.items():
        if not (value is None and key == "q_lora_rank") and not (
            isinstance(value, int) and not isinstance(value, bool) and value > 0
        ):
            raise ConfigError(f"{name}: {key} must be a positive integer, got {value!r}")
    if mla["qk_rope_head_dim"] % 2:
        raise ConfigError(f"{name}: qk_rope_head_dim {mla['qk_rope_head_dim']} must be even (rotated in pairs)")
    if raw.get("hidden_act", "silu") != "silu":
        raise ConfigError(f"{name}: hidden_act {raw.get('hidden_act')!r} is not supported (silu)")
    rope = dict(raw.get("rope_parameters") or {})
    qk = mla["qk_nope_head_dim"] + mla["qk_rope_head_dim"]
    scaling = config_rope_scaling(raw, rope, name)
    kimi = raw["model_type"] == "kimi_linear"  # (its attention layers without rope, its KDA layers' states)
    layers = common["num_hidden_layers"]
    layer_types, kda = kimi_linear_layers(raw, layers, name) if kimi else ((), None)
    return ModelConfig(
        **common,
        intermediate_size=need("intermediate_size"),
        num_key_value_heads=common["num_attention_heads"],
        head_dim=qk,  # (a query's and a key's; the rotary embedding turns the last qk_rope_head_dim of it)
        partial_rotary_dim=mla["qk_rope_head_dim"],
        norm_eps=json_float(raw.get("rms_norm_eps", 1e-6), "rms_norm_eps", name),
        rope_theta=json_float(rope.get("rope_theta", raw.get("rope_theta", 10000.0)), "rope_theta", name),
        rope_scaling=scaling,
        llama4_scaling_beta=read_llama4_scaling_beta(raw["model_type"], scaling, rope, name),
        attention_bias=bool(raw.get("attention_bias", False)),
        moe=read_moe(raw, common["num_hidden_layers"], name) if raw["model_type"] in MOE_TYPES else None,
        # (V2's checkpoints rotate adjacent pairs of q_R and k_R; V3's where rope_interleave says, its default;
        # MiniCPM3's halves)
        mla={
            **mla,
            "rope_interleave": raw["model_type"] == "deepseek_v2"
            or bool(raw.get("rope_interleave", not kimi and raw["model_type"] != "minicpm3")),
        },
        layer_types=layer_types,
        rotary_layers=(False,) * layers if kimi else (),
        gated_delta_net=kda,
        **(_minicpm3_scales(raw, common) if raw["model_type"] == "minicpm3" else {}),
    )


def _minicpm3_scales(raw: dict[str, Any], common: dict[str, Any]) -> dict[str, float]:
    """MiniCPM3's scales as Granite's multipliers: the embeddings times ``scale_emb``, each output times
    ``scale_depth`` / sqrt(layers) as it joins the stream, the logits over hidden_size / ``dim_model_base``
    (transformers divides the final hidden states, the engine the logits: equal up to rounding)."""
    layers, hidden, name = common["num_hidden_layers"], common["hidden_size"], common["name"]
    depth, base = raw.get("scale_depth"), raw.get("dim_model_base")  # (None: no scaling, as transformers reads it)
    depth = layers**0.5 if depth is None else json_float(depth, "scale_depth", name)
    base = hidden if base is None else json_float(base, "dim_model_base", name)
    return {
        "embedding_multiplier": json_float(raw["scale_emb"], "scale_emb", name),
        "residual_multiplier": depth / layers**0.5,
        "logits_scaling": hidden / base,
    }


# Kimi Linear's config names on the Hub (transformers' attribute_map) for the generic ones, and its linear_attn_config's
KIMI_LINEAR_NAMES = {
    "model_max_length": "max_position_embeddings", "moe_renormalize": "norm_topk_prob",
    "num_expert_group": "n_group", "num_experts": "n_routed_experts", "num_local_experts": "n_routed_experts",
    "num_experts_per_token": "num_experts_per_tok", "num_shared_experts": "n_shared_experts",
}  # fmt: skip
KIMI_LINEAR_ATTENTION_NAMES = {
    "head_dim": "linear_head_dim", "num_heads": "linear_num_heads", "short_conv_kernel_size": "linear_conv_kernel_dim",
}  # fmt: skip


def kimi_linear_names(raw: dict[str, Any], name: str) -> dict[str, Any]:
    """Kimi Linear's config under the generic names, as transformers reads it: the Hub's names of its sizes and
    routing (``KIMI_LINEAR_NAMES``), its ``linear_attn_config``'s KDA sizes and layers (1-indexed there)."""
    renamed = {KIMI_LINEAR_NAMES.get(key, key): value for key, value in raw.items()}
    linear = raw.get("linear_attn_config") or {}
    if not isinstance(linear, dict):
        raise ConfigError(f"{name}: linear_attn_config must be an object, got {linear!r}")
    renamed.update({ours: linear[theirs] for theirs, ours in KIMI_LINEAR_ATTENTION_NAMES.items() if theirs in linear})
    layers = renamed.get("num_hidden_layers")
    if renamed.get("layer_types") is None and "full_attn_layers" in linear and "kda_layers" in linear:
        check_positive_ints({"num_hidden_layers": layers}, ("num_hidden_layers",), name)
        kinds: list[Any] = [None] * layers
        for key, kind in (("full_attn_layers", "full_attention"), ("kda_layers", LINEAR_ATTENTION)):
            for layer in linear[key] if isinstance(linear[key], list) else [linear[key]]:
                if not (isinstance(layer, int) and 1 <= layer <= layers):
                    raise ConfigError(f"{name}: linear_attn_config {key} holds {layer!r}, not a layer in 1..{layers}")
                kinds[layer - 1] = kind
        renamed["layer_types"] = kinds
    return renamed


def gpt2_config(raw: dict[str, Any], common: dict[str, Any], name: str) -> ModelConfig:
    """GPT-2's config, transformers' GPT2Config defaults where it has none (an MLP 4 times as wide, gelu_new);
    GPT-BigCode's (``gpt_bigcode``): one KV head where ``multi_query`` (its default), GELU by tanh's approximation."""
    bigcode = common["model_type"] == "gpt_bigcode"
    activation = raw.get("activation_function", "gelu_pytorch_tanh" if bigcode else "gelu_new")
    if activation not in GPT2_ACTIVATIONS:
        raise ConfigError(
            f"{name}: GPT-2 activation_function {activation!r} is not supported ({', '.join(GPT2_ACTIVATIONS)})"
        )
    if raw.get("add_cross_attention"):
        raise ConfigError(f"{name}: add_cross_attention (GPT-2 as an encoder-decoder's decoder) is not supported")
    hidden, heads = common["hidden_size"], common["num_attention_heads"]
    if hidden % heads:
        raise ConfigError(f"{name}: n_head {heads} must divide n_embd {hidden}")
    return ModelConfig(
        **common,
        intermediate_size=raw.get("n_inner") or 4 * hidden,
        num_key_value_heads=1 if bigcode and raw.get("multi_query", True) else heads,
        head_dim=hidden // heads,
        norm_eps=json_float(raw.get("layer_norm_epsilon", 1e-5), "layer_norm_epsilon", name),
        hidden_act=activation,
        attention_bias=True,
        attention_output_bias=True,
        mlp_bias=True,
        # (None: head_dim ** -0.5)
        attention_multiplier=None if raw.get("scale_attn_weights", True) else 1.0,
        extra={"scale_attn_by_inverse_layer_idx": bool(raw.get("scale_attn_by_inverse_layer_idx", False))},
    )


def nemotron_h_config(raw: dict[str, Any], common: dict[str, Any], name: str, need) -> ModelConfig:
    """Nemotron-H's config: its blocks (``nemotron_h_kinds``), its Mamba-2 mixers (transformers' names and the
    Hub's ``mamba_*`` ones; d_inner is heads x head_dim; the steps at least ``time_step_min``, as transformers
    clamps them), attention without a position embedding, a squared-ReLU MLP; transformers' defaults."""
    for key, want in (("mamba_hidden_act", "silu"), ("mlp_hidden_act", "relu2")):
        if raw.get(key, want) != want:
            raise ConfigError(f"{name}: {key} {raw[key]!r} is not supported ({want})")
    heads, head_dim = raw.get("mamba_num_heads", 128), raw.get("mamba_head_dim", 64)
    mamba = {
        "n_heads": heads,
        "head_dim": head_dim,
        "n_groups": raw.get("n_groups", raw.get("mamba_n_groups", 8)),
        "d_state": raw.get("ssm_state_size", 128),
        "d_conv": raw.get("conv_kernel", raw.get("mamba_d_conv", 4)),
        "chunk_size": raw.get("chunk_size", raw.get("mamba_chunk_size", 128)),
    }
    check_positive_ints(mamba, tuple(mamba), name, "nemotron_h Mamba ")
    if heads % mamba["n_groups"]:
        raise ConfigError(f"{name}: n_groups {mamba['n_groups']} must divide mamba_num_heads {heads}")
    least = json_float(raw.get("time_step_min", raw.get("mamba_dt_min", 0.001)), "time_step_min", name)
    mamba.update(
        d_inner=heads * head_dim,
        conv_bias=bool(raw.get("use_conv_bias", raw.get("mamba_conv_bias", True))),
        proj_bias=bool(raw.get("use_bias", False)),
        out_proj_bias=bool(raw.get("use_bias", False)),
        rms_norm=True,
        norm_before_gate=False,
        time_step_limit=(least, float("inf")),
    )
    layers, kinds = common["num_hidden_layers"], nemotron_h_kinds(raw, name)
    return ModelConfig(
        **common,
        intermediate_size=need("intermediate_size"),
        num_key_value_heads=raw.get("num_key_value_heads") or common["num_attention_heads"],
        head_dim=raw.get("head_dim") or common["hidden_size"] // common["num_attention_heads"],
        norm_eps=json_float(raw.get("layer_norm_epsilon", 1e-5), "layer_norm_epsilon", name),
        hidden_act="relu2",
        mlp_bias=bool(raw.get("mlp_bias", False)),  # (its attention has no biases whatever the config says)
        layer_types=tuple(kinds),
        rotary_layers=(False,) * layers,  # (no position embedding: the Mamba layers order the tokens)
        mamba=mamba,
        moe=nemotron_h_moe(raw, kinds, name),
    )


def mamba_config(raw: dict[str, Any], common: dict[str, Any], name: str) -> ModelConfig:
    """Mamba's, Falcon Mamba's or Mamba-2's config (transformers' names and defaults): every layer an RMSNorm and a
    mixer of ``expand`` x hidden_size channels, Mamba's (``models/mamba1.py``; Falcon Mamba's with its step, B and C
    RMS-normalized without weights, at ``mixer_rms_eps``) or Mamba-2's (``models/mamba2.py``), the residual stream in
    float32 where ``residual_in_fp32``. No layer attends: the one nominal head (of two numbers) is read by none."""
    model_type, hidden = common["model_type"], common["hidden_size"]
    if raw.get("hidden_act", "silu") != "silu":
        raise ConfigError(f"{name}: hidden_act {raw.get('hidden_act')!r} is not supported for {model_type} (silu)")
    version = 2 if model_type == "mamba2" else 1
    rank = raw.get("time_step_rank", "auto")
    sizes = {  # (the config's names, transformers' defaults)
        "state_size": raw.get("state_size", 128 if version == 2 else 16),
        "conv_kernel": raw.get("conv_kernel", 4),
        "expand": raw.get("expand", 2),
        **({"time_step_rank": math.ceil(hidden / 16) if rank == "auto" else rank} if version == 1 else {}),
        **({key: raw.get(key, default) for key, default in MAMBA2_SIZES.items()} if version == 2 else {}),
    }
    check_positive_ints(sizes, tuple(sizes), name)
    d_inner, bias = sizes["expand"] * hidden, bool(raw.get("use_bias", False))
    mamba = {"d_inner": d_inner, "d_state": sizes["state_size"], "d_conv": sizes["conv_kernel"],
             "conv_bias": bool(raw.get("use_conv_bias", True)), "proj_bias": bias}  # fmt: skip
    if version == 1:
        falcon = model_type == "falcon_mamba"
        eps = json_float(raw.get("mixer_rms_eps", 1e-6), "mixer_rms_eps", name) if falcon else None
        mamba.update(version=1, dt_rank=sizes["time_step_rank"], dt_bc_norms=falcon, dt_bc_norm_weights=False,
                     dt_bc_norm_eps=eps)  # fmt: skip
    else:
        heads, head_dim, groups = sizes["num_heads"], sizes["head_dim"], sizes["n_groups"]
        if heads * head_dim != d_inner or heads % groups:
            raise ConfigError(
                f"{name}: num_heads {heads} x head_dim {head_dim} must be expand x hidden_size {d_inner}, and "
                f"n_groups {groups} must divide the heads"
            )
        limit = [json_float(bound, "time_step_limit", name) for bound in raw.get("time_step_limit") or (0.0, math.inf)]
        if len(limit) != 2:
            raise ConfigError(f"{name}: time_step_limit must be two numbers (the steps' least and most), got {limit!r}")
        mamba.update(n_heads=heads, head_dim=head_dim, n_groups=groups, chunk_size=sizes["chunk_size"],
                     out_proj_bias=bias, rms_norm=True, norm_before_gate=False, time_step_limit=tuple(limit))  # fmt: skip
    mamba["residual_in_fp32"] = bool(raw.get("residual_in_fp32", True))
    layers = common["num_hidden_layers"]
    return ModelConfig(
        **common,
        intermediate_size=d_inner,
        num_key_value_heads=1,
        head_dim=2,
        norm_eps=json_float(raw.get("layer_norm_epsilon", 1e-5), "layer_norm_epsilon", name),
        layer_types=(MAMBA,) * layers,
        rotary_layers=(False,) * layers,
        mamba=mamba,
    )


def gemma3_config(raw: dict[str, Any], common: dict[str, Any], name: str, need) -> ModelConfig:
    """A Gemma 3 text model's config (transformers 5's ``rope_parameters`` per layer type, or the
    older ``rope_theta``, ``rope_local_base_freq``, ``rope_scaling`` and ``sliding_window_pattern``), or
    Gemma 2's (no query/key norms; one rope base for every layer; scores capped), VaultGemma's (Gemma 2's without
    the norms of each part's output: ``extra["output_norms"]``)."""
    gemma2 = raw["model_type"] in ("gemma2", "vaultgemma")
    activation = raw.get("hidden_activation") or raw.get("hidden_act") or "gelu_pytorch_tanh"
    if activation != "gelu_pytorch_tanh":
        raise ConfigError(f"{name}: hidden_activation {activation!r} is not supported (gelu_pytorch_tanh)")
    if raw.get("use_bidirectional_attention"):
        raise ConfigError(f"{name}: bidirectional attention is not supported")
    layers = need("num_hidden_layers")
    layer_types = raw.get("layer_types")
    if layer_types is None:  # every pattern-th layer is global
        pattern = int(raw.get("sliding_window_pattern", 6))
        layer_types = [SLIDING if (i + 1) % pattern else "full_attention" for i in range(layers)]
    rope = raw.get("rope_parameters") or {}
    full = dict(rope.get("full_attention") or (rope if gemma2 else {}))
    local = dict(rope.get(SLIDING) or (full if gemma2 else {}))
    if gemma2 and "rope_theta" in raw:  # (before transformers 5: at the top level, for every layer)
        full.setdefault("rope_theta", raw["rope_theta"])
        local.setdefault("rope_theta", raw["rope_theta"])
    return ModelConfig(
        **{**common, "tie_word_embeddings": bool(raw.get("tie_word_embeddings", True))},
        intermediate_size=need("intermediate_size"),
        num_key_value_heads=raw.get("num_key_value_heads") or common["num_attention_heads"],
        head_dim=raw.get("head_dim") or 256,
        norm_eps=json_float(raw.get("rms_norm_eps", 1e-6), "rms_norm_eps", name),
        rope_theta=json_float(
            full.get("rope_theta", raw.get("rope_theta", 10_000.0 if gemma2 else 1_000_000.0)), "rope_theta", name
        ),
        rope_scaling=read_rope_scaling(
            full if full.get("rope_type", "default") != "default" else raw.get("rope_scaling"), name
        ),
        rope_local_theta=json_float(
            local.get("rope_theta", raw.get("rope_local_base_freq", 10_000.0)), "rope_theta", name
        ),
        attention_bias=bool(raw.get("attention_bias", False)),
        hidden_act=activation,
        qk_norm=not gemma2,
        query_pre_attn_scalar=float(raw.get("query_pre_attn_scalar", 256)),
        layer_types=tuple(layer_types),
        sliding_window=int(raw.get("sliding_window") or 4096),
        final_logit_softcapping=raw.get("final_logit_softcapping"),
        attn_logit_softcapping=raw.get("attn_logit_softcapping"),
        extra={"output_norms": raw["model_type"] != "vaultgemma"},
    )
