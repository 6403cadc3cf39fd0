"""A GGUF file with a SentencePiece tokenizer (``tokenizer.ggml.model = llama``: Llama 2, Mistral 7B,
TinyLlama), written here as llama.cpp's converter writes one: pieces with scores and no merges, the byte
tokens ``<0x00>``..``<0xFF>``, ``<unk>``, ``<s>`` and ``</s>``. The engine reads the tokens transformers'
GGUF reader reads, decodes them back to the text (characters outside the vocabulary as their bytes),
and gives the greedy tokens of the model the file holds."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")
pytest.importorskip("gguf")

import gguf_files  # noqa: E402
from gguf_files import tiny_llama, write_gguf  # noqa: E402

from sloserve import LLM, SamplingParams  # noqa: E402
from sloserve.checkpoint.gguf_tokenizer import merges_from_scores  # noqa: E402
from sloserve.core.errors import ConfigError  # noqa: E402

CORPUS = [
    "Hello world, how are you today? The weather is fine.",
    "Serving language models is about latency and throughput, said the café owner.",
] * 20
TEXTS = [
    "Hello world, how are you?",
    "  two leading spaces and   three inside",
    "café naïve ✓ 🙂 and an emoji",
    "a line\nbreak, then</s>after the end",
]


def sentencepiece_vocabulary() -> tuple[list[str], list[float], list[int]]:
    return gguf_files.sentencepiece_vocabulary(CORPUS)


def write_sentencepiece_gguf(path, model, tokens, scores, types, bos: int = 1) -> None:
    fields = {
        "add_tokenizer_model": "llama",
        "add_token_list": tokens,
        "add_token_scores": scores,
        "add_token_types": types,
        "add_unk_token_id": 0,
        "add_bos_token_id": bos,
        "add_eos_token_id": 2,
    }
    write_gguf(path, model, fields)


@pytest.fixture(scope="module")
def sentencepiece_gguf(tmp_path_factory):
    tokens, scores, types = sentencepiece_vocabulary()
    model = tiny_llama(len(tokens), {"rope_type": "default", "rope_theta": 10000.0})
    path = tmp_path_factory.mktemp("spm-gguf") / "tiny-spm.gguf"
    write_sentencepiece_gguf(path, model, tokens, scores, types)
    return path, model, tokens


def test_tokens_and_text_equal_transformers_gguf_reading(sentencepiece_gguf):
    path, _, tokens = sentencepiece_gguf
    llm = LLM(str(path), kv_capacity_tokens=512)
    reference = transformers.AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name)
    for text in TEXTS:
        ids = llm.tokenizer.encode(text)
        assert ids == reference(text)["input_ids"], text
        assert ids[0] == 1  # <s>: a SentencePiece file that does not say otherwise adds BOS, as llama.cpp
        assert llm.tokenizer.decode(ids) == reference.decode(ids, skip_special_tokens=True)
    # spaces as the pieces' "▁", one before the text; characters outside the vocabulary as their bytes.
    # NOTE: a text that opens with spaces gets no "▁" before it, so decodes one short (transformers' too)
    for text in (TEXTS[0], TEXTS[2]):
        assert llm.tokenizer.decode(llm.tokenizer.encode(text)) == text
    emoji = llm.tokenizer.encode("🙂")
    assert [tokens[i] for i in emoji[-4:]] == ["<0xF0>", "<0x9F>", "<0x99>", "<0x82>"]
    assert 2 in llm.tokenizer.encode(TEXTS[3])  # "</s>" in the text: the control token, whole


def test_greedy_tokens_and_their_text_equal_the_models(sentencepiece_gguf):
    path, model, _ = sentencepiece_gguf
    llm = LLM(str(path), kv_capacity_tokens=512)
    for text in TEXTS[:2]:
        ids = llm.tokenizer.encode(text)
        with torch.no_grad():
            expected = model.generate(torch.tensor([ids]), max_new_tokens=16, min_new_tokens=16, do_sample=False)
        [out] = llm.generate({"prompt_token_ids": ids}, SamplingParams(max_tokens=16, temperature=0, ignore_eos=True))
        assert out.outputs[0].token_ids == expected[0, len(ids) :].tolist()
        assert out.outputs[0].text == llm.tokenizer.decode(out.outputs[0].token_ids)


def test_a_tokenizer_without_scores_a_vocabulary_or_with_a_bos_outside_is_refused(tmp_path, sentencepiece_gguf):
    _, model, tokens = sentencepiece_gguf
    _, scores, types = sentencepiece_vocabulary()
    path = tmp_path / "no-scores.gguf"
    write_sentencepiece_gguf(path, model, tokens, scores[:10], types)
    with pytest.raises(ConfigError, match="needs tokenizer.ggml.scores, one a token"):
        LLM(str(path), kv_capacity_tokens=256)
    path = tmp_path / "bos-outside.gguf"  # (an IndexError, once)
    write_sentencepiece_gguf(path, model, tokens, scores, types, bos=len(tokens))
    with pytest.raises(ConfigError, match=f"bos_token_id {len(tokens)} is outside the vocabulary"):
        LLM(str(path), kv_capacity_tokens=256)
    path = tmp_path / "no-vocabulary.gguf"  # (a KeyError, once)
    write_gguf(path, model, {"add_tokenizer_model": "llama", "add_vocab_size": len(tokens)})
    with pytest.raises(ConfigError, match="GGUF metadata has no tokenizer.ggml.tokens"):
        LLM(str(path), kv_capacity_tokens=256)


@settings(max_examples=200, deadline=None)
@given(st.lists(st.tuples(st.text("ab\u2581", min_size=1, max_size=5), st.integers(-5, 5)), min_size=1, max_size=40))
def test_merges_from_scores_rank_as_transformers_ranks_them(scored):
    """Ties of score and of parts' lengths (small alphabets, few scores) and tokens listed twice: the
    merges, in order, are transformers' ``generate_merges``'s."""
    from transformers.tokenization_utils_base import generate_merges

    tokens, scores = [t for t, _ in scored], [float(s) for _, s in scored]
    vocab = {token: index for index, token in enumerate(tokens)}
    assert merges_from_scores(tokens, scores) == generate_merges(vocab, dict(zip(tokens, scores, strict=True)))
