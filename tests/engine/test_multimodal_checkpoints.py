"""Gemma 3 4B-27B and Mistral Small 3.1 ship as multimodal checkpoints (``Gemma3ForConditionalGeneration``,
``Mistral3ForConditionalGeneration``): a language model beside a vision tower. The engine serves the
language model as text, as vLLM does with no image in the prompt: the config's ``text_config`` (Gemma's
sparse on the Hub: what it leaves out is transformers' default), EOS from the top level, the language
model's tensors under either layout transformers saved, its LM head tied or not as the weights say, the
vision tower's never read; the greedy tokens are transformers' multimodal model's on the same text."""

from __future__ import annotations

import json

import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")
safetensors_torch = pytest.importorskip("safetensors.torch")

from hf_models import VOCAB, greedy  # noqa: E402
from sloserve import LLM, SamplingParams  # noqa: E402
from sloserve.checkpoint.config import load_hf_config  # noqa: E402
from sloserve.core.errors import ConfigError  # noqa: E402

PROMPTS = [[2, *range(10, 40)], [2, 7, 1, 9] * 6]
END_OF_TURN = 106 % VOCAB


def assert_gives_the_greedy_tokens_of(model, path, num_tokens: int = 16) -> None:
    """The engine on the checkpoint at ``path`` gives transformers' greedy tokens of ``model`` for each of
    ``PROMPTS``."""
    llm = LLM(str(path), kv_capacity_tokens=512)
    params = SamplingParams(max_tokens=num_tokens, temperature=0, ignore_eos=True)
    outputs = llm.generate([{"prompt_token_ids": ids} for ids in PROMPTS], params)
    assert [o.outputs[0].token_ids for o in outputs] == [greedy(model, ids, num_tokens) for ids in PROMPTS]


def tiny_gemma3_multimodal():
    """Text: the defaults' 8 heads and 4 KV heads (left out of the config below), a window of 8 (shorter
    than the prompts), one sliding layer and one global; vision: a one-layer SigLIP."""
    text = dict(vocab_size=VOCAB, hidden_size=64, num_hidden_layers=2, head_dim=16, intermediate_size=128,
                max_position_embeddings=256, sliding_window=8, query_pre_attn_scalar=16,
                layer_types=["sliding_attention", "full_attention"], initializer_range=0.2)  # fmt: skip
    vision = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2, image_size=28,
                  patch_size=14)  # fmt: skip
    config = transformers.Gemma3Config(
        text_config=text, vision_config=vision, mm_tokens_per_image=1, image_token_index=VOCAB - 1,
        boi_token_index=VOCAB - 3, eoi_token_index=VOCAB - 2,
    )  # fmt: skip
    torch.manual_seed(12)
    model = transformers.Gemma3ForConditionalGeneration(config).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.ndim == 1 and "language_model" in name:
                p.add_(0.1 * torch.randn_like(p))  # (0 at init: Gemma's norms scale by 1 + weight)
    return model


def hub_config(path) -> None:
    """config.json as the Hub's Gemma 3 4B has it: a text_config that lists what differs from
    transformers' defaults, EOS ([<eos>, <end_of_turn>]) and the dtype at the top level."""
    raw = json.loads((path / "config.json").read_text())
    for key in ("num_attention_heads", "num_key_value_heads", "rms_norm_eps", "eos_token_id", "bos_token_id"):
        raw["text_config"].pop(key)
    raw["eos_token_id"] = [1, END_OF_TURN]
    raw["torch_dtype"] = raw.pop("dtype", "float32")
    (path / "config.json").write_text(json.dumps(raw))


@pytest.fixture(scope="module")
def gemma3_4b_like(tmp_path_factory):
    model = tiny_gemma3_multimodal()
    path = tmp_path_factory.mktemp("gemma3-multimodal")
    model.save_pretrained(path)
    hub_config(path)
    return path, model


