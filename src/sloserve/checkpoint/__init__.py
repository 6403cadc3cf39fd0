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
