"""Each architecture the engine runs against its transformers model: greedy tokens on four schedulers, the
simulator's shape read from its directory, prompt log-probabilities where a feature only moves
probabilities, and the config readings and checkpoint layouts particular to one model. (The engine's own
behaviour, on Llama and a few others: test_engine.py.)"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from hf_models import PROMPTS, greedy_past_eos, greedy_tokens, hf_cached, hf_greedy, reference  # noqa: E402
from sloserve import LLM, SamplingParams  # noqa: E402
from sloserve.checkpoint import model_spec  # noqa: E402
from sloserve.core.errors import ConfigError  # noqa: E402
from sloserve.engine.llm_engine import kv_bytes_per_token  # noqa: E402

# Beside Llama (tests/hf_models.py: each with what sets it apart)
OTHER_ARCHITECTURES = ["qwen2", "qwen3", "gemma3", "opt", "phi3", "smollm3", "gemma2", "qwen3_moe", "mixtral", "granite",
                       "olmo2", "qwen2_moe", "gpt_oss", "olmo3", "olmoe", "glm", "glm4",
                       "ministral3", "exaone4", "seed_oss", "ernie4_5", "gpt_neox", "cohere", "cohere2", "cohere2_moe", "cohere2_moe_sigmoid",
                       "gpt2", "phi", "starcoder2", "gemma", "deepseek_v2", "deepseek_v3", "stablelm", "olmo",
                       "nemotron", "arcee", "granitemoe", "hunyuan", "glm4_moe", "ernie4_5_moe",
                       "apertus", "hunyuan_moe", "granitemoehybrid", "granitemoehybrid_moe", "granite_swa",
                       "mistral4", "glm4_moe_lite", "minimax_m2", "exaone_moe", "granitemoeshared",
                       "granitemoe_swa", "llama4", "llama4_maverick", "exaone", "internlm3", "iquestcoder",
                       "ministral", "helium", "dots1", "phimoe", "solar_open", "sarvam_moe", "youtu", "hy_v3",
                       "afmoe", "gpt_bigcode", "gpt_bigcode_mha", "falcon", "falcon_40b", "falcon_11b",
                       "falcon_rw", "falcon_rw_alibi", "bloom", "bloom_6_heads", "mpt", "mpt_6_heads", "flex_olmo", "nanochat",
                       "minicpm3",
                       "jais2", "cwm",
                       "vaultgemma", "hyperclovax"]  # fmt: skip


@pytest.mark.parametrize("arch", OTHER_ARCHITECTURES)
@pytest.mark.parametrize("scheduler", ["vllm", "sarathi", "orca", "bros"])
def test_other_architectures_give_hf_greedy_tokens(hf_dirs, arch, scheduler):
    tokens, _ = greedy_tokens(hf_dirs[arch], scheduler)
    assert tokens == reference(arch)


@pytest.mark.parametrize("arch", ["llama", *OTHER_ARCHITECTURES])
def test_a_model_directory_gives_the_simulator_its_shape(hf_dirs, arch):
    """`simulate --model DIR`: the spec read from config.json counts the parameters transformers has (a
    mixture of experts: all of them; its biases, sinks, norms and shared experts too)."""
    spec = model_spec(hf_dirs[arch])
    hf = hf_cached(arch)
    # (DeepSeek-V3's router bias, Apertus's xIELU beta and eps: buffers to transformers, tensors of the checkpoint)
    stored = ("e_score_correction_bias", "act_fn.beta", "act_fn.eps")
    biases = sum(b.numel() for name, b in hf.named_buffers() if name.endswith(stored))
    assert spec.num_params == sum(p.numel() for p in hf.parameters()) + biases
    kv_heads = getattr(hf.config, "num_key_value_heads", 4)  # (OPT and GPT-NeoX: as many as the heads)
    if arch.startswith("falcon"):  # (its attention's: one where multi_query, whatever num_kv_heads says)
        kv_heads = hf.transformer.h[0].self_attention.num_kv_heads
    head_dim = getattr(hf.config, "head_dim", None) or 16  # (64 / 4 heads, where the config has none)
    if arch.startswith(("bloom", "mpt")):  # (BLOOM's n_head, MPT's n_heads: every head's KV)
        kv_heads = hf.config.num_attention_heads
        head_dim = hf.config.hidden_size // kv_heads
    tensors = 2  # K and V
    if arch.startswith("deepseek") or arch in ("mistral4", "glm4_moe_lite", "youtu", "minicpm3"):  # MLA's latent, k_R
        kv_heads, head_dim, tensors = 1, hf.config.kv_lora_rank + hf.config.qk_rope_head_dim, 1
    assert (spec.num_layers, spec.num_kv_heads, spec.head_dim) == (hf.config.num_hidden_layers, kv_heads, head_dim)
    assert spec.dtype_bytes == 4  # saved in float32
    assert spec.kv_bytes_per_token == tensors * spec.num_layers * kv_heads * head_dim * 4
    # a mixture of experts: its routed experts' parameters (not the router's, not the shared experts')
    routed = sum(p.numel() for name, p in hf.named_parameters() if ".experts." in name)
    num_experts = next((getattr(hf.config, key) for key in ("num_experts", "num_local_experts", "n_routed_experts")
                        if getattr(hf.config, key, None)), 0)  # fmt: skip
    top_k = getattr(hf.config, "num_experts_per_tok", 0) if routed else 0
    assert (spec.num_experts, spec.experts_per_token, spec.expert_params) == (num_experts, top_k, routed)


def test_exaone_4s_attention_without_a_window_and_a_pattern_by_name():
    """EXAONE 4.0 1.2B has no sliding window: every layer attends to all and rotates (its 32B: three
    sliding layers with rope, then one global without). A pattern by letters ("LLLG") needs layer_types."""
    from sloserve.checkpoint.config import from_hf_config

    raw = hf_cached("exaone4").config.to_dict()
    hybrid = from_hf_config(raw)
    assert [hybrid.layer_window(i) for i in range(4)] == [8, 8, 8, None]
    assert [hybrid.layer_rotates(i) for i in range(4)] == [True, True, True, False]
    dense = from_hf_config({**raw, "sliding_window": None})
    assert [dense.layer_window(i) for i in range(4)] == [None] * 4 and all(dense.layer_rotates(i) for i in range(4))
    with pytest.raises(ConfigError, match="sliding_window_pattern 'LLLG' needs layer_types"):
        from_hf_config({**raw, "layer_types": None, "sliding_window_pattern": "LLLG"})


def test_granite_4s_config_as_the_hub_says_it():
    """Granite 4.0 Micro's config.json: layer_types "attention" (transformers 5 says "full_attention"), rope,
    its MLP the shared one's size; NoPE where position_embedding_type is null. The 4.0-H models' "mamba" layers
    (transformers 5's "linear_attention"; a config without layer_types: all of them, transformers' default) with
    their mixers' settings; another layer type or position embedding refused by name."""
    from sloserve.checkpoint.config import from_hf_config
    from sloserve.checkpoint.model_config import MAMBA

    raw = {**hf_cached("granitemoehybrid").config.to_dict(), "layer_types": ["attention", "attention"]}
    micro = from_hf_config(raw)
    assert (micro.intermediate_size, micro.moe, micro.mamba, micro.residual_multiplier) == (48, None, None, 0.22)
    assert [micro.layer_rotates(i) for i in range(2)] == [True, True] and micro.num_kv_layers == 2
    nope = from_hf_config({**raw, "position_embedding_type": None})
    assert [nope.layer_rotates(i) for i in range(2)] == [False, False]
    experts = from_hf_config(hf_cached("granitemoehybrid_moe").config.to_dict())
    assert (experts.moe["moe_intermediate_size"], experts.moe["shared_expert_intermediate_size"]) == (32, 48)
    for kinds in (["mamba", "attention"], ["linear_attention", "full_attention"]):
        hybrid = from_hf_config({**raw, "layer_types": kinds})
        assert hybrid.layer_types == (MAMBA, "full_attention") and hybrid.num_kv_layers == 1
        assert hybrid.mamba["d_inner"] == 2 * 64 and hybrid.mamba["time_step_limit"] == (0.0, float("inf"))
    assert from_hf_config({**raw, "layer_types": None}).num_kv_layers == 0
    with pytest.raises(ConfigError, match="granitemoehybrid layer type 'cross_attention' is not supported"):
        from_hf_config({**raw, "layer_types": ["cross_attention", "attention"]})
    with pytest.raises(ConfigError, match="position_embedding_type 'alibi' is not supported \\(rope, nope or null\\)"):
        from_hf_config({**raw, "position_embedding_type": "alibi"})
    with pytest.raises(ConfigError, match="mamba_n_heads 7 x mamba_d_head 1 must be mamba_expand x hidden_size 128"):
        from_hf_config({**raw, "layer_types": ["mamba", "attention"], "mamba_n_heads": 7})