def test_the_language_model_gives_transformers_greedy_tokens(gemma3_4b_like):
    path, model = gemma3_4b_like
    config = load_hf_config(path)
    assert (config.num_attention_heads, config.num_key_value_heads) == (8, 4)  # transformers' defaults
    assert config.eos_token_ids == (1, END_OF_TURN)  # the top level's
    assert config.layer_types == ("sliding_attention", "full_attention") and config.sliding_window == 8
    llm = LLM(str(path), kv_capacity_tokens=512)
    params = SamplingParams(max_tokens=16, temperature=0, ignore_eos=True)
    outputs = llm.generate([{"prompt_token_ids": ids} for ids in PROMPTS], params)
    assert [o.outputs[0].token_ids for o in outputs] == [greedy(model, ids, 16) for ids in PROMPTS]


def test_the_newer_layout_loads_and_vision_tensors_are_not_read(gemma3_4b_like, tmp_path):
    """transformers >= 4.52 saves the language model under ``model.language_model.``, the vision tower
    under ``model.vision_tower.``; a vision tensor of any shape is skipped, a stray language tensor is
    not."""
    path, model = gemma3_4b_like
    for name in ("config.json", "tokenizer.json"):
        if (path / name).exists():
            (tmp_path / name).write_text((path / name).read_text())
    tensors = safetensors_torch.load_file(path / "model.safetensors")
    renamed = {
        key.replace("language_model.model.", "model.language_model.").replace("vision_tower.", "model.vision_tower."): t
        for key, t in tensors.items()
    }
    renamed["model.vision_tower.not_a_text_weight"] = torch.zeros(3, 5)
    safetensors_torch.save_file(renamed, tmp_path / "model.safetensors")
    llm = LLM(str(tmp_path), kv_capacity_tokens=512)
    [out] = llm.generate({"prompt_token_ids": PROMPTS[0]}, SamplingParams(max_tokens=8, temperature=0, ignore_eos=True))
    assert out.outputs[0].token_ids == greedy(model, PROMPTS[0], 8)
    renamed["model.language_model.layers.9.mlp.up_proj.weight"] = torch.zeros(3, 5)
    safetensors_torch.save_file(renamed, tmp_path / "model.safetensors")
    with pytest.raises(ConfigError, match="unexpected tensor 'model.layers.9.mlp.up_proj.weight'"):
        LLM(str(tmp_path), kv_capacity_tokens=512)


def test_a_processors_chat_template_is_the_models(gemma3_4b_like, tmp_path):
    from sloserve.engine.chat_template import ChatTemplate

    path, _ = gemma3_4b_like
    template = "{{ bos_token }}{% for m in messages %}<start_of_turn>{{ m['content'] }}<end_of_turn>{% endfor %}"
    (tmp_path / "chat_template.json").write_text(json.dumps({"chat_template": template}))
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({"bos_token": "<bos>"}))
    chat = ChatTemplate.for_model(tmp_path)
    assert chat.from_model and chat.render([{"role": "user", "content": "hi"}]) == "<bos><start_of_turn>hi<end_of_turn>"
    (tmp_path / "chat_template.json").write_text("{not json")
    with pytest.raises(ConfigError, match="chat_template.json: cannot read"):
        ChatTemplate.for_model(tmp_path)


@pytest.mark.parametrize("tied", [False, True], ids=["own LM head (Mistral Small 3.1)", "tied"])
def test_mistral_small_31s_language_model_gives_transformers_greedy_tokens(tmp_path, tied):
    """Mistral Small 3.1's config.json says nothing of tied embeddings at the top level (where
    transformers' default is tied) and its weights hold an LM head: the weights decide."""
    text = dict(model_type="mistral", vocab_size=VOCAB, hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                num_key_value_heads=2, head_dim=16, intermediate_size=128, max_position_embeddings=256,
                initializer_range=0.2)  # fmt: skip
    vision = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2, head_dim=16,
                  image_size=28, patch_size=14)  # fmt: skip
    config = transformers.Mistral3Config(
        text_config=text, vision_config=vision, image_token_index=VOCAB - 1, tie_word_embeddings=tied
    )
    torch.manual_seed(13)
    model = transformers.Mistral3ForConditionalGeneration(config).eval()
    model.save_pretrained(tmp_path)
    raw = json.loads((tmp_path / "config.json").read_text())
    raw.pop("tie_word_embeddings")
    (tmp_path / "config.json").write_text(json.dumps(raw))
    assert load_hf_config(tmp_path).model_type == "mistral"
    llm = LLM(str(tmp_path), kv_capacity_tokens=512)
    assert llm.engine.executor.model.config.tie_word_embeddings == tied
    params = SamplingParams(max_tokens=16, temperature=0, ignore_eos=True)
    outputs = llm.generate([{"prompt_token_ids": ids} for ids in PROMPTS], params)
    assert [o.outputs[0].token_ids for o in outputs] == [greedy(model, ids, 16) for ids in PROMPTS]


