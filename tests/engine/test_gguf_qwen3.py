"""A Qwen3 GGUF file written here (``gguf.GGUFWriter``) from a tiny random Qwen3 and a trained BPE
tokenizer, as llama.cpp's converter lays it out (architecture ``qwen3``, unpermuted Q and K, query and
key norms, Qwen's pre-tokenizer): the engine and transformers (``from_pretrained(gguf_file=...)``)
read the same tokens from the same text and give the same greedy tokens."""

from __future__ import annotations

import json

import numpy as np
import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")
gguf = pytest.importorskip("gguf")
pytest.importorskip("accelerate")  # transformers reads GGUF files only with it

from gguf_files import uneven_norms_, write_gguf  # noqa: E402

from chat_model import make_chat_model  # noqa: E402
from hf_models import VOCAB  # noqa: E402
from sloserve import LLM, SamplingParams  # noqa: E402

TEXTS = ["Hello world, how are you today?", "The quick brown fox's 12 jumps\n\nover  the dog."]


def write_qwen3_gguf(path, tokenizer_dir) -> None:
    # NOTE: head_dim 128, Qwen3's: transformers' GGUF reader does not read attention.key_length
    torch.manual_seed(4)
    c = transformers.Qwen3Config(
        vocab_size=VOCAB, hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
        head_dim=128, intermediate_size=128, max_position_embeddings=256, initializer_range=0.2,
    )  # fmt: skip
    model = uneven_norms_(transformers.Qwen3ForCausalLM(c).eval())
    tokenizer = json.loads((tokenizer_dir / "tokenizer.json").read_text())
    vocab = tokenizer["model"]["vocab"]
    tokens = sorted(vocab, key=vocab.get)
    special = {t["content"] for t in tokenizer["added_tokens"]}
    fields = {
        "add_tokenizer_model": "gpt2",
        "add_tokenizer_pre": "qwen2",
        "add_token_list": tokens,
        "add_token_types": [3 if t in special else 1 for t in tokens],
        "add_token_merges": [m if isinstance(m, str) else " ".join(m) for m in tokenizer["model"]["merges"]],
        "add_bos_token_id": vocab["<s>"],
        "add_eos_token_id": vocab["</s>"],
        "add_add_bos_token": False,
    }
    write_gguf(path, model, fields, arch="qwen3")


@pytest.fixture(scope="module")
def qwen3_gguf(tmp_path_factory):
    root = tmp_path_factory.mktemp("qwen3-gguf")
    write_qwen3_gguf(root / "tiny-qwen3.gguf", make_chat_model(root / "tokenizer"))
    return root / "tiny-qwen3.gguf"


def test_a_qwen3_gguf_file_gives_transformers_tokens(qwen3_gguf):
    reference = transformers.AutoModelForCausalLM.from_pretrained(
        qwen3_gguf.parent, gguf_file=qwen3_gguf.name, dtype=torch.float32
    ).eval()
    hf_tokenizer = transformers.AutoTokenizer.from_pretrained(qwen3_gguf.parent, gguf_file=qwen3_gguf.name)
    llm = LLM(str(qwen3_gguf), kv_capacity_tokens=1024)
    assert llm.loaded.config.model_type == "qwen3" and llm.loaded.config.head_dim == 128
    for text in TEXTS:
        ids = llm.tokenizer.encode(text)
        assert ids == hf_tokenizer.encode(text)
        with torch.no_grad():
            out = reference.generate(
                torch.tensor([ids]), max_new_tokens=12, min_new_tokens=12, do_sample=False, eos_token_id=None
            )
        ours = llm.generate({"prompt_token_ids": ids}, SamplingParams(max_tokens=12, temperature=0, ignore_eos=True))
        assert ours[0].outputs[0].token_ids == out[0, len(ids) :].tolist()
    assert np.isfinite(reference.lm_head.weight.detach().numpy()).all()