def test_gpt_neox_one_after_the_other_and_the_hubs_config_names(tmp_path):
    """GPT-NeoX-20B-style layers (``use_parallel_residual`` false: the MLP reads the stream after attention),
    a config as the Hub's Pythia ones say it (``rotary_pct``, ``rotary_emb_base`` at the top level) and an old
    checkpoint's causal-mask buffers: transformers' greedy tokens."""
    import safetensors.torch

    model = hf_cached("gpt_neox")
    sequential = transformers.GPTNeoXForCausalLM(
        transformers.GPTNeoXConfig(**{**model.config.to_dict(), "use_parallel_residual": False, "model_type": None})
    ).eval()
    sequential.load_state_dict(model.state_dict())
    sequential.save_pretrained(tmp_path)
    config = json.loads((tmp_path / "config.json").read_text())
    rope = config.pop("rope_parameters")
    config.update(rotary_pct=rope["partial_rotary_factor"], rotary_emb_base=rope["rope_theta"])
    (tmp_path / "config.json").write_text(json.dumps(config))
    weights = safetensors.torch.load_file(str(tmp_path / "model.safetensors"))
    weights["gpt_neox.layers.0.attention.bias"] = torch.ones(1, 1, 8, 8, dtype=torch.bool).tril()
    weights["gpt_neox.layers.0.attention.masked_bias"] = torch.tensor(-1e9)
    safetensors.torch.save_file(weights, str(tmp_path / "model.safetensors"))
    ids = PROMPTS[1]
    out = LLM(str(tmp_path)).generate({"prompt_token_ids": ids}, SamplingParams(max_tokens=8, temperature=0))[0]
    expected = sequential.generate(torch.tensor([ids]), max_new_tokens=8, do_sample=False, pad_token_id=0)
    assert out.outputs[0].token_ids == expected[0, len(ids) :].tolist()
    assert out.outputs[0].token_ids != hf_greedy("gpt_neox", tuple(ids), 8)  # NOTE: the layer's order matters


LOGPROB_CHECKED = ["gpt2", "phi", "starcoder2", "deepseek_v2", "deepseek_v3", "nemotron", "olmo", "hunyuan",
                   "glm4_moe", "ernie4_5_moe", "apertus", "hunyuan_moe", "llama4", "llama4_maverick",
                   "minicpm3", "hyperclovax", "nanochat", "bloom", "mpt_6_heads"]  # fmt: skip


@pytest.mark.parametrize("arch", LOGPROB_CHECKED)
def test_prompt_logprobs_are_transformers(hf_dirs, arch):
    """The scores of the models that came with the GELU MLPs, MLA and since to 1e-4: greedy tokens alone would not
    tell GELU by tanh's approximation (``gelu_new``) from the exact one, DeepSeek's YaRN softmax scale from none, or
    Llama 4's query scale from position p + 1 from one from p, MiniCPM3's logits scaled from unscaled, or nanochat's
    capped from uncapped; BLOOM's and MPT's scores with ALiBi too."""
    from hf_models import prompt_logprobs

    ids = PROMPTS[2]
    params = SamplingParams(max_tokens=1, temperature=0, prompt_logprobs=0)
    [out] = LLM(hf_dirs[arch]).generate({"prompt_token_ids": ids}, params)
    ours = [entry.logprob for entry in out.prompt_logprobs[1:]]
    assert ours == pytest.approx(prompt_logprobs(hf_cached(arch), ids), abs=1e-4)


