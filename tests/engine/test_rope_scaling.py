"""Rope scaling from an HF config (``rope_parameters``, ``rope_scaling`` before transformers 5): linear,
Llama 3.1's and YaRN (Qwen's long-context recipe) with its options. The engine's greedy tokens equal
transformers' on the same checkpoint, and differ from those of the same weights without the scaling (a
pretrained context of 32 positions, so that the scaling bites within the tests' contexts)."""

from __future__ import annotations

import json

import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from hf_models import VOCAB, greedy, hf_model, prompt_logprobs  # noqa: E402
from sloserve import LLM, SamplingParams  # noqa: E402
from sloserve.checkpoint.config import load_hf_config  # noqa: E402
from sloserve.core.errors import ConfigError  # noqa: E402

THETA = 10000.0
OLD = 32  # the "pretrained" context
SCALINGS = {
    "linear": {"rope_type": "linear", "factor": 2.0},
    "llama3": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
               "original_max_position_embeddings": OLD},
    "yarn": {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": OLD},
    "yarn, its options": {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": OLD,
                          "attention_factor": 1.3, "beta_fast": 8, "beta_slow": 2, "truncate": False},
    "yarn, DeepSeek's mscale": {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": OLD,
                                "mscale": 0.707, "mscale_all_dim": 1.0},
    "yarn, no factor": {"rope_type": "yarn", "factor": None, "original_max_position_embeddings": OLD},
}  # fmt: skip
PROMPTS = [list(range(3, 40)), [7, 1, 9] * 20]


def checkpoint(arch: str, scaling: dict | None):
    common = dict(vocab_size=VOCAB, hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                  intermediate_size=128, max_position_embeddings=256, initializer_range=0.2,
                  rope_parameters={"rope_theta": THETA, **(scaling or {"rope_type": "default"})})  # fmt: skip
    torch.manual_seed(11)
    if arch == "qwen3":
        model = transformers.Qwen3ForCausalLM(transformers.Qwen3Config(**common, head_dim=32))
    else:
        model = transformers.LlamaForCausalLM(transformers.LlamaConfig(**common))
    return model.eval()


@pytest.mark.parametrize(
    "arch, name", [("llama", name) for name in SCALINGS] + [("qwen3", "yarn")], ids=lambda x: str(x)
)
def test_greedy_tokens_with_rope_scaling_equal_transformers(tmp_path, arch, name):
    model = checkpoint(arch, SCALINGS[name])
    model.save_pretrained(tmp_path)
    assert_gives_the_scaled_tokens(model, arch, tmp_path)


def assert_gives_the_scaled_tokens(model, arch: str, path) -> None:
    """The engine on ``path`` gives ``model``'s greedy tokens, and the same weights unscaled give others."""
    unscaled = checkpoint(arch, None)
    unscaled.load_state_dict(model.state_dict())
    llm = LLM(str(path), kv_capacity_tokens=1024)
    params = SamplingParams(max_tokens=24, temperature=0, ignore_eos=True)
    outputs = llm.generate([{"prompt_token_ids": ids} for ids in PROMPTS], params)
    expected = [greedy(model, ids, 24) for ids in PROMPTS]
    assert [o.outputs[0].token_ids for o in outputs] == expected
    assert expected != [greedy(unscaled, ids, 24) for ids in PROMPTS]  # NOTE: the scaling matters here


def test_dynamic_ntk_is_plain_rope_within_the_context_and_an_unknown_scaling_is_refused_by_name(tmp_path):
    """Dynamic NTK (InternLM3's) stretches the base only past max_position_embeddings, which the engine never serves:
    transformers' greedy tokens, those of the same weights unscaled. A rope type the engine does not know is refused
    in one line naming it."""
    model = checkpoint("llama", {"rope_type": "dynamic", "factor": 2.0})
    model.save_pretrained(tmp_path)
    unscaled = checkpoint("llama", None)
    unscaled.load_state_dict(model.state_dict())
    params = SamplingParams(max_tokens=24, temperature=0, ignore_eos=True)
    outputs = LLM(str(tmp_path), kv_capacity_tokens=1024).generate([{"prompt_token_ids": p} for p in PROMPTS], params)
    expected = [greedy(model, ids, 24) for ids in PROMPTS]
    assert [o.outputs[0].token_ids for o in outputs] == expected == [greedy(unscaled, ids, 24) for ids in PROMPTS]
    raw = json.loads((tmp_path / "config.json").read_text())
    raw["rope_parameters"]["rope_type"] = "ntk_by_parts"
    (tmp_path / "config.json").write_text(json.dumps(raw))
    with pytest.raises(ConfigError, match="rope scaling 'ntk_by_parts' is not supported"):
        LLM(str(tmp_path), kv_capacity_tokens=256)


