"""A config's rotary-embedding scaling (``rope_scaling``, transformers 5's ``rope_parameters``): linear,
llama3, YaRN, LongRoPE, Hunyuan's NTK-alpha, Llama 4's query scaling; read into ``ModelConfig.rope_scaling``."""

from __future__ import annotations

from typing import Any

from sloserve.core.errors import ConfigError


def read_ntk_alpha(
    raw: dict[str, Any], rope: dict[str, Any], theta: float, head_dim: int, name: str
) -> tuple[float, dict[str, Any], dict[str, Any]]:
    """Hunyuan's rope scaling, "dynamic" with a fixed ``alpha`` (NTK-aware): its base times alpha ** (d / (d - 2)),
    the same at every length (transformers' ``ntk_alpha``). Returns (the base, rope settings and config
    without the scaling). Dynamic scaling without an alpha (by the sequence's length) is refused."""
    scaling = raw.get("rope_scaling") or (rope if rope.get("rope_type", "default") != "default" else None)
    if not scaling or scaling.get("rope_type", scaling.get("type")) != "dynamic":
        return theta, rope, raw
    alpha = scaling.get("alpha")
    if not isinstance(alpha, (int, float)) or isinstance(alpha, bool) or alpha <= 0:
        raise ConfigError(f"{name}: dynamic rope scaling needs a positive alpha (Hunyuan's NTK-alpha), got {alpha!r}")
    theta = theta * alpha ** (head_dim / (head_dim - 2))
    return theta, {k: v for k, v in rope.items() if k != "rope_type"}, {**raw, "rope_scaling": None}


def config_rope_scaling(raw: dict[str, Any], rope: dict[str, Any], name: str) -> dict[str, Any] | None:
    """The rope scaling of a config: ``rope_scaling`` (before transformers 5), else its ``rope_parameters``
    (``rope``) where they name a type other than default."""
    return read_rope_scaling(
        raw.get("rope_scaling") or (rope if rope.get("rope_type", "default") != "default" else None), name
    )


def read_rope_scaling(scaling: dict[str, Any] | None, name: str) -> dict[str, Any] | None:
    """An HF rope scaling dict if it is one the engine applies (None: plain rope)."""
    if scaling is None:
        return None
    kind = scaling.get("rope_type", scaling.get("type"))
    if kind == "mrope":  # (Qwen2-VL's first name of its MRoPE: on text, plain RoPE; transformers reads it so)
        kind = "default"
    if kind == "su":  # (LongRoPE's first name, in the first 128K Phi-3 configs; transformers reads it so)
        scaling, kind = {**scaling, "rope_type": "longrope"}, "longrope"
    # NOTE: dynamic NTK (InternLM3's) stretches the rope's base only for a sequence past max_position_embeddings, which
    # the engine never serves (``resolve_max_model_len``): within it transformers' is plain rope, and so is the engine's
    # (vLLM's scales the base whatever the length, and serves factor x the positions)
    if kind == "dynamic":
        kind = "default"
    # NOTE: frequency_factors is a GGUF file's (llama.cpp's rope_freqs tensor), not an HF config's
    if kind not in ("default", "linear", "llama3", "yarn", "longrope", "frequency_factors", "proportional"):
        raise ConfigError(
            f"{name}: rope scaling {kind!r} is not supported (default, linear, llama3, yarn, longrope, proportional, "
            "dynamic)"
        )
    if kind == "yarn" and not scaling.get("original_max_position_embeddings"):
        raise ConfigError(f"{name}: yarn rope scaling needs original_max_position_embeddings (the pretrained context)")
    return None if kind == "default" else scaling


def read_llama4_scaling_beta(model_type: str, scaling: dict | None, rope: dict, name: str) -> float | None:
    """Ministral 3's query scale, beta (its rope settings' ``llama_4_scaling_beta``), checked: it scales
    by the positions past the rope's pretrained context, and needs that context."""
    beta = (scaling or rope).get("llama_4_scaling_beta") if model_type in ("ministral3", "mistral4") else None
    if beta is None:
        return None
    if not isinstance(beta, (int, float)) or isinstance(beta, bool):
        raise ConfigError(f"{name}: llama_4_scaling_beta must be a number, got {beta!r}")
    if not (scaling or {}).get("original_max_position_embeddings"):
        raise ConfigError(f"{name}: llama_4_scaling_beta needs the rope's original_max_position_embeddings")
    return float(beta)


def read_longrope(scaling: dict[str, Any], raw: dict[str, Any], rotary_dim: int, name: str) -> dict[str, Any]:
    """LongRoPE's settings (Phi-3.5, Phi-4 mini, the 128K Phi-3s), checked: a short and a long factor per
    frequency, and the pretrained context (Phi-3 keeps it at the top level of its config; transformers'
    Phi3Config default 4,096 where it has none)."""
    original = scaling.get("original_max_position_embeddings") or raw.get("original_max_position_embeddings")
    if original is None:
        original = 4096 if raw.get("model_type") == "phi3" else raw.get("max_position_embeddings")
    for key in ("short_factor", "long_factor"):
        factors = scaling.get(key)
        if not isinstance(factors, list) or not all(
            isinstance(f, (int, float)) and not isinstance(f, bool) and f > 0 for f in factors
        ):
            raise ConfigError(f"{name}: longrope rope scaling needs {key}, a list of positive numbers")
        if len(factors) != rotary_dim // 2:
            raise ConfigError(
                f"{name}: longrope {key} has {len(factors)} factors; the rotary embedding has {rotary_dim // 2} "
                "frequencies"
            )
    if not isinstance(original, int) or isinstance(original, bool) or original < 1:
        raise ConfigError(
            f"{name}: longrope original_max_position_embeddings must be a positive integer, got {original!r}"
        )
    return {**scaling, "rope_type": "longrope", "original_max_position_embeddings": original}