def test_bloom_as_the_hub_holds_it(tmp_path):
    """BLOOM's checkpoints on the Hub hold its base model (BloomModel's names, without ``transformer.``, no LM head:
    it is the embeddings'): transformers' greedy tokens."""
    import safetensors.torch

    model = hf_cached("bloom")
    model.save_pretrained(tmp_path)
    weights = safetensors.torch.load_file(str(tmp_path / "model.safetensors"))
    assert "transformer.word_embeddings_layernorm.weight" in weights  # (as transformers 5 saves it)
    weights = {key.removeprefix("transformer."): tensor for key, tensor in weights.items() if key != "lm_head.weight"}
    safetensors.torch.save_file(weights, str(tmp_path / "model.safetensors"))
    ids = PROMPTS[0]
    out = LLM(str(tmp_path)).generate({"prompt_token_ids": ids}, SamplingParams(max_tokens=12, temperature=0))[0]
    assert out.outputs[0].token_ids == hf_greedy("bloom", tuple(ids), 12)


def test_gpt2_as_openai_saved_it_and_its_scaling_options(tmp_path):
    """GPT-2's checkpoint as OpenAI's (tensors without the ``transformer.`` prefix, each layer's causal-mask
    buffers) and a config with Stanford CRFM's ``scale_attn_by_inverse_layer_idx`` and the exact GELU:
    transformers' greedy tokens."""
    import safetensors.torch

    model = hf_cached("gpt2")
    options = {"scale_attn_by_inverse_layer_idx": True, "activation_function": "gelu"}
    scaled = transformers.GPT2LMHeadModel(transformers.GPT2Config(**{**model.config.to_dict(), **options})).eval()
    scaled.load_state_dict(model.state_dict())
    scaled.save_pretrained(tmp_path)
    weights = safetensors.torch.load_file(str(tmp_path / "model.safetensors"))
    weights = {key.removeprefix("transformer."): tensor for key, tensor in weights.items()}
    for layer in range(2):
        weights[f"h.{layer}.attn.bias"] = torch.ones(1, 1, 256, 256).tril()
        weights[f"h.{layer}.attn.masked_bias"] = torch.tensor(-1e4)
    safetensors.torch.save_file(weights, str(tmp_path / "model.safetensors"))
    ids = PROMPTS[0]
    out = LLM(str(tmp_path)).generate({"prompt_token_ids": ids}, SamplingParams(max_tokens=12, temperature=0))[0]
    expected = scaled.generate(torch.tensor([ids]), max_new_tokens=12, do_sample=False, pad_token_id=0)
    assert out.outputs[0].token_ids == expected[0, len(ids) :].tolist()
    assert out.outputs[0].token_ids != hf_greedy("gpt2", tuple(ids), 12)  # NOTE: the options change the tokens
    config = json.loads((tmp_path / "config.json").read_text())
    for bad, message in (
        ({"activation_function": "swish"}, "GPT-2 activation_function 'swish' is not supported"),
        ({"add_cross_attention": True}, "add_cross_attention"),
    ):
        (tmp_path / "config.json").write_text(json.dumps({**config, **bad}))
        with pytest.raises(ConfigError, match=message):
            LLM(str(tmp_path))


@pytest.mark.parametrize(("arch", "default_rotary_dim"), [("phi", 8), ("stablelm", 4), ("nemotron", 8)])
def test_partial_rotary_configs_as_transformers_reads_them(hf_dirs, arch, default_rotary_dim):
    """A config without ``partial_rotary_factor`` turns transformers' default share of each head (Phi's and
    Nemotron's half, StableLM's quarter), one with the Hub's top-level keys reads as transformers 5's
    ``rope_parameters``; Phi's and StableLM's query and key LayerNorms and StableLM 2 12B's parallel layers
    are refused by name."""
    from sloserve.checkpoint.config import from_hf_config

    raw = json.loads((Path(hf_dirs[arch]) / "config.json").read_text())
    rope = raw.pop("rope_parameters")
    hub = from_hf_config({**raw, "rope_theta": rope["rope_theta"], "partial_rotary_factor": 0.4})
    assert hub == from_hf_config({**raw, "rope_parameters": {**rope, "partial_rotary_factor": 0.4}})
    assert hub.rotary_dim == 6  # (0.4 of 16, rounded down)
    assert from_hf_config(raw).rotary_dim == default_rotary_dim
    if arch != "nemotron":
        with pytest.raises(ConfigError, match="qk_layernorm .*is not supported"):
            from_hf_config({**raw, "qk_layernorm": True})
    if arch == "stablelm":
        with pytest.raises(ConfigError, match="use_parallel_residual .*is not supported"):
            from_hf_config({**raw, "use_parallel_residual": True})


def test_gemma_1s_first_configs_gelu_is_its_tanh_approximation(hf_dirs):
    """Gemma 1's first configs say ``hidden_act: gelu`` for the tanh approximation, as transformers reads it;
    another activation is refused by name."""
    from sloserve.checkpoint.config import from_hf_config

    raw = json.loads((Path(hf_dirs["gemma"]) / "config.json").read_text())
    assert from_hf_config({**raw, "hidden_act": "gelu"}).hidden_act == "gelu_pytorch_tanh"
    assert transformers.GemmaConfig(**{**raw, "hidden_act": "gelu"}).hidden_act == "gelu_pytorch_tanh"
    with pytest.raises(ConfigError, match="hidden_act 'silu' is not supported \\(gelu_pytorch_tanh\\)"):
        from_hf_config({**raw, "hidden_act": "silu"})


def test_deepseek_v2_lites_shape_caches_one_latent_a_token(tmp_path):
    """V2-Lite's outline (one query projection, no rope scaling) with group-limited routing: transformers'
    greedy tokens, its parameter count, and a KV cache of one latent and rotated key a token and layer (40
    numbers here, where keys and values by head would be 4 x (24 + 12))."""
    options = {"q_lora_rank": None, "topk_method": "group_limited_greedy", "n_group": 2, "topk_group": 1}
    config = transformers.DeepseekV2Config(**{**hf_cached("deepseek_v2").config.to_dict(), **options})
    config.rope_parameters = {"rope_type": "default", "rope_theta": 10000.0}
    torch.manual_seed(35)
    model = transformers.DeepseekV2ForCausalLM(config).eval()
    model.save_pretrained(tmp_path)
    llm = LLM(str(tmp_path), kv_capacity_tokens=256, block_size=4)
    cache = llm.engine.cache.gpu  # (1: keys only, layers, slots, 1, 40)
    assert cache.shape[0] == 1 and cache.shape[-2:] == (1, 32 + 8)
    assert kv_bytes_per_token(llm.loaded) == model_spec(str(tmp_path)).kv_bytes_per_token == cache[:, :, 0].nbytes
    assert llm.loaded.config.num_params == sum(p.numel() for p in model.parameters())
    ids = PROMPTS[0]
    out = llm.generate({"prompt_token_ids": ids}, SamplingParams(max_tokens=12, temperature=0, ignore_eos=True))[0]
    assert out.outputs[0].token_ids == greedy_past_eos(model, ids, 12)