@pytest.mark.parametrize("experts", [0, 8], ids=["Qwen3-VL", "Qwen3-VL-MoE"])
def test_qwen3_vls_language_model_gives_transformers_greedy_tokens(tmp_path, experts):
    """Qwen3-VL (2B-32B, ``Qwen3VLForConditionalGeneration``): its text_config is Qwen3's layers (``qwen3_vl_text``)
    and its interleaved MRoPE is Qwen3's RoPE on text; the vision tower (``model.visual``) is not read. Qwen3-VL-MoE
    (30B-A3B, 235B-A22B): Qwen3-MoE's layers, its experts stored stacked (E, inputs, outputs) as the Hub's are. The
    greedy tokens of transformers' multimodal model on the same text."""
    text = dict(vocab_size=VOCAB, hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                head_dim=16, intermediate_size=128, max_position_embeddings=256, initializer_range=0.2,
                rope_parameters={"rope_type": "default", "rope_theta": 5e6, "mrope_section": [2, 3, 3],
                                 "mrope_interleaved": True})  # fmt: skip
    vision = dict(depth=1, hidden_size=32, intermediate_size=64, num_heads=2, out_hidden_size=64, patch_size=4,
                  spatial_merge_size=2, temporal_patch_size=2, num_position_embeddings=16, deepstack_visual_indexes=[0])  # fmt: skip
    torch.manual_seed(14)
    if experts:
        text.update(num_experts=experts, num_experts_per_tok=2, moe_intermediate_size=16)
        config = transformers.Qwen3VLMoeConfig(text_config=text, vision_config=vision)
        model = transformers.Qwen3VLMoeForConditionalGeneration(config).eval()
    else:
        model = transformers.Qwen3VLForConditionalGeneration(
            transformers.Qwen3VLConfig(text_config=text, vision_config=vision)
        ).eval()
    with torch.no_grad():  # (q/k norms: 1 at init)
        for name, p in model.named_parameters():
            if name.endswith(("q_norm.weight", "k_norm.weight")):
                p.mul_(1 + 0.3 * torch.randn_like(p))
    model.save_pretrained(tmp_path)
    if experts:  # the Hub's layout: (E, H, 2 I) and (E, I, H), where transformers saves (E, 2 I, H), (E, H, I)
        weights = safetensors_torch.load_file(str(tmp_path / "model.safetensors"))
        for key in [k for k in weights if k.endswith(("experts.gate_up_proj", "experts.down_proj"))]:
            weights[key] = weights[key].transpose(1, 2).contiguous()
        safetensors_torch.save_file(weights, str(tmp_path / "model.safetensors"))
    config = load_hf_config(tmp_path)
    kind = "qwen3_moe" if experts else "qwen3"
    assert (config.model_type, config.qk_norm, config.rope_theta) == (kind, True, 5e6)
    assert_gives_the_greedy_tokens_of(model, tmp_path)


def tiny_qwen2_vl(arch: str):
    """Qwen2-VL's or Qwen2.5-VL's (``arch``) language model (Qwen2's layers, q/k/v biases, MRoPE of three sections)
    beside a one-block vision tower, in transformers 5's layout."""
    text = dict(vocab_size=VOCAB, hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                intermediate_size=128, max_position_embeddings=256, initializer_range=0.2,
                rope_parameters={"rope_type": "default", "type": "mrope", "rope_theta": 2e5, "mrope_section": [2, 3, 3]})  # fmt: skip
    if arch == "qwen2_vl":
        vision = dict(depth=1, embed_dim=32, hidden_size=64, num_heads=2, mlp_ratio=2, patch_size=4)
        config, model_class = transformers.Qwen2VLConfig, transformers.Qwen2VLForConditionalGeneration
    else:
        vision = dict(depth=1, hidden_size=32, intermediate_size=64, num_heads=2, out_hidden_size=64, patch_size=4,
                      fullatt_block_indexes=[0])  # fmt: skip
        config, model_class = transformers.Qwen2_5_VLConfig, transformers.Qwen2_5_VLForConditionalGeneration
    torch.manual_seed(15)
    return model_class(config(text_config=text, vision_config=vision)).eval()


