"""A Phi-3 GGUF file (``general.architecture = phi3``), written here as llama.cpp's converter writes Phi-3
mini: Q/K/V and gate/up fused (``attn_qkv``, ``ffn_up``), unpermuted, every layer's sliding window
(``phi3.attention.sliding_window``; 0 for Phi-4, which has none), a SentencePiece vocabulary with
``<|end|>`` and ``<|endoftext|>`` added. The engine reads the tokens transformers' GGUF reader reads
(Phi-3 puts a space before any text, one that starts with spaces too), ends a turn at ``<|end|>``, and
gives the greedy tokens of the transformers model the file was written from."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")
pytest.importorskip("gguf")

from gguf_files import assert_reads_as_transformers, sentencepiece_vocabulary, write_gguf  # noqa: E402

from hf_models import greedy  # noqa: E402
from sloserve import LLM, SamplingParams  # noqa: E402
from sloserve.checkpoint.gguf import read_gguf  # noqa: E402

CORPUS = [
    "Hello world, how are you today? The weather is fine.",
    "Phi models answer questions, said the café owner.",
] * 20
TEXTS = ["Hello world, how are you today?", "  two leading spaces and   three inside", "café ✓ 🙂<|end|>after"]
ADDED = ("<|endoftext|>", "<|user|>", "<|end|>")
WINDOW = 8  # shorter than the tests' contexts


def tiny_phi3(vocab_size: int, window: int | None):
    config = transformers.Phi3Config(
        vocab_size=vocab_size, hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
        intermediate_size=128, max_position_embeddings=256, sliding_window=window, initializer_range=0.2,
        pad_token_id=0, bos_token_id=1, eos_token_id=vocab_size - 3,
    )  # fmt: skip
    torch.manual_seed(14)
    model = transformers.Phi3ForCausalLM(config).eval()
    with torch.no_grad():
        for p in model.parameters():
            if p.ndim == 1:
                p.mul_(1 + 0.1 * torch.randn_like(p))
    return model


def write_phi3_gguf(path, model, vocabulary, window: int, tensors=None) -> None:
    tokens, scores, types = vocabulary
    fields = {
        "add_tokenizer_model": "llama",
        "add_tokenizer_pre": "default",
        "add_token_list": tokens,
        "add_token_scores": scores,
        "add_token_types": types,
        "add_bos_token_id": 1,
        "add_eos_token_id": tokens.index("<|endoftext|>"),
        "add_unk_token_id": 0,
        "add_sliding_window": window,
    }
    write_gguf(path, model, fields, arch="phi3", tensors=tensors)


@pytest.fixture(scope="module")
def phi3(tmp_path_factory):
    vocabulary = sentencepiece_vocabulary(CORPUS, ADDED)
    model = tiny_phi3(len(vocabulary[0]), WINDOW)
    path = tmp_path_factory.mktemp("phi3-gguf") / "tiny-phi3.gguf"
    write_phi3_gguf(path, model, vocabulary, WINDOW)
    return path, model, vocabulary[0]


def test_tokens_and_text_equal_transformers_gguf_reading(phi3):
    path, _, tokens = phi3
    llm = LLM(str(path), kv_capacity_tokens=1024)
    assert_reads_as_transformers(llm, path, TEXTS)
    leading = [tokens[i] for i in llm.tokenizer.encode(TEXTS[1])]
    assert "".join(leading[1:]).startswith("\u2581\u2581\u2581two")  # a space before the text's two
    config = read_gguf(path).hf_config
    assert config["sliding_window"] == WINDOW
    # <|end|> and <|endoftext|> end a generation (llama.cpp's end-of-generation texts)
    assert config["eos_token_id"] == sorted(tokens.index(t) for t in ("<|endoftext|>", "<|end|>"))


def test_greedy_tokens_equal_the_models_past_its_window(phi3):
    path, model, _ = phi3
    llm = LLM(str(path), kv_capacity_tokens=1024)
    for text in (TEXTS[0] * 3, TEXTS[1] * 2):
        ids = llm.tokenizer.encode(text)
        assert len(ids) > WINDOW
        expected = greedy(model, ids, 16)
        [out] = llm.generate({"prompt_token_ids": ids}, SamplingParams(max_tokens=16, temperature=0, ignore_eos=True))
        assert out.outputs[0].token_ids == expected


def test_phi_4s_zero_window_is_none(tmp_path):
    vocabulary = sentencepiece_vocabulary(CORPUS, ADDED)
    model = tiny_phi3(len(vocabulary[0]), None)
    path = tmp_path / "phi4-like.gguf"
    write_phi3_gguf(path, model, vocabulary, 0)
    assert read_gguf(path).hf_config["sliding_window"] is None
    llm = LLM(str(path), kv_capacity_tokens=256)
    ids = llm.tokenizer.encode(TEXTS[0] * 2)
    expected = greedy(model, ids, 8)
    [out] = llm.generate({"prompt_token_ids": ids}, SamplingParams(max_tokens=8, temperature=0, ignore_eos=True))
    assert out.outputs[0].token_ids == expected