def test_deepseek_v3_without_interleaved_rope_and_with_a_multi_token_prediction_layer(tmp_path):
    """A DeepSeek-V3 checkpoint whose rotary embedding turns halves (``rope_interleave`` false: its rows
    load as they are) and that carries a multi-token-prediction layer past its layers (DeepSeek-V3's, not
    run, as vLLM serves it): transformers' greedy tokens."""
    import safetensors.torch

    config = transformers.DeepseekV3Config(**{**hf_cached("deepseek_v3").config.to_dict(), "rope_interleave": False})
    model = transformers.DeepseekV3ForCausalLM(config).eval()
    model.load_state_dict(hf_cached("deepseek_v3").state_dict())
    model.save_pretrained(tmp_path)
    weights = safetensors.torch.load_file(str(tmp_path / "model.safetensors"))
    weights.update(
        {key.replace("layers.1.", "layers.2."): t.clone() for key, t in weights.items() if "layers.1." in key}
    )
    safetensors.torch.save_file(weights, str(tmp_path / "model.safetensors"))
    ids = PROMPTS[0]
    out = LLM(str(tmp_path)).generate({"prompt_token_ids": ids}, SamplingParams(max_tokens=12, temperature=0))[0]
    assert out.outputs[0].token_ids == greedy_past_eos(model, ids, 12)
    assert out.outputs[0].token_ids != hf_greedy("deepseek_v3", tuple(ids), 12)  # NOTE: the layout changes them


def test_glm4_moe_as_the_hub_writes_it_with_a_multi_token_prediction_layer(hf_dirs, tmp_path):
    """GLM-4.5's config.json as the Hub's (its partial_rotary_factor at the top, or left to transformers'
    default of 0.5; no topk_method: V3's routing whatever it says) and a checkpoint with its
    multi-token-prediction layer past the model's (not run, as vLLM serves it): transformers' greedy tokens."""
    import safetensors.torch

    from sloserve.checkpoint.config import from_hf_config

    raw = json.loads((Path(hf_dirs["glm4_moe"]) / "config.json").read_text())
    rope = raw.pop("rope_parameters")
    hub = {**raw, "rope_theta": rope["rope_theta"], "partial_rotary_factor": 0.5}
    assert from_hf_config(hub).partial_rotary_dim == 8 == from_hf_config({**raw, "rope_theta": 1e4}).partial_rotary_dim
    assert from_hf_config({**hub, "topk_method": "greedy"}).moe["topk_method"] == "noaux_tc"
    (tmp_path / "config.json").write_text(json.dumps(hub))
    weights = safetensors.torch.load_file(str(Path(hf_dirs["glm4_moe"]) / "model.safetensors"))
    weights.update(
        {key.replace("layers.1.", "layers.2."): t.clone() for key, t in weights.items() if "layers.1." in key}
    )
    safetensors.torch.save_file(weights, str(tmp_path / "model.safetensors"))
    for name in ("tokenizer.json", "tokenizer_config.json"):
        if (Path(hf_dirs["glm4_moe"]) / name).exists():
            (tmp_path / name).write_bytes((Path(hf_dirs["glm4_moe"]) / name).read_bytes())
    tokens, _ = greedy_tokens(str(tmp_path), "vllm")
    assert tokens == reference("glm4_moe")


def test_ernie4_5_moe_places_its_experts_as_transformers_and_skips_its_mtp_tensors(hf_dirs, tmp_path):
    """ERNIE 4.5 MoE's experts every ``moe_layer_interval``-th layer from the start index through the end one
    (transformers' layers say which); a checkpoint with its multi-token-prediction tensors (``mtp_*``, not
    run, as transformers and vLLM skip them): transformers' greedy tokens."""
    import safetensors.torch

    from sloserve.checkpoint.config import from_hf_config

    raw = json.loads((Path(hf_dirs["ernie4_5_moe"]) / "config.json").read_text())
    placed = {**raw, "num_hidden_layers": 6, "moe_layer_interval": 2, "moe_layer_start_index": 1,
              "moe_layer_end_index": 4}  # fmt: skip
    theirs = transformers.Ernie4_5_MoeForCausalLM(transformers.Ernie4_5_MoeConfig(**placed))
    sparse = tuple(hasattr(layer.mlp, "experts") for layer in theirs.model.layers)
    assert from_hf_config(placed).moe["moe_layers"] == sparse == (False, True, False, True, False, False)
    for name in ("config.json", "tokenizer.json", "tokenizer_config.json"):
        if (Path(hf_dirs["ernie4_5_moe"]) / name).exists():
            (tmp_path / name).write_bytes((Path(hf_dirs["ernie4_5_moe"]) / name).read_bytes())
    weights = safetensors.torch.load_file(str(Path(hf_dirs["ernie4_5_moe"]) / "model.safetensors"))
    extra = ("model.mtp_block.0.mlp.gate_proj.weight", "model.mtp_emb_norm.0.weight", "model.mtp_linear_proj.0.weight")
    weights.update({name: torch.randn(4, 4) for name in extra})
    safetensors.torch.save_file(weights, str(tmp_path / "model.safetensors"))
    tokens, _ = greedy_tokens(str(tmp_path), "vllm")
    assert tokens == reference("ernie4_5_moe")


