"""GGUF tensor names (llama.cpp's) and the HF names they load under, by architecture (``ARCH_TENSORS``), with
the tensors that load otherwise: joined (``JOINED_TENSORS``), stacked experts, Q and K rows permuted
(``PERMUTED``), norms stored shifted (``SHIFTED_NORMS``), the rope's factors (not weights)."""

from __future__ import annotations

# GGUF tensor names of the Llama architecture -> HF names ({n}: the layer).
LLAMA_TENSORS = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
    "blk.{n}.attn_norm.weight": "model.layers.{n}.input_layernorm.weight",
    "blk.{n}.ffn_norm.weight": "model.layers.{n}.post_attention_layernorm.weight",
    "blk.{n}.attn_q.weight": "model.layers.{n}.self_attn.q_proj.weight",
    "blk.{n}.attn_k.weight": "model.layers.{n}.self_attn.k_proj.weight",
    "blk.{n}.attn_v.weight": "model.layers.{n}.self_attn.v_proj.weight",
    "blk.{n}.attn_output.weight": "model.layers.{n}.self_attn.o_proj.weight",
    "blk.{n}.ffn_gate.weight": "model.layers.{n}.mlp.gate_proj.weight",
    "blk.{n}.ffn_up.weight": "model.layers.{n}.mlp.up_proj.weight",
    "blk.{n}.ffn_down.weight": "model.layers.{n}.mlp.down_proj.weight",
}
# More tensors of the other architectures
ARCH_TENSORS = {
    "llama": {},
    "gemma": {},  # (Gemma 1, CodeGemma: Llama's tensors, its norms shifted)
    "smollm3": {},
    "granite": {},
    "qwen2": {f"blk.{{n}}.attn_{x}.bias": f"model.layers.{{n}}.self_attn.{x}_proj.bias" for x in ("q", "k", "v")},
    "qwen3": {
        "blk.{n}.attn_q_norm.weight": "model.layers.{n}.self_attn.q_norm.weight",
        "blk.{n}.attn_k_norm.weight": "model.layers.{n}.self_attn.k_norm.weight",
    },
    "qwen3moe": {  # (the experts' stacked tensors: EXPERT_TENSORS)
        "blk.{n}.attn_q_norm.weight": "model.layers.{n}.self_attn.q_norm.weight",
        "blk.{n}.attn_k_norm.weight": "model.layers.{n}.self_attn.k_norm.weight",
        "blk.{n}.ffn_gate_inp.weight": "model.layers.{n}.mlp.gate.weight",
    },
    "qwen2moe": {  # Qwen2's biases; the router, the shared expert and its gate (the experts: EXPERT_TENSORS)
        **{f"blk.{{n}}.attn_{x}.bias": f"model.layers.{{n}}.self_attn.{x}_proj.bias" for x in ("q", "k", "v")},
        "blk.{n}.ffn_gate_inp.weight": "model.layers.{n}.mlp.gate.weight",
        **{
            f"blk.{{n}}.ffn_{x}_shexp.weight": f"model.layers.{{n}}.mlp.shared_expert.{x}_proj.weight"
            for x in ("gate", "up", "down")
        },
        "blk.{n}.ffn_gate_inp_shexp.weight": "model.layers.{n}.mlp.shared_expert_gate.weight",
    },
    "olmo2": {  # no norms before attention and the MLP: after them; query and key norms over whole projections
        "blk.{n}.attn_q_norm.weight": "model.layers.{n}.self_attn.q_norm.weight",
        "blk.{n}.attn_k_norm.weight": "model.layers.{n}.self_attn.k_norm.weight",
        "blk.{n}.post_attention_norm.weight": "model.layers.{n}.post_attention_layernorm.weight",
        "blk.{n}.post_ffw_norm.weight": "model.layers.{n}.post_feedforward_layernorm.weight",
    },
    "phi3": {  # Q/K/V and gate/up fused, as in its HF checkpoints (``FUSED_CHECKPOINTS``)
        "blk.{n}.attn_qkv.weight": "model.layers.{n}.self_attn.qkv_proj.weight",
        "blk.{n}.ffn_up.weight": "model.layers.{n}.mlp.gate_up_proj.weight",
    },
    "gemma2": {
        "blk.{n}.post_attention_norm.weight": "model.layers.{n}.post_attention_layernorm.weight",
        "blk.{n}.ffn_norm.weight": "model.layers.{n}.pre_feedforward_layernorm.weight",  # (Llama's: post_attention_)
        "blk.{n}.post_ffw_norm.weight": "model.layers.{n}.post_feedforward_layernorm.weight",
    },
}
ARCH_TENSORS["gpt-oss"] = {  # (its experts, stacked: GPT_OSS_EXPERTS)
    "blk.{n}.post_attention_norm.weight": "model.layers.{n}.post_attention_layernorm.weight",  # (before the MLP)
    **{f"blk.{{n}}.attn_{x}.bias": f"model.layers.{{n}}.self_attn.{x}_proj.bias" for x in ("q", "k", "v")},
    "blk.{n}.attn_output.bias": "model.layers.{n}.self_attn.o_proj.bias",
    "blk.{n}.attn_sinks.weight": "model.layers.{n}.self_attn.sinks",
    "blk.{n}.ffn_gate_inp.weight": "model.layers.{n}.mlp.router.weight",
    "blk.{n}.ffn_gate_inp.bias": "model.layers.{n}.mlp.router.bias",
}
# gpt-oss's stacked experts as llama.cpp's converter writes them (gate and up apart, each (E, I, H), down
# (E, H, I), biases beside; MXFP4 or not: ``gguf`` dequantizes either) -> (the part of transformers' tensor)
GPT_OSS_EXPERTS = {"ffn_gate_exps": "gate", "ffn_up_exps": "up", "ffn_down_exps": "down"}
GPT_OSS_EXPERT_PARTS = tuple(f"{part}.{kind}" for part in ("gate", "up", "down") for kind in ("weight", "bias"))
# LayerNorms' biases (StableLM's, StarCoder2's)
NORM_BIASES = {
    "blk.{n}.attn_norm.bias": "model.layers.{n}.input_layernorm.bias",
    "blk.{n}.ffn_norm.bias": "model.layers.{n}.post_attention_layernorm.bias",
    "output_norm.bias": "model.norm.bias",
}
ARCH_TENSORS["stablelm"] = {  # (and q/k/v biases where use_qkv_bias)
    **NORM_BIASES,
    **{f"blk.{{n}}.attn_{x}.bias": f"model.layers.{{n}}.self_attn.{x}_proj.bias" for x in ("q", "k", "v")},
}
ARCH_TENSORS["starcoder2"] = {  # (every projection's bias where use_bias; its MLP's two matrices)
    **ARCH_TENSORS["stablelm"],
    "blk.{n}.attn_output.bias": "model.layers.{n}.self_attn.o_proj.bias",
    "blk.{n}.ffn_up.weight": "model.layers.{n}.mlp.c_fc.weight",
    "blk.{n}.ffn_up.bias": "model.layers.{n}.mlp.c_fc.bias",
    "blk.{n}.ffn_down.weight": "model.layers.{n}.mlp.c_proj.weight",
    "blk.{n}.ffn_down.bias": "model.layers.{n}.mlp.c_proj.bias",
}
ARCH_TENSORS["lfm2"] = {  # LFM2's short convolutions (llama.cpp's ``shortconv``), its final norm named after the
    # embeddings (as its checkpoints name it: ``model.embedding_norm``, run after the last layer)
    **ARCH_TENSORS["qwen3"],
    **{
        f"blk.{{n}}.shortconv.{x}.weight": f"model.layers.{{n}}.conv.{x}.weight"
        for x in ("in_proj", "conv", "out_proj")
    },
    "token_embd_norm.weight": "model.norm.weight",
}
ARCH_TENSORS["lfm2moe"] = {  # LFM2-MoE's: LFM2's, the experts' router and its bias (``exp_probs_b``; stacked experts)
    **ARCH_TENSORS["lfm2"],
    "blk.{n}.ffn_gate_inp.weight": "model.layers.{n}.feed_forward.gate.weight",
    "blk.{n}.exp_probs_b.bias": "model.layers.{n}.feed_forward.expert_bias",
}
# Mamba's and Mamba-2's blocks (llama.cpp's ``mamba``: Falcon Mamba's too; ``mamba2``), under their HF names: the norm
# ``attn_norm``; the mixer's A as A = -exp(A_log) (``ssm_a``, read back as A_log), its convolution (C, taps);
# Mamba-2's step bias as ``ssm_dt.bias``, A, D (heads, 1) and its norm's weight by group (groups, d_inner / groups)
MAMBA_MIXER = {"ssm_in": "in_proj", "ssm_conv1d": "conv1d", "ssm_out": "out_proj"}
MAMBA_BACKBONE = {
    "token_embd.weight": "backbone.embeddings.weight",
    "output_norm.weight": "backbone.norm_f.weight",
    "blk.{n}.attn_norm.weight": "backbone.layers.{n}.norm.weight",
}


