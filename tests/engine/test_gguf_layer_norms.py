"""GGUF files of models with LayerNorms, as llama.cpp's converter writes them (Q and K unpermuted, each norm's
bias beside its weight, ``attention.layer_norm_epsilon``): StableLM (``stablelm``: a quarter of each head
rotated, ``rope.dimension_count``; q/k/v biases where the file has them) and StarCoder2 (``starcoder2``: every
projection's bias, its MLP's two matrices as ``ffn_up`` and ``ffn_down``). The engine gives the greedy tokens
and the log-probabilities of the transformers model the file was written from."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")
pytest.importorskip("gguf")

from gguf_files import assert_greedy_tokens_and_logprobs, uneven_norms_, write_gguf  # noqa: E402

from sloserve import LLM  # noqa: E402
from sloserve.checkpoint.gguf import read_gguf  # noqa: E402
from sloserve.core.errors import ConfigError  # noqa: E402

VOCAB = 300
PROMPTS = [list(range(3, 40)), [7, 1, 9] * 12]
TOKENS = {"add_tokenizer_model": "gpt2", "add_token_list": [f"t{i}" for i in range(VOCAB)]}


@torch.no_grad()
def with_biases_(model):
    """``model`` with its norms' and projections' biases (0 at init) drawn, so that they count."""
    for name, p in model.named_parameters():
        if name.endswith("bias"):
            p.normal_(0.0, 0.2)
    return uneven_norms_(model)


def test_stablelm_reads_as_its_model(tmp_path):
    config = transformers.StableLmConfig(
        vocab_size=VOCAB, hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
        intermediate_size=128, max_position_embeddings=256, use_qkv_bias=True, initializer_range=0.2, pad_token_id=0,
    )  # fmt: skip
    torch.manual_seed(36)
    model = with_biases_(transformers.StableLmForCausalLM(config).eval())
    path = tmp_path / "tiny-stablelm.gguf"
    write_gguf(path, model, {**TOKENS, "add_rope_dimension_count": 4, "add_parallel_residual": False}, arch="stablelm")
    read = read_gguf(path).hf_config
    assert (read["partial_rotary_factor"], read["use_qkv_bias"]) == (0.25, True)
    assert read["layer_norm_eps"] == pytest.approx(1e-5)  # (a float32 in the file)
    assert_greedy_tokens_and_logprobs(LLM(str(path), kv_capacity_tokens=512), model, PROMPTS)
    parallel = tmp_path / "parallel.gguf"  # StableLM 2 12B's layers
    write_gguf(
        parallel, model, {**TOKENS, "add_rope_dimension_count": 4, "add_parallel_residual": True}, arch="stablelm"
    )
    with pytest.raises(ConfigError, match="use_parallel_residual .*is not supported"):
        LLM(str(parallel), kv_capacity_tokens=256)


def test_starcoder2_reads_as_its_model(tmp_path):
    config = transformers.Starcoder2Config(
        vocab_size=VOCAB, hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
        intermediate_size=128, max_position_embeddings=256, sliding_window=None, initializer_range=0.2,
        pad_token_id=0, bos_token_id=1, eos_token_id=2, tie_word_embeddings=False,
    )  # fmt: skip
    torch.manual_seed(37)
    model = with_biases_(transformers.Starcoder2ForCausalLM(config).eval())
    path = tmp_path / "tiny-starcoder2.gguf"
    write_gguf(path, model, {**TOKENS, "add_tokenizer_pre": "starcoder"}, arch="starcoder2")
    read = read_gguf(path).hf_config
    assert (read["use_bias"], read["tie_word_embeddings"]) == (True, False)
    assert read["norm_epsilon"] == pytest.approx(1e-5)
    assert_greedy_tokens_and_logprobs(LLM(str(path), kv_capacity_tokens=512), model, PROMPTS)