def test_hunyuan_moe_settings_a_layer_and_always_renormalized(hf_dirs):
    """Hunyuan-A13B's config gives its experts and top k a value a layer (read as one where all agree, refused
    where they differ); transformers renormalizes its top weights whatever ``norm_topk_prob`` says."""
    from sloserve.checkpoint.config import from_hf_config

    raw = json.loads((Path(hf_dirs["hunyuan_moe"]) / "config.json").read_text())
    layers = raw["num_hidden_layers"]
    # (as the Hub's config.json gives them: moe_intermediate_size and num_shared_expert a value a layer, not read)
    hub = {"moe_intermediate_size": [raw["intermediate_size"]] * layers, "num_shared_expert": [1] * layers}
    per_layer = {**raw, **hub, "num_experts": [8] * layers, "moe_topk": [2] * layers, "norm_topk_prob": False}
    moe = from_hf_config(per_layer).moe
    assert (moe["num_experts"], moe["num_experts_per_tok"], moe["norm_topk_prob"]) == (8, 2, True)
    with pytest.raises(ConfigError, match="num_experts_per_tok differs between layers \\(\\[2, 3\\]\\)"):
        from_hf_config({**raw, "moe_topk": [2, 3]})


def test_hunyuans_ntk_alpha_as_the_hub_and_transformers_write_it(hf_dirs):
    """Hunyuan's rope base times alpha ** (d / (d - 2)), from the Hub's top-level ``rope_scaling`` (``type``:
    dynamic) as from transformers 5's ``rope_parameters``; dynamic scaling without an alpha is refused."""
    from sloserve.checkpoint.config import from_hf_config

    raw = json.loads((Path(hf_dirs["hunyuan"]) / "config.json").read_text())
    rope = raw.pop("rope_parameters")
    ours = from_hf_config({**raw, "rope_parameters": rope})
    assert ours.rope_theta == pytest.approx(10000.0 * 1000.0 ** (16 / 14)) and ours.rope_scaling is None
    hub = {**raw, "rope_theta": 10000.0, "rope_scaling": {"type": "dynamic", "alpha": 1000.0, "factor": 1.0}}
    assert from_hf_config(hub) == ours
    with pytest.raises(ConfigError, match="dynamic rope scaling needs a positive alpha"):
        from_hf_config({**hub, "rope_scaling": {"type": "dynamic", "factor": 2.0}})


def test_granite_swas_layers_rope_bases_and_window_as_its_config_says():
    """Granite SWA: each layer's rope base from ``layer_rope_theta`` (0: no rope), transformers' pattern where the
    config has no layer types (full attention where i % 4 == 0), a sink a head; two rope bases refused by name."""
    from sloserve.checkpoint.config import from_hf_config
    from sloserve.checkpoint.model_config import SLIDING

    raw = hf_cached("granite_swa").config.to_dict()
    config = from_hf_config(raw)
    assert [config.layer_rotates(i) for i in range(4)] == [False, True, True, True]
    assert [config.layer_window(i) for i in range(4)] == [None, 8, 8, 8] and config.attention_sinks
    unlisted = from_hf_config({**raw, "num_hidden_layers": 5, "layer_types": None, "layer_rope_theta": None})
    assert unlisted.layer_types == ("full_attention", SLIDING, SLIDING, SLIDING, "full_attention")
    assert all(unlisted.layer_rotates(i) for i in range(5)) and unlisted.rope_theta == 10000.0
    with pytest.raises(
        ConfigError, match="layer_rope_theta with more than one rope base \\(\\[10000.0, 500000.0\\]\\)"
    ):
        from_hf_config({**raw, "layer_rope_theta": [0, 10000.0, 500000.0, 10000.0]})


def test_mistral_small_4s_router_and_query_scale_as_transformers():
    """Mistral Small 4: each token's experts and weights as transformers' router gives them (softmax scores, the
    groups by their two best, renormalized, times routed_scaling_factor); Llama 4's query scale read from its rope
    settings; transformers' latent sizes where the config has none."""
    from transformers.models.mistral4.modeling_mistral4 import Mistral4TopkRouter

    from sloserve.checkpoint.config import from_hf_config
    from sloserve.engine.models.moe import DeepseekMoE

    hf = hf_cached("mistral4")
    raw = hf.config.to_dict()
    config = from_hf_config(raw)
    assert (config.llama4_scaling_beta, config.moe["topk_method"], config.moe["n_group"]) == (
        0.5, "softmax_top2_groups", 2)  # fmt: skip
    theirs: Mistral4TopkRouter = hf.model.layers[1].mlp.gate
    ours = DeepseekMoE(config, None)
    ours.gate.weight.data.copy_(theirs.weight)
    x = torch.randn(64, 64, generator=torch.Generator().manual_seed(4))
    with torch.no_grad():
        _, want_weights, want_experts = theirs(x)
        weights, experts = ours.route(x)
    order, want_order = experts.sort(dim=-1), want_experts.sort(dim=-1)  # (transformers' top k is unsorted)
    assert torch.equal(order.values, want_order.values)
    torch.testing.assert_close(weights.gather(1, order.indices), want_weights.gather(1, want_order.indices))
    bare = {k: v for k, v in raw.items() if k not in ("kv_lora_rank", "q_lora_rank", "qk_nope_head_dim", "v_head_dim")}
    assert {k: from_hf_config(bare).mla[k] for k in ("kv_lora_rank", "q_lora_rank", "qk_nope_head_dim", "v_head_dim")} == {
        "kv_lora_rank": 256, "q_lora_rank": 1024, "qk_nope_head_dim": 64, "v_head_dim": 128}  # fmt: skip


def test_glm_4_7_flashs_mlps_as_mlp_layer_types_says():
    """GLM-4.7-Flash (``glm4_moe_lite``): each layer's MLP dense or experts as ``mlp_layer_types`` says, else the
    first dense (transformers' default); GLM-4.5's routing (sigmoid scores with the bias, scaled by 1.8 where the
    config has no factor); a bad entry refused by name."""
    from sloserve.checkpoint.config import from_hf_config

    raw = hf_cached("glm4_moe_lite").config.to_dict()
    config = from_hf_config(raw)
    assert config.moe["moe_layers"] == (False, True, False) and config.moe["topk_method"] == "noaux_tc"
    unlisted = from_hf_config({k: v for k, v in raw.items() if k not in ("mlp_layer_types", "routed_scaling_factor")})
    assert unlisted.moe["moe_layers"] == (False, True, True) and unlisted.moe["routed_scaling_factor"] == 1.8
    with pytest.raises(ConfigError, match="mlp_layer_types must be 3 entries of dense or sparse"):
        from_hf_config({**raw, "mlp_layer_types": ["dense", "moe", "dense"]})


