"""Each layer's kind (``ModelConfig.layer_types``) as each model with more than one kind of layer says it:
sliding and chunked attention, Mamba mixers (and Mamba-2's settings), short convolutions, gated DeltaNet
and KDA linear attention, Nemotron-H's block pattern."""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

from sloserve.checkpoint.config_values import (
    check_layer_period,
    check_positive_ints,
    checked_layer_types,
    json_float,
    layer_index,
)
from sloserve.checkpoint.model_config import CHUNKED, LINEAR_ATTENTION, MAMBA, MLP_LAYER, MOE_LAYER, SHORT_CONV, SLIDING
from sloserve.checkpoint.model_types import MAMBA2_DEFAULTS, MOE_DEFAULTS
from sloserve.checkpoint.moe_config import dense_layers
from sloserve.core.errors import ConfigError


def kimi_linear_layers(raw: dict[str, Any], layers: int, name: str) -> tuple[tuple[str, ...], dict[str, Any]]:
    """Kimi Linear's (each layer's type: transformers' default, every fourth but the first attending, where the
    config has none; its KDA layers' settings: as many key as value heads, of one width)."""
    kinds = raw.get("layer_types")
    if kinds is None:
        kinds = ["full_attention" if i and i % 4 == 0 else LINEAR_ATTENTION for i in range(layers)]
    kinds = checked_layer_types(kinds, layers, (LINEAR_ATTENTION, "full_attention"), raw["model_type"], name)
    sizes = {key: raw.get(key) for key in ("linear_num_heads", "linear_head_dim", "linear_conv_kernel_dim")}
    check_positive_ints(sizes, tuple(sizes), name)
    heads, width = sizes["linear_num_heads"], sizes["linear_head_dim"]
    eps = json_float(raw.get("rms_norm_eps"), "rms_norm_eps", name)
    kda = {"num_k_heads": heads, "num_v_heads": heads, "head_k_dim": width, "head_v_dim": width,
           "width": sizes["linear_conv_kernel_dim"], "beta_scale": 1.0, "norm_eps": eps,
           "channel_decay": True}  # fmt: skip
    return kinds, kda


def granite_4_layers(
    raw: dict[str, Any], layers: int, name: str
) -> tuple[list[bool], int, tuple[str, ...], dict[str, Any] | None]:
    """Granite 4.0's (``granitemoehybrid``): (whether each layer rotates, the dense MLP's size, each layer's type:
    attention or MAMBA, the Mamba-2 mixers' settings: None without them). Its layers are attention (the Hub's
    "attention", transformers 5's "full_attention") or Mamba-2 (the Hub's "mamba", transformers 5's
    "linear_attention": the 4.0-H models); a rotary embedding only where ``position_embedding_type`` is "rope"
    (None, transformers' default, or "nope": none, the 4.0-H models'); without experts its MLP is the shared
    one (``shared_intermediate_size``; ``intermediate_size`` is the experts'). transformers' defaults where the
    config has none."""
    kinds = raw.get("layer_types") or raw.get("layers_block_type") or [MAMBA] * layers
    if len(kinds) != layers:
        raise ConfigError(f"{name}: layer_types has {len(kinds)} entries; the model has {layers} layers")
    unknown = sorted({kind for kind in kinds if kind not in ("attention", "full_attention", MAMBA, "linear_attention")})
    if unknown:
        raise ConfigError(
            f"{name}: granitemoehybrid layer type {unknown[0]!r} is not supported (attention, full_attention, mamba, "
            "linear_attention)"
        )
    layer_types = tuple(MAMBA if kind in (MAMBA, "linear_attention") else "full_attention" for kind in kinds)
    position = raw.get("position_embedding_type")
    if position not in (None, "rope", "nope"):
        raise ConfigError(f"{name}: position_embedding_type {position!r} is not supported (rope, nope or null)")
    dense = not raw.get("num_local_experts", MOE_DEFAULTS["granitemoehybrid"]["num_experts"])
    intermediate = raw.get("shared_intermediate_size", 1024) if dense else raw["intermediate_size"]
    mamba = read_mamba2(raw, name) if MAMBA in layer_types else None
    return [position == "rope"] * layers, intermediate, layer_types, mamba