def _mamba_mixer_tensors(mixer: str, version: int) -> dict[str, str]:
    """llama.cpp's names of a layer's Mamba mixer's tensors -> its HF names under ``mixer`` (with ``{n}``): Mamba's
    (``version`` 1: ``ssm_x`` and the step's ``ssm_dt``) or Mamba-2's (its step's bias ``ssm_dt.bias``, its gated
    norm)."""
    projections = {**MAMBA_MIXER, **({"ssm_x": "x_proj", "ssm_dt": "dt_proj"} if version == 1 else {})}
    tensors = {
        **{
            f"blk.{{n}}.{ours}.{kind}": f"{mixer}.{theirs}.{kind}"
            for ours, theirs in projections.items()
            for kind in ("weight", "bias")
        },
        "blk.{n}.ssm_a": f"{mixer}.A_log",
        "blk.{n}.ssm_d": f"{mixer}.D",
    }
    if version == 2:
        tensors.update({"blk.{n}.ssm_dt.bias": f"{mixer}.dt_bias", "blk.{n}.ssm_norm.weight": f"{mixer}.norm.weight"})
    return tensors


ARCH_TENSORS["mamba"] = {**MAMBA_BACKBONE, **_mamba_mixer_tensors("backbone.layers.{n}.mixer", 1)}
ARCH_TENSORS["mamba2"] = {**MAMBA_BACKBONE, **_mamba_mixer_tensors("backbone.layers.{n}.mixer", 2)}
# Granite 4.0-H's (llama.cpp's ``granitehybrid``): Llama's layers, a Mamba-2 mixer where a layer does not attend (as
# Mamba-2's), its experts' router and stacked experts (Qwen3-MoE's) beside the shared MLP (``*_shexp``; without
# experts the shared MLP is Llama's own, ``ffn_gate``...)
ARCH_TENSORS["granitehybrid"] = {
    **_mamba_mixer_tensors("model.layers.{n}.mamba", 2),
    "blk.{n}.ffn_gate_inp.weight": "model.layers.{n}.mlp.gate.weight",
    "blk.{n}.ffn_down.weight": "model.layers.{n}.shared_mlp.output_linear.weight",
    "blk.{n}.ffn_down_shexp.weight": "model.layers.{n}.shared_mlp.output_linear.weight",
}
# Nemotron-H's (``nemotron_h``): blocks of a norm and one mixer each, under the Hub's names (``backbone.``, ``mixer``):
# a Mamba-2 mixer, attention or a two-matrix MLP
ARCH_TENSORS["nemotron_h"] = {
    **ARCH_TENSORS["mamba2"],
    **{
        f"blk.{{n}}.attn_{ours}.weight": f"backbone.layers.{{n}}.mixer.{theirs}_proj.weight"
        for ours, theirs in (("q", "q"), ("k", "k"), ("v", "v"), ("output", "o"))
    },
    **{f"blk.{{n}}.ffn_{x}.weight": f"backbone.layers.{{n}}.mixer.{x}_proj.weight" for x in ("up", "down")},
}
# Falcon-H1's (``falcon-h1``): Llama's layers, each with a Mamba-2 mixer beside its attention; its muP multipliers
# already folded into the weights by the converter (as the engine's loader folds a checkpoint's: 1 here)
ARCH_TENSORS["falcon-h1"] = _mamba_mixer_tensors("model.layers.{n}.mamba", 2)
# Jamba's (``jamba``): Llama's layers, Mamba's mixer (Mamba 1's ``ssm_*`` with its norms of the step, B and C) where a
# layer does not attend, experts (stacked: ``EXPERT_TENSORS``) where a layer has a router
ARCH_TENSORS["jamba"] = {
    **_mamba_mixer_tensors("model.layers.{n}.mamba", 1),
    **{f"blk.{{n}}.ssm_{x}_norm.weight": f"model.layers.{{n}}.mamba.{x}_layernorm.weight" for x in ("dt", "b", "c")},
    "blk.{n}.ffn_gate_inp.weight": "model.layers.{n}.mlp.gate.weight",
}
ARCH_TENSORS["nemotron_h_moe"] = {  # (Nemotron 3's: blocks of experts beside a shared one, their router's bias)
    **ARCH_TENSORS["nemotron_h"],
    "blk.{n}.ffn_gate_inp.weight": "backbone.layers.{n}.mixer.gate.weight",
    "blk.{n}.exp_probs_b.bias": "backbone.layers.{n}.mixer.gate.e_score_correction_bias",
    **{
        f"blk.{{n}}.ffn_{x}_shexp.weight": f"backbone.layers.{{n}}.mixer.shared_experts.{x}_proj.weight"
        for x in ("up", "down")
    },
}
# Qwen3.5's (``qwen35``: the dense 0.8B-27B): Qwen3's attention (its Q rows twice as many: each head's gate),
# gated DeltaNets (``linear_attn``) in the other layers, the second norm named ``post_attention_norm``
ARCH_TENSORS["qwen35"] = {
    **ARCH_TENSORS["qwen3"],
    "blk.{n}.post_attention_norm.weight": "model.layers.{n}.post_attention_layernorm.weight",
    **{
        f"blk.{{n}}.{ours}": f"model.layers.{{n}}.linear_attn.{theirs}"
        for ours, theirs in (
            ("attn_qkv.weight", "in_proj_qkv.weight"),
            ("attn_gate.weight", "in_proj_z.weight"),
            ("ssm_alpha.weight", "in_proj_a.weight"),
            ("ssm_beta.weight", "in_proj_b.weight"),
            ("ssm_a", "A_log"),
            ("ssm_dt.bias", "dt_bias"),
            ("ssm_conv1d.weight", "conv1d.weight"),
            ("ssm_norm.weight", "norm.weight"),
            ("ssm_out.weight", "out_proj.weight"),
        )
    },
}
# Qwen3.5's MoE (``qwen35moe``: 35B-A3B-397B-A17B): Qwen3.5's layers, experts in every one (stacked:
# ``EXPERT_TENSORS``; the converter splits the checkpoint's gate_up_proj) beside a shared expert and its gate
ARCH_TENSORS["qwen35moe"] = {
    **ARCH_TENSORS["qwen35"],
    "blk.{n}.ffn_gate_inp.weight": "model.layers.{n}.mlp.gate.weight",
    **{
        f"blk.{{n}}.ffn_{x}_shexp.weight": f"model.layers.{{n}}.mlp.shared_expert.{x}_proj.weight"
        for x in ("gate", "up", "down")
    },
    "blk.{n}.ffn_gate_inp_shexp.weight": "model.layers.{n}.mlp.shared_expert_gate.weight",
}
# Qwen3-Next's (``qwen3next``: 80B-A3B): the same, but for its DeltaNets' projections, its checkpoints' grouped by key
# head (each head's q, k, value heads' v, z: ``in_proj_qkvz``; b, a: ``in_proj_ba``). The converter writes q, k and v
# of all heads as ``attn_qkv`` and z as ``attn_gate`` (joined and grouped back: ``_qwen3next_grouped_qkvz``), b and a
# as they were (``ssm_ba``), and reorders no value heads
ARCH_TENSORS["qwen3next"] = {
    **{k: v for k, v in ARCH_TENSORS["qwen35moe"].items() if ".linear_attn.in_proj" not in v},
    "blk.{n}.ssm_ba.weight": "model.layers.{n}.linear_attn.in_proj_ba.weight",
}
QWEN35_ARCHS = ("qwen35", "qwen35moe", "qwen3next")
# Qwen3.5's tensors whose value heads the converter reorders (``_qwen35_value_heads_grouped``)
QWEN35_VALUE_HEAD_TENSORS = ("attn_qkv", "attn_gate", "ssm_alpha", "ssm_beta", "ssm_a", "ssm_dt", "ssm_conv1d",
                             "ssm_out")  # fmt: skip
