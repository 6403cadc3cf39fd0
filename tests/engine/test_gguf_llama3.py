"""A Llama 3.x GGUF file written here (``gguf.GGUFWriter``) as llama.cpp's converter writes Llama 3.1 and
3.2: permuted Q and K, Llama 3's pre-tokenizer (``tokenizer.ggml.pre = llama-bpe``: digits in runs of at
most three), the rope scaling as a tensor of frequency factors (``rope_freqs.weight``), ``<|eot_id|>``
as the end of a turn beside EOS. The engine reads the tokens the model's tokenizer.json reads, and gives
the greedy tokens of transformers' model with the same ``llama3`` rope scaling."""

from __future__ import annotations

import json
import math

import numpy as np
import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")
gguf = pytest.importorskip("gguf")

from gguf_files import SPECIAL, TEXTS, USER_DEFINED, llama3_tokenizer, tiny_llama, write_gguf  # noqa: E402

from sloserve import LLM, SamplingParams  # noqa: E402
from sloserve.checkpoint.gguf import read_gguf  # noqa: E402
from sloserve.checkpoint.gguf_tokenizer import PRE_TOKENIZER_SPLITS  # noqa: E402
from sloserve.core.errors import ConfigError  # noqa: E402

ROPE = {"rope_type": "llama3", "rope_theta": 10000.0, "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
        "original_max_position_embeddings": 64}  # fmt: skip


def rope_factors(rope: dict, head_dim: int) -> list[float]:
    """llama.cpp's converter's ``rope_freqs`` of Llama 3.1's scaling: per frequency, the factor its
    wavelength is stretched by."""
    freqs = 1.0 / (rope["rope_theta"] ** (np.arange(0, head_dim, 2) / head_dim))
    old_len, factor = rope["original_max_position_embeddings"], rope["factor"]
    low_wavelen, high_wavelen = old_len / rope["low_freq_factor"], old_len / rope["high_freq_factor"]
    factors = []
    for freq in freqs:
        wavelen = 2 * math.pi / freq
        if wavelen < high_wavelen:
            factors.append(1.0)
        elif wavelen > low_wavelen:
            factors.append(factor)
        else:
            smooth = (old_len / wavelen - rope["low_freq_factor"]) / (
                rope["high_freq_factor"] - rope["low_freq_factor"]
            )
            factors.append(1 / ((1 - smooth) / factor + smooth))
    return factors


def hf_llama3(vocab_size: int, rope: dict | None):
    return tiny_llama(vocab_size, rope or {"rope_type": "default", "rope_theta": ROPE["rope_theta"]})


def write_llama3_gguf(path, model, tokenizer, pre: str = "llama-bpe") -> None:
    vocab = tokenizer.get_vocab()
    tokens = sorted(vocab, key=vocab.get)
    fields = {
        "add_tokenizer_model": "gpt2",
        "add_tokenizer_pre": pre,
        "add_token_list": tokens,
        "add_token_types": [3 if t in SPECIAL else 4 if t in USER_DEFINED else 1 for t in tokens],
        "add_token_merges": [" ".join(m) for m in json.loads(tokenizer.to_str())["model"]["merges"]],
        "add_bos_token_id": vocab["<|begin_of_text|>"],
        "add_eos_token_id": vocab["<|end_of_text|>"],
        "add_eot_token_id": vocab["<|eot_id|>"],
        "add_add_bos_token": True,
    }
    write_gguf(path, model, fields, rope_freqs=rope_factors(ROPE, model.config.head_dim))


@pytest.fixture(scope="module")
def llama3(tmp_path_factory):
    tokenizer = llama3_tokenizer()
    model = hf_llama3(tokenizer.get_vocab_size(), ROPE)
    path = tmp_path_factory.mktemp("llama3-gguf") / "tiny-llama3.gguf"
    write_llama3_gguf(path, model, tokenizer)
    return path, model, tokenizer


