"""A SmolLM3 GGUF file (``general.architecture = smollm3``), written here as llama.cpp's converter writes
one: its Llama converter's (Q and K rows permuted), and nothing of which layers have no rotary embedding
(llama.cpp's code says every fourth, as SmolLM3's config does by default). The engine gives the greedy
tokens of the transformers model the file was written from."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")
pytest.importorskip("gguf")

from gguf_files import uneven_norms_, write_gguf  # noqa: E402

from sloserve import LLM, SamplingParams  # noqa: E402
from sloserve.checkpoint.gguf import read_gguf  # noqa: E402

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
    with torch.no_grad():
        expected = [
            model.generate(torch.tensor([ids]), max_new_tokens=16, min_new_tokens=16, do_sample=False)[0, len(ids) :]
            for ids in PROMPTS
        ]
    assert [o.outputs[0].token_ids for o in outputs] == [e.tolist() for e in expected]