# The architectures of Mamba-2 mixers (their tensors' shapes: ``MAMBA2_RESHAPED``)
MAMBA2_ARCHS = ("mamba2", "granitehybrid", "nemotron_h", "nemotron_h_moe", "falcon-h1")
# Tensors the converter splits that a checkpoint holds as one: GGUF name -> (HF name, the part's place in it). Granite
# 4.0-H's shared MLP (with experts ``*_shexp``, without them Llama's names): its gate rows, then its up rows, in
# ``shared_mlp.input_linear`` (the engine's ``gate_up_proj``, loaded whole: ``FUSED_CHECKPOINTS``)
JOINED_TENSORS = {
    "granitehybrid": {
        f"blk.{{n}}.ffn_{part}{suffix}.weight": ("model.layers.{n}.shared_mlp.input_linear.weight", place)
        for place, part in enumerate(("gate", "up"))
        for suffix in ("", "_shexp")
    },
    "qwen3next": {
        f"blk.{{n}}.attn_{part}.weight": ("model.layers.{n}.linear_attn.in_proj_qkvz.weight", place)
        for place, part in enumerate(("qkv", "gate"))
    },
}
# Mamba-2's tensors the converter writes in a shape of its own (A and D as (heads, 1); the norm by group): flattened
MAMBA2_RESHAPED = ("ssm_a", "ssm_d", "ssm_norm.weight")
ARCH_TENSORS["gemma3"] = {
    **ARCH_TENSORS["gemma2"],
    "blk.{n}.attn_q_norm.weight": "model.layers.{n}.self_attn.q_norm.weight",
    "blk.{n}.attn_k_norm.weight": "model.layers.{n}.self_attn.k_norm.weight",
}
# A mixture of experts' stacked tensors ((E, I, H) gate and up, (E, H, I) down), by the per-expert
# tensors of an HF checkpoint they split into (``mlp.experts.{e}.gate_proj.weight``...)
EXPERT_TENSORS = {"ffn_gate_exps": "gate_proj", "ffn_up_exps": "up_proj", "ffn_down_exps": "down_proj"}
# ... or gate and up as one (E, 2 I, H), the gate's rows first (as llama.cpp's SwiGLU halves it; Qwen3.5-MoE's and
# Qwen3-Next's files may hold them so, as their checkpoints' gate_up_proj)
FUSED_EXPERTS = "ffn_gate_up_exps"
# The architectures whose Q and K rows llama.cpp's converter permutes (its Llama converter's)
PERMUTED = ("llama", "smollm3", "granite", "granitehybrid", "nemotron_h", "nemotron_h_moe")
# The architectures whose norms llama.cpp's converter stores as 1 + weight (Gemma's and Qwen3.5's RMSNorms scale by
# 1 + weight; llama.cpp's by the weight). NOTE: not Qwen3.5's DeltaNets' gated norm (``ssm_norm``), which scales by
# its weight
SHIFTED_NORMS = ("gemma", "gemma2", "gemma3", *QWEN35_ARCHS)
# Llama 3.1's rope scaling, as llama.cpp's converter stores it: per frequency, the factor its wavelength
# is stretched by (1 for the short ones, the scaling factor for the long ones, a ramp between)
ROPE_FREQS = "rope_freqs.weight"
# LongRoPE's factors per frequency (Phi-3.5, Phi-4 mini): HF's name -> the GGUF tensor's
LONGROPE_FACTORS = {"short_factor": "rope_factors_short.weight", "long_factor": "rope_factors_long.weight"}
