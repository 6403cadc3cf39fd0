"""A checkpoint's sampling defaults: the ``generation_config.json`` beside its weights (transformers'
``GenerationConfig``), read as vLLM's ``--generation-config auto`` reads it. A request that does not set
``temperature``, ``top_p``, ``top_k``, ``min_p`` or ``repetition_penalty`` samples with the model's
(Llama 3.1 Instruct: temperature 0.6, top_p 0.9; Qwen3: 0.6, 0.95 and top_k 20), not with the API's
defaults (1.0 and no filter); its ``max_new_tokens`` is the ``max_tokens`` of a request that sets none."""

from __future__ import annotations

import json
from pathlib import Path

from sloserve.core.errors import ConfigError

# The fields a generation config may set, with transformers' defaults: a value equal to its default is
# not the model's choice (vLLM reads ``GenerationConfig.to_diff_dict()``, which leaves such values out)
SAMPLING_DEFAULTS_OF_TRANSFORMERS = {
    "temperature": 1.0,
    "top_p": 1.0,
    "top_k": 50,
    "min_p": None,
    "repetition_penalty": 1.0,
    "max_new_tokens": None,
}
# Their names in SamplingParams, where they differ
SAMPLING_NAMES = {"max_new_tokens": "max_tokens"}


def sampling_defaults(directory: str | Path) -> dict[str, float]:
    """The sampling fields that ``directory``'s ``generation_config.json`` sets, by their SamplingParams
    names (a model directory, or any directory given to ``--generation-config``); {} where it has none,
    or ``directory`` is not one (a GGUF file, a ``random:`` model). A value that is not a number is a
    ConfigError naming the file and the field."""
    file = Path(directory).expanduser() / "generation_config.json"
    raw = read_generation_config(file)
    if raw is None:
        return {}
    defaults: dict[str, float] = {}
    for name, transformers_default in SAMPLING_DEFAULTS_OF_TRANSFORMERS.items():
        value = raw.get(name)
        if value is None or value == transformers_default:
            continue
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise ConfigError(f"{file}: {name} must be a number, got {value!r}")
        defaults[SAMPLING_NAMES.get(name, name)] = value
    return defaults


def generation_eos_ids(file: Path) -> tuple[int, ...]:
    """The ``eos_token_id`` (one or a list) of a generation_config.json; () where there is none."""
    raw = read_generation_config(file)
    eos = None if raw is None else raw.get("eos_token_id")
    ids = eos if isinstance(eos, list) else [] if eos is None else [eos]
    if not all(isinstance(i, int) and not isinstance(i, bool) and i >= 0 for i in ids):
        raise ConfigError(f"{file}: eos_token_id must be a token id or a list of them, got {eos!r}")
    return tuple(ids)


def read_generation_config(file: Path) -> dict | None:
    """The JSON object of a generation_config.json; None where there is none. One that is not JSON, or
    not an object, is a ConfigError naming the file."""
    if not file.is_file():
        return None
    try:
        raw = json.loads(file.read_text())
    except json.JSONDecodeError as e:
        raise ConfigError(f"{file}: not valid JSON ({e})") from None
    if not isinstance(raw, dict):
        raise ConfigError(f"{file}: must be a JSON object, got {type(raw).__name__}")
    return raw