def hub_config_of_qwen2_vl(path) -> None:
    """config.json as the Hub's Qwen2-VL and Qwen2.5-VL have it: the language model's settings at the top level
    beside vision_config, MRoPE by its first name (``rope_scaling`` of type mrope); rms_norm_eps left out
    (transformers' default, 1e-5: not Qwen2's 1e-6)."""
    raw = json.loads((path / "config.json").read_text())
    text = raw.pop("text_config")
    rope = text.pop("rope_parameters")
    flat = {**text, **raw, "rope_theta": rope["rope_theta"]}
    flat["rope_scaling"] = {"type": "mrope", "mrope_section": rope["mrope_section"]}
    flat["torch_dtype"] = flat.pop("dtype", None) or "float32"
    assert flat.pop("rms_norm_eps") == 1e-5
    (path / "config.json").write_text(json.dumps(flat))


def names_of_transformers_4_52(path) -> None:
    """The tensors' names as transformers 4.52-4.57 saved them (``model.language_model...``, ``model.visual...``);
    transformers 5 saves the Hub's (``model.layers...``, ``visual...``)."""
    weights = safetensors_torch.load_file(str(path / "model.safetensors"))
    assert "model.embed_tokens.weight" in weights and any(key.startswith("visual.") for key in weights)
    renamed = {}
    for key, tensor in weights.items():
        if key.startswith("visual."):
            key = "model." + key
        elif key.startswith("model."):
            key = "model.language_model." + key.removeprefix("model.")
        renamed[key] = tensor
    safetensors_torch.save_file(renamed, str(path / "model.safetensors"))


@pytest.mark.parametrize("layout", ["hub", "transformers 5", "transformers 4.52"])
@pytest.mark.parametrize("arch", ["qwen2_vl", "qwen2_5_vl"])
def test_qwen2_vls_language_model_gives_transformers_greedy_tokens(tmp_path, arch, layout):
    """Qwen2-VL (2B-72B) and Qwen2.5-VL (3B-72B): Qwen2's layers, their MRoPE Qwen2's RoPE on text, from the
    Hub's files (the settings at the config's top level), transformers 5's (in a text_config) and 4.52's (the
    tensors renamed); the vision tower's tensors never read. The greedy tokens of transformers' multimodal
    model on the same text."""
    model = tiny_qwen2_vl(arch)
    model.save_pretrained(tmp_path)
    if layout == "hub":
        hub_config_of_qwen2_vl(tmp_path)
    elif layout == "transformers 4.52":
        names_of_transformers_4_52(tmp_path)
    config = load_hf_config(tmp_path)
    assert (config.model_type, config.attention_bias, config.rope_theta, config.rope_scaling) == (
        "qwen2",
        True,
        2e5,
        None,
    )
    assert config.norm_eps == 1e-5
    assert_gives_the_greedy_tokens_of(model, tmp_path)


def test_a_multimodal_config_without_its_text_config_is_refused(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "gemma3", "vision_config": {}}))
    with pytest.raises(ConfigError, match="a gemma3 config.json needs a text_config"):
        load_hf_config(tmp_path)


def test_a_multimodal_checkpoints_unsupported_language_model_is_refused_by_name(tmp_path):
    """A text_config of a type the engine does not run is refused, not read as the wrapper's usual one."""
    config = {"model_type": "mistral3", "text_config": {"model_type": "gemma4_text"}, "vision_config": {}}
    (tmp_path / "config.json").write_text(json.dumps(config))
    with pytest.raises(
        ConfigError, match="unsupported architecture 'gemma4_text' \\(config.json text_config model_type\\)"
    ):
        load_hf_config(tmp_path)