GGUF_TOKENS = {"add_tokenizer_model": "gpt2", "add_token_list": [f"t{i}" for i in range(VOCAB)]}


def gguf_rope_fields(scaling: dict) -> dict:
    """The ``rope.scaling.*`` keys llama.cpp's converter writes for an HF rope scaling."""
    import gguf

    fields = {
        "add_rope_scaling_type": gguf.RopeScalingType(scaling["rope_type"]),
        "add_rope_scaling_factor": scaling["factor"],
    }
    if scaling["rope_type"] == "yarn":
        fields["add_rope_scaling_orig_ctx_len"] = scaling["original_max_position_embeddings"]
        for hf_key, method in (("attention_factor", "add_rope_scaling_yarn_attn_factor"),
                               ("beta_fast", "add_rope_scaling_yarn_beta_fast"),
                               ("beta_slow", "add_rope_scaling_yarn_beta_slow")):  # fmt: skip
            if hf_key in scaling:
                fields[method] = float(scaling[hf_key])
    return fields


@pytest.mark.parametrize("name", ["linear", "yarn", "yarn, its options"])
def test_a_gguf_files_rope_scaling_gives_transformers_greedy_tokens(tmp_path, name):
    """The same scalings as a GGUF file's ``rope.scaling.*`` keys (a Llama's Q and K permuted, as the
    converter writes them): read back as the HF scaling they were written from."""
    pytest.importorskip("gguf")
    from gguf_files import write_gguf

    scaling = {k: v for k, v in SCALINGS[name].items() if k != "truncate"}  # (a GGUF file cannot say it)
    model = checkpoint("llama", scaling)
    path = tmp_path / "scaled.gguf"
    write_gguf(path, model, {**GGUF_TOKENS, **gguf_rope_fields(scaling)})
    assert_gives_the_scaled_tokens(model, "llama", path)


@pytest.mark.parametrize(
    "scaling, fields, message",
    [
        (
            {"rope_type": "longrope", "factor": 2.0},
            {},
            "rope scaling 'longrope' .* is not supported \\(linear, yarn\\)",
        ),
        ({"rope_type": "linear", "factor": 0.5}, {}, "rope.scaling.factor is 0.5; linear rope scaling needs one >= 1"),
        (
            SCALINGS["yarn"],
            {"add_rope_scaling_yarn_log_mul": 0.1},
            "yarn rope scaling with llama.rope.scaling.yarn_log",
        ),
        (SCALINGS["yarn"], {"add_rope_scaling_orig_ctx_len": 0}, "yarn rope scaling needs llama.rope.scaling.original"),
        (SCALINGS["linear"], {"add_rope_dimension_count": 8}, "rope.dimension_count 8 rotates part of a head of 16"),
    ],
    ids=["longrope", "factor", "log multiplier", "no context", "partial"],
)
def test_a_gguf_rope_the_engine_does_not_apply_is_refused_by_name(tmp_path, scaling, fields, message):
    pytest.importorskip("gguf")
    from gguf_files import write_gguf

    path = tmp_path / "refused.gguf"
    write_gguf(path, checkpoint("llama", None), {**GGUF_TOKENS, **gguf_rope_fields(scaling), **fields})
    with pytest.raises(ConfigError, match=message):
        LLM(str(path), kv_capacity_tokens=256)


