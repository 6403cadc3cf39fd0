"""StableLM (``stablelm``: StableLM 2 1.6B, StableLM 3B 4E1T, Zephyr 3B, StableCode 3B): Llama's layers with
LayerNorms (with biases), the rotary embedding on the first quarter of each head (``partial_rotary_factor``),
q/k/v biases where ``use_qkv_bias``. StableLM 2 12B's parallel residual and per-head query and key
LayerNorms are refused (config.py). HF parameter names; piecewise graphs as Llama's."""

from __future__ import annotations

from sloserve.engine.models.llama import LayerNorm, LlamaDecoderLayer, LlamaForCausalLM, LlamaModel


class StableLmDecoderLayer(LlamaDecoderLayer):
    norm_class = LayerNorm


class StableLmModel(LlamaModel):
    layer_class = StableLmDecoderLayer
    norm_class = LayerNorm


class StableLmForCausalLM(LlamaForCausalLM):
    model_class = StableLmModel
