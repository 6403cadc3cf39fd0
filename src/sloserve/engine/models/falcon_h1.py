"""Falcon-H1 (``falcon_h1``: 0.5B-34B): Llama's layers, each with a Mamba-2 mixer (``models/mamba2.py``) beside its
attention, both reading the same normalized input and their outputs summed (the layer's ``forward``), then the
MLP. Its muP multipliers scale each projection's input or output by a constant: the loader folds them into the
weights (``checkpoint_tensor``), as a linear map of a scaled input is the scaled map of it.

NOTE: folded, a bf16 weight is rounded once after its scaling, where transformers rounds the weight, then the
product: outputs within a bf16 rounding of transformers'; equal in float32 to the order of the products.
"""

from __future__ import annotations

import torch

from sloserve.checkpoint.model_config import ModelConfig

# The checkpoint's names of the modules the engine names as Llama's
CHECKPOINT_NAMES = {
    ".feed_forward.": ".mlp.",
    ".pre_ff_layernorm.": ".post_attention_layernorm.",
    "model.final_layernorm.": "model.norm.",
}


def mup_vector(config: ModelConfig) -> torch.Tensor:
    """The factor of each output of a mixer's in_proj: its z, x, B, C and dt parts' ``ssm_multipliers``."""
    m, multipliers = config.mamba, config.extra["falcon_h1_multipliers"]["ssm_multipliers"]
    parts = (m["d_inner"], m["d_inner"], m["n_groups"] * m["d_state"], m["n_groups"] * m["d_state"], m["n_heads"])
    return torch.cat([torch.full((size,), factor, dtype=torch.float64) for size, factor in zip(parts, multipliers)])


def checkpoint_tensor(key: str, tensor: torch.Tensor, config: ModelConfig) -> tuple[str, torch.Tensor]:
    """A Falcon-H1 checkpoint's tensor with its multipliers folded in: attention's input (q, k, v weights) and
    output (o_proj), the keys' (k_proj), the mixer's input (in_proj's weight) and its parts' (in_proj's rows), its
    output (out_proj), the MLP's gate and down projections."""
    mult = config.extra["falcon_h1_multipliers"]
    gate, down = mult["mlp_multipliers"]
    scale: float | torch.Tensor = 1.0
    if key.endswith(("self_attn.q_proj.weight", "self_attn.v_proj.weight")):
        scale = mult["attention_in_multiplier"]
    elif key.endswith("self_attn.k_proj.weight"):
        scale = mult["attention_in_multiplier"] * mult["key_multiplier"]
    elif key.endswith("self_attn.k_proj.bias"):
        scale = mult["key_multiplier"]
    elif ".self_attn.o_proj." in key:
        scale = mult["attention_out_multiplier"]
    elif key.endswith(("mamba.in_proj.weight", "mamba.in_proj.bias")):
        rows = mup_vector(config)
        scale = rows[:, None] * mult["ssm_in_multiplier"] if key.endswith("weight") else rows
    elif ".mamba.out_proj." in key:
        scale = mult["ssm_out_multiplier"]
    elif ".mlp.gate_proj." in key:
        scale = gate
    elif ".mlp.down_proj." in key:
        scale = down
    if isinstance(scale, torch.Tensor):
        scale = scale.to(tensor.device)  # (a checkpoint's tensors may come on the GPU the model loads to)
    if isinstance(scale, torch.Tensor) or scale != 1.0:
        tensor = (tensor.double() * scale).to(tensor.dtype)  # (one rounding, from float64)
    return key, tensor