def granite_swa_layers(
    raw: dict[str, Any], layers: int, rope_theta: float, name: str
) -> tuple[tuple[str, ...], int, list[bool], float]:
    """Granite SWA's (each layer's type, by ``layer_types`` or transformers' pattern: full attention where
    i % 4 == 0, sliding elsewhere; the window; whether each layer rotates; the rope base). ``layer_rope_theta``
    gives each layer its base, 0 for none (NoPE); the engine runs one base, so the others must agree."""
    kinds = raw.get("layer_types") or ["full_attention" if i % 4 == 0 else SLIDING for i in range(layers)]
    kinds = checked_layer_types(kinds, layers, ("full_attention", SLIDING), raw["model_type"], name)
    thetas = raw.get("layer_rope_theta") or [rope_theta] * layers
    if len(thetas) != layers or not all(isinstance(t, (int, float)) and t >= 0 for t in thetas):
        raise ConfigError(f"{name}: layer_rope_theta must be {layers} numbers >= 0, got {thetas!r}")
    bases = sorted({float(t) for t in thetas if t})
    if len(bases) > 1:
        raise ConfigError(f"{name}: layer_rope_theta with more than one rope base ({bases}) is not supported")
    window = raw.get("sliding_window", 128)
    return kinds, window, [bool(t) for t in thetas], bases[0] if bases else rope_theta