@pytest.mark.parametrize("arch", ["lfm2_vl", "lfm3_vl"])
def test_lfm_vls_language_model_gives_transformers_greedy_tokens(tmp_path, arch):
    """LFM2-VL, LFM3-VL: an LFM2 (short convolutions, an attention layer) or an LFM3 (a sliding layer too, gated
    heads, normalized outputs) beside a vision tower and a projector; its language model's tensors
    (``model.language_model.``) served as text, the vision tower's and the projector's not read. The reference:
    forward passes over whole sequences (transformers' ``generate`` for LFM2 parts from them on long prompts:
    tests/hf_models.py's ``greedy_by_full_forwards``)."""
    text = dict(model_type=arch.removesuffix("_vl"), vocab_size=VOCAB, hidden_size=64, num_hidden_layers=3,
                num_attention_heads=4, num_key_value_heads=2, intermediate_size=96, block_multiple_of=32,
                max_position_embeddings=256, layer_types=["conv", "full_attention", "conv"],
                initializer_range=0.2)  # fmt: skip
    if arch == "lfm3_vl":
        text.update(head_dim=16, sliding_window=8, layer_types=["conv", "sliding_attention", "full_attention"],
                    pad_token_id=0, bos_token_id=1, eos_token_id=2)  # fmt: skip
        vision = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2,
                      num_key_value_heads=2, patch_size=4)  # fmt: skip
        config = transformers.Lfm3VlConfig(text_config=text, vision_config=vision, image_token_id=VOCAB - 1,
                                           video_token_id=VOCAB - 2, projector_hidden_size=32)  # fmt: skip
        cls = transformers.Lfm3VlForConditionalGeneration
    else:
        vision = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2, patch_size=4,
                      num_patches=16)  # fmt: skip
        config = transformers.Lfm2VlConfig(
            text_config=text, vision_config=vision, image_token_id=VOCAB - 1, projector_hidden_size=32
        )
        cls = transformers.Lfm2VlForConditionalGeneration
    torch.manual_seed(14)
    model = cls(config).eval()
    model.save_pretrained(tmp_path)
    assert load_hf_config(tmp_path).model_type == arch.removesuffix("_vl")
    llm = LLM(str(tmp_path), kv_capacity_tokens=512)
    params = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)
    outputs = llm.generate([{"prompt_token_ids": ids} for ids in PROMPTS], params)

    def reference(ids: list[int]) -> list[int]:
        ids = list(ids)
        with torch.no_grad():
            for _ in range(12):
                ids.append(int(model(input_ids=torch.tensor([ids]), use_cache=False).logits[0, -1].argmax()))
        return ids[-12:]

    assert [o.outputs[0].token_ids for o in outputs] == [reference(ids) for ids in PROMPTS]


@pytest.mark.parametrize("text_type", ["exaone4", "exaone4_5_text"], ids=["transformers", "hub"])
def test_exaone_4_5s_language_model_gives_transformers_greedy_tokens(tmp_path, text_type):
    """EXAONE 4.5: EXAONE 4's layers (three sliding with rope, a full one without) beside a vision tower
    (``model.visual``, not read); its text_config's model type as transformers saves it or as the Hub's configs
    say (``exaone4_5_text``)."""
    text = dict(model_type="exaone4", vocab_size=VOCAB, hidden_size=64, num_hidden_layers=4, num_attention_heads=4,
                num_key_value_heads=2, intermediate_size=128, max_position_embeddings=256, sliding_window=8,
                initializer_range=0.2, pad_token_id=0)  # fmt: skip
    vision = dict(depth=1, hidden_size=32, intermediate_size=64, num_heads=2, num_key_value_heads=2,
                  out_hidden_size=64, fullatt_block_indexes=[0])  # fmt: skip
    config = transformers.Exaone4_5_Config(text_config=text, vision_config=vision, image_token_id=VOCAB - 1,
                                           video_token_id=VOCAB - 2)  # fmt: skip
    torch.manual_seed(15)
    model = transformers.Exaone4_5_ForConditionalGeneration(config).eval()
    model.save_pretrained(tmp_path)
    raw = json.loads((tmp_path / "config.json").read_text())
    raw["text_config"]["model_type"] = text_type
    (tmp_path / "config.json").write_text(json.dumps(raw))
    assert load_hf_config(tmp_path).model_type == "exaone4"
    assert_gives_the_greedy_tokens_of(model, tmp_path)


