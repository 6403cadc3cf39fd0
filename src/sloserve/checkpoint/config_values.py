"""A config.json's values checked as they are read: each bad one a ConfigError naming the checkpoint, the
setting and the value."""

from __future__ import annotations

from typing import Any

from sloserve.core.errors import ConfigError


def _is_int(value: Any) -> bool:
    """An integer, not a bool (JSON's true is not a count)."""
    return isinstance(value, int) and not isinstance(value, bool)


def checked_layer_types(kinds: Any, layers: int, known, model_type: str, name: str) -> tuple[str, ...]:
    """A config's ``layer_types`` (``kinds``): ``layers`` entries, each one of ``known``; else a ConfigError naming
    them."""
    if not isinstance(kinds, (list, tuple)) or len(kinds) != layers or not set(kinds) <= set(known):
        raise ConfigError(
            f"{name}: {model_type} layer_types must be {layers} entries of {', '.join(sorted(known))}, got {kinds!r}"
        )
    return tuple(kinds)


def check_layer_period(period: Any, offset: Any, setting: str, name: str) -> None:
    """A ConfigError naming Jamba's ``{setting}_period`` or ``{setting}_offset`` unless 0 <= offset < period."""
    check_positive_ints({f"{setting}_period": period}, (f"{setting}_period",), name)
    if not _is_int(offset) or not 0 <= offset < period:
        raise ConfigError(f"{name}: {setting}_offset must be an integer in 0..{period - 1}, got {offset!r}")


def json_float(value: Any, key: str, name: str) -> float:
    """A config's number, or transformers 5's JSON spelling of a non-finite one ({"__float__": "Infinity"})."""
    if isinstance(value, dict) and set(value) == {"__float__"}:
        value = value["__float__"]
    try:
        return float(value)
    except (TypeError, ValueError):
        raise ConfigError(f"{name}: {key} must hold numbers, got {value!r}") from None


def check_positive_ints(settings: dict[str, Any], keys: tuple[str, ...], name: str, label: str = "") -> None:
    """A ConfigError naming the first of ``keys`` whose value in ``settings`` is not a positive integer (``label``:
    its name's prefix in the config)."""
    for key in keys:
        value = settings[key]
        if not _is_int(value) or value < 1:
            raise ConfigError(f"{name}: {label}{key} must be a positive integer, got {value!r}")


def one_for_all_layers(raw: dict[str, Any], key: str, name: str) -> Any:
    """``raw[key]``, given as one value or one a layer (Hunyuan's): the value, where every layer's is the same."""
    value = raw.get(key)
    if not isinstance(value, list):
        return value
    if not value or any(v != value[0] for v in value):
        raise ConfigError(f"{name}: {key} differs between layers ({value!r}); one value for all is supported")
    return value[0]


def layer_index(raw: dict[str, Any], key: str, default: int, name: str) -> int:
    """The layer index (or count) ``raw[key]``: an integer >= 0, or -1 (the last layer) where the default is."""
    value = raw.get(key, default)
    if value is None and default == 0:  # (DeepSeek's configs may say null: none)
        return 0
    if not _is_int(value) or value < min(default, 0):
        allowed = "an integer >= 0" + (" or -1" if default == -1 else "")
        raise ConfigError(f"{name}: {key} must be {allowed}, got {value!r}")
    return value


def _is_number(value: Any) -> bool:
    """A JSON number, or transformers 5's spelling of a non-finite one ({"__float__": "Infinity"})."""
    if isinstance(value, dict) and set(value) == {"__float__"}:
        return isinstance(value["__float__"], str)
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def _is_token_ids(value: Any) -> bool:
    """One token id or a list of them (a config's EOS ids)."""
    return all(_is_int(i) and i >= 0 for i in (value if isinstance(value, list) else [value]))


