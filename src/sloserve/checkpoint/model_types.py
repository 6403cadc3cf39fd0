"""The HF model types the engine reads (``ARCHITECTURES``, ``MULTIMODAL``) and what each one's config.json
may leave out: transformers' defaults by model type, the names some configs give the common settings, and
the groups of model types that share a trait (QK norms, biases, two-matrix MLPs, Mamba mixers). Tables
only; ``config.from_hf_config`` reads a config with them."""

from __future__ import annotations

# HF ``model_type`` -> our architecture (the module that implements it).
ARCHITECTURES: dict[str, str] = {
    "llama": "llama",
    "iquestcoder": "llama",  # (IQuest-Coder-V1 40B: Llama's)
    "internlm3": "llama",  # (InternLM3-8B: Llama's, biases where qkv_bias and bias say)
    "exaone": "exaone",  # (EXAONE 3.0 and 3.5, 2.4B-32B: Llama's layers under GPT-2's names on the Hub)
    "helium": "llama",  # (Helium 1 2B: Llama's layers, every head rotated by adjacent pairs)
    "mistral": "llama",
    "ministral": "llama",  # (Ministral 8B: Mistral's layers, each sliding or full as layer_types says)
    # (Ministral 3: Mistral's layers, queries past the pretrained context scaled up, as Llama 4's)
    "ministral3": "llama",
    "qwen2": "llama",
    "qwen3": "llama",
    "qwen3_moe": "llama",  # (Qwen3's layers, their MLPs sparse mixtures of experts: ``engine/models/moe.py``)
    "qwen2_moe": "llama",  # (Qwen2's layers, their MLPs mixtures of experts beside a gated shared expert)
    # (gpt-oss: Llama's layers with attention sinks, every other one sliding; its experts' clamped SwiGLU)
    "gpt_oss": "llama",
    "mixtral": "llama",  # (Mistral's layers, their MLPs mixtures of experts)
    # (Phi-3.5-MoE: Llama's layers with LayerNorms and biases, Mixtral's experts routed by SparseMixer)
    "phimoe": "phimoe",
    "phi3": "llama",  # (Phi-3, Phi-4: Llama's layers, their Q/K/V and gate/up stored fused)
    "smollm3": "llama",  # (Llama's layers, every fourth without a rotary embedding)
    "granite": "llama",  # (Llama's layers, scaled: ModelConfig's multipliers)
    # (HyperCLOVA X SEED: Granite's scaled layers, each part's output normalized before it joins the stream)
    "hyperclovax": "hyperclovax",
    # (Granite's layers, most sliding, each head with gpt-oss's attention sink, a rope base a layer or none)
    "granite_swa": "llama",
    "granitemoe": "llama",  # (Granite 3 MoE: Granite's layers, their MLPs mixtures of experts)
    # (Granite 4.0: Granite's layers, NoPE where it says, a shared MLP (beside any experts); Micro's all attention,
    # the 4.0-H models' mostly Mamba-2 mixers)
    "granitemoehybrid": "granitemoehybrid",
    # (Granite MoE Shared: Granite MoE's layers, an ungated shared MLP beside the experts; Granite Swash (MoE SWA,
    # 3B-A600M): those with Granite SWA's attention, most layers sliding, each head a sink)
    "granitemoeshared": "granitemoehybrid",
    "granitemoe_swa": "granitemoehybrid",
    # (Bamba 9B: Llama's layers, Mamba-2 mixers in most of them, half of each attention head rotated)
    "bamba": "bamba",
    # (Jamba 1.5, 1.7 Mini and Large: Llama's layers, Mamba's selective state spaces in seven of eight, attention
    # without rope in the eighth; every other MLP Mixtral's experts)
    "jamba": "jamba",
    # (Nemotron-H, Nemotron Nano 2: blocks of one mixer each, Mamba-2, attention without rope or a squared-ReLU MLP)
    "nemotron_h": "nemotron_h",
    # (Mamba 130M-2.8B, Falcon Mamba 7B (its step, B and C normalized), Mamba-2 130M-2.7B, Mamba-Codestral 7B: no
    # attention; Nemotron-H's blocks, every one a Mamba mixer)
    "mamba": "mamba",
    "falcon_mamba": "mamba",
    "mamba2": "mamba",
    # (Falcon-H1 0.5B-34B: Llama's layers with a Mamba-2 mixer beside each attention, muP multipliers)
    "falcon_h1": "falcon_h1",
    # (LFM2 350M-2.6B: Llama's layers, most mixing by a gated short convolution instead of attention, Qwen3's
    # query and key norms in the others)
    "lfm2": "lfm2",
    "lfm2_moe": "lfm2",  # (LFM2-8B-A1B: those layers, the MLPs after the first few sigmoid-routed experts)
    # (LFM3: LFM2's layers, some attention sliding, each layer's outputs normalized, each head's output gated)
    "lfm3": "lfm3",
    # (Qwen3-Next 80B-A3B: three layers of four mixing by gated DeltaNet, a linear attention of the delta rule
    # (``ModelConfig.gated_delta_net``), the fourth by attention with its output gated; norms of 1 + weight; experts
    # beside a gated shared one)
    "qwen3_next": "qwen3_next",
    "qwen3_5_text": "qwen3_next",  # (Qwen3.5 0.8B-27B's language models: those layers with dense MLPs)
    "qwen3_5_moe_text": "qwen3_next",  # (Qwen3.5 35B-A3B-397B-A17B's: those layers, experts in every one)
    # (OLMo Hybrid 7B: OLMo 3's attention layers, one of four, without rope as released; gated DeltaNets in the others,
    # in Llama's order)
    "olmo_hybrid": "olmo_hybrid",
    # (Kimi Linear 48B-A3B: DeepSeek-V3's outline, its attention (MLA) without rope in one layer of four, Kimi Delta
    # Attention in the others: a gated DeltaNet with a decay a key channel)
    "kimi_linear": "kimi_linear",
    # (Hunyuan 0.5B-7B: Llama's layers, each query and key head normalized after the rotary embedding)
    "hunyuan_v1_dense": "hunyuan",
    # (Hunyuan-A13B: those layers, each MLP a softmax-routed mixture of experts beside an ungated shared one)
    "hunyuan_v1_moe": "hunyuan",
    "gemma3_text": "gemma3",
    "gemma": "gemma",  # (Gemma 1, CodeGemma: Llama's layers with Gemma's norms, GeGLU MLP and scaled embeddings)
    "gemma2": "gemma3",  # (Gemma 3's layers without query/key norms, with capped scores)
    "vaultgemma": "gemma3",  # (VaultGemma 1B: Gemma 2's layers without the norms of each part's output)
    "olmo2": "olmo2",
    "olmo3": "olmo2",  # (OLMo 2's layers, three of four sliding, the others' rope scaled)
    "olmoe": "llama",  # (Llama's layers, OLMo 2's query and key norms, Qwen3-MoE's experts)
    "flex_olmo": "olmo2",  # (FlexOlmo 7x7B: OLMo 2's layers, their MLPs OLMoE's experts)
    "seed_oss": "llama",  # (Seed-OSS-36B: Llama's layers with biases)
    "ernie4_5": "llama",  # (ERNIE 4.5's dense models: Llama's layers, every head rotated by adjacent pairs)
    # (ERNIE 4.5's MoE models: those layers with experts chosen by softmax scores plus a bias, beside shared ones)
    "ernie4_5_moe": "ernie4_5_moe",
    # (EXAONE 4: OLMo 2's layers with Qwen3's query and key norms; three of four sliding, the others unrotated)
    "exaone4": "olmo2",
    # (K-EXAONE 236B-A23B: EXAONE 4's attention in Llama's layers (norms before each part), DeepSeek-V3's experts
    # beside a shared one after a dense first MLP; its multi-token prediction (``mtp.``) not read)
    "exaone_moe": "exaone_moe",
    "glm": "llama",  # (GLM-4 of 2024: Llama's layers, half of each head rotated by adjacent pairs)
    "glm4": "glm4",  # (GLM-4-0414: those layers with a norm after attention and after the MLP too)
    "gpt_neox": "gpt_neox",  # (Pythia, GPT-NeoX-20B: LayerNorms, a GELU MLP, attention and MLP in parallel)
    "cohere": "cohere",  # (Command R: attention and MLP in parallel from one LayerNorm, rope by adjacent pairs)
    "cohere2": "cohere",  # (Command R7B, A: those layers, three of four sliding with rope, the fourth without)
    # (Command A+: those layers, their MLPs experts after dense ones, beside a shared MLP; its norms RMSNorms or not)
    "cohere2_moe": "cohere",
    "opt": "opt",
    "gpt2": "gpt2",  # (GPT-2: learned positions, LayerNorms, a GELU MLP, Conv1D weights stored (in, out))
    # (Falcon 7B, 40B, 180B, Falcon 2 11B: LayerNorms, attention and a GELU MLP in parallel, one or a few KV heads;
    # Falcon-RW 1B, 7B: attention then the MLP, ALiBi)
    "falcon": "falcon",
    # (BLOOM 560M-176B, BLOOMZ: Falcon-RW's layers, a LayerNorm of the embeddings, GELU by tanh's approximation)
    "bloom": "falcon",
    "mpt": "mpt",  # (MPT-7B, 30B: ALiBi, LayerNorms and projections without biases, a GELU MLP)
    # (nanochat: Llama's layers, norms of no weight (the rotated heads' too), a squared-ReLU MLP, capped logits)
    "nanochat": "nanochat",
    # (StarCoder 1, SantaCoder, WizardCoder 15B, SQLCoder: GPT-2's layers, one KV head (multi_query), Linear weights)
    "gpt_bigcode": "gpt2",
    "phi": "phi",  # (Phi-1, 1.5, 2: attention and a GELU MLP in parallel from one LayerNorm, partial rotary)
    # (DeepSeek-V2, V2-Lite: multi-head latent attention, experts beside shared ones)
    "deepseek_v2": "deepseek_v2",
    # (DeepSeek-V3's outline, Moonlight, Kimi K2: V2's layers, experts chosen by sigmoid scores with a bias)
    "deepseek_v3": "deepseek_v2",
    # (Mistral Small 4: DeepSeek-V3's outline, its experts chosen by softmax scores, queries scaled by Llama 4's rule)
    "mistral4": "deepseek_v2",
    # (GLM-4.7-Flash: DeepSeek-V3's attention (MLA) with GLM-4.5's experts, dense or sparse as mlp_layer_types says)
    "glm4_moe_lite": "deepseek_v2",
    "youtu": "deepseek_v2",  # (Youtu-LLM 2B: DeepSeek-V3's attention (MLA) with a dense MLP in every layer)
    # (MiniCPM3 4B: DeepSeek-V2's attention (MLA, rope by halves) with dense MLPs, its embeddings, outputs and logits
    # scaled: Granite's multipliers)
    "minicpm3": "deepseek_v2",
    # (MiniMax-M2: Llama's layers, queries and keys normalized over their whole projections, half of each head
    # rotated, every MLP experts chosen by sigmoid scores plus a bias)
    "minimax_m2": "minimax_m2",
    # (GLM-4.5, 4.6, 4.5-Air: Llama's layers, half of each head rotated, DeepSeek-V3's experts beside a shared one)
    "glm4_moe": "glm4_moe",
    # (dots.llm1 142B-A14B: Qwen3's attention, DeepSeek-V3's experts beside shared ones after dense first MLPs; layers
    # from max_window_layers on sliding)
    "dots1": "glm4_moe",
    # (Solar Open 100B: Llama's attention, every MLP GLM-4.5's experts beside a shared one)
    "solar_open": "glm4_moe",
    # (Sarvam-30B, 105B: GLM-4.5's layers, whole heads rotated, query and key norms; the Hub's names of its own)
    "sarvam_moe": "sarvam_moe",
    # (Hunyuan 3: Llama's layers with Qwen3's query and key norms, a dense first MLP, then experts chosen by sigmoid
    # scores plus a bias beside a shared one; its multi-token-prediction layer not read)
    "hy_v3": "hy_v3",
    # (Arcee's Trinity: a norm before and after attention and the MLP, three layers of four sliding and rotated, the
    # fourth global without rope, each head's output gated, DeepSeek-V3's routing beside shared experts)
    "afmoe": "afmoe",
    "stablelm": "stablelm",  # (StableLM 2 1.6B, 3B: Llama's layers with LayerNorms, a quarter of each head rotated)
    "olmo": "olmo",  # (OLMo 1: Llama's layers with LayerNorms of no weight, clip_qkv)
    "nemotron": "nemotron",  # (Minitron: LayerNorms of 1 + weight, a squared-ReLU MLP of two matrices, half rotated)
    "arcee": "arcee",  # (AFM-4.5B: Llama's layers with a squared-ReLU MLP of two matrices)
    "jais2": "jais2",  # (Jais 2: Arcee's layers with LayerNorms and biases)
    # (CWM 32B: Llama's layers, three of four sliding, the first of each four full)
    "cwm": "llama",
    "starcoder2": "starcoder2",  # (StarCoder2: Llama's layers with LayerNorms, a GELU MLP, biases, a window)
    # (Llama 4 Scout 17B-16E, Maverick 17B-128E: Llama's layers, three of four rotated by adjacent pairs and seeing
    # only their chunk of 8,192 positions, the fourth unrotated and seeing all; experts fed tokens scaled by their
    # router's sigmoid, beside a shared one)
    "llama4_text": "llama4",
    "apertus": "apertus",  # (Apertus 8B, 70B: Llama's layers with query/key norms, a two-matrix xIELU MLP)
}
# Multimodal checkpoints served as text: their config.json's text_config is the language model's
# (Gemma 3 4B-27B: Gemma3ForConditionalGeneration; its vision tower is not read, ``LANGUAGE_MODEL_PREFIXES``)
MULTIMODAL = {
    "gemma3": "gemma3_text",
    "mistral3": "mistral",  # (Mistral Small 3.1, 3.2)
    "qwen2_vl": "qwen2_vl_text",
    "qwen2_5_vl": "qwen2_5_vl_text",
    "qwen3_vl": "qwen3_vl_text",
    "qwen3_vl_moe": "qwen3_vl_moe_text",
    "lfm2_vl": "lfm2",  # (LFM2-VL 450M-3B)
    "lfm3_vl": "lfm3",
    "exaone4_5": "exaone4",  # (EXAONE 4.5: EXAONE 4's layers beside a vision tower)
    # (Qwen3.5: Qwen3-Next's layers; their interleaved MRoPE gives a text token one position in every section,
    # which is plain RoPE, as for Qwen3-VL's)
    "qwen3_5": "qwen3_5_text",
    "qwen3_5_moe": "qwen3_5_moe_text",
    # (GLM-4.1V 9B: GLM-4-0414's layers; GLM-4.5V and 4.6V: GLM-4.5's MoE layers; their MRoPE plain RoPE on text)
    "glm4v": "glm4v_text",
    "glm4v_moe": "glm4v_moe_text",
    "glm46v": "glm4v_text",
    "llama4": "llama4_text",  # (Llama 4 Scout, Maverick: Llama4ForConditionalGeneration)
}
# Those whose Hub configs hold the language model's settings at the top level, beside vision_config (Qwen2-VL's
# and Qwen2.5-VL's; transformers 5 saves them in a text_config)
FLAT_MULTIMODAL = ("qwen2_vl", "qwen2_5_vl")
# The language models of those that are another architecture's, and transformers' defaults of theirs that differ:
# Qwen3-VL's is Qwen3's layers, and its interleaved MRoPE gives a text token the same position in each of its
# sections (temporal, height, width), which is Qwen3's RoPE (as vLLM serves a prompt without images); Qwen3-VL-MoE's
# is Qwen3-MoE's, its top weights always renormalized; Qwen2-VL's and Qwen2.5-VL's are Qwen2's, their MRoPE (its
# sections side by side) likewise Qwen2's RoPE on text
TEXT_MODEL_TYPES = {
    "qwen2_vl_text": ("qwen2", {"rope_theta": 1_000_000.0, "rms_norm_eps": 1e-5}),
    "qwen2_5_vl_text": ("qwen2", {"rope_theta": 1_000_000.0, "rms_norm_eps": 1e-5}),
    "qwen3_vl_text": ("qwen3", {"rope_theta": 500_000.0}),
    "qwen3_vl_moe_text": ("qwen3_moe", {"rope_theta": 500_000.0, "norm_topk_prob": True}),
    "exaone4_5_text": ("exaone4", {}),  # (the Hub's name of EXAONE 4.5's; transformers reads it as exaone4)
    # (GLM-4.1V's: its rope turns whole heads where its settings do not say, its q/k/v biases always there)
    "glm4v_text": ("glm4", {"rms_norm_eps": 1e-5, "partial_rotary_factor": 1.0}),
    "glm4v_moe_text": ("glm4_moe", {"attention_bias": True}),  # (GLM-4.5V's, 4.6V's: q/k/v biases by default)
}
# transformers' Gemma3TextConfig defaults: a Gemma 3 text_config lists only what differs from them
GEMMA3_TEXT_DEFAULTS = {
    "vocab_size": 262_208, "hidden_size": 2304, "intermediate_size": 9216, "num_hidden_layers": 26,
    "num_attention_heads": 8, "num_key_value_heads": 4, "head_dim": 256, "max_position_embeddings": 131_072,
    "rms_norm_eps": 1e-6, "bos_token_id": 2, "eos_token_id": 1,
}  # fmt: skip
# transformers' Gemma2Config defaults (Gemma 2 2B's shape; every other layer global, scores capped at 50,
# logits at 30)
GEMMA2_DEFAULTS = {
    **GEMMA3_TEXT_DEFAULTS, "vocab_size": 256_000, "max_position_embeddings": 8192, "sliding_window_pattern": 2,
    "attn_logit_softcapping": 50.0, "final_logit_softcapping": 30.0,
}  # fmt: skip
# DeepSeek-V2's MLA sizes, transformers' defaults (V2's; V2-Lite's config says q_lora_rank null)
DEEPSEEK_MLA_DEFAULTS = {
    "q_lora_rank": 1536,
    "kv_lora_rank": 512,
    "qk_nope_head_dim": 128,
    "qk_rope_head_dim": 64,
    "v_head_dim": 128,
}
# The mixtures of experts, and transformers' defaults for what their configs may leave out
MOE_DEFAULTS = {
    "qwen3_moe": {"num_experts": 128, "num_experts_per_tok": 8, "moe_intermediate_size": 768},
    "qwen2_moe": {"num_experts": 60, "num_experts_per_tok": 4, "moe_intermediate_size": 1408},
    "mixtral": {"num_experts": 8, "num_experts_per_tok": 2, "moe_intermediate_size": None},  # (intermediate_size)
    "gpt_oss": {"num_experts": 128, "num_experts_per_tok": 4, "moe_intermediate_size": None},  # (intermediate_size)
    "olmoe": {"num_experts": 64, "num_experts_per_tok": 8, "moe_intermediate_size": None},  # (intermediate_size)
    "flex_olmo": {"num_experts": 7, "num_experts_per_tok": 5, "moe_intermediate_size": None},  # (intermediate_size)
    "granitemoe": {"num_experts": 8, "num_experts_per_tok": 2, "moe_intermediate_size": None},  # (intermediate_size)
    "granitemoehybrid": {"num_experts": 8, "num_experts_per_tok": 2, "moe_intermediate_size": None},  # (likewise)
    "granitemoeshared": {"num_experts": 8, "num_experts_per_tok": 2, "moe_intermediate_size": None},  # (likewise)
    "granitemoe_swa": {"num_experts": 8, "num_experts_per_tok": 2, "moe_intermediate_size": None},  # (likewise)
    "deepseek_v2": {"num_experts": 64, "num_experts_per_tok": None, "moe_intermediate_size": 1407},
    "deepseek_v3": {"num_experts": 256, "num_experts_per_tok": 8, "moe_intermediate_size": 2048},
    "glm4_moe": {"num_experts": 128, "num_experts_per_tok": 8, "moe_intermediate_size": 1408},
    "dots1": {"num_experts": None, "num_experts_per_tok": None, "moe_intermediate_size": 1408},
    "solar_open": {"num_experts": 128, "num_experts_per_tok": 8, "moe_intermediate_size": 1280},
    "sarvam_moe": {"num_experts": 128, "num_experts_per_tok": 6, "moe_intermediate_size": 1024},
    "hy_v3": {"num_experts": 192, "num_experts_per_tok": 8, "moe_intermediate_size": 1536},
    "afmoe": {"num_experts": 64, "num_experts_per_tok": 6, "moe_intermediate_size": 1408},
    "ernie4_5_moe": {"num_experts": 64, "num_experts_per_tok": 6, "moe_intermediate_size": 1536},
    # (Hunyuan's experts: of intermediate_size)
    "hunyuan_v1_moe": {"num_experts": 1, "num_experts_per_tok": 1, "moe_intermediate_size": None},
    "lfm2_moe": {"num_experts": 32, "num_experts_per_tok": 4, "moe_intermediate_size": 1792},
    "mistral4": {"num_experts": 128, "num_experts_per_tok": 4, "moe_intermediate_size": 2048},
    "glm4_moe_lite": {"num_experts": 64, "num_experts_per_tok": 4, "moe_intermediate_size": 1536},
    "minimax_m2": {"num_experts": 256, "num_experts_per_tok": 8, "moe_intermediate_size": None},  # (intermediate_size)
    "kimi_linear": {"num_experts": 256, "num_experts_per_tok": 8, "moe_intermediate_size": 1024},
    "exaone_moe": {"num_experts": 64, "num_experts_per_tok": 8, "moe_intermediate_size": 1024},
    "qwen3_next": {"num_experts": 512, "num_experts_per_tok": 10, "moe_intermediate_size": 512},
    "qwen3_5_moe_text": {"num_experts": 256, "num_experts_per_tok": 8, "moe_intermediate_size": 512},
    "llama4_text": {"num_experts": 16, "num_experts_per_tok": 1, "moe_intermediate_size": None},  # (intermediate_size)
    "phimoe": {"num_experts": 16, "num_experts_per_tok": 2, "moe_intermediate_size": None},  # (intermediate_size)
    "jamba": {"num_experts": 16, "num_experts_per_tok": 2, "moe_intermediate_size": None},  # (intermediate_size)
    "cohere2_moe": {"num_experts": 8, "num_experts_per_tok": 2, "moe_intermediate_size": None},  # (likewise)
}
# The mixtures of experts beside a shared expert gated by a sigmoid of the token (Qwen2-MoE's), and transformers'
# default size of that expert
GATED_SHARED_EXPERTS = {"qwen2_moe": 5632, "qwen3_next": 512, "qwen3_5_moe_text": 512}
# The models of multi-head latent attention
DEEPSEEK_TYPES = ("deepseek_v2", "deepseek_v3", "mistral4", "glm4_moe_lite", "kimi_linear", "youtu", "minicpm3")
# transformers' GraniteMoeHybridConfig defaults of its Mamba-2 mixers (``mamba_*`` in a config), and FalconH1Config's
MAMBA2_DEFAULTS = {
    "n_heads": 128, "n_groups": 1, "d_state": 256, "d_head": "auto", "d_conv": 4, "expand": 2, "chunk_size": 256,
    "conv_bias": True, "proj_bias": False,
}  # fmt: skip
FALCON_H1_MAMBA_DEFAULTS = {**MAMBA2_DEFAULTS, "d_ssm": 1024, "rms_norm": False, "norm_before_gate": True}
# transformers' defaults of their routing where it differs by version: (n_shared_experts, routed_scaling_factor,
# topk_method, n_group, topk_group, norm_topk_prob, first_k_dense_replace)
DEEPSEEK_ROUTING_DEFAULTS = {
    "deepseek_v2": {"n_shared_experts": 2, "routed_scaling_factor": 1.0, "topk_method": "greedy", "n_group": None,
                    "topk_group": None, "norm_topk_prob": False, "first_k_dense_replace": 0},
    "deepseek_v3": {"n_shared_experts": 1, "routed_scaling_factor": 2.5, "topk_method": "noaux_tc", "n_group": 8,
                    "topk_group": 4, "norm_topk_prob": True, "first_k_dense_replace": 3},
    "solar_open": {"n_shared_experts": 1, "routed_scaling_factor": 1.0, "topk_method": "noaux_tc", "n_group": 1,
                   "topk_group": 1, "norm_topk_prob": True, "first_k_dense_replace": 0},
    "afmoe": {"n_shared_experts": 2, "routed_scaling_factor": 1.0, "topk_method": "noaux_tc", "n_group": 1,
              "topk_group": 1, "norm_topk_prob": True, "first_k_dense_replace": 1},
    "hy_v3": {"n_shared_experts": 1, "routed_scaling_factor": 2.826, "topk_method": "noaux_tc", "n_group": 1,
              "topk_group": 1, "norm_topk_prob": True, "first_k_dense_replace": 1},
    "sarvam_moe": {"n_shared_experts": 1, "routed_scaling_factor": 2.5, "topk_method": "noaux_tc", "n_group": 1,
                   "topk_group": 1, "norm_topk_prob": True, "first_k_dense_replace": 1},
    "dots1": {"n_shared_experts": None, "routed_scaling_factor": 1.0, "topk_method": "noaux_tc", "n_group": 1,
              "topk_group": 1, "norm_topk_prob": False, "first_k_dense_replace": 0},
    "glm4_moe": {"n_shared_experts": 1, "routed_scaling_factor": 1.0, "topk_method": "noaux_tc", "n_group": 1,
                 "topk_group": 1, "norm_topk_prob": True, "first_k_dense_replace": 1},
    "ernie4_5_moe": {"n_shared_experts": 2, "routed_scaling_factor": 1.0, "topk_method": "softmax_with_bias",
                     "n_group": None, "topk_group": None, "norm_topk_prob": True},
    "hunyuan_v1_moe": {"n_shared_experts": 1, "routed_scaling_factor": 1.0, "topk_method": "greedy", "n_group": None,
                       "topk_group": None, "norm_topk_prob": True, "first_k_dense_replace": 0},
    # (LFM2-MoE's: DeepSeek-V3's sigmoid scores with a bias, one group, no shared expert, 1e-6 in the renormalization)
    "lfm2_moe": {"n_shared_experts": 0, "routed_scaling_factor": 1.0, "topk_method": "noaux_tc", "n_group": 1,
                 "topk_group": 1, "norm_topk_prob": True, "first_k_dense_replace": 2, "norm_topk_eps": 1e-6},
    "mistral4": {"n_shared_experts": 1, "routed_scaling_factor": 1.0, "topk_method": "softmax_top2_groups",
                 "n_group": 1, "topk_group": 1, "norm_topk_prob": True, "first_k_dense_replace": 0},
    "kimi_linear": {"n_shared_experts": 1, "routed_scaling_factor": 2.446, "topk_method": "noaux_tc", "n_group": 1,
                    "topk_group": 1, "norm_topk_prob": True, "first_k_dense_replace": 1},
    "exaone_moe": {"n_shared_experts": 1, "routed_scaling_factor": 2.5, "topk_method": "noaux_tc", "n_group": 1,
                   "topk_group": 1, "norm_topk_prob": True, "first_k_dense_replace": 1},
    "glm4_moe_lite": {"n_shared_experts": 1, "routed_scaling_factor": 1.8, "topk_method": "noaux_tc", "n_group": 1,
                      "topk_group": 1, "norm_topk_prob": True, "first_k_dense_replace": 1},
    # (MiniMax-M2's: V3's sigmoid scores with a bias, one group, no shared expert, the top weights' sum alone)
    "minimax_m2": {"n_shared_experts": 0, "routed_scaling_factor": 1.0, "topk_method": "noaux_tc", "n_group": 1,
                   "topk_group": 1, "norm_topk_prob": True, "first_k_dense_replace": 0, "norm_topk_eps": 0.0},
}  # fmt: skip
# ERNIE 4.5's and Hunyuan's names of those settings (transformers' attribute_maps' and their own)
MOE_SETTING_NAMES = {
    "ernie4_5_moe": {"moe_num_experts": "n_routed_experts", "moe_k": "num_experts_per_tok",
                     "moe_num_shared_experts": "n_shared_experts"},
    "hunyuan_v1_moe": {"num_experts": "n_routed_experts", "moe_topk": "num_experts_per_tok"},
    "lfm2_moe": {"num_experts": "n_routed_experts", "num_dense_layers": "first_k_dense_replace"},
    "minimax_m2": {"num_local_experts": "n_routed_experts"},
    "exaone_moe": {"num_experts": "n_routed_experts", "num_shared_experts": "n_shared_experts"},
    "sarvam_moe": {"num_experts": "n_routed_experts", "num_local_experts": "n_routed_experts",
                   "num_shared_experts": "n_shared_experts"},
    "afmoe": {"num_experts": "n_routed_experts", "num_shared_experts": "n_shared_experts",
              "route_scale": "routed_scaling_factor", "num_dense_layers": "first_k_dense_replace"},
    "hy_v3": {"num_experts": "n_routed_experts", "num_local_experts": "n_routed_experts",
              "num_shared_experts": "n_shared_experts", "router_scaling_factor": "routed_scaling_factor"},
}  # fmt: skip
# The mixtures of experts routed as DeepSeek's
DEEPSEEK_ROUTED = tuple(DEEPSEEK_ROUTING_DEFAULTS)
# Each one's routings (``moe.DeepseekMoE``): V3's and GLM-4.5's sigmoid scores with a bias (the Hub's configs say
# noaux_tc), ERNIE 4.5's softmax scores with a bias
ROUTING_METHODS = {
    "deepseek_v2": ("greedy", "group_limited_greedy"),
    "deepseek_v3": ("noaux_tc",),
    "glm4_moe": ("noaux_tc",),
    "dots1": ("noaux_tc",),
    "solar_open": ("noaux_tc",),
    "sarvam_moe": ("noaux_tc",),
    "hy_v3": ("noaux_tc",),
    "afmoe": ("noaux_tc",),
    "ernie4_5_moe": ("softmax_with_bias",),
    "hunyuan_v1_moe": ("greedy",),
    "lfm2_moe": ("noaux_tc",),
    # (softmax scores; the groups by their two best scores, V3's rule without its bias)
    "mistral4": ("softmax_top2_groups",),
    "glm4_moe_lite": ("noaux_tc",),
    "minimax_m2": ("noaux_tc",),
    "kimi_linear": ("noaux_tc",),
    "exaone_moe": ("noaux_tc",),
}
# The routings whose choice adds the router's bias (``e_score_correction_bias``) to the scores: DeepSeek-V3's
# (sigmoid scores) and ERNIE 4.5's (softmax scores)
BIASED_ROUTINGS = ("noaux_tc", "softmax_with_bias")
MOE_TYPES = tuple(MOE_DEFAULTS)
# The models whose q/k/v projections have biases where their configs do not say (transformers' defaults)
QKV_BIASED = ("qwen2", "gpt_oss", "glm", "glm4", "seed_oss", "phi")
# InternLM3's and EXAONE 3's names of settings (transformers' attribute maps)
SETTING_NAMES = {
    "internlm3": {"qkv_bias": "attention_bias", "bias": "mlp_bias"},
    "sarvam_moe": {"use_qkv_bias": "attention_bias"},
    "exaone": {"num_layers": "num_hidden_layers", "layer_norm_epsilon": "rms_norm_eps",
               "activation_function": "hidden_act"},
    "bloom": {"n_layer": "num_hidden_layers", "n_head": "num_attention_heads", "n_embed": "hidden_size",
              "seq_length": "max_position_embeddings"},
    "mpt": {"n_layers": "num_hidden_layers", "n_heads": "num_attention_heads", "d_model": "hidden_size",
            "max_seq_len": "max_position_embeddings"},
}  # fmt: skip
# The OLMo models (their query and key norms over the whole projections)
OLMO_TYPES = ("olmo2", "olmo3", "olmoe", "olmo_hybrid", "flex_olmo")
# The models whose attention output projection has a bias where the q/k/v projections have them
OUTPUT_BIASED = ("gpt_oss", "exaone4", "exaone_moe", "internlm3", "phimoe", "jais2", "cohere", "cohere2",
                 "cohere2_moe", "phi", "nemotron", "arcee", "falcon_h1", *OLMO_TYPES)  # fmt: skip
