"""Gemma GGUF files. A Gemma 3 file (``general.architecture = gemma3``), written here as llama.cpp's
converter writes one: norms stored as 1 + weight, Q and K unpermuted, a tied embedding, the sliding window but not which
layers slide (llama.cpp's code says every sixth layer is global, their rope base 10,000), the 4B-27B
models' linear rope scaling, and a SentencePiece vocabulary without a space before the text whose runs of
spaces are spelled as spaces and whose scores do not follow its merges. The engine reads the tokens
transformers' GGUF reader reads, ends a turn at ``<end_of_turn>``, and gives the greedy tokens of the
transformers model the file was written from. A Gemma 2 file (``gemma2``) the same way, with its every
other layer global and its capped scores and logits (``attn_logit_softcapping``,
``final_logit_softcapping``), and a Gemma 1 file (``gemma``: Llama's tensors, its norms shifted)."""

from __future__ import annotations

import random

import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")
gguf = pytest.importorskip("gguf")

from gguf_files import assert_reads_as_transformers, write_gguf  # noqa: E402

from hf_models import greedy, prompt_logprobs  # noqa: E402
from sloserve import LLM, SamplingParams  # noqa: E402
from sloserve.checkpoint.gguf import read_gguf  # noqa: E402
from sloserve.core.errors import ConfigError  # noqa: E402

CORPUS = [
    "Hello world, how are you today? The weather is fine and the café is open.",
    "Serving language models is about latency and throughput, said the owner of the café.",
] * 20
TEXTS = [
    "Hello world, how are you?",
    "  two leading spaces and   three inside,    four",
    "café naïve ✓ 🙂\nand a line\n\nbreak",
    "<start_of_turn>user\nHow is the weather?<end_of_turn>\n<start_of_turn>model\n",
]
SPECIAL = ["<pad>", "<eos>", "<bos>", "<unk>", "<mask>", "<start_of_turn>", "<end_of_turn>"]
SPACES = ["  ", "   ", "    "]  # NOTE: runs of spaces as the converter writes them: spaces, not "▁"s
NEWLINES = ["\n", "\n\n"]
EOS, END_OF_TURN = 1, 6
WINDOW = 8  # shorter than the tests' contexts
TEMPLATE = (
    "{{ bos_token }}{% for m in messages %}<start_of_turn>{{ 'model' if m['role'] == 'assistant' else m['role'] }}\n"
    "{{ m['content'] }}<end_of_turn>\n{% endfor %}{% if add_generation_prompt %}<start_of_turn>model\n{% endif %}"
)


def gemma_vocabulary() -> tuple[list[str], list[float], list[int]]:
    """(tokens, scores, types): the special tokens (control; <unk> type 2), runs of spaces, runs of
    newlines (user-defined), the 256 byte tokens, then BPE pieces learned without a space before the
    text, in the order they were merged, their scores shuffled (Gemma's do not follow that order)."""
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers

    trained = Tokenizer(models.BPE())
    trained.pre_tokenizer = pre_tokenizers.Metaspace(replacement="\u2581", prepend_scheme="never", split=True)
    trained.train_from_iterator(CORPUS, trainers.BpeTrainer(vocab_size=300))
    vocab = trained.get_vocab()
    pieces = sorted(vocab, key=vocab.get)
    tokens = [*SPECIAL, *SPACES, *NEWLINES, *(f"<0x{b:02X}>" for b in range(256)), *pieces]
    types = [3, 3, 3, 2, 3, 3, 3] + [1] * len(SPACES) + [4] * len(NEWLINES) + [6] * 256 + [1] * len(pieces)
    ranks = list(range(len(pieces)))
    random.Random(3).shuffle(ranks)
    scores = [0.0] * (len(tokens) - len(pieces)) + [-float(rank) for rank in ranks]
    return tokens, scores, types


def gemma_model(model_class, config, seed: int):
    """A random transformers Gemma of ``config`` whose norms count (0 at init: Gemma's norms scale by 1 + weight)."""
    torch.manual_seed(seed)
    model = model_class(config).eval()
    with torch.no_grad():
        for p in model.parameters():
            if p.ndim == 1:
                p.add_(0.1 * torch.randn_like(p))
    return model