@pytest.mark.parametrize("experts", [0, 8], ids=["Qwen3.5", "Qwen3.5-MoE"])
def test_qwen3_5s_language_model_gives_transformers_greedy_tokens(tmp_path, experts):
    """Qwen3.5 (0.8B-27B, ``Qwen3_5ForConditionalGeneration``) and Qwen3.5-MoE (35B-A3B-397B-A17B): Qwen3-Next's
    layers (gated DeltaNets, gated attention) beside a vision tower (``model.visual``, not read); their interleaved
    MRoPE is plain RoPE on text; the multi-token-prediction layer the Hub's checkpoints hold (``mtp.``) not read.
    The greedy tokens of transformers' multimodal model on the same text."""
    text = dict(vocab_size=VOCAB, hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                head_dim=16, intermediate_size=96, max_position_embeddings=256, linear_num_key_heads=2,
                linear_num_value_heads=4, linear_key_head_dim=8, linear_value_head_dim=8, initializer_range=0.2,
                layer_types=["linear_attention", "full_attention"],
                rope_parameters={"rope_type": "default", "rope_theta": 1e7, "partial_rotary_factor": 0.25,
                                 "mrope_section": [1, 1, 0], "mrope_interleaved": True})  # fmt: skip
    vision = dict(depth=1, hidden_size=32, intermediate_size=64, num_heads=2, out_hidden_size=64, patch_size=4,
                  spatial_merge_size=2, temporal_patch_size=2, num_position_embeddings=16)  # fmt: skip
    torch.manual_seed(16)
    if experts:
        text.update(
            num_experts=experts, num_experts_per_tok=2, moe_intermediate_size=16, shared_expert_intermediate_size=24
        )
        model = transformers.Qwen3_5MoeForConditionalGeneration(
            transformers.Qwen3_5MoeConfig(text_config=text, vision_config=vision)
        ).eval()
    else:
        model = transformers.Qwen3_5ForConditionalGeneration(
            transformers.Qwen3_5Config(text_config=text, vision_config=vision)
        ).eval()
    with torch.no_grad():  # (the norms scale by 1 + weight: 0 at init)
        for name, p in model.named_parameters():
            if name.endswith("norm.weight") and "visual" not in name:
                p.add_(0.3 * torch.randn_like(p))
    model.save_pretrained(tmp_path)
    weights = safetensors_torch.load_file(str(tmp_path / "model.safetensors"))
    assert any(key.startswith("model.visual.") for key in weights)
    weights["mtp.fc.weight"] = torch.randn(64, 128)  # (the Hub's multi-token prediction: not in the engine's model)
    safetensors_torch.save_file(weights, str(tmp_path / "model.safetensors"))
    config = load_hf_config(tmp_path)
    kind = "qwen3_5_moe_text" if experts else "qwen3_5_text"
    assert (config.model_type, config.rotary_dim, config.rope_theta, config.num_state_layers) == (kind, 4, 1e7, 1)
    assert_gives_the_greedy_tokens_of(model, tmp_path)