def test_minimax_m2s_rotary_dim_and_router_bias_as_the_hub_writes_them(hf_dirs):
    """MiniMax-M2: the Hub's ``rotary_dim`` (the dimensions turned) read as transformers reads it where the rope
    settings have no partial_rotary_factor; its router's bias, the MoE block's tensor in the checkpoint, loads into
    the router's (``e_score_correction_bias``)."""
    from sloserve.checkpoint.config import from_hf_config

    raw = hf_cached("minimax_m2").config.to_dict()
    hub = {**raw, "rope_parameters": None, "rope_theta": 5_000_000.0}
    assert from_hf_config(hub).partial_rotary_dim == from_hf_config(raw).partial_rotary_dim == 8
    llm = LLM(hf_dirs["minimax_m2"], kv_capacity_tokens=512)
    gate = llm.loaded.model.model.layers[1].mlp.gate
    want = hf_cached("minimax_m2").model.layers[1].mlp.e_score_correction_bias
    assert torch.equal(gate.e_score_correction_bias.detach(), want)


def test_k_exaones_checkpoint_as_the_hub_writes_it(hf_dirs, tmp_path):
    """K-EXAONE (``exaone_moe``): its router's bias under the MoE block's name and its multi-token-prediction module
    (``mtp.``, not read) as the Hub's checkpoint holds them; its global layers unrotated, the first MLP dense."""
    import shutil

    from sloserve.checkpoint.config import from_hf_config

    safetensors_torch = pytest.importorskip("safetensors.torch")
    config = from_hf_config(hf_cached("exaone_moe").config.to_dict())
    assert config.rotary_layers == (True, True, True, False) and config.moe["moe_layers"] == (False, True, True, True)
    shutil.copytree(hf_dirs["exaone_moe"], tmp_path / "hub")
    path = tmp_path / "hub" / "model.safetensors"
    weights = safetensors_torch.load_file(str(path))
    assert "model.layers.1.mlp.e_score_correction_bias" in weights  # (transformers saves the Hub's name)
    weights["mtp.fc.weight"] = torch.randn(64, 128)
    safetensors_torch.save_file(weights, str(path))
    tokens, _ = greedy_tokens(str(tmp_path / "hub"), "vllm")
    assert tokens == reference("exaone_moe")


def test_exaone_3s_checkpoint_and_config_as_the_hub_writes_them(hf_dirs, tmp_path):
    """EXAONE 3.0 and 3.5 on the Hub: GPT-2's names of its modules (``transformer.h.0.attn.attention.q_proj``,
    ``ln_1``, ``mlp.c_fc_0``...) and of its settings (``num_layers``, ``layer_norm_epsilon``,
    ``activation_function``); transformers' greedy tokens."""
    import shutil

    safetensors_torch = pytest.importorskip("safetensors.torch")
    shutil.copytree(hf_dirs["exaone"], tmp_path / "hub")
    path = tmp_path / "hub" / "model.safetensors"
    hub_names = {"model.embed_tokens.": "transformer.wte.", "model.layers.": "transformer.h.",
                 "model.norm.": "transformer.ln_f.", ".self_attn.o_proj.": ".attn.attention.out_proj.",
                 ".self_attn.": ".attn.attention.", ".input_layernorm.": ".ln_1.", ".post_attention_layernorm.": ".ln_2.",
                 ".mlp.gate_proj.": ".mlp.c_fc_0.", ".mlp.up_proj.": ".mlp.c_fc_1.", ".mlp.down_proj.": ".mlp.c_proj."}  # fmt: skip
    weights = {}
    for key, tensor in safetensors_torch.load_file(str(path)).items():
        for ours, theirs in hub_names.items():
            key = key.replace(ours, theirs)
        weights[key] = tensor
    assert (
        "transformer.h.1.attn.attention.out_proj.weight" in weights and "transformer.h.0.mlp.c_fc_1.weight" in weights
    )
    safetensors_torch.save_file(weights, str(path))
    config = json.loads((tmp_path / "hub" / "config.json").read_text())
    for ours, theirs in (("num_hidden_layers", "num_layers"), ("rms_norm_eps", "layer_norm_epsilon"),
                         ("hidden_act", "activation_function")):  # fmt: skip
        config[theirs] = config.pop(ours)
    (tmp_path / "hub" / "config.json").write_text(json.dumps(config))
    tokens, _ = greedy_tokens(str(tmp_path / "hub"), "vllm")
    assert tokens == reference("exaone")


def test_falcons_kv_heads_and_norms_as_its_configs_say():
    """Falcon 7B: one KV head (multi_query), whatever num_kv_heads says; 40B: num_kv_heads and a norm before each
    part; Falcon 2 11B: one norm; Falcon-RW's outline: every head's KV, the parts one after the other, ALiBi where
    alibi says; BLOOM's: Falcon-RW's with ALiBi, its embeddings normed, GELU by tanh. A new-architecture layer not in
    parallel and BLOOM's residual after the norm refused by name."""
    from sloserve.checkpoint.config import from_hf_config

    readings = {}
    for arch in ("falcon", "falcon_40b", "falcon_11b", "falcon_rw", "falcon_rw_alibi", "bloom"):
        config = from_hf_config(hf_cached(arch).config.to_dict())
        readings[arch] = (config.num_key_value_heads, config.extra["falcon_norms"], config.parallel_residual,
                          config.alibi, config.extra["embedding_norm"], config.hidden_act)  # fmt: skip
    assert readings == {
        "falcon": (1, "input", True, False, False, "gelu"),
        "falcon_40b": (2, "ln_attn, ln_mlp", True, False, False, "gelu"),
        "falcon_11b": (2, "input", True, False, False, "gelu"),
        "falcon_rw": (4, "input, post_attention", False, False, False, "gelu"),
        "falcon_rw_alibi": (4, "input, post_attention", False, True, False, "gelu"),
        "bloom": (4, "input, post_attention", False, True, True, "gelu_pytorch_tanh"),
    }
    raw = hf_cached("bloom").config.to_dict()
    assert (
        from_hf_config({k: v for k, v in raw.items() if k != "max_position_embeddings"}).max_position_embeddings == 2048
    )
    with pytest.raises(ConfigError, match="apply_residual_connection_post_layernorm .* is not supported"):
        from_hf_config({**raw, "apply_residual_connection_post_layernorm": True})
    with pytest.raises(ConfigError, match="config.json has no 'n_head'"):  # (BLOOM's name of it, not ours)
        from_hf_config({k: v for k, v in raw.items() if k != "n_head"})
    raw = hf_cached("falcon").config.to_dict()
    with pytest.raises(ConfigError, match="new_decoder_architecture without parallel_attn is not supported"):
        from_hf_config({**raw, "new_decoder_architecture": True, "parallel_attn": False})