def test_olmo_3s_scaling_is_its_full_layers_only(tmp_path):
    """OLMo 3's config as the Hub has it (``rope_theta`` and ``rope_scaling`` at the top level, as transformers
    before 5 wrote it): the scaling is its full layers' (one of four); its sliding layers' rope is not scaled.
    Log-probabilities over 90 positions (past the 64 it scales from) equal transformers'."""
    model = hf_model("olmo3")
    model.save_pretrained(tmp_path)
    config = json.loads((tmp_path / "config.json").read_text())
    full = config.pop("rope_parameters")["full_attention"]
    config.update(rope_theta=full.pop("rope_theta"), rope_scaling=full)
    (tmp_path / "config.json").write_text(json.dumps(config))
    ids = [(i * 7 + 3) % VOCAB for i in range(90)]
    out = LLM(str(tmp_path), kv_capacity_tokens=256).generate(
        {"prompt_token_ids": ids}, SamplingParams(max_tokens=1, prompt_logprobs=0)
    )[0]
    assert [e.logprob for e in out.prompt_logprobs[1:]] == pytest.approx(prompt_logprobs(model, ids), abs=1e-4)


def test_ministral_3s_queries_are_scaled_past_the_pretrained_context(tmp_path):
    """Ministral 3 (Llama 4's attention scaling): a query at position p is scaled by
    1 + beta ln(1 + floor(p / 16)) here; log-probabilities over 60 positions equal transformers', and
    the same weights without the scaling give others. Served as Mistral3ForConditionalGeneration ships it,
    its text_config's model_type (ministral3) is the one read."""
    model = hf_model("ministral3")
    model.save_pretrained(tmp_path / "text")
    ids = [(i * 7 + 3) % VOCAB for i in range(60)]
    params = SamplingParams(max_tokens=1, prompt_logprobs=0)
    scored = LLM(str(tmp_path / "text"), kv_capacity_tokens=256).generate({"prompt_token_ids": ids}, params)[0]
    ours = [e.logprob for e in scored.prompt_logprobs[1:]]
    assert ours == pytest.approx(prompt_logprobs(model, ids), abs=1e-4)
    unscaled = json.loads((tmp_path / "text" / "config.json").read_text())
    unscaled["rope_parameters"]["llama_4_scaling_beta"] = 0.0
    (tmp_path / "text" / "config.json").write_text(json.dumps(unscaled))
    plain = LLM(str(tmp_path / "text"), kv_capacity_tokens=256).generate({"prompt_token_ids": ids}, params)[0]
    assert max(abs(a - e.logprob) for a, e in zip(ours, plain.prompt_logprobs[1:], strict=True)) > 0.01
    multimodal = tmp_path / "multimodal"
    multimodal.mkdir()
    config = {"model_type": "mistral3", "text_config": model.config.to_dict(), "vision_config": {}}
    (multimodal / "config.json").write_text(json.dumps(config))
    assert load_hf_config(multimodal).llama4_scaling_beta == 0.5


def test_the_rotary_tables_hold_the_served_positions(hf_dirs):
    """An engine's rotary tables hold the positions of its context (``max_model_len``), not all of the model's
    (Llama 4 Scout's 10M would be 10 GB): the first rows of the whole tables; a longer context served after builds
    them again, a shorter one keeps them. Gemma 3's sliding layers' own tables too."""
    from sloserve.checkpoint.config import from_hf_config
    from sloserve.engine.models.llama import Rotary

    config = from_hf_config(hf_model("llama").config.to_dict())
    whole = Rotary(config).tables(torch.device("cpu"))
    rotary = Rotary(config)
    rotary.serve_context(40)
    assert all(torch.equal(t, w[:40]) for t, w in zip(rotary.tables(torch.device("cpu")), whole, strict=True))
    rotary.serve_context(20)
    assert rotary.tables(torch.device("cpu"))[0].shape == (40, config.rotary_dim)
    rotary.serve_context(100)
    assert rotary.tables(torch.device("cpu"))[0].shape == (100, config.rotary_dim)
    model = LLM(hf_dirs["gemma3"], max_model_len=48).loaded.model
    assert (
        model.rotary.tables(torch.device("cpu"))[0].shape[0]
        == model.local_rotary.tables(torch.device("cpu"))[0].shape[0]
        == 48
    )