@pytest.mark.parametrize("experts", [0, 8], ids=["GLM-4.1V", "GLM-4.5V"])
def test_glm_vs_language_model_gives_transformers_greedy_tokens(tmp_path, experts):
    """GLM-4.1V (``glm4v``: GLM-4-0414's layers, half of each head rotated by adjacent pairs, its gate and up
    projections stored fused) and GLM-4.5V, 4.6V (``glm4v_moe``: GLM-4.5's layers, its experts beside a shared one,
    q/k/v biases): their MRoPE is plain RoPE on text, the vision tower (``model.visual``) not read. The greedy tokens
    of transformers' multimodal model on the same text."""
    text = dict(vocab_size=VOCAB, hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                head_dim=16, intermediate_size=96, max_position_embeddings=256, initializer_range=0.2,
                rope_parameters={"rope_type": "default", "rope_theta": 1e4, "partial_rotary_factor": 0.5,
                                 "mrope_section": [1, 1, 2]})  # fmt: skip
    vision = dict(depth=1, hidden_size=32, intermediate_size=64, num_heads=2, out_hidden_size=64, patch_size=4,
                  spatial_merge_size=2, temporal_patch_size=2)  # fmt: skip
    torch.manual_seed(17)
    if experts:
        text.update(n_routed_experts=experts, num_experts_per_tok=2, moe_intermediate_size=16, n_shared_experts=1,
                    first_k_dense_replace=1)  # fmt: skip
        model = transformers.Glm4vMoeForConditionalGeneration(
            transformers.Glm4vMoeConfig(text_config=text, vision_config=vision)
        ).eval()
    else:
        model = transformers.Glm4vForConditionalGeneration(
            transformers.Glm4vConfig(text_config=text, vision_config=vision)
        ).eval()
    with torch.no_grad():  # (biases 0 and norms 1 at init: make them count)
        for name, p in model.named_parameters():
            if "visual" not in name and (name.endswith("bias") or p.ndim == 1):
                p.add_(0.2 * torch.randn_like(p))
        for name, b in model.named_buffers():
            if name.endswith("e_score_correction_bias"):
                b.normal_(0.0, 0.5)
    model.save_pretrained(tmp_path)
    config = load_hf_config(tmp_path)
    assert (config.model_type, config.rotary_dim) == ("glm4_moe" if experts else "glm4", 8)
    assert config.rotary_interleaved is not bool(experts) and config.attention_bias
    # a text_config that leaves out its norms' epsilon and biases reads transformers' defaults of them
    from sloserve.checkpoint.config import from_hf_config

    raw = json.loads((tmp_path / "config.json").read_text())
    sparse = {**raw, "text_config": {k: v for k, v in raw["text_config"].items() if k not in ("rms_norm_eps",
                                                                                             "attention_bias")}}  # fmt: skip
    filled = type(model.config)(**{k: v for k, v in sparse.items() if k != "model_type"}).to_dict()
    assert from_hf_config(sparse) == from_hf_config(filled) and from_hf_config(sparse).norm_eps == 1e-5
    assert_gives_the_greedy_tokens_of(model, tmp_path)


def test_llama_4s_language_model_gives_transformers_greedy_tokens(tmp_path):
    """Llama 4 Scout and Maverick (``llama4``: Llama4ForConditionalGeneration): the language model's layers (chunked,
    rotated by adjacent pairs, experts fed tokens scaled by their router's sigmoid) under the Hub's names, which
    transformers 5 keeps (``language_model.model.``, ``language_model.lm_head``), the vision model (``vision_model``)
    and the projector not read. The greedy tokens of the multimodal model's language model (``language_model``, a
    Llama4ForCausalLM: what its forward runs on text; transformers 5.24's own fails without an image, reading
    ``image_outputs`` from the text model's outputs)."""
    text = dict(vocab_size=VOCAB, hidden_size=64, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2,
                head_dim=16, intermediate_size=48, intermediate_size_mlp=96, num_local_experts=4,
                interleave_moe_layer_step=2, attention_chunk_size=8, floor_scale=4, attn_scale=0.5,
                max_position_embeddings=256, initializer_range=0.2)  # fmt: skip
    vision = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2, image_size=28,
                  patch_size=14, vision_output_dim=32, projector_input_dim=32, projector_output_dim=32)  # fmt: skip
    torch.manual_seed(19)
    config = transformers.Llama4Config(text_config=text, vision_config=vision, image_token_index=VOCAB - 1)
    model = transformers.Llama4ForConditionalGeneration(config).eval()
    with torch.no_grad():  # (norms 1 at init: make them count)
        for name, p in model.named_parameters():
            if "language_model" in name and p.ndim == 1:
                p.mul_(1 + 0.1 * torch.randn_like(p))
    model.save_pretrained(tmp_path)
    weights = safetensors_torch.load_file(str(tmp_path / "model.safetensors"))
    assert {key.split(".")[0] for key in weights} == {"language_model", "vision_model", "multi_modal_projector"}
    config = load_hf_config(tmp_path)
    assert config.model_type == "llama4_text" and config.attention_chunk_size == 8 and config.rotary_interleaved
    assert_gives_the_greedy_tokens_of(model.language_model, tmp_path)