def test_the_file_reads_as_llama_3_its_tokens_its_ends_and_its_rope(llama3):
    from tokenizers import pre_tokenizers

    path, _, tokenizer = llama3
    config = read_gguf(path).hf_config
    vocab = tokenizer.get_vocab()
    assert config["eos_token_id"] == sorted([vocab["<|end_of_text|>"], vocab["<|eot_id|>"]])
    assert config["rope_scaling"]["rope_type"] == "frequency_factors"
    llm = LLM(str(path), kv_capacity_tokens=1024)
    reference = transformers.PreTrainedTokenizerFast(tokenizer_object=tokenizer)
    gpt2_split = transformers.PreTrainedTokenizerFast(tokenizer_object=llama3_tokenizer())
    gpt2_split.backend_tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    hf_gguf = transformers.AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name)  # transformers' reading
    for text in TEXTS:
        assert llm.tokenizer.encode(text) == reference(text)["input_ids"] == hf_gguf(text)["input_ids"]
    # the one EOS vLLM reports with stop_reason None (<|eot_id|> ends a generation too, as a stop token)
    assert llm.tokenizer.eos_token_id == hf_gguf.eos_token_id == vocab["<|end_of_text|>"]
    thinking = llm.tokenizer.encode(TEXTS[2])  # user-defined tokens: read whole, kept when decoding
    assert {vocab["<think>"], vocab["</think>"]} <= set(thinking) and llm.tokenizer.decode(thinking) == TEXTS[2]
    # NOTE: the split matters here: GPT-2's (the default) reads other tokens
    assert any(gpt2_split(text)["input_ids"] != reference(text)["input_ids"] for text in TEXTS)
    # <|eot_id|> ends a generation as EOS does (forced by a logit bias)
    eot = vocab["<|eot_id|>"]
    [out] = llm.generate(TEXTS[0], SamplingParams(max_tokens=8, temperature=0, logit_bias={eot: 100}))
    assert out.outputs[0].finish_reason == "stop" and out.outputs[0].token_ids == [eot]


def test_greedy_tokens_equal_transformers_with_llama3_rope_scaling(llama3):
    path, model, tokenizer = llama3
    llm = LLM(str(path), kv_capacity_tokens=1024)
    unscaled = hf_llama3(tokenizer.get_vocab_size(), None)
    unscaled.load_state_dict(model.state_dict())
    differs = False
    for text in TEXTS:
        ids = tokenizer.encode(text).ids
        with torch.no_grad():
            expected, plain = (
                m.generate(torch.tensor([ids]), max_new_tokens=24, min_new_tokens=24, do_sample=False)[0, len(ids) :]
                for m in (model, unscaled)
            )
        ours = llm.generate({"prompt_token_ids": ids}, SamplingParams(max_tokens=24, temperature=0, ignore_eos=True))
        assert ours[0].outputs[0].token_ids == expected.tolist()
        differs |= plain.tolist() != expected.tolist()
    assert differs  # NOTE: the scaling changes the tokens here: read without it, the file would fail this test


def test_a_file_whose_metadata_describes_more_than_its_tensors_is_refused_before_the_model_is_built(tmp_path):
    """A corrupt width (feed_forward_length 10**9 over a tiny model's tensors): one ConfigError from the tensors'
    shapes, not the allocation error of building the model the metadata describes (a raw RuntimeError, once)."""
    tokenizer = llama3_tokenizer()
    model = hf_llama3(tokenizer.get_vocab_size(), ROPE)
    model.config.intermediate_size = 10**9  # (the file's metadata only: its tensors are the model's)
    path = tmp_path / "wide.gguf"
    write_llama3_gguf(path, model, tokenizer)
    with pytest.raises(ConfigError, match=r"wide.gguf: the config describes a model of .* parameters, but the weights"):
        LLM(str(path), kv_capacity_tokens=256)


