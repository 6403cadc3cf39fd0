"""Model files without torch: a model's shape from a HuggingFace ``config.json``, a GGUF file's
metadata (``gguf.py``: config, tokenizer, chat template, dequantized tensors) or a named random shape
(``config.py``). The engine builds its models from them; the simulator and the planner read an
engine model's shape through ``model_spec``.
"""

from __future__ import annotations

from pathlib import Path

from sloserve.core.errors import UnknownNameError
from sloserve.cost.specs import ModelSpec


def model_spec(name: str) -> ModelSpec:
    """A bundled spec by name, or the shape of an engine model: ``random:NAME``, a local HF
    directory (its config.json) or a GGUF file (its metadata), so a preset profiled on it simulates it."""
    from sloserve.checkpoint.config import RANDOM_PREFIX, from_hf_config, load_hf_config, random_config
    from sloserve.checkpoint.gguf import is_gguf, read_gguf
    from sloserve.cost import get_model

    if name.startswith(RANDOM_PREFIX):
        return random_config(name[len(RANDOM_PREFIX) :]).spec()
    if Path(name).expanduser().is_dir():
        return load_hf_config(Path(name).expanduser()).spec()
    if is_gguf(name):
        return from_hf_config(read_gguf(name).hf_config, name=Path(name).stem).spec()
    try:
        return get_model(name)
    except UnknownNameError as err:
        err.args = (f"{err.args[0]}; or random:NAME, a local HF model directory or a .gguf file",)
        raise


def check_engine_model(model: str) -> None:
    """A ConfigError now for an engine model (``--model`` of ``run``, ``profile`` and ``serve``) that the loader
    would refuse for what its name or config says: an unknown ``random:`` shape, a directory that does not exist or
    has no readable config.json, a GGUF file that is missing or not one, or an unsupported architecture. Reads no
    weights and imports no torch (2-3 s), so a typo is answered at once, before an engine or a server starts."""
    from sloserve.checkpoint.config import RANDOM_PREFIX, load_hf_config
    from sloserve.checkpoint.gguf import is_gguf

    if model.startswith(RANDOM_PREFIX) or is_gguf(model):
        model_spec(model)
    else:
        load_hf_config(Path(model).expanduser())
