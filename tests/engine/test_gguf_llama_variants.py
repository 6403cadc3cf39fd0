"""GGUF files of Llama's variants that llama.cpp's Llama converter writes (Q and K rows permuted), each
with what sets it apart. SmolLM3 (``smollm3``): nothing of which layers have no rotary embedding (llama.cpp's
code says every fourth, as SmolLM3's config does by default). Granite (``granite``): its four scales under
llama.cpp's names (``granite.embedding_scale``, ``residual_scale``, ``attention.scale``, ``logit_scale``).
OLMo 2 (``olmo2``, written unpermuted): its norms after attention and the MLP (``post_attention_norm``,
``post_ffw_norm``), none before. The engine gives the greedy tokens (and, for Granite and OLMo 2, the
log-probabilities) of the transformers model the file was written from."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")
pytest.importorskip("gguf")

from gguf_files import assert_greedy_tokens_and_logprobs, uneven_norms_, write_gguf  # noqa: E402

from hf_models import greedy  # noqa: E402
from sloserve import LLM, SamplingParams  # noqa: E402
from sloserve.checkpoint.gguf import read_gguf  # noqa: E402
from sloserve.core.errors import ConfigError  # noqa: E402

VOCAB = 300
PROMPTS = [list(range(3, 40)), [7, 1, 9] * 12]


def test_every_fourth_layer_has_no_rope_and_greedy_tokens_equal_the_models(tmp_path):
    config = transformers.SmolLM3Config(
        vocab_size=VOCAB, hidden_size=64, num_hidden_layers=8, num_attention_heads=4, num_key_value_heads=2,
        intermediate_size=128, max_position_embeddings=256, initializer_range=0.2, pad_token_id=0,
    )  # fmt: skip
    assert config.no_rope_layers == [1, 1, 1, 0] * 2  # transformers' default: every fourth layer without
    torch.manual_seed(15)
    model = uneven_norms_(transformers.SmolLM3ForCausalLM(config).eval())
    path = tmp_path / "tiny-smollm3.gguf"
    write_gguf(path, model, {"add_tokenizer_model": "gpt2", "add_token_list": [f"t{i}" for i in range(VOCAB)]},
               arch="smollm3")  # fmt: skip
    assert read_gguf(path).hf_config["no_rope_layers"] == config.no_rope_layers
    llm = LLM(str(path), kv_capacity_tokens=512)
    params = SamplingParams(max_tokens=16, temperature=0, ignore_eos=True)
    outputs = llm.generate([{"prompt_token_ids": ids} for ids in PROMPTS], params)
    assert [o.outputs[0].token_ids for o in outputs] == [greedy(model, ids, 16) for ids in PROMPTS]


def test_granites_scales_read_from_llama_cpps_keys(tmp_path):
    config = transformers.GraniteConfig(
        vocab_size=VOCAB, hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
        intermediate_size=128, max_position_embeddings=256, initializer_range=0.2, embedding_multiplier=12.0,
        residual_multiplier=0.22, attention_multiplier=0.0625, logits_scaling=16.0,
    )  # fmt: skip
    torch.manual_seed(16)
    model = uneven_norms_(transformers.GraniteForCausalLM(config).eval())
    path = tmp_path / "tiny-granite.gguf"
    fields = {
        "add_tokenizer_model": "gpt2", "add_token_list": [f"t{i}" for i in range(VOCAB)], "add_embedding_scale": 12.0,
        "add_residual_scale": 0.22, "add_attention_scale": 0.0625, "add_logit_scale": 16.0,
    }  # fmt: skip
    write_gguf(path, model, fields, arch="granite")
    read = read_gguf(path).hf_config
    assert [read[k] for k in ("embedding_multiplier", "residual_multiplier", "attention_multiplier", "logits_scaling")] \
        == pytest.approx([12.0, 0.22, 0.0625, 16.0])  # fmt: skip
    assert_greedy_tokens_and_logprobs(LLM(str(path), kv_capacity_tokens=512), model, PROMPTS)


def test_olmo_2s_norms_after_attention_and_the_mlp(tmp_path):
    config = transformers.Olmo2Config(
        vocab_size=VOCAB, hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
        intermediate_size=128, max_position_embeddings=256, initializer_range=0.2, pad_token_id=0,
    )  # fmt: skip
    torch.manual_seed(17)
    model = uneven_norms_(transformers.Olmo2ForCausalLM(config).eval())
    path = tmp_path / "tiny-olmo2.gguf"
    tokens = {"add_tokenizer_model": "gpt2", "add_token_list": [f"t{i}" for i in range(VOCAB)]}
    write_gguf(path, model, tokens, arch="olmo2")
    assert_greedy_tokens_and_logprobs(LLM(str(path), kv_capacity_tokens=512), model, PROMPTS)
    olmo3 = tmp_path / "olmo3.gguf"  # llama.cpp's Olmo 3: olmo2 with a window on three layers of four
    write_gguf(olmo3, model, {**tokens, "add_sliding_window": 4096}, arch="olmo2")
    with pytest.raises(ConfigError, match="olmo2.attention.sliding_window 4096 .*Olmo 3.* is not supported"):
        LLM(str(olmo3), kv_capacity_tokens=256)