@pytest.mark.parametrize(
    "pre", ["tekken", "deepseek-r1-qwen", "smaug-bpe", "dbrx", "gpt-4o", "falcon-h1", "midm-2.0", "olmo", "mpt"]
)
def test_the_pre_tokenizer_a_file_names_reads_the_tokens_transformers_reads(tmp_path, pre):
    """Other names of llama.cpp's pre-tokenizers (Mistral Nemo's, DeepSeek-R1's Qwen distills', Phi-4 mini's,
    Falcon-H1's; OLMo's and MPT's, GPT-2's pattern): the engine splits text as transformers' GGUF reader does, and
    as the tokenizer.json trained with that split; a name neither knows is refused rather than read as GPT-2's, and a merge that is not two tokens
    that make a third by name."""
    tokenizer = llama3_tokenizer(PRE_TOKENIZER_SPLITS[pre])
    path = tmp_path / f"{pre}.gguf"
    write_llama3_gguf(path, hf_llama3(tokenizer.get_vocab_size(), ROPE), tokenizer, pre=pre)
    llm = LLM(str(path), kv_capacity_tokens=256)
    hf_gguf = transformers.AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name)
    for text in TEXTS:
        assert llm.tokenizer.encode(text) == tokenizer.encode(text).ids == hf_gguf(text)["input_ids"]
    merges = [" ".join(m) for m in json.loads(tokenizer.to_str())["model"]["merges"]]
    bad_merge = tmp_path / "bad-merge.gguf"  # (a TypeError from the tokenizers library, once)
    write_gguf(bad_merge, hf_llama3(tokenizer.get_vocab_size(), ROPE),
               {"add_tokenizer_model": "gpt2", "add_token_list": sorted(tokenizer.get_vocab(), key=tokenizer.get_vocab().get),
                "add_token_merges": [*merges[:3], "nospace", *merges[3:]]})  # fmt: skip
    with pytest.raises(ConfigError, match="GGUF merge 3 of tokenizer.ggml.merges is 'nospace', not two tokens"):
        LLM(str(bad_merge), kv_capacity_tokens=256)
    # (two tokens that make none: a panic in the tokenizers library, once, which no `except Exception` caught)
    write_gguf(bad_merge, hf_llama3(tokenizer.get_vocab_size(), ROPE),
               {"add_tokenizer_model": "gpt2", "add_token_list": sorted(tokenizer.get_vocab(), key=tokenizer.get_vocab().get),
                "add_token_merges": [*merges[:3], "<think> </think>", *merges[3:]]})  # fmt: skip
    with pytest.raises(
        ConfigError, match="merge 3 of tokenizer.ggml.merges is '<think> </think>', not two tokens .* that"
    ):
        LLM(str(bad_merge), kv_capacity_tokens=256)
    unknown = tmp_path / "unknown.gguf"
    write_llama3_gguf(unknown, hf_llama3(tokenizer.get_vocab_size(), ROPE), tokenizer, pre="nonesuch")
    with pytest.raises(ConfigError, match="pre-tokenizer 'nonesuch' \\(tokenizer.ggml.pre\\) is not supported"):
        LLM(str(unknown), kv_capacity_tokens=256)


@pytest.mark.parametrize("pre,whole", [("llama-bpe", True), ("tekken", True), ("lfm2", True), ("gpt-2", False)])
def test_a_piece_in_the_vocabulary_is_one_token_after_llama_3s_split(pre, whole):
    """llama.cpp's ``ignore_merges`` (and Llama 3's tokenizer.json's): after Llama 3's or Tekken's split, a piece
    that is a token is that token, although no merge makes it; GPT-2's split goes on merging (``ab`` + ``c``). The
    reference: the tokenizers library's BPE told the same, on the same vocabulary."""
    from tokenizers import Tokenizer, models, pre_tokenizers

    from sloserve.checkpoint.gguf import GGUFCheckpoint
    from sloserve.checkpoint.gguf_tokenizer import gguf_tokenizer

    tokens = [*pre_tokenizers.ByteLevel.alphabet(), "ab", "abc"]  # "abc": in the vocabulary, no merge reaches it
    metadata = {"tokenizer.ggml.model": "gpt2", "tokenizer.ggml.pre": pre, "tokenizer.ggml.tokens": tokens,
                "tokenizer.ggml.merges": ["a b"], "tokenizer.ggml.token_type": [1] * len(tokens)}  # fmt: skip
    ours = gguf_tokenizer(GGUFCheckpoint("tiny.gguf", {}, metadata))
    reference = Tokenizer(models.BPE({t: i for i, t in enumerate(tokens)}, [("a", "b")], ignore_merges=whole))
    reference.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    ids = ours.encode("abc").ids
    assert ids == reference.encode("abc").ids
    assert [tokens[i] for i in ids] == (["abc"] if whole else ["ab", "c"])