def vocabulary_fields(tokens: list[str], scores: list[float], types: list[int]) -> dict:
    """The GGUF fields of ``gemma_vocabulary``'s tokenizer, as llama.cpp's converter writes a Gemma's."""
    return {
        "add_tokenizer_model": "llama", "add_token_list": tokens, "add_token_scores": scores,
        "add_token_types": types, "add_bos_token_id": 2, "add_eos_token_id": EOS, "add_add_space_prefix": False,
    }  # fmt: skip


def tiny_gemma3(vocab_size: int, layers: int = 6, heads: int = 4, scaling: bool = True):
    """A random transformers Gemma 3 with its default layer pattern (every sixth layer global) and rope
    bases, linear scaling on the global layers as 4B-27B have it, norms that count."""
    full = {"rope_type": "linear", "factor": 8.0, "rope_theta": 1e6} if scaling else {"rope_theta": 1e6}
    config = transformers.Gemma3TextConfig(
        vocab_size=vocab_size, hidden_size=64, num_hidden_layers=layers, num_attention_heads=heads,
        num_key_value_heads=2, head_dim=16, query_pre_attn_scalar=16 if layers != 62 else 64 // heads,
        intermediate_size=128, max_position_embeddings=512, sliding_window=WINDOW, initializer_range=0.2,
        rope_parameters={"full_attention": full, "sliding_attention": {"rope_type": "default", "rope_theta": 1e4}},
    )  # fmt: skip
    return gemma_model(transformers.Gemma3ForCausalLM, config, 8)


def write_gemma3_gguf(path, model, tokens, scores, types, **extra) -> None:
    fields = {
        **vocabulary_fields(tokens, scores, types),
        "add_unk_token_id": 3,
        "add_pad_token_id": 0,
        "add_add_bos_token": True,
        "add_chat_template": TEMPLATE,
        "add_sliding_window": WINDOW,
        "add_rope_scaling_type": gguf.RopeScalingType.LINEAR,
        "add_rope_scaling_factor": 8.0,
        **extra,
    }
    write_gguf(path, model, fields, arch="gemma3")


@pytest.fixture(scope="module")
def gemma3(tmp_path_factory):
    tokens, scores, types = gemma_vocabulary()
    model = tiny_gemma3(len(tokens))
    path = tmp_path_factory.mktemp("gemma3-gguf") / "tiny-gemma3.gguf"
    write_gemma3_gguf(path, model, tokens, scores, types)
    return path, model, tokens


def test_the_file_reads_as_gemma_3_its_layers_its_rope_and_its_ends(gemma3):
    path, model, tokens = gemma3
    config = read_gguf(path).hf_config
    assert config["model_type"] == "gemma3_text"
    assert config["layer_types"] == model.config.layer_types == ["sliding_attention"] * 5 + ["full_attention"]
    assert (config["sliding_window"], config["rope_local_base_freq"], config["rope_theta"]) == (WINDOW, 1e4, 1e6)
    assert config["rope_scaling"] == {"rope_type": "linear", "factor": 8.0}
    assert config["query_pre_attn_scalar"] == 16  # head_dim's: 1B-12B
    assert config["eos_token_id"] == [EOS, END_OF_TURN]  # <end_of_turn> by its text, as llama.cpp
    llm = LLM(str(path), kv_capacity_tokens=1024)
    [out] = llm.generate(TEXTS[0], SamplingParams(max_tokens=8, temperature=0, logit_bias={END_OF_TURN: 100}))
    assert out.outputs[0].finish_reason == "stop" and out.outputs[0].token_ids == [END_OF_TURN]


