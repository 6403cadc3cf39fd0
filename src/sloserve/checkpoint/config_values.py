"""A config.json's values checked as they are read: each bad one a ConfigError naming the checkpoint, the
setting and the value."""

from __future__ import annotations

from typing import Any

from sloserve.core.errors import ConfigError


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
    if isinstance(offset, bool) or not isinstance(offset, int) or not 0 <= offset < period:
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
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
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
    if isinstance(value, bool) or not isinstance(value, int) or value < min(default, 0):
        allowed = "an integer >= 0" + (" or -1" if default == -1 else "")
        raise ConfigError(f"{name}: {key} must be {allowed}, got {value!r}")
    return value