# What each kind of setting must be: (the words of the error, the check)
POSITIVE_INT = ("a positive integer", lambda v: _is_int(v) and v > 0)
COUNT = ("an integer >= 0", lambda v: _is_int(v) and v >= 0)
NUMBER = ("a number", _is_number)
POSITIVE_NUMBER = ("a positive number", lambda v: _is_number(v) and not isinstance(v, dict) and v > 0)
NONZERO_NUMBER = ("a number other than 0", lambda v: _is_number(v) and v != 0)
# The most decoder layers a config.json may give. NOTE: the deepest models have a few hundred (Llama 3.1 405B:
# 126); a corrupt count of 10**8 made the reader build its per-layer lists for seconds to minutes (10**9: out of
# memory) before the weights could say they hold fewer (engine/models: check_config_fits_checkpoint)
MAX_LAYERS = 10_000
LAYER_COUNT = (f"a positive integer up to {MAX_LAYERS:,}", lambda v: _is_int(v) and 0 < v <= MAX_LAYERS)
OBJECT = ("an object", lambda v: isinstance(v, dict))
LIST = ("a list", lambda v: isinstance(v, (list, tuple)))
BOOLEAN = ("true or false", lambda v: isinstance(v, bool))
TEXT = ("a string", lambda v: isinstance(v, str))
STRINGS = ("a list of strings", lambda v: isinstance(v, list) and all(isinstance(x, str) for x in v))
NUMBERS = ("a list of numbers", lambda v: isinstance(v, list) and all(_is_number(x) for x in v))
INTEGERS = ("a list of integers", lambda v: isinstance(v, list) and all(_is_int(x) for x in v))


# The kind of value a config.json's setting holds, checked before it is read (``check_setting_kinds``): a value of
# another kind would otherwise fail deep in the reading (a TypeError, a division by zero). The second entry: whether
# a null is accepted (some model types read it as unset).
SETTING_KINDS: dict[str, tuple[tuple[str, Any], bool]] = {
    # the shape, under transformers' names and GPT-2's, BLOOM's, MPT's and EXAONE's
    **{key: (POSITIVE_INT, False) for key in (
        "vocab_size", "hidden_size", "num_attention_heads", "max_position_embeddings",
        "n_embd", "n_embed", "d_model", "n_head", "n_heads", "n_positions", "seq_length", "max_seq_len",
    )},
    **{key: (LAYER_COUNT, False) for key in ("num_hidden_layers", "n_layer", "n_layers", "num_layers")},
    "mamba_d_head": (('a positive integer or "auto"', lambda v: v == "auto" or POSITIVE_INT[1](v)), False),
    # sizes where 0 or null means "the default" or "none" for some model type
    **{key: (COUNT, True) for key in (
        "intermediate_size", "moe_intermediate_size", "head_dim", "num_key_value_heads", "num_experts",
        "num_local_experts", "n_routed_experts", "num_experts_per_tok",
    )},
    "num_experts_per_token": (COUNT, False),
    "bos_token_id": (("a token id (an integer >= 0)", COUNT[1]), True),
    "eos_token_id": (("a token id (an integer >= 0) or a list of them", _is_token_ids), True),
    "sliding_window": (("an integer >= 0", lambda v: isinstance(v, int) and v >= 0), True),  # (false: no window)
    **{key: (NUMBER, True) for key in ("rms_norm_eps", "layer_norm_epsilon", "attention_multiplier",
                                       "router_jitter_noise", "rope_theta")},
    **{key: (NUMBER, False) for key in ("layer_norm_eps", "norm_eps", "norm_epsilon", "embedding_multiplier",
                                        "residual_multiplier", "swiglu_alpha", "swiglu_limit")},
    "logits_scaling": (NONZERO_NUMBER, False),
    "query_pre_attn_scalar": (POSITIVE_NUMBER, False),
    "dim_model_base": (POSITIVE_NUMBER, True),
    **{key: (OBJECT, True) for key in ("rope_parameters", "rope_scaling", "attn_config")},
    **{key: (LIST, True) for key in ("layer_types", "mlp_only_layers", "no_rope_layers", "layer_rope_theta",
                                     "layers_block_type", "time_step_limit")},
}  # fmt: skip
# The settings a model type's config may give as one value a layer, each of the setting's kind: Hunyuan-A13B's
# (the reader takes one for all, ``one_for_all_layers``; its moe_intermediate_size is not read, as transformers'
# experts are intermediate_size wide)
PER_LAYER_SETTINGS = {"hunyuan_v1_moe": ("num_experts", "moe_intermediate_size")}


def check_setting_kinds(raw: dict[str, Any], model_type: str, name: str) -> None:
    """A ConfigError naming the first setting of ``raw`` (a config.json's dict of ``model_type``, as written) whose
    value is not of its kind (``SETTING_KINDS``)."""
    for key, value in raw.items():
        if key not in SETTING_KINDS:
            continue
        (words, holds), null_allowed = SETTING_KINDS[key]
        if value is None and null_allowed:
            continue
        if isinstance(value, list) and value and key in PER_LAYER_SETTINGS.get(model_type, ()):
            if all(v is not None and holds(v) for v in value):
                continue
            words = f"{words}, or a list of them (one a layer)"
        if value is None or not holds(value):
            raise ConfigError(f"{name}: {key} must be {words}, got {value!r}")