def test_tokens_and_text_equal_transformers_gguf_reading(gemma3):
    path, _, tokens = gemma3
    llm = LLM(str(path), kv_capacity_tokens=1024)
    assert_reads_as_transformers(llm, path, TEXTS)
    # no space before the text: spaces come back as they were, leading ones too
    for text in TEXTS[:3]:
        assert llm.tokenizer.decode(llm.tokenizer.encode(text)) == text
    spaced = [tokens[i] for i in llm.tokenizer.encode(TEXTS[1])]
    assert spaced[:2] == ["<bos>", "  "] and "    " in spaced  # the runs' own tokens
    turn = llm.tokenizer.encode(TEXTS[3], add_special_tokens=False)
    assert turn[0] == 5 and END_OF_TURN in turn  # control tokens whole


def test_greedy_tokens_and_logprobs_equal_the_models_and_the_chat_prompt_has_one_bos(gemma3):
    path, model, _ = gemma3
    llm = LLM(str(path), kv_capacity_tokens=1024)
    unscaled = tiny_gemma3(model.config.vocab_size, scaling=False)
    unscaled.load_state_dict(model.state_dict())
    for text in (TEXTS[0] * 3, TEXTS[2]):
        ids = llm.tokenizer.encode(text)
        assert len(ids) > WINDOW
        expected = greedy(model, ids, 24)
        params = SamplingParams(max_tokens=24, temperature=0, ignore_eos=True, prompt_logprobs=0)
        [out] = llm.generate({"prompt_token_ids": ids}, params)
        assert out.outputs[0].token_ids == expected
        ours = [entry.logprob for entry in out.prompt_logprobs[1:]]
        assert ours == pytest.approx(prompt_logprobs(model, ids), abs=1e-4)
        # NOTE: the global layer's scaling moves them more than that: read without it, the file fails here
        assert ours != pytest.approx(prompt_logprobs(unscaled, ids), abs=1e-2)
    [chat] = llm.chat([[{"role": "user", "content": "Hello"}]], SamplingParams(max_tokens=1, temperature=0))
    assert chat.prompt_token_ids[:2] == [2, 5]  # <bos><start_of_turn>: the template's BOS, none added


def test_27b_scales_scores_by_hidden_over_heads(tmp_path):
    """llama.cpp scales Gemma 3 27B's scores (62 layers) by (hidden / heads) ** -0.5, its config.json's
    query_pre_attn_scalar (168); the others' by head_dim ** -0.5."""
    tokens, scores, types = gemma_vocabulary()
    model = tiny_gemma3(len(tokens), layers=62, heads=2)
    path = tmp_path / "tiny-gemma3-62.gguf"
    write_gemma3_gguf(path, model, tokens, scores, types)
    assert read_gguf(path).hf_config["query_pre_attn_scalar"] == 32 == model.config.query_pre_attn_scalar
    llm = LLM(str(path), kv_capacity_tokens=256)
    ids = llm.tokenizer.encode(TEXTS[0])
    expected = greedy(model, ids, 6)
    [out] = llm.generate({"prompt_token_ids": ids}, SamplingParams(max_tokens=6, temperature=0, ignore_eos=True))
    assert out.outputs[0].token_ids == expected


def test_a_layer_pattern_that_fits_no_layer_count_is_refused(tmp_path, gemma3):
    _, model, tokens = gemma3
    _, scores, types = gemma_vocabulary()
    path = tmp_path / "bad-pattern.gguf"
    write_gemma3_gguf(path, model, tokens, scores, types, add_sliding_window_pattern=[True, False])
    with pytest.raises(ConfigError, match="sliding_window_pattern is \\[True, False\\]; it needs a period or one flag"):
        LLM(str(path), kv_capacity_tokens=256)
    path = tmp_path / "pattern.gguf"  # one flag a layer: read as written
    write_gemma3_gguf(path, model, tokens, scores, types, add_sliding_window_pattern=[True, False] * 3)
    assert read_gguf(path).hf_config["layer_types"] == ["sliding_attention", "full_attention"] * 3


