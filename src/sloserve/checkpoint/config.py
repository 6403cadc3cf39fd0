"""Model configuration for the engine: read from a HuggingFace ``config.json`` or a named random shape.

Supported architectures (``ARCHITECTURES``): the Llama family (Llama-2/3, Mistral-style GQA, Phi-3 and
Phi-4, SmolLM3, Granite 3), Qwen2 / Qwen2.5 (QKV biases), Qwen3 (per-head RMSNorm of queries and keys, no QKV
biases), Qwen3-MoE and Mixtral (their MLPs mixtures of experts), OLMo 2 (norms after attention and the
MLP), Gemma 2 and Gemma 3 text models
(``gemma3_text``: sliding-window layers beside global ones) and OPT (learned positions, LayerNorm, ReLU);
and the language model of multimodal checkpoints (``MULTIMODAL``: Gemma 3 4B-27B, Mistral Small 3.1, Qwen2-VL,
Qwen2.5-VL, Qwen3-VL, Qwen3-VL-MoE, LFM2-VL, LFM3-VL, EXAONE 4.5, Qwen3.5, GLM-4.1V, 4.5V, 4.6V and Llama 4), served
as text.

``from_hf_config`` reads a config with the tables of ``model_types``, the readers of ``rope_config``,
``moe_config`` and ``layer_types``, and for the model types not of Llama's outline ``family_configs``.
``random_config`` gives the named random shapes of ``random:NAME`` models.
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from sloserve.checkpoint.config_values import check_positive_ints, check_setting_kinds, json_float
from sloserve.checkpoint.family_configs import (
    deepseek_config,
    falcon_config,
    gemma3_config,
    gpt2_config,
    gpt_neox_config,
    kimi_linear_names,
    mamba_config,
    mpt_config,
    nemotron_h_config,
    opt_config,
)
from sloserve.checkpoint.generation_config import generation_eos_ids
from sloserve.checkpoint.layer_types import (
    bamba_layers,
    cohere2_moe_layers,
    gated_delta_net_layers,
    granite_4_layers,
    granite_swa_layers,
    jamba_layers,
    lfm2_layers,
    llama4_layers,
    nemotron_h_kinds,
    read_mamba2,
    sliding_layers,
)
from sloserve.checkpoint.model_config import PARALLEL_HYBRID, SLIDING, ModelConfig
from sloserve.checkpoint.model_types import (
    ARCHITECTURES,
    COHERE_TYPES,
    CONFIG_DEFAULTS,
    DEEPSEEK_TYPES,
    DEFAULT_ROPE_PARAMETERS,
    DEFAULT_ROPE_THETA,
    FALCON_H1_MAMBA_DEFAULTS,
    FLAT_MULTIMODAL,
    GATED_DELTA_NET_TYPES,
    GEMMA2_DEFAULTS,
    GEMMA3_TEXT_DEFAULTS,
    GPT2_NAMES,
    GRANITE_SCALED,
    LFM_TYPES,
    MAMBA_TYPES,
    MLP_ACTIVATIONS,
    MOE_DEFAULTS,
    MOE_TYPES,
    MULTIMODAL,
    OLMO_TYPES,
    OUTPUT_BIASED,
    PARTIAL_ROTARY,
    PARTIAL_ROTARY_DEFAULTS,
    QK_NORMED,
    QKV_BIASED,
    QWEN3_NEXT_TYPES,
    RMS_NORM_EPS_DEFAULTS,
    ROTARY_INTERLEAVED,
    SETTING_NAMES,
    SLIDING_PATTERNS,
    TEXT_MODEL_TYPES,
    UNNAMED_CONTEXT_TOKENS,
)
from sloserve.checkpoint.moe_config import read_moe
from sloserve.checkpoint.rope_config import config_rope_scaling, read_llama4_scaling_beta, read_longrope, read_ntk_alpha
from sloserve.core.errors import ConfigError, UnknownNameError
from sloserve.cost.specs import MODELS

# Byte-level tokenizer of random models: ids 0..255 are bytes, then BOS and EOS.
BYTE_BOS_ID, BYTE_EOS_ID = 256, 257
RANDOM_PREFIX = "random:"


def from_hf_config(raw: dict[str, Any], name: str = "model") -> ModelConfig:
    """A ``ModelConfig`` from the dict of an HF ``config.json``; unsupported ones are a ConfigError."""
    model_type = raw.get("model_type")
    if model_type in MULTIMODAL:
        return _language_model_config(raw, name)
    if model_type not in ARCHITECTURES:
        raise ConfigError(
            f"{name}: unsupported architecture {model_type!r} (config.json model_type); "
            f"supported: {', '.join(sorted([*ARCHITECTURES, *MULTIMODAL]))}"
        )
    check_setting_kinds(raw, model_type, name)
    if model_type == "gemma3_text":
        raw = {**GEMMA3_TEXT_DEFAULTS, **raw}
    elif model_type in ("gemma2", "vaultgemma"):
        raw = {**GEMMA2_DEFAULTS, **raw}
    elif model_type in ("gpt2", "gpt_bigcode"):
        raw = {GPT2_NAMES.get(key, key): value for key, value in raw.items()}
    elif model_type in SETTING_NAMES:  # (a config's own names of the common settings win, as transformers reads them)
        raw = {**raw, **{ours: raw[theirs] for theirs, ours in SETTING_NAMES[model_type].items() if theirs in raw}}
    elif model_type in MAMBA_TYPES:  # (no attention: one nominal head; no positions: the default context)
        tied = model_type != "mamba2"  # (transformers' defaults)
        raw = {
            "num_attention_heads": 1,
            "max_position_embeddings": UNNAMED_CONTEXT_TOKENS,
            "tie_word_embeddings": tied,
            **raw,
        }
    elif model_type == "nemotron_h":  # (its blocks' count is its pattern's length)
        raw = {**raw, "num_hidden_layers": len(nemotron_h_kinds(raw, name))}
    elif model_type == "kimi_linear":
        raw = kimi_linear_names(raw, name)
    elif model_type in LFM_TYPES:  # (the Hub's names, as transformers reads them: over the generic ones)
        raw = {
            **raw,
            "tie_word_embeddings": raw.get("tie_embedding", raw.get("tie_word_embeddings", True)),
            "intermediate_size": raw.get("block_ff_dim", raw.get("intermediate_size")),
            "rms_norm_eps": raw.get("norm_eps", raw.get("rms_norm_eps", 1e-5)),
        }
    raw = {**CONFIG_DEFAULTS.get(model_type, {}), **raw}
    if model_type in DEFAULT_ROPE_PARAMETERS and not any(
        raw.get(k) for k in ("rope_parameters", "rope_scaling", "rope_theta")
    ):
        raw = {**raw, "rope_parameters": DEFAULT_ROPE_PARAMETERS[model_type]}
    fp8_block = _fp8_weight_block(raw.get("quantization_config"), model_type, name)
    config = _config_of(raw, model_type, name)
    if fp8_block is None:
        return config
    return dataclasses.replace(config, extra={**config.extra, "fp8_weight_block": fp8_block})


def _fp8_weight_block(quantization: Any, model_type: str, name: str) -> tuple[int, int] | None:
    """The (rows, columns) of a block-wise FP8 checkpoint's weight blocks (``quant_method`` fp8 with a
    ``weight_block_size``: DeepSeek-V3's, Qwen3's and GLM-4.5's FP8 releases; their weights are dequantized
    as they load, ``models.dequantize_fp8_blocks``); None for an unquantized one (or gpt-oss's MXFP4 experts,
    dequantized as they load too). Any other quantization is a ConfigError: its tensors (AWQ's packed ints,
    per-tensor FP8) would load as plain weights."""
    method = quantization.get("quant_method") if isinstance(quantization, dict) else None
    if not quantization or (model_type == "gpt_oss" and method == "mxfp4"):
        return None
    block = quantization.get("weight_block_size") if method == "fp8" else None
    if block is None:
        raise ConfigError(
            f"{name}: quantized checkpoints are not supported (config.json quantization_config, quant_method "
            f"{method!r}{' without weight_block_size' if method == 'fp8' else ''}); use the unquantized model, "
            "a block-wise FP8 one, or a GGUF file of it"
        )
    if not (isinstance(block, list) and len(block) == 2 and all(isinstance(b, int) and b > 0 for b in block)):
        raise ConfigError(f"{name}: quantization_config weight_block_size must be two positive integers, got {block!r}")
    for key, value in (("fmt", "e4m3"), ("activation_scheme", "dynamic")):
        if quantization.get(key, value) != value:
            raise ConfigError(f"{name}: FP8 quantization_config {key} {quantization[key]!r} is not supported ({value})")
    return block[0], block[1]


def _config_of(raw: dict[str, Any], model_type: str, name: str) -> ModelConfig:
    """``from_hf_config``'s reading of a supported, unquantized-as-held ``raw`` of ``model_type``: the settings
    every config names, then a family's own reader (``family_configs``) or Llama's outline: what it refuses
    (``_refuse_unsupported``), its rotary embedding (``_rotary``), its layers (``_layers``) and the fields
    only some families set (``_family_fields``)."""
    need = _needing(raw, model_type, name)
    common = _common_settings(raw, model_type, name, need)
    if model_type == "opt":
        return opt_config(raw, common, name, need)
    if model_type in ("gemma3_text", "gemma2", "vaultgemma"):
        return gemma3_config(raw, common, name, need)
    if model_type == "gpt_neox":
        return gpt_neox_config(raw, common, name, need)
    if model_type in ("falcon", "bloom"):
        return falcon_config(raw, common, name)
    if model_type == "mpt":
        return mpt_config(raw, common, name)
    if model_type in ("gpt2", "gpt_bigcode"):
        return gpt2_config(raw, common, name)
    if model_type in DEEPSEEK_TYPES:
        return deepseek_config(raw, common, name, need)
    if model_type == "nemotron_h":
        return nemotron_h_config(raw, common, name, need)
    if model_type in MAMBA_TYPES:
        return mamba_config(raw, common, name)
    _refuse_unsupported(raw, model_type, name)
    head_dim = raw.get("head_dim") or common["hidden_size"] // common["num_attention_heads"]
    rotary = _rotary(raw, model_type, head_dim, name)
    layers = _layers(raw, model_type, common, rotary, need, name)
    return ModelConfig(
        **common,
        intermediate_size=layers.intermediate_size,
        num_key_value_heads=raw.get("num_key_value_heads") or common["num_attention_heads"],
        head_dim=head_dim,
        norm_eps=_norm_eps(raw, model_type, name),
        hidden_act=_activation(raw, model_type, name),
        rope_theta=rotary.theta if layers.rope_theta is None else layers.rope_theta,
        rope_scaling=rotary.scaling,
        rope_local_theta=rotary.local_theta,
        partial_rotary_dim=rotary.rotary_dim if rotary.rotary_dim != head_dim else None,
        rotary_interleaved=model_type in ROTARY_INTERLEAVED,
        llama4_scaling_beta=read_llama4_scaling_beta(model_type, rotary.scaling, rotary.settings, name),
        **_biases(raw, model_type),
        lm_head_bias=model_type == "phi" or (model_type == "phimoe" and bool(raw.get("lm_head_bias", False))),
        attention_sinks=model_type in ("gpt_oss", "granite_swa", "granitemoe_swa"),
        qk_norm=model_type in (*QK_NORMED, *QWEN3_NEXT_TYPES)
        or (model_type in ("glm4_moe", "sarvam_moe") and bool(raw.get("use_qk_norm", model_type == "sarvam_moe"))),
        qk_norm_after_rotary=model_type in ("hunyuan_v1_dense", "hunyuan_v1_moe"),
        qk_norm_whole_projection=model_type in (*OLMO_TYPES, "minimax_m2"),
        clip_qkv=raw.get("clip_qkv") if model_type in ("olmoe", "olmo") else None,
        moe=read_moe(raw, common["num_hidden_layers"], name) if model_type in MOE_TYPES else None,
        layer_types=layers.layer_types,
        sliding_window=int(layers.sliding_window) if layers.sliding_window else None,
        attention_chunk_size=layers.attention_chunk_size,
        rotary_layers=tuple(bool(flag) for flag in layers.rotary_layers or ()),
        mamba=layers.mamba,
        short_conv=layers.short_conv,
        gated_delta_net=layers.gated_delta_net,
        **_family_fields(raw, model_type, name),
    )


def _needing(raw: dict[str, Any], model_type: str, name: str) -> Callable[[str], Any]:
    """``need(key)``: ``raw[key]``, or a ConfigError naming the setting as the config names it (BLOOM's n_head)."""

    def need(key: str) -> Any:
        if key not in raw:
            theirs = [t for t, ours in SETTING_NAMES.get(model_type, {}).items() if ours == key]
            raise ConfigError(f"{name}: config.json has no {theirs[0] if theirs else key!r}")
        return raw[key]

    return need


def _common_settings(raw: dict[str, Any], model_type: str, name: str, need: Callable[[str], Any]) -> dict[str, Any]:
    """The ModelConfig fields every family's config gives: the shape, the context, the special tokens, the dtype."""
    eos = raw.get("eos_token_id")
    return dict(
        model_type=model_type,
        vocab_size=need("vocab_size"),
        hidden_size=need("hidden_size"),
        num_hidden_layers=need("num_hidden_layers"),
        num_attention_heads=need("num_attention_heads"),
        max_position_embeddings=need("max_position_embeddings"),
        tie_word_embeddings=bool(raw.get("tie_word_embeddings", model_type == "opt")),
        bos_token_id=raw.get("bos_token_id"),
        eos_token_ids=tuple(eos) if isinstance(eos, list) else (() if eos is None else (eos,)),
        torch_dtype=str(raw.get("torch_dtype") or raw.get("dtype") or "float32"),
        name=name,
    )


def _refuse_unsupported(raw: dict[str, Any], model_type: str, name: str) -> None:
    """A ConfigError for a setting of Llama's outline that the engine's models leave out."""
    if raw.get("use_sliding_window"):
        raise ConfigError(f"{name}: sliding-window attention (use_sliding_window) is not supported for {model_type}")
    if model_type in COHERE_TYPES and raw.get("use_qk_norm"):
        # NOTE: Command R+'s query and key LayerNorms (a weight per head and dimension) would be left out
        raise ConfigError(f"{name}: use_qk_norm (Command R+'s query and key LayerNorms) is not supported")
    if model_type in ("phi", "stablelm") and raw.get("qk_layernorm"):
        # NOTE: their query and key LayerNorms (one for every head) would be left out
        raise ConfigError(f"{name}: qk_layernorm (query and key LayerNorms) is not supported for {model_type}")
    if model_type == "stablelm" and raw.get("use_parallel_residual"):
        raise ConfigError(f"{name}: use_parallel_residual (StableLM 2 12B's layers) is not supported")


def _activation(raw: dict[str, Any], model_type: str, name: str) -> str:
    """The MLP's activation (``hidden_act``), one of those the model type's MLP runs."""
    activation = raw.get("hidden_act", "silu")
    if model_type == "gemma" and activation == "gelu":  # (Gemma's first configs' name of it, as transformers reads it)
        activation = "gelu_pytorch_tanh"
    activations = MLP_ACTIVATIONS.get(model_type, ("silu",))
    if activation not in activations:
        raise ConfigError(f"{name}: hidden_act {activation!r} is not supported ({', '.join(activations)})")
    return activation


@dataclasses.dataclass(frozen=True)
class _Rotary:
    """A config's rotary embedding, as ``_rotary`` reads it."""

    theta: float  # rope_theta (the base, θ); the full-attention layers' where the sliding ones have their own
    local_theta: float | None  # the sliding layers' base (OLMo 3, LFM3)
    scaling: dict[str, Any] | None  # the rope scaling the engine applies (None: plain rope)
    settings: dict[str, Any]  # transformers 5's rope_parameters, as read
    rotary_dim: int  # the dimensions of a head that turn (head_dim but for partial rotary embeddings)
    unrotated: bool  # no layer rotates (OLMo Hybrid as released: no position embedding)


def _rotary(raw: dict[str, Any], model_type: str, head_dim: int, name: str) -> _Rotary:
    """The rotary embedding of a config of Llama's outline: its base, scaling and rotated dimensions."""
    # transformers >= 5 keeps rope settings in rope_parameters; older configs at the top level.
    rope = dict(raw.get("rope_parameters") or {})
    default_theta = DEFAULT_ROPE_THETA.get(model_type, 10000.0)
    local_theta = None
    if model_type in ("olmo3", "lfm3"):  # (transformers 5: one dict a layer type; the scaling the full layers' only)
        local_theta = (rope.get(SLIDING) or {}).get("rope_theta", raw.get("rope_theta", default_theta))
        local_theta = json_float(local_theta, "rope_theta", name)
        rope = dict(rope.get("full_attention") or {})
    rope_theta = rope.get("rope_theta", raw.get("rope_theta", default_theta))
    unrotated = model_type == "olmo_hybrid" and rope_theta is None
    rope_theta = default_theta if unrotated else json_float(rope_theta, "rope_theta", name)
    if model_type in ("hunyuan_v1_dense", "hunyuan_v1_moe"):  # (the scaling folded into the base)
        rope_theta, rope, raw = read_ntk_alpha(raw, rope, rope_theta, head_dim, name)
    scaling = config_rope_scaling(raw, rope, name)
    rotated = rope.get(
        "partial_rotary_factor", raw.get("partial_rotary_factor", PARTIAL_ROTARY_DEFAULTS.get(model_type, 1.0))
    )
    if model_type == "bamba":  # (transformers' Bamba rotates half of each head whatever its config says)
        rotated = 0.5
    if model_type == "minimax_m2" and raw.get("rotary_dim"):  # (the Hub's: the dimensions turned, 64 of 128)
        rotated = raw["rotary_dim"] / head_dim
    if scaling is not None and scaling.get("rope_type") == "proportional":  # (whole heads, some pairs unturned)
        rotated = 1.0
    if rotated != 1.0 and model_type not in PARTIAL_ROTARY:  # NOTE: transformers' Llama rotates whole heads
        raise ConfigError(
            f"{name}: partial_rotary_factor {rotated} (a rotary embedding on part of a head) is not supported "
            f"for {model_type} ({', '.join(PARTIAL_ROTARY)} only)"
        )
    if not isinstance(rotated, (int, float)) or not 0 < rotated <= 1:
        raise ConfigError(f"{name}: partial_rotary_factor must be in (0, 1], got {rotated!r}")
    rotary_dim = int(head_dim * rotated)  # (transformers' rounding)
    if scaling is not None and scaling.get("rope_type", scaling.get("type")) == "longrope":
        scaling = read_longrope(scaling, raw, rotary_dim, name)
        for key in ("short_mscale", "long_mscale") if model_type == "phimoe" else ():  # (Phi-3.5-MoE's cos/sin scales)
            if isinstance(scaling.get(key), bool) or not isinstance(scaling.get(key), (int, float)):
                raise ConfigError(f"{name}: phimoe's longrope rope scaling needs {key}, a number")
    return _Rotary(rope_theta, local_theta, scaling, rope, rotary_dim, unrotated)


@dataclasses.dataclass(frozen=True)
class _Layers:
    """What a config of Llama's outline says of its layers (ModelConfig's fields of the same names), as
    ``_layers`` reads it."""

    intermediate_size: int  # the dense MLPs' width (without them, what stands for it: the experts', a shared MLP's)
    layer_types: tuple[str, ...]  # each layer's kind (empty: every one full attention)
    sliding_window: Any  # the sliding layers' window (None: no layer slides)
    rotary_layers: Sequence[bool] | None  # whether each layer rotates (None: every one)
    attention_chunk_size: int | None  # Llama 4's chunked layers' chunk
    mamba: dict[str, Any] | None  # the Mamba mixers' settings (Jamba, Bamba, Granite 4.0-H, Falcon-H1)
    short_conv: dict[str, Any] | None  # LFM2's short convolutions' settings
    gated_delta_net: dict[str, Any] | None  # the linear-attention layers' (Qwen3-Next, Qwen3.5, OLMo Hybrid, Kimi)
    rope_theta: float | None  # the one base of Granite SWA's ``layer_rope_theta`` (None: the config's rope_theta)


def _layers(
    raw: dict[str, Any],
    model_type: str,
    common: dict[str, Any],
    rotary: _Rotary,
    need: Callable[[str], Any],
    name: str,
) -> _Layers:
    """Each layer's kind (full or sliding attention, chunked, a Mamba mixer, a short convolution, linear
    attention), whether it rotates, and the MLPs' size, by each family's settings and transformers' defaults."""
    num_layers = common["num_hidden_layers"]
    # NOTE: Mistral 7B v0.1's and Phi-3 mini's every layer sees the last sliding_window positions (later
    # Mistrals, Phi-4: null; a window as long as the context changes nothing); Qwen's sliding_window is
    # unused unless use_sliding_window
    window = (
        raw.get("sliding_window")
        if model_type in ("mistral", "ministral3", "mixtral", "phi3", "starcoder2", "phimoe")
        else None
    )
    if window is not None and window >= common["max_position_embeddings"]:
        window = None
    layer_types = (SLIDING,) * num_layers if window else ()
    if model_type == "dots1":  # (without layer_types: those from max_window_layers on sliding, as transformers')
        window, first_sliding = raw.get("sliding_window", 4096), raw.get("max_window_layers", 62)
        layer_types, window = sliding_layers(raw, window, lambda i: window is not None and i >= first_sliding, name)
    if model_type == "cwm":  # (without layer_types: layers 0, 4, 8... full, the others sliding, as transformers')
        layer_types, window = sliding_layers(raw, raw.get("sliding_window"), lambda i: i % 4 != 0, name)
    if model_type == "ministral":  # (without layer_types: every layer sliding where there is a window)
        window = raw.get("sliding_window")
        layer_types, window = sliding_layers(raw, window, lambda i: bool(window), name)
    if model_type in SLIDING_PATTERNS:  # gpt-oss: every other layer sees the last 128 positions; OLMo 3: 3 of 4
        window, pattern = SLIDING_PATTERNS[model_type]
        window, pattern = raw.get("sliding_window", window), raw.get("sliding_window_pattern", pattern)
        if not raw.get("layer_types") and not (isinstance(pattern, int) and pattern > 0):
            raise ConfigError(f"{name}: sliding_window_pattern {pattern!r} needs layer_types (or a positive integer)")
        layer_types = tuple(raw.get("layer_types") or [SLIDING if (i + 1) % pattern else "full_attention"
                                                       for i in range(num_layers)])  # fmt: skip
        if len(layer_types) != num_layers:
            raise ConfigError(f"{name}: layer_types has {len(layer_types)} entries; the model has {num_layers} layers")
    rotary_layers = raw.get("no_rope_layers") if model_type == "smollm3" else None  # (HF's name: 1 rotates)
    if rotary.unrotated:
        rotary_layers = [False] * num_layers
    if model_type in ("qwen3_5_moe_text", "solar_open"):  # (no dense MLP: its experts' size stands for one, unbuilt)
        intermediate = raw.get("moe_intermediate_size", MOE_DEFAULTS[model_type]["moe_intermediate_size"])
    else:
        intermediate = need("intermediate_size")
    mamba = short_conv = gated_delta_net = chunk = rope_theta = None
    if model_type == "jamba":  # (attention in one layer of attn_layer_period, without rope; Mamba's mixers elsewhere)
        layer_types, mamba = jamba_layers(raw, num_layers, name)
        rotary_layers = [False] * num_layers
    if model_type in LFM_TYPES:
        layer_types, intermediate, short_conv = lfm2_layers(raw, num_layers, model_type, name)
        window = raw.get("sliding_window") if SLIDING in layer_types else None
    if model_type == "cohere2_moe":  # (its layers' kinds and rotations)
        layer_types, window, rotary_layers = cohere2_moe_layers(raw, num_layers, name)
        intermediate = raw.get("prefix_dense_intermediate_size") or intermediate  # (its dense MLPs')
    if model_type == "granitemoehybrid":
        rotary_layers, intermediate, layer_types, mamba = granite_4_layers(raw, num_layers, name)
    elif model_type == "bamba":  # (attention at attn_layer_indices, Mamba-2 elsewhere)
        layer_types, mamba = bamba_layers(raw, num_layers, name)
    elif model_type == "falcon_h1":  # (both in every layer)
        layer_types = (PARALLEL_HYBRID,) * num_layers
        mamba = read_mamba2(raw, name, FALCON_H1_MAMBA_DEFAULTS)
    if model_type in GATED_DELTA_NET_TYPES:
        layer_types, gated_delta_net = gated_delta_net_layers(raw, num_layers, model_type, name)
    if model_type in ("granite_swa", "granitemoe_swa"):
        layer_types, window, rotary_layers, rope_theta = granite_swa_layers(raw, num_layers, rotary.theta, name)
    if model_type in ("exaone4", "exaone_moe") and window:  # (its hybrid attention: the global layers without rope)
        rotary_layers = [layer_type == SLIDING for layer_type in layer_types]
    if model_type == "cohere2":  # (only its sliding layers rotate: none where it has no window)
        rotary_layers = [layer_type == SLIDING and bool(window) for layer_type in layer_types]
    if model_type == "llama4_text":  # (chunked layers that rotate, global ones that do not; the dense MLPs' size)
        layer_types, rotary_layers, chunk = llama4_layers(raw, num_layers, name)
        intermediate = raw["intermediate_size_mlp"]
    if model_type == "afmoe":  # (layer_types, or every global_attn_every_n_layers-th global; only the sliding rotate)
        every = raw.get("global_attn_every_n_layers", 4)
        check_positive_ints({"global_attn_every_n_layers": every}, ("global_attn_every_n_layers",), name)
        layer_types, window = sliding_layers(raw, raw.get("sliding_window", 1024), lambda i: (i + 1) % every, name)
        rotary_layers = [kind == SLIDING for kind in layer_types]
    if rotary_layers is not None and len(rotary_layers) != num_layers:
        raise ConfigError(f"{name}: no_rope_layers has {len(rotary_layers)} flags; the model has {num_layers} layers")
    return _Layers(
        intermediate, layer_types, window, rotary_layers, chunk, mamba, short_conv, gated_delta_net, rope_theta
    )


def _family_fields(raw: dict[str, Any], model_type: str, name: str) -> dict[str, Any]:
    """ModelConfig's fields that only some families of Llama's outline set: their scales and multipliers, Llama 4's
    attention, and ``extra`` (what a family's model reads of its config beyond the fields)."""
    fields: dict[str, Any] = {}
    extra: dict[str, Any] = {}
    if model_type == "lfm3":  # (each operator's and MLP's output normalized; each head's output gated)
        extra = {key: bool(raw.get(key, True)) for key in ("use_sandwich_norm", "use_attention_gate")}
    if model_type == "cohere2_moe":  # (RMSNorms where it gives their epsilon)
        extra = {"rms_norm": raw.get("rms_norm_eps") is not None}
    if model_type == "hyperclovax":  # (each part's output normalized before it joins the stream)
        extra = {"use_post_norm": bool(raw.get("use_post_norm", True))}
    if model_type == "falcon_h1":  # (its multipliers folded into the weights as they load)
        extra = {"falcon_h1_multipliers": _falcon_h1_multipliers(raw, name)}
        fields.update(_falcon_h1_scales(raw, name))
    if model_type == "nanochat":  # (Llama 4's unweighted norms of the rotated heads, Gemma 2's capped logits)
        fields.update(qk_unweighted_norm=True, final_logit_softcapping=raw["final_logit_softcapping"])
    if model_type == "llama4_text":
        fields.update(_llama4_attention(raw, name))
    if model_type == "afmoe" and raw.get("mup_enabled"):  # (the embeddings times sqrt(hidden_size))
        fields["embedding_multiplier"] = raw["hidden_size"] ** 0.5
    if model_type in GRANITE_SCALED:
        fields.update(_granite_multipliers(raw))
    if model_type in COHERE_TYPES:
        if not (isinstance(raw["logit_scale"], (int, float)) and raw["logit_scale"] > 0):
            raise ConfigError(f"{name}: logit_scale must be a positive number, got {raw['logit_scale']!r}")
        # NOTE: Cohere's logits times logit_scale, as its inverse's quotient (the Hub's: powers of two, exact)
        fields["logits_scaling"] = 1 / float(raw["logit_scale"])
    return {**fields, "extra": extra}


def _norm_eps(raw: dict[str, Any], model_type: str, name: str) -> float:
    """The norms' epsilon under each config's name, transformers' default where it has none."""
    key, default = "rms_norm_eps", RMS_NORM_EPS_DEFAULTS.get(model_type, 1e-6)
    if model_type == "cohere2_moe" and raw.get("rms_norm_eps") is not None:  # (its RMSNorms; else LayerNorms)
        key = "rms_norm_eps"
    elif model_type in (*COHERE_TYPES, "phi", "stablelm", "jais2"):
        key, default = "layer_norm_eps", 1e-5
    elif model_type == "nemotron":
        key, default = "norm_eps", 1e-5
    elif model_type == "starcoder2":
        key, default = "norm_epsilon", 1e-5
    return json_float(raw.get(key, default), key, name)


def _biases(raw: dict[str, Any], model_type: str) -> dict[str, bool]:
    """Which projections have biases, by each config's names and transformers' defaults: ``attention_bias``
    is the q/k/v projections' (Qwen2's config has no key: always; Qwen2-MoE's says ``qkv_bias``, StableLM's
    ``use_qkv_bias``), and the output projection's too for gpt-oss, EXAONE 4, OLMo, Nemotron and Arcee;
    Seed-OSS names the latter ``attention_out_bias``; ERNIE 4.5's and StarCoder2's ``use_bias`` is every
    linear layer's."""
    if model_type in ("ernie4_5", "ernie4_5_moe", "starcoder2"):
        every = bool(raw.get("use_bias", model_type == "starcoder2"))
        return {"attention_bias": every, "attention_output_bias": every, "mlp_bias": every}
    if model_type == "qwen2_moe":
        qkv = raw.get("qkv_bias", True)
    elif model_type == "stablelm":
        qkv = raw.get("use_qkv_bias", False)
    else:
        qkv = raw.get("attention_bias", model_type in QKV_BIASED)
    if model_type == "seed_oss":
        output = raw.get("attention_out_bias", False)
    else:
        output = model_type in OUTPUT_BIASED and qkv
    return {
        "attention_bias": bool(qkv),
        "attention_output_bias": bool(output),
        "mlp_bias": bool(raw.get("mlp_bias", model_type == "phi")),
    }


def _llama4_attention(raw: dict[str, Any], name: str) -> dict[str, Any]:
    """Llama 4's query and key norms (``use_qk_norm``) and its unrotated layers' attention temperature
    (``attn_temperature_tuning``, with ``attn_scale`` and ``floor_scale``): ModelConfig's fields, transformers'
    defaults where the config has none."""
    tuned = raw.get("attn_temperature_tuning", True)  # (the Hub's Scout config: 4, a true value)
    scale, floor = raw.get("attn_scale", 0.1), raw.get("floor_scale", 8192)
    if tuned:
        if isinstance(scale, bool) or not isinstance(scale, (int, float)):
            raise ConfigError(f"{name}: attn_scale must be a number, got {scale!r}")
        check_positive_ints({"floor_scale": floor}, ("floor_scale",), name)
    return {
        "qk_unweighted_norm": bool(raw.get("use_qk_norm", True)),
        "attn_scale": float(scale) if tuned else None,
        "floor_scale": floor if tuned else 8192,
    }


def _falcon_h1_scales(raw: dict[str, Any], name: str) -> dict[str, float]:
    """Falcon-H1's embeddings times ``embedding_multiplier``, its logits times ``lm_head_multiplier`` (Granite's
    fields: the logits divided by its inverse)."""
    head = json_float(raw.get("lm_head_multiplier", 1.0), "lm_head_multiplier", name)
    if not head:
        raise ConfigError(f"{name}: lm_head_multiplier must not be 0")
    return {
        "embedding_multiplier": json_float(raw.get("embedding_multiplier", 1.0), "embedding_multiplier", name),
        "logits_scaling": 1 / head,
    }


def _falcon_h1_multipliers(raw: dict[str, Any], name: str) -> dict[str, Any]:
    """Falcon-H1's muP multipliers of its projections (the loader folds them into the weights,
    ``models/falcon_h1.py``): attention's input, keys and output, the mixer's input, its in_proj's five parts (z,
    x, B, C, dt) and output, the MLP's gate and down projection; transformers' defaults (1)."""
    scalars = {
        key: json_float(raw.get(key, 1.0), key, name)
        for key in ("attention_in_multiplier", "key_multiplier", "attention_out_multiplier", "ssm_in_multiplier",
                    "ssm_out_multiplier")
    }  # fmt: skip
    lists = {"ssm_multipliers": 5, "mlp_multipliers": 2}
    for key, size in lists.items():
        values = raw.get(key) or [1.0] * size
        if not isinstance(values, list) or len(values) != size:
            raise ConfigError(f"{name}: {key} must be {size} numbers, got {values!r}")
        scalars[key] = [json_float(v, key, name) for v in values]
    return scalars


def _granite_multipliers(raw: dict[str, Any]) -> dict[str, float | None]:
    """Granite's scales, transformers' GraniteConfig defaults (1) where the config has none; HyperCLOVA X's, whose
    ``logits_scaling`` multiplies (the engine divides by its inverse: equal up to rounding) and whose attention
    scale is head_dim ** -0.5 where its config has none."""
    hyperclova = raw["model_type"] == "hyperclovax"
    attention = raw.get("attention_multiplier", None if hyperclova else 1.0)
    logits = float(raw.get("logits_scaling", 1.0))
    return {
        "embedding_multiplier": float(raw.get("embedding_multiplier", 1.0)),
        "residual_multiplier": float(raw.get("residual_multiplier", 1.0)),
        "attention_multiplier": None if attention is None else float(attention),
        "logits_scaling": 1 / logits if hyperclova else logits,
    }


def _language_model_config(raw: dict[str, Any], name: str) -> ModelConfig:
    """The language model of a multimodal checkpoint (``MULTIMODAL``): its ``text_config``, with what the
    top level says of generation (EOS: Gemma 3's [1, 106]) and of the weights' dtype. (Whether its LM head
    is tied, the weights say: ``loader.load_model``.)"""
    text = raw.get("text_config")
    if text is None and raw["model_type"] in FLAT_MULTIMODAL:  # (the top level is the language model's)
        text = {key: value for key, value in raw.items() if key not in ("model_type", "vision_config")}
    if not isinstance(text, dict):
        raise ConfigError(f"{name}: a {raw['model_type']} config.json needs a text_config (its language model's)")
    # (Ministral 3's text_config says ministral3; Gemma 3's and Mistral Small's may say nothing: their own)
    kind = text.get("model_type") or MULTIMODAL[raw["model_type"]]
    if kind in TEXT_MODEL_TYPES:  # (a setting the text_config leaves null: the default's)
        kind, defaults = TEXT_MODEL_TYPES[kind]
        text = {**defaults, **{key: value for key, value in text.items() if value is not None}}
    if kind not in ARCHITECTURES:
        raise ConfigError(
            f"{name}: unsupported architecture {kind!r} (config.json text_config model_type); "
            f"supported: {', '.join(sorted([*ARCHITECTURES, *MULTIMODAL]))}"
        )
    merged = {**text, "model_type": kind}
    for key in ("eos_token_id", "bos_token_id", "torch_dtype", "dtype"):
        if raw.get(key) is not None and (key == "eos_token_id" or key not in text):
            merged[key] = raw[key]
    config = from_hf_config(merged, name)
    return dataclasses.replace(config, extra={**config.extra, "multimodal_checkpoint": True})


def load_hf_config(path: str | Path) -> ModelConfig:
    """Read ``config.json`` of a local HF model directory."""
    path = Path(path)
    if not path.is_dir():
        raise ConfigError(f"model directory {path} does not exist (models are never downloaded)")
    config_file = path / "config.json"
    if not config_file.is_file():
        raise ConfigError(f"model directory {path} has no config.json")
    try:
        raw = json.loads(config_file.read_text())
    except json.JSONDecodeError as e:
        raise ConfigError(f"{config_file}: not valid JSON ({e})") from None
    if not isinstance(raw, dict):
        raise ConfigError(f"{config_file}: must be a JSON object, got {type(raw).__name__}")
    config = from_hf_config(raw, name=path.name)
    # NOTE: a generation config's EOS ids end a generation too, as in vLLM (it adds them to every request's
    # stop ids): Qwen2.5/Qwen3 Instruct's config.json names <|im_end|>, their generation config <|endoftext|>
    # too; some checkpoints keep EOS there alone
    more = [i for i in generation_eos_ids(path / "generation_config.json") if i not in config.eos_token_ids]
    if more:
        config = dataclasses.replace(config, eos_token_ids=(*config.eos_token_ids, *more))
    return config


def _tiny(model_type: str, **overrides: Any) -> ModelConfig:
    values = dict(
        model_type=model_type,
        vocab_size=512,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2 if model_type != "opt" else 4,
        head_dim=16,
        max_position_embeddings=1024,
        name=f"tiny-{model_type}",
    )
    values.update(overrides)
    return ModelConfig(**values)


def _from_spec(spec_name: str, model_type: str, **overrides: Any) -> ModelConfig:
    """A random model with the shape of a bundled cost-model spec (one source of the numbers)."""
    s = MODELS[spec_name]
    values = dict(
        model_type=model_type,
        vocab_size=s.vocab_size,
        hidden_size=s.hidden_size,
        intermediate_size=s.intermediate_size,
        num_hidden_layers=s.num_layers,
        num_attention_heads=s.num_attention_heads,
        num_key_value_heads=s.num_kv_heads,
        head_dim=s.head_dim,
        max_position_embeddings=s.max_context_len,
        tie_word_embeddings=s.tied_embeddings,
        torch_dtype="bfloat16",
        name=spec_name,
    )
    values.update(overrides)
    return ModelConfig(**values)


# Named shapes for ``random:NAME`` models (benchmarks and tests); weights are random, the tokenizer
# is byte-level (ids 0..255, BOS 256, EOS 257).
RANDOM_SHAPES: dict[str, ModelConfig] = {
    "tiny-llama": _tiny("llama"),
    "tiny-qwen2": _tiny("qwen2", attention_bias=True, norm_eps=1e-6, rope_theta=1e6),
    "tiny-opt": _tiny("opt", hidden_act="relu", word_embed_proj_dim=64, tie_word_embeddings=True),
    # Steps of 3-20 ms on one CPU core (batch 1-32), as a 7-8B model's on a GPU: where a served request's
    # host work (HTTP, a fleet's calls) is as small a share of a step as it is there
    "small-llama": _tiny(
        "llama",
        hidden_size=256,
        intermediate_size=768,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=64,
        max_position_embeddings=2048,
        name="small-llama",
    ),
    "llama-2-7b": _from_spec("llama-2-7b", "llama"),
    "llama-3-8b": _from_spec("llama-3-8b", "llama", rope_theta=500000.0),
    "tiny-qwen3": _tiny("qwen3", qk_norm=True, norm_eps=1e-6, rope_theta=1e6),
    "tiny-gemma3": _tiny(
        "gemma3_text",
        qk_norm=True,
        hidden_act="gelu_pytorch_tanh",
        norm_eps=1e-6,
        rope_theta=1e6,
        rope_local_theta=1e4,
        query_pre_attn_scalar=16.0,
        layer_types=("sliding_attention", "full_attention"),
        sliding_window=64,
        tie_word_embeddings=True,
        name="tiny-gemma3",
    ),
    # Mistral 7B v0.1's sliding window on every layer, shorter than most test contexts
    "tiny-mistral": _tiny("mistral", layer_types=(SLIDING, SLIDING), sliding_window=16),
    # Granite 3.3 8B's scales (its attention's for head_dim 16)
    "tiny-granite": _tiny(
        "granite", embedding_multiplier=12.0, residual_multiplier=0.22, attention_multiplier=0.0625, logits_scaling=16.0
    ),
    # Phi-4 mini's rotary embedding: 12 of each head's 16 dimensions turn, LongRoPE past 256 positions
    "tiny-phi4-mini": _tiny(
        "phi3",
        tie_word_embeddings=True,
        partial_rotary_dim=12,
        rope_scaling={
            "rope_type": "longrope",
            "original_max_position_embeddings": 256,
            "short_factor": [1.0, 1.1, 1.2, 1.3, 1.4, 1.5],
            "long_factor": [1.0, 4.0, 8.0, 12.0, 16.0, 20.0],
        },
        name="tiny-phi4-mini",
    ),
    # Ministral 3's queries scaled past the rope's pretrained 64 positions (Llama 4's attention scaling)
    "tiny-ministral3": _tiny(
        "ministral3",
        rope_scaling={"rope_type": "yarn", "factor": 16.0, "original_max_position_embeddings": 64},
        llama4_scaling_beta=0.5,
    ),
    # Gemma 1's norms, GeGLU MLP and scaled embeddings on Llama's layers
    "tiny-gemma": _tiny("gemma", hidden_act="gelu_pytorch_tanh", norm_eps=1e-6, tie_word_embeddings=True),
    # StarCoder2's LayerNorms, GELU MLP and biases, every layer's window shorter than most test contexts
    "tiny-starcoder2": _tiny(
        "starcoder2",
        attention_bias=True,
        attention_output_bias=True,
        mlp_bias=True,
        hidden_act="gelu_pytorch_tanh",
        layer_types=(SLIDING, SLIDING),
        sliding_window=16,
        tie_word_embeddings=True,
    ),
    "qwen2.5-7b": _from_spec("qwen2.5-7b", "qwen2", attention_bias=True, norm_eps=1e-6, rope_theta=1e6),
    "opt-13b": _from_spec("opt-13b", "opt", hidden_act="relu", word_embed_proj_dim=5120),
}


def random_config(name: str) -> ModelConfig:
    """The shape registered as ``random:NAME``, with the byte tokenizer's special ids."""
    if name not in RANDOM_SHAPES:
        raise UnknownNameError("random model shape", name, list(RANDOM_SHAPES))
    return dataclasses.replace(RANDOM_SHAPES[name], bos_token_id=BYTE_BOS_ID, eos_token_ids=(BYTE_EOS_ID,))