def test_mpts_settings_as_its_configs_say_and_what_transformers_does_not_read_refused():
    """MPT: ALiBi by alibi_bias_max, every head's KV, clip_qkv and softmax_scale where given (0: no clip, as
    transformers reads it), an MLP of expansion_ratio; learned positions, biases, QK norms, a logit scale, prefix LM and
    other attention types refused by name."""
    from sloserve.checkpoint.config import from_hf_config

    raw = hf_cached("mpt_6_heads").config.to_dict()
    config = from_hf_config(raw)
    assert (config.alibi, config.alibi_bias_max, config.num_key_value_heads, config.clip_qkv) == (True, 8.0, 6, 0.5)
    assert (config.attention_multiplier, config.intermediate_size, config.max_position_embeddings) == (0.2, 192, 256)
    attn = raw["attn_config"]
    assert from_hf_config({**raw, "attn_config": {**attn, "clip_qkv": 0}}).clip_qkv is None
    assert from_hf_config({**raw, "expansion_ratio": 2}).intermediate_size == 96
    for change, message in (
        ({"attn_config": {**attn, "alibi": False}}, "attn_config.alibi false \\(learned position embeddings\\)"),
        ({"no_bias": False}, "no_bias false \\(biases\\)"),
        ({"attn_config": {**attn, "qk_ln": True}}, "attn_config.qk_ln"),
        ({"logit_scale": "inv_sqrt_d_model"}, "logit_scale"),
        ({"attn_config": {**attn, "prefix_lm": True}}, "attn_config.prefix_lm"),
        (
            {"attn_config": {**attn, "attn_type": "multiquery_attention"}},
            "attn_config.attn_type 'multiquery_attention'",
        ),
    ):
        with pytest.raises(ConfigError, match=f"MPT's {message}.* is not supported"):
            from_hf_config({**raw, **change})


def test_alibi_slopes_are_transformers():
    """ALiBi's slopes for 1-40 heads (powers of two and between them): BLOOM's and Falcon's as transformers' BLOOM
    computes them, MPT's (alibi_bias_max 8, and 16) as its ``build_mpt_alibi_tensor``, bit for bit."""
    from transformers.models.bloom.modeling_bloom import _get_alibi_slopes
    from transformers.models.mpt.modeling_mpt import build_mpt_alibi_tensor

    from sloserve.engine.alibi import alibi_slopes

    for heads in range(1, 41):
        assert torch.equal(alibi_slopes(heads), _get_alibi_slopes(heads, torch.device("cpu"))), heads
        for bias_max in (8, 16):
            biases = build_mpt_alibi_tensor(heads, 2, bias_max)  # (heads, 1, 2): positions -1, 0 times the slopes
            assert torch.equal(alibi_slopes(heads, bias_max), -biases[:, 0, 0]), (heads, bias_max)
    assert alibi_slopes(8).tolist() == [2.0**-h for h in range(1, 9)]  # (Press et al.'s 2^(-8h/n))


def test_llama_4s_layers_and_experts_as_its_configs_say():
    """Llama 4 Scout's shape (transformers' defaults): three layers of four chunked (8,192) and rotated, the fourth
    neither, experts in every layer; Maverick's: 128 experts every other layer, no query and key norms. Both count
    transformers' parameters. What the Hub's configs write: no_rope_layers [] (transformers' pattern) and
    attn_temperature_tuning 4 (true); a null chunk size (no chunked layer), experts at moe_layers; bad ones refused by
    name."""
    from sloserve.checkpoint.config import from_hf_config
    from sloserve.checkpoint.model_config import CHUNKED

    def count(config) -> int:
        with torch.device("meta"):
            return sum(p.numel() for p in transformers.Llama4ForCausalLM(config).parameters())

    scout = transformers.Llama4TextConfig()
    config = from_hf_config(scout.to_dict())
    assert config.layer_types[:4] == (CHUNKED, CHUNKED, CHUNKED, "full_attention")
    assert config.attention_chunk_size == 8192
    assert config.rotary_layers[:4] == (True, True, True, False) and config.rotary_interleaved
    assert all(config.moe["moe_layers"]) and config.moe["num_experts_per_tok"] == 1
    assert (config.intermediate_size, config.moe["moe_intermediate_size"]) == (16384, 8192)
    assert (config.qk_unweighted_norm, config.attn_scale, config.floor_scale) == (True, 0.1, 8192)
    assert config.num_params == count(scout)  # (107,769,861,120: Scout's 109B less its vision model)
    maverick = transformers.Llama4TextConfig(interleave_moe_layer_step=2, num_local_experts=128, use_qk_norm=False)
    config = from_hf_config(maverick.to_dict())
    assert config.moe["moe_layers"][:4] == (False, True, False, True) and not config.qk_unweighted_norm
    assert config.num_params == count(maverick)
    raw = scout.to_dict()
    hub = from_hf_config({**raw, "layer_types": None, "no_rope_layers": [], "attn_temperature_tuning": 4})
    assert hub == from_hf_config(raw)
    unchunked = from_hf_config({**raw, "layer_types": None, "attention_chunk_size": None})
    assert CHUNKED not in unchunked.layer_types and unchunked.attention_chunk_size is None
    assert from_hf_config({**raw, "attn_temperature_tuning": False}).attn_scale is None
    listed = from_hf_config({**raw, "moe_layers": [1, 3], "interleave_moe_layer_step": 5})
    assert [i for i, moe in enumerate(listed.moe["moe_layers"]) if moe] == [1, 3]
    with pytest.raises(ConfigError, match=r"no_rope_layers must be 48 flags of 0 or 1, got \[1, 2\]"):
        from_hf_config({**raw, "no_rope_layers": [1, 2]})
    with pytest.raises(ConfigError, match=r"moe_layers must be layer indices below 48, got \[48\]"):
        from_hf_config({**raw, "moe_layers": [48]})
    with pytest.raises(ConfigError, match="attention_chunk_size must be a positive integer, got 0"):
        from_hf_config({**raw, "attention_chunk_size": 0})


