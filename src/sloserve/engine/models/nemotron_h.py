"""Nemotron-H (``nemotron_h``: Nemotron-H 8B-56B, Nemotron Nano 2 9B and 12B): a stack of blocks, each an RMSNorm and
one mixer (Mamba-2's, ``models/mamba2.py``; attention without a position embedding; a squared-ReLU MLP; or
Nemotron 3's experts), its
output added to the residual stream. HF parameter names, the Hub's ``backbone.`` and every block's ``mixer.``
renamed to the engine's (``checkpoint_tensor``).
"""

from __future__ import annotations

import torch
from torch import nn

from sloserve.checkpoint.model_config import MAMBA, MLP_LAYER, MOE_LAYER, ModelConfig
from sloserve.engine.attention import AttentionBackend
from sloserve.engine.models.gpt2 import ACTIVATIONS
from sloserve.engine.models.llama import LlamaAttention, LlamaForCausalLM, LlamaModel, RMSNorm, mamba_mixer
from sloserve.engine.models.moe import DeepseekMoE, UpDownExperts
from sloserve.engine.models.nemotron import UpDownMLP


class NemotronHBlock(nn.Module):
    """A norm and the block's mixer: ``mamba``, ``self_attn`` or ``mlp`` (an MLP, or experts: DeepSeek-V3's routing
    over two-matrix experts beside a shared one; the others None)."""

    norm_class: type[nn.Module] = RMSNorm

    def __init__(self, config: ModelConfig, backend: AttentionBackend, layer: int) -> None:
        super().__init__()
        kind = config.layer_types[layer]
        self.input_layernorm = self.norm_class(config.hidden_size, config.norm_eps)
        self.mamba = mamba_mixer(config, layer) if kind == MAMBA else None
        self.self_attn = LlamaAttention(config, backend, layer) if kind == "full_attention" else None
        self.mlp = UpDownMLP(config) if kind == MLP_LAYER else None
        if kind == MOE_LAYER:
            moe, relu2 = config.moe, ACTIVATIONS["relu2"]
            experts = UpDownExperts(moe["num_experts"], config.hidden_size, moe["moe_intermediate_size"], relu2)
            shared = UpDownMLP(config, intermediate_size=moe["shared_expert_intermediate_size"])
            self.mlp = DeepseekMoE(config, shared, experts)

    def forward(self, x, residual, cos, sin, k_cache, v_cache, meta):
        """``LlamaDecoderLayer.forward``'s contract: (this block's output, the stream before it), the output
        joining the stream in the next norm."""
        h, residual = (
            (self.input_layernorm(x), x) if residual is None else self.input_layernorm.add_and_norm(x, residual)
        )
        if self.mamba is not None:
            return self.mamba(h, meta.states), residual
        if self.mlp is not None:
            return self.mlp(h), residual
        return self.self_attn(h, cos, sin, k_cache, v_cache, meta), residual


class NemotronHModel(LlamaModel):
    layer_class = NemotronHBlock


class NemotronHForCausalLM(LlamaForCausalLM):
    model_class = NemotronHModel


def checkpoint_tensor(key: str, tensor: torch.Tensor, config: ModelConfig) -> tuple[str, torch.Tensor]:
    """A Nemotron-H checkpoint's tensor under the engine's name: the Hub's ``backbone.`` is transformers'
    ``model.``; ``embeddings``, ``norm_f``, a block's ``norm`` and its ``mixer`` (by the block's kind) are the
    engine's ``embed_tokens``, ``norm``, ``input_layernorm`` and ``mamba``/``self_attn``/``mlp``."""
    if key.startswith("backbone."):
        key = "model." + key.removeprefix("backbone.")
    key = key.replace("model.embeddings.", "model.embed_tokens.").replace("model.norm_f.", "model.norm.")
    parts = key.split(".")
    if key.startswith("model.layers.") and len(parts) > 3:
        kind = config.layer_types[int(parts[2])]
        part = {
            "norm": "input_layernorm",
            "mixer": {MAMBA: "mamba", MLP_LAYER: "mlp", MOE_LAYER: "mlp"}.get(kind, "self_attn"),
        }
        parts[3] = part.get(parts[3], parts[3])
        key = ".".join(parts)
    return key, tensor