def test_gemma_2_reads_as_its_model_with_its_capped_scores(tmp_path):
    """Every other layer global (llama.cpp's pattern for Gemma 2), one rope base, scores capped at 2 and
    logits at 5 as the file says: prompt logprobs within 1e-4 of the transformers model's (read without
    the cap on the scores, they move by more than 0.05) and the same greedy tokens."""
    tokens, scores, types = gemma_vocabulary()
    config = transformers.Gemma2Config(
        vocab_size=len(tokens), hidden_size=64, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2,
        head_dim=16, query_pre_attn_scalar=16, intermediate_size=128, max_position_embeddings=512,
        sliding_window=WINDOW, attn_logit_softcapping=2.0, final_logit_softcapping=5.0, initializer_range=0.2,
    )  # fmt: skip
    model = gemma_model(transformers.Gemma2ForCausalLM, config, 16)
    path = tmp_path / "tiny-gemma2.gguf"
    fields = {
        **vocabulary_fields(tokens, scores, types),
        "add_sliding_window": WINDOW,
        "add_attn_logit_softcapping": 2.0,
        "add_final_logit_softcapping": 5.0,
    }
    write_gguf(path, model, fields, arch="gemma2")
    read = read_gguf(path).hf_config
    assert read["layer_types"] == model.config.layer_types == ["sliding_attention", "full_attention"] * 2
    assert (read["attn_logit_softcapping"], read["final_logit_softcapping"]) == (2.0, 5.0)
    llm = LLM(str(path), kv_capacity_tokens=1024)
    assert_reads_as_transformers(llm, path, [TEXTS[0] * 3])
    ids = llm.tokenizer.encode(TEXTS[0] * 3)
    assert len(ids) > WINDOW
    params = SamplingParams(max_tokens=16, temperature=0, ignore_eos=True, prompt_logprobs=0)
    [out] = llm.generate({"prompt_token_ids": ids}, params)
    expected = greedy(model, ids, 16)
    assert out.outputs[0].token_ids == expected
    ours = [entry.logprob for entry in out.prompt_logprobs[1:]]
    assert ours == pytest.approx(prompt_logprobs(model, ids), abs=1e-4)
    model.config.attn_logit_softcapping = None
    for layer in model.model.layers:
        layer.self_attn.attn_logit_softcapping = None
    assert ours != pytest.approx(prompt_logprobs(model, ids), abs=5e-2)


def test_gemma_1_reads_as_its_model(tmp_path):
    """A Gemma 1 file (CodeGemma's <end_of_turn> as its EOT): Llama's layers with Gemma's norms (stored as
    1 + weight), GeGLU MLP and scaled embeddings; prompt logprobs within 1e-4 of the transformers model's
    and the same greedy tokens."""
    tokens, scores, types = gemma_vocabulary()
    config = transformers.GemmaConfig(
        vocab_size=len(tokens), hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
        head_dim=16, intermediate_size=128, max_position_embeddings=512, initializer_range=0.2,
    )  # fmt: skip
    model = gemma_model(transformers.GemmaForCausalLM, config, 17)
    path = tmp_path / "tiny-gemma.gguf"
    fields = {**vocabulary_fields(tokens, scores, types), "add_eot_token_id": END_OF_TURN}
    write_gguf(path, model, fields, arch="gemma")
    assert read_gguf(path).hf_config["eos_token_id"] == [EOS, END_OF_TURN]
    llm = LLM(str(path), kv_capacity_tokens=1024)
    # NOTE: transformers' GGUF reader refuses gemma files; llama.cpp writes their vocabulary as Gemma 2's
    same_vocabulary = tmp_path / "vocabulary" / "gemma2.gguf"
    same_vocabulary.parent.mkdir()
    write_gguf(same_vocabulary, model, fields, arch="gemma2")
    assert_reads_as_transformers(llm, same_vocabulary, TEXTS)
    ids = llm.tokenizer.encode(TEXTS[0] * 3)
    params = SamplingParams(max_tokens=16, temperature=0, ignore_eos=True, prompt_logprobs=0)
    [out] = llm.generate({"prompt_token_ids": ids}, params)
    assert out.outputs[0].token_ids == greedy(model, ids, 16)
    ours = [entry.logprob for entry in out.prompt_logprobs[1:]]
    assert ours == pytest.approx(prompt_logprobs(model, ids), abs=1e-4)