# The models whose queries and keys are RMS-normalized (each head: Qwen3's; OLMo's whole projections)
QK_NORMED = ("qwen3", "qwen3_moe", "dots1", "hy_v3", "afmoe", "lfm2", "lfm2_moe", "lfm3", "exaone4", "exaone_moe",
             "hunyuan_v1_dense", "hunyuan_v1_moe", "apertus", "minimax_m2", *OLMO_TYPES)  # fmt: skip
# transformers' rope bases where a config has none
DEFAULT_ROPE_THETA = {
    "gpt_oss": 150_000.0,
    "olmo3": 500_000.0,
    "flex_olmo": 500_000.0,
    "ernie4_5": 500_000.0,
    "ernie4_5_moe": 500_000.0,
    "apertus": 12_000_000.0,
    "lfm2": 1_000_000.0,
    "lfm2_moe": 1_000_000.0,
    "minimax_m2": 5_000_000.0,
    "mixtral": 1_000_000.0,
    "smollm3": 2_000_000.0,
    "cohere": 500_000.0,
    "llama4_text": 500_000.0,
    "exaone": 500_000.0,
    "helium": 100_000.0,
    "phimoe": 1_000_000.0,
    "cwm": 1_000_000.0,
    "solar_open": 1_000_000.0,
    "sarvam_moe": 8_000_000.0,
    "hy_v3": 11_158_840.0,
}
# transformers' rope settings of the models whose default rope is scaled, where a config says nothing of its rope
DEFAULT_ROPE_PARAMETERS = {
    "apertus": {"rope_type": "llama3", "rope_theta": 12_000_000.0, "factor": 8.0,
                "original_max_position_embeddings": 8192, "low_freq_factor": 1.0, "high_freq_factor": 4.0},
    "gpt_oss": {"rope_type": "yarn", "factor": 32.0, "beta_fast": 32.0, "beta_slow": 1.0, "truncate": False,
                "original_max_position_embeddings": 4096, "rope_theta": 150_000.0},
    "ministral3": {"type": "yarn", "rope_type": "yarn", "rope_theta": 1_000_000.0, "factor": 16.0,
                   "original_max_position_embeddings": 16384, "max_position_embeddings": 262144, "beta_fast": 32.0,
                   "beta_slow": 1.0, "mscale_all_dim": 1.0, "mscale": 1.0, "llama_4_scaling_beta": 0.1},
    "cwm": {"rope_type": "llama3", "rope_theta": 1_000_000.0, "factor": 16.0, "high_freq_factor": 4.0,
            "low_freq_factor": 1.0, "original_max_position_embeddings": 8192},
    "mistral4": {"type": "yarn", "rope_type": "yarn", "rope_theta": 10_000.0, "factor": 128.0,
                 "original_max_position_embeddings": 8192, "max_position_embeddings": 1048576,
                 "beta_fast": 32.0, "beta_slow": 1.0, "mscale_all_dim": 1.0, "mscale": 1.0,
                 "llama_4_scaling_beta": 0.1, "partial_rotary_factor": 0.5},
}  # fmt: skip
# transformers' defaults where theirs differ from the generic reading (a head_dim of 128, not hidden / heads; an
# MLP's activation other than SiLU, which a GGUF file does not name)
CONFIG_DEFAULTS = {
    # (GLM-4.7-Flash's latent sizes and norms' epsilon, transformers' Glm4MoeLiteConfig defaults)
    "glm4_moe_lite": {
        "q_lora_rank": 768,
        "kv_lora_rank": 512,
        "qk_nope_head_dim": 192,
        "qk_rope_head_dim": 64,
        "v_head_dim": 256,
        "rms_norm_eps": 1e-5,
    },
    # (Mistral Small 4's latent sizes, transformers' Mistral4Config defaults)
    "mistral4": {
        "q_lora_rank": 1024,
        "kv_lora_rank": 256,
        "qk_nope_head_dim": 64,
        "qk_rope_head_dim": 64,
        "v_head_dim": 128,
    },
    # (Kimi Linear's latent sizes, norms' epsilon and KDA heads, transformers' KimiLinearConfig defaults)
    "kimi_linear": {
        "q_lora_rank": None,
        "kv_lora_rank": 512,
        "qk_nope_head_dim": 128,
        "qk_rope_head_dim": 64,
        "v_head_dim": 128,
        "rms_norm_eps": 1e-5,
        "linear_head_dim": 128,
        "linear_num_heads": 32,
        "linear_conv_kernel_dim": 4,
    },
    # (LFM3's rope by layer type: the sliding layers' plain, the full ones' on half of each head's pairs)
    "lfm3": {
        "rope_parameters": {
            "sliding_attention": {"rope_type": "default", "rope_theta": 10_000.0},
            "full_attention": {"rope_type": "proportional", "rope_theta": 1_000_000.0, "partial_rotary_factor": 0.5},
        },
        "sliding_window": 256,
    },
    "ernie4_5": {"head_dim": 128, "tie_word_embeddings": True},
    "internlm3": {"head_dim": 128},
    "iquestcoder": {"head_dim": 128},
    "helium": {"head_dim": 128},
    "solar_open": {"head_dim": 128},
    "youtu": {"tie_word_embeddings": True},
    # (MiniCPM3's latent sizes and scales, transformers' MiniCPM3Config defaults; its v_head_dim: hidden / heads)
    "minicpm3": {
        "q_lora_rank": 768,
        "kv_lora_rank": 256,
        "qk_nope_head_dim": 64,
        "qk_rope_head_dim": 32,
        "tie_word_embeddings": True,
        "rms_norm_eps": 1e-5,
        "scale_emb": 12,
        "scale_depth": 1.4,
        "dim_model_base": 256,
    },
    "hy_v3": {"head_dim": 128},
    "afmoe": {"head_dim": 128},
    "sarvam_moe": {"head_dim": 64},
    # (Llama 4's: its experts' and shared expert's size, its dense MLPs', its chunks')
    "llama4_text": {
        "head_dim": 128,
        "intermediate_size": 8192,
        "intermediate_size_mlp": 16384,
        "attention_chunk_size": 8192,
    },
    # (transformers' defaults of what a model's own reading would otherwise take from its other sizes)
    "qwen3_next": {"head_dim": 256},
    "qwen3_5_text": {"head_dim": 256},
    "qwen3_5_moe_text": {"head_dim": 256},
    "minimax_m2": {"head_dim": 128},
    "gpt_oss": {"head_dim": 64},
    "granite_swa": {"tie_word_embeddings": True},
    "mistral": {"sliding_window": 4096},  # (Mistral 7B v0.1's window; later Mistrals' configs say null)
    "ministral": {"sliding_window": 4096},
    "smollm3": {"tie_word_embeddings": True},
    "ernie4_5_moe": {"tie_word_embeddings": True},
    "seed_oss": {"head_dim": 128},
    "cohere": {"tie_word_embeddings": True, "logit_scale": 0.0625},
    "cohere2": {"tie_word_embeddings": True, "logit_scale": 0.0625},
    "cohere2_moe": {"tie_word_embeddings": True, "logit_scale": 0.0625},
    "gpt2": {"tie_word_embeddings": True},
    "gpt_bigcode": {"tie_word_embeddings": True},
    "falcon": {"tie_word_embeddings": True},
    # (BLOOM's config has no context length: vLLM's default where a config names none, BLOOM's training context)
    "bloom": {"tie_word_embeddings": True, "max_position_embeddings": 2048},
    "mpt": {"tie_word_embeddings": True, "max_position_embeddings": 2048},
    "nanochat": {"hidden_act": "relu2", "final_logit_softcapping": 15.0},
    "starcoder2": {"tie_word_embeddings": True, "hidden_act": "gelu_pytorch_tanh"},
    "phi": {"hidden_act": "gelu_new"},
    "nemotron": {"hidden_act": "relu2"},
    "arcee": {"hidden_act": "relu2"},
    "jais2": {"hidden_act": "relu2", "head_dim": 128, "attention_bias": True, "mlp_bias": True},
    "cwm": {"head_dim": 128, "sliding_window": 8192},
    "apertus": {"hidden_act": "xielu"},
    "gemma": {"head_dim": 256, "tie_word_embeddings": True, "hidden_act": "gelu_pytorch_tanh"},
}
# transformers' RMSNorm epsilons where a config has none, where they are not 1e-6
RMS_NORM_EPS_DEFAULTS = {
    **dict.fromkeys(("apertus", "arcee", "bamba", "ernie4_5", "ernie4_5_moe", "exaone4", "exaone_moe", "falcon_h1",
                     "glm4_moe", "gpt_oss", "granite_swa", "hunyuan_v1_dense", "hunyuan_v1_moe", "llama4_text",
                     "ministral3", "mixtral", "olmo2", "olmo3", "olmoe", "phi3", "exaone", "internlm3", "iquestcoder",
                     "phimoe", "solar_open", "hy_v3", "afmoe", "cwm"),
                   1e-5),
    "glm": 1.5625e-07, "glm4": 1.5625e-07, "helium": 1e-8,
}  # fmt: skip
# GPT-2's config names for the common ones (transformers' GPT2Config.attribute_map)
GPT2_NAMES = {
    "n_embd": "hidden_size",
    "n_layer": "num_hidden_layers",
    "n_head": "num_attention_heads",
    "n_positions": "max_position_embeddings",
}
# The two-matrix MLPs' activations (GPT-2's ``activation_function``, Phi's ``hidden_act``: transformers'
# names; engine/models/gpt2.py)
GPT2_ACTIVATIONS = ("gelu_new", "gelu_pytorch_tanh", "gelu", "relu")
# The rotated share of a head where a config does not say, by model type (transformers' defaults)
PARTIAL_ROTARY_DEFAULTS = {
    "glm": 0.5, "glm4": 0.5, "glm4_moe": 0.5, "phi": 0.5, "stablelm": 0.25, "nemotron": 0.5, "bamba": 0.5,
    "qwen3_next": 0.25, "qwen3_5_text": 0.25, "qwen3_5_moe_text": 0.25,
}  # fmt: skip
# The models whose rotary embedding may turn part of each head (partial_rotary_factor), as transformers' do:
# those with a default share, and Phi-3's (whole heads unless its config says)
PARTIAL_ROTARY = ("phi3", "minimax_m2", *PARTIAL_ROTARY_DEFAULTS)
# The models with sliding layers by default: (window, every pattern-th layer global), transformers' defaults
SLIDING_PATTERNS = {"gpt_oss": (128, 2), "olmo3": (4096, 4), "exaone4": (4096, 4), "exaone_moe": (4096, 4),
                    "cohere2": (4096, 4)}  # fmt: skip