def test_llama_4s_experts_load_as_transformers_holds_them_whatever_their_shape(hf_dirs, tmp_path):
    """Llama 4's stacked experts are (E, inputs, outputs) as transformers multiplies by them: transposed as they load
    even where the gate and up projections' are square (2 x 32 wide, in a model 64 wide), where their shape could
    not tell."""
    from hf_models import MAX_TOKENS, greedy

    config = hf_cached("llama4").config
    torch.manual_seed(3)
    model = transformers.Llama4ForCausalLM(type(config)(**{**config.to_dict(), "intermediate_size": 32})).eval()
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0.0, 0.2) if p.ndim > 1 else p.mul_(1 + 0.1 * torch.randn_like(p))
    assert model.model.layers[0].feed_forward.experts.gate_up_proj.shape == (4, 64, 64)
    model.save_pretrained(tmp_path)
    tokens, _ = greedy_tokens(str(tmp_path), "vllm")
    assert tokens == [greedy(model, ids, n) for ids, n in zip(PROMPTS, MAX_TOKENS, strict=True)]


@pytest.mark.parametrize(
    "key",
    ["rms_norm_eps", "layer_norm_eps", "norm_eps", "norm_epsilon", "layer_norm_epsilon", "rope_parameters",
     "tie_word_embeddings", "head_dim", "sliding_window", "attention_bias", "hidden_act", "norm_topk_prob",
     "layer_types", "mlp_bias"],
)  # fmt: skip
def test_a_config_without_a_setting_reads_transformers_default_of_it(key):
    """Every model type transformers knows, its default config without one setting (a sparse Hub config): read as
    the whole one is (transformers' default of it: the norms' epsilon, 1e-5 for most; the rope, scaled by default
    for gpt-oss, Apertus, Ministral 3 and Mistral Small 4; tied embeddings; head sizes; windows...). The number of
    KV heads and the context are left out: every config gives them. Two defaults are not models the engine reads
    (DeepSeek-V2's without a top k, GLM-4.5's of an odd rotated width)."""
    from transformers import CONFIG_MAPPING

    from sloserve.checkpoint.config import from_hf_config
    from sloserve.checkpoint.model_types import ARCHITECTURES

    unread = {"deepseek_v2", "glm4_moe"}
    wrong, checked = {}, 0
    for model_type in sorted(set(ARCHITECTURES) & set(CONFIG_MAPPING) - unread):
        defaults = CONFIG_MAPPING[model_type]().to_dict()
        if defaults.get(key) is None:
            continue
        whole, sparse = from_hf_config(defaults), from_hf_config({k: v for k, v in defaults.items() if k != key})
        checked += 1
        if sparse != whole:
            wrong[model_type] = [f for f in whole.__dataclass_fields__ if getattr(sparse, f) != getattr(whole, f)]
    assert not wrong and checked


def test_a_setting_of_the_wrong_kind_is_one_config_error_naming_it():
    """Every model type transformers knows, its default config with one setting at a time made null, a string, -1,
    0, true, a list or an object: read, or refused with a ConfigError; never a TypeError or a division by zero deep
    in the reading (164 kinds of them before the settings' kinds were checked as read)."""
    from transformers import CONFIG_MAPPING

    from sloserve.checkpoint.config import from_hf_config
    from sloserve.checkpoint.model_types import ARCHITECTURES

    crashes, readings = {}, 0
    for model_type in sorted(set(ARCHITECTURES) & set(CONFIG_MAPPING)):
        defaults = CONFIG_MAPPING[model_type]().to_dict()
        for key in sorted(set(defaults) - {"model_type"}):
            for bad in (None, "x", -1, 0, True, [], {}):
                readings += 1
                try:
                    from_hf_config({**defaults, key: bad}, model_type)
                except ConfigError:
                    pass
                except Exception as error:  # noqa: BLE001 (what the test looks for)
                    crashes[(model_type, key, repr(bad))] = f"{type(error).__name__}: {error}"
    assert readings > 10_000 and not crashes
    defaults = CONFIG_MAPPING["llama"]().to_dict()
    with pytest.raises(ConfigError, match=r"^llama: hidden_size must be a positive integer, got 'x'$"):
        from_hf_config({**defaults, "hidden_size": "x"}, "llama")
    with pytest.raises(ConfigError, match=r"^llama: rope_parameters must be an object, got -1$"):
        from_hf_config({**defaults, "rope_parameters": -1}, "llama")
    with pytest.raises(ConfigError, match=r"^llama: eos_token_id must be a token id .*, got \[2, 'x'\]$"):
        from_hf_config({**defaults, "eos_token_id": [2, "x"]}, "llama")  # (once a generation that never met its EOS)
    mixtral = CONFIG_MAPPING["mixtral"]().to_dict()  # (10**8 layers: once seconds of per-layer lists; 10**9 the memory)
    with pytest.raises(ConfigError, match=r"^mixtral: num_hidden_layers must be a positive integer up to 10,000, got"):
        from_hf_config({**mixtral, "num_hidden_layers": 10**8}, "mixtral")
    bamba = CONFIG_MAPPING["bamba"]().to_dict()  # (a Mamba-2 head's width "auto": the mixer's over its heads)
    assert from_hf_config({**bamba, "mamba_d_head": "auto"}, "bamba") == from_hf_config(bamba, "bamba")
    hunyuan = CONFIG_MAPPING["hunyuan_v1_moe"]().to_dict()
    with pytest.raises(ConfigError, match=r"num_experts must be an integer >= 0, or a list of them \(one a layer\)"):
        from_hf_config({**hunyuan, "num_experts": [8, "x"]}, "hunyuan_v1_moe")