def lfm2_layers(
    raw: dict[str, Any], layers: int, model_type: str, name: str
) -> tuple[tuple[str, ...], int, dict[str, Any]]:
    """LFM2's (each layer's type: full_attention or SHORT_CONV, by ``layer_types`` or the Hub's ``full_attn_idxs``;
    the MLP's size; its short convolutions' settings). NOTE: transformers' size rule for LFM2's (not LFM2-MoE's
    dense MLPs, of intermediate_size): with ``block_auto_adjust_ff_dim``, 2/3 of intermediate_size, times
    ``block_ffn_dim_multiplier``, rounded up to a multiple of ``block_multiple_of`` (only with a multiplier)."""
    kinds, known = raw.get("layer_types"), {"full_attention", SHORT_CONV}
    if model_type == "lfm3":  # (its sliding layers; transformers' pattern where the config has none)
        known.add(SLIDING)
        if kinds is None:
            kinds = [
                "full_attention" if i % 4 == 2 else SLIDING if i % 4 == 0 and i else SHORT_CONV for i in range(layers)
            ]
    if kinds is None:
        attending = raw.get("full_attn_idxs")
        attending = range(layers) if attending is None else attending
        kinds = ["full_attention" if i in attending else SHORT_CONV for i in range(layers)]
    kinds = checked_layer_types(kinds, layers, known, model_type, name)
    intermediate = raw.get("intermediate_size")
    if not isinstance(intermediate, int) or intermediate < 1:
        raise ConfigError(
            f"{name}: {model_type} block_ff_dim (intermediate_size) must be a positive integer, got {intermediate!r}"
        )
    if model_type == "lfm2" and raw.get("block_auto_adjust_ff_dim", True):
        intermediate = int(2 * intermediate / 3)
        multiplier, multiple = raw.get("block_ffn_dim_multiplier", 1.0), raw.get("block_multiple_of", 256)
        if multiplier is not None:
            check_positive_ints({"block_multiple_of": multiple}, ("block_multiple_of",), name)
            intermediate = int(json_float(multiplier, "block_ffn_dim_multiplier", name) * intermediate)
            intermediate = multiple * -(-intermediate // multiple)
    width = raw.get("conv_L_cache", 7 if model_type == "lfm3" else 3)  # (transformers' defaults)
    check_positive_ints({"conv_L_cache": width}, ("conv_L_cache",), name)
    short_conv = {"width": width, "bias": bool(raw.get("conv_bias", False))}
    return kinds, intermediate, short_conv if SHORT_CONV in kinds else None


def gated_delta_net_layers(
    raw: dict[str, Any], layers: int, model_type: str, name: str
) -> tuple[tuple[str, ...], dict[str, Any]]:
    """Qwen3-Next's, Qwen3.5's and OLMo Hybrid's (each layer's type: LINEAR_ATTENTION or full_attention, by
    ``layer_types`` or, as transformers reads a config without them, every ``full_attention_interval``-th layer
    attending (4; OLMo Hybrid's every fourth, its last where it has fewer layers); the gated DeltaNets' settings,
    transformers' defaults where the config has none: OLMo Hybrid's heads as many as attention's, keys 3/4 of the
    hidden size over them, values twice a key, beta in (0, 2) unless ``linear_allow_neg_eigval`` is false, its
    gated norm's epsilon 1e-5, the reference kernels')."""
    olmo = model_type == "olmo_hybrid"
    interval = 4 if olmo else raw.get("full_attention_interval", 4)
    kinds = raw.get("layer_types")
    if kinds is None:
        check_positive_ints({"full_attention_interval": interval}, ("full_attention_interval",), name)
        kinds = [LINEAR_ATTENTION if (i + 1) % interval else "full_attention" for i in range(layers)]
        if olmo and "full_attention" not in kinds:
            kinds[-1] = "full_attention"
    kinds = checked_layer_types(kinds, layers, (LINEAR_ATTENTION, "full_attention"), model_type, name)
    sizes = {"num_k_heads": "linear_num_key_heads", "num_v_heads": "linear_num_value_heads",
             "head_k_dim": "linear_key_head_dim", "head_v_dim": "linear_value_head_dim",
             "width": "linear_conv_kernel_dim"}  # fmt: skip
    defaults = {"linear_num_key_heads": 16, "linear_num_value_heads": 32, "linear_key_head_dim": 128,
                "linear_value_head_dim": 128, "linear_conv_kernel_dim": 4}  # fmt: skip
    given = {key: raw.get(key) for key in defaults}
    if olmo:  # (its defaults follow its attention's: checked first)
        check_positive_ints(raw, ("num_attention_heads", "hidden_size"), name)
        defaults["linear_num_key_heads"] = defaults["linear_num_value_heads"] = raw["num_attention_heads"]
        key_heads = given["linear_num_key_heads"] or raw["num_attention_heads"]
        key_dim = int(0.75 * raw["hidden_size"] / key_heads) if isinstance(key_heads, int) and key_heads > 0 else 0
        defaults["linear_key_head_dim"] = key_dim
        defaults["linear_value_head_dim"] = 2 * (given["linear_key_head_dim"] or key_dim)
    given = {key: default if given[key] is None else given[key] for key, default in defaults.items()}
    check_positive_ints(given, tuple(given), name)
    net = {ours: given[theirs] for ours, theirs in sizes.items()}
    net["beta_scale"] = 2.0 if olmo and raw.get("linear_allow_neg_eigval", True) else 1.0
    net["norm_eps"] = 1e-5 if olmo else json_float(raw.get("rms_norm_eps", 1e-6), "rms_norm_eps", name)
    if net["num_v_heads"] % net["num_k_heads"]:
        raise ConfigError(
            f"{name}: linear_num_key_heads {net['num_k_heads']} must divide linear_num_value_heads {net['num_v_heads']}"
        )
    return kinds, net


def sliding_layers(
    raw: dict[str, Any], window: Any, slides: Callable[[int], Any], name: str
) -> tuple[tuple[str, ...], Any]:
    """(each layer's type, the window): ``layer_types`` (sliding or full) where the config gives them, else layer i
    sliding where ``slides(i)`` (transformers' reading of a config without them); the window None where no layer
    slides."""
    layers = raw["num_hidden_layers"]
    kinds = raw.get("layer_types") or [SLIDING if slides(i) else "full_attention" for i in range(layers)]
    kinds = checked_layer_types(kinds, layers, (SLIDING, "full_attention"), raw["model_type"], name)
    return kinds, window if SLIDING in kinds else None


def cohere2_moe_layers(raw: dict[str, Any], layers: int, name: str) -> tuple[tuple[str, ...], Any, list[bool]]:
    """Command A+'s (each layer's type, the window, whether each rotates), as transformers reads them: ``layer_types``,
    else the first ``first_k_dense_replace`` layers (those of dense MLPs) every ``prefix_dense_sliding_window_pattern``
    -th global and the others every ``sliding_window_pattern``-th; the sliding layers rotate where there is a window,
    and the dense ones where their pattern is 1 (each of them global)."""
    first_dense = layer_index(raw, "first_k_dense_replace", 0, name)
    prefix, rest = raw.get("prefix_dense_sliding_window_pattern", 1), raw.get("sliding_window_pattern", 4)
    check_positive_ints({"prefix_dense_sliding_window_pattern": prefix, "sliding_window_pattern": rest},
                         ("prefix_dense_sliding_window_pattern", "sliding_window_pattern"), name)  # fmt: skip
    kinds = raw.get("layer_types") or [
        SLIDING if (i + 1) % (prefix if i < first_dense else rest) else "full_attention"
        for i in (*range(first_dense), *range(layers - first_dense))
    ]
    kinds = checked_layer_types(kinds, layers, (SLIDING, "full_attention"), "cohere2_moe", name)
    dense = dense_layers(raw["mlp_layer_types"], layers, name) if raw.get("mlp_layer_types") else range(first_dense)
    window = raw.get("sliding_window", 4096) if SLIDING in kinds else None
    rotary = [(kind == SLIDING and bool(window)) or (i in dense and prefix == 1) for i, kind in enumerate(kinds)]
    return kinds, window, rotary


def llama4_layers(raw: dict[str, Any], layers: int, name: str) -> tuple[tuple[str, ...], list[bool], int | None]:
    """Llama 4's (each layer's type, whether each rotates, the chunks' length). A layer rotates where
    ``no_rope_layers`` says 1 (transformers' name), or, where the config lists none, all but every
    ``no_rope_layer_interval``-th; ``layer_types`` (CHUNKED or full) where it gives them, else, as transformers
    reads a config without them, the rotated layers chunked where ``attention_chunk_size`` is not null."""
    interval = raw.get("no_rope_layer_interval", 4)
    check_positive_ints({"no_rope_layer_interval": interval}, ("no_rope_layer_interval",), name)
    rotary = raw.get("no_rope_layers") or [int((i + 1) % interval != 0) for i in range(layers)]
    if not isinstance(rotary, list) or len(rotary) != layers or not set(rotary) <= {0, 1}:
        raise ConfigError(f"{name}: no_rope_layers must be {layers} flags of 0 or 1, got {rotary!r}")
    chunk = raw.get("attention_chunk_size")
    kinds = raw.get("layer_types") or [CHUNKED if flag and chunk is not None else "full_attention" for flag in rotary]
    kinds = checked_layer_types(kinds, layers, (CHUNKED, "full_attention"), "llama4_text", name)
    if CHUNKED not in kinds:
        return kinds, [bool(flag) for flag in rotary], None
    check_positive_ints({"attention_chunk_size": chunk}, ("attention_chunk_size",), name)
    return kinds, [bool(flag) for flag in rotary], chunk


def bamba_layers(raw: dict[str, Any], layers: int, name: str) -> tuple[tuple[str, ...], dict[str, Any] | None]:
    """Bamba's (each layer's type, its Mamba-2 mixers' settings): attention at ``attn_layer_indices``, a mixer in
    every other layer (transformers' ``layers_block_type``)."""
    indices = raw.get("attn_layer_indices") or []
    if not isinstance(indices, list) or any(isinstance(i, bool) or not isinstance(i, int) or not 0 <= i < layers
                                            for i in indices):  # fmt: skip
        raise ConfigError(f"{name}: attn_layer_indices must be layer indices below {layers}, got {indices!r}")
    layer_types = tuple("full_attention" if i in indices else MAMBA for i in range(layers))
    return layer_types, read_mamba2(raw, name) if MAMBA in layer_types else None


def jamba_layers(raw: dict[str, Any], layers: int, name: str) -> tuple[tuple[str, ...], dict[str, Any] | None]:
    """Jamba's (each layer's type: attention where i % attn_layer_period is attn_layer_offset, Mamba's mixer
    elsewhere; the mixers' settings, ``mamba_*``, transformers' JambaConfig defaults where it has none)."""
    period, offset = raw.get("attn_layer_period", 8), raw.get("attn_layer_offset", 4)
    check_layer_period(period, offset, "attn_layer", name)
    kinds = tuple("full_attention" if i % period == offset else MAMBA for i in range(layers))
    if MAMBA not in kinds:
        return kinds, None
    hidden = raw["hidden_size"]
    settings = {key: raw.get(f"mamba_{key}", default) for key, default in
                (("d_state", 16), ("d_conv", 4), ("expand", 2), ("dt_rank", "auto"))}  # fmt: skip
    if settings["dt_rank"] == "auto":  # (transformers' rule)
        settings["dt_rank"] = math.ceil(hidden / 16)
    check_positive_ints(settings, ("d_state", "d_conv", "expand", "dt_rank"), name, "mamba_")
    if raw.get("hidden_act", "silu") != "silu":
        raise ConfigError(f"{name}: hidden_act {raw.get('hidden_act')!r} is not supported with Mamba layers (silu)")
    return kinds, {
        "version": 1,  # (Mamba's selective state spaces, not Mamba-2's: ``models/mamba1.py``)
        "d_inner": settings.pop("expand") * hidden,
        **settings,
        "conv_bias": bool(raw.get("mamba_conv_bias", True)),
        "proj_bias": bool(raw.get("mamba_proj_bias", False)),
        # (Jamba's RMSNorms of the step, B and C, with weights, at the model's norm_eps)
        "dt_bc_norms": True,
        "dt_bc_norm_weights": True,
        "dt_bc_norm_eps": None,
    }


def read_mamba2(raw: dict[str, Any], name: str, defaults: dict[str, Any] = MAMBA2_DEFAULTS) -> dict[str, Any]:
    """The Mamba-2 mixers' settings of a Granite 4.0-H, Bamba or Falcon-H1 config (``mamba_*``, its transformers
    class's defaults: ``defaults``), checked. ``d_ssm``: the mixer's width where given (Falcon-H1's), else
    ``expand`` x hidden."""
    hidden = raw["hidden_size"]
    settings = {key: raw.get(f"mamba_{key}", default) for key, default in defaults.items()}
    check_positive_ints(settings, ("n_heads", "n_groups", "d_state", "d_conv", "expand", "chunk_size"), name, "mamba_")
    d_inner = settings.pop("d_ssm", None) or settings["expand"] * hidden
    settings.pop("expand")
    heads, head_dim = settings["n_heads"], settings.pop("d_head")
    if head_dim == "auto":
        head_dim = d_inner // heads
    if head_dim * heads != d_inner or heads % settings["n_groups"]:
        raise ConfigError(
            f"{name}: mamba_n_heads {heads} x mamba_d_head {head_dim} must be mamba_expand x hidden_size {d_inner}, "
            f"and mamba_n_groups {settings['n_groups']} must divide the heads"
        )
    if raw.get("hidden_act", "silu") != "silu":
        raise ConfigError(f"{name}: hidden_act {raw.get('hidden_act')!r} is not supported with Mamba layers (silu)")
    limit = [json_float(bound, "time_step_limit", name) for bound in raw.get("time_step_limit") or (0.0, float("inf"))]
    if len(limit) != 2:
        raise ConfigError(f"{name}: time_step_limit must be two numbers (the steps' least and most), got {limit!r}")
    return {
        **settings,
        "head_dim": head_dim,
        "d_inner": d_inner,
        "conv_bias": bool(settings["conv_bias"]),
        "proj_bias": bool(settings["proj_bias"]),
        # (the out projection's bias: Falcon-H1's projectors_bias, else in_proj's)
        "out_proj_bias": bool(raw.get("projectors_bias", settings["proj_bias"])),
        # (the output gated and RMS-normalized by group, the gate after the norm where norm_before_gate; else
        # only gated: Falcon-H1's default)
        "rms_norm": bool(settings.pop("rms_norm", True)),
        "norm_before_gate": bool(settings.pop("norm_before_gate", False)),
        "time_step_limit": tuple(limit),
    }


# Nemotron-H's blocks by the Hub's pattern letters (``hybrid_override_pattern``) and by transformers 5's names
NEMOTRON_H_KINDS = {"M": MAMBA, "*": "full_attention", "-": MLP_LAYER, "E": MOE_LAYER}
NEMOTRON_H_NAMES = {"linear_attention": MAMBA, "full_attention": "full_attention", "mlp": MLP_LAYER, "moe": MOE_LAYER}


def nemotron_h_kinds(raw: dict[str, Any], name: str) -> list[str]:
    """Nemotron-H's blocks, each a Mamba-2 mixer, attention, an MLP or experts: ``layers_block_type`` (transformers
    5) or the Hub's ``hybrid_override_pattern`` ("M-M-M-MM*-...": a letter a block)."""
    listed = raw.get("layers_block_type") or raw.get("layer_types")
    if listed:
        kinds = [NEMOTRON_H_NAMES.get(kind) for kind in listed]
        bad = next((kind for kind, ours in zip(listed, kinds) if ours is None), None)
    else:
        pattern = raw.get("hybrid_override_pattern")
        if not isinstance(pattern, str) or not pattern:
            raise ConfigError(f"{name}: a nemotron_h config.json needs layers_block_type or hybrid_override_pattern")
        kinds = [NEMOTRON_H_KINDS.get(letter) for letter in pattern]
        bad = next((letter for letter, ours in zip(pattern, kinds) if ours is None), None)
    if bad is not None:
        raise ConfigError(
            f"{name}: nemotron_h block type {bad!r} is not one of M, *, -, E (mamba, attention, mlp, moe)"
        )
    return kinds