# The norms (of a weight each) of a layer, by model type or architecture (Llama's: 2)
NORMS_PER_LAYER = {"gemma3": 4, "glm4": 4, "cohere": 1, "phi": 1, "afmoe": 4, "vaultgemma": 2}
# The MLP activations of the models of Llama's outline whose MLP is not SwiGLU (transformers' names)
MLP_ACTIVATIONS = {
    "phi": GPT2_ACTIVATIONS,
    "starcoder2": GPT2_ACTIVATIONS,
    "gemma": ("gelu_pytorch_tanh",),
    "nemotron": ("relu2",),
    "nanochat": ("relu2",),
    "arcee": ("relu2",),
    "jais2": ("relu2",),
    "apertus": ("xielu",),
}
# The models whose MLP is two matrices (up, an activation, down), not a gated three
TWO_MATRIX_MLPS = ("opt", "gpt_neox", "gpt2", "phi", "starcoder2", "nemotron", "arcee", "apertus", "jais2", "nanochat")
# Cohere's models (Command R, R7B and A, A+: a logit scale; rope by adjacent pairs)
COHERE_TYPES = ("cohere", "cohere2", "cohere2_moe")
# The models of Llama's outline whose rotary embedding turns adjacent pairs (GPT-J's layout), not halves
ROTARY_INTERLEAVED = ("glm", "glm4", "ernie4_5", "ernie4_5_moe", *COHERE_TYPES, "llama4_text", "helium")
# The models of Llama's outline whose norms are LayerNorms with biases
LAYER_NORMS = ("phi", "starcoder2", "stablelm", "nemotron", "phimoe", "jais2")
# The models of Llama's outline whose norms have no weights (OLMo 1's)
WEIGHTLESS_NORMS = ("olmo", "nanochat")
GRANITE_SCALED = (
    "granite",
    "granitemoe",
    "granitemoehybrid",
    "granite_swa",
    "granitemoeshared",
    "granitemoe_swa",
    "hyperclovax",
)
# The mixtures of experts beside a shared MLP every token runs, unscaled (Granite's ``shared_mlp``)
UNGATED_SHARED_EXPERTS = ("granitemoehybrid", "granitemoeshared", "granitemoe_swa")
LFM_TYPES = ("lfm2", "lfm2_moe", "lfm3")  # (Liquid AI's models of short convolutions and attention)
MAMBA_TYPES = ("mamba", "falcon_mamba", "mamba2")  # (no attention: every layer a Mamba mixer)
# The context of a model whose config names none (Mamba's: no position embedding ends it), vLLM's default
UNNAMED_CONTEXT_TOKENS = 2048
MAMBA2_SIZES = {"num_heads": 128, "head_dim": 64, "n_groups": 8, "chunk_size": 256}  # (Mamba2Config's defaults)
QWEN3_NEXT_TYPES = ("qwen3_next", "qwen3_5_text", "qwen3_5_moe_text")  # (gated DeltaNet and gated attention)
GATED_DELTA_NET_TYPES = (*QWEN3_NEXT_TYPES, "olmo_hybrid")  # (the models with gated DeltaNet layers)
# OPT's learned position table starts at index 2 (a fairseq leftover, kept by HF).
OPT_POSITION_OFFSET = 2
# Bytes per weight of a checkpoint's torch_dtype (the simulator's weight and KV sizes).
DTYPE_BYTES = {"float32": 4, "float16": 2, "bfloat16": 2}
