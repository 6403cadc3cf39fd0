"""Phi-4 mini's rotary embedding (and Phi-3.5's, the 128K Phi-3s'): LongRoPE, a short and a long factor per
frequency and cos and sin scaled by sqrt(1 + ln(s) / ln(L)), on the leading 3/4 of each head (partial
rotary), from an HF checkpoint and from a GGUF file as llama.cpp's converter writes one.

The engine picks one set of factors for all it serves, as vLLM does: the long ones when its context
(``max_model_len``) exceeds the pretrained one (64 here, of 256). transformers picks by the longest
position of each forward call; on a context wholly within or wholly past the pretrained one the two agree,
and there the engine's log-probabilities equal transformers'."""

from __future__ import annotations

import json
import math
import shutil

import numpy as np
import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from hf_models import LONGROPE, LONGROPE_PRETRAINED_CONTEXT, VOCAB, hf_model, prompt_logprobs  # noqa: E402
from sloserve import LLM, SamplingParams  # noqa: E402
from sloserve.core.errors import ConfigError  # noqa: E402
from sloserve.engine.llm_engine import LLMEngine  # noqa: E402
from sloserve.engine.loader import load_model  # noqa: E402

SHORT_PROMPT = [i * 7 % VOCAB for i in range(1, 41)]  # 40 + 12 generated: within the pretrained 64
LONG_PROMPT = [i * 11 % VOCAB for i in range(1, 81)]  # 80: past it from the first step
PARAMS = SamplingParams(max_tokens=12, temperature=0, logprobs=0, prompt_logprobs=0, ignore_eos=True)


@pytest.fixture(scope="module")
def phi4_mini(tmp_path_factory):
    path = tmp_path_factory.mktemp("hf-phi4-mini")
    model = hf_model("phi4_mini")
    model.save_pretrained(path)
    return path, model


def engine_logprobs(llm: LLM, prompt: list[int]) -> tuple[list[int], list[float]]:
    """(the sequence, the engine's log-probability of each of its tokens after the first)."""
    out = llm.generate({"prompt_token_ids": prompt}, PARAMS)[0]
    completion = out.outputs[0]
    scores = [entry.logprob for entry in out.prompt_logprobs[1:]] + [entry.logprob for entry in completion.logprobs]
    return prompt + completion.token_ids, scores


@pytest.mark.parametrize(("scheduler", "options"), [("vllm", {}), ("sarathi", {"prefill_token_budget": 16})])
@pytest.mark.parametrize(
    ("max_model_len", "prompt"), [(64, SHORT_PROMPT), (256, LONG_PROMPT)], ids=["short factors", "long factors"]
)
def test_logprobs_equal_transformers_with_either_set_of_factors(phi4_mini, scheduler, options, max_model_len, prompt):
    path, model = phi4_mini
    llm = LLM(str(path), scheduler, max_model_len=max_model_len, kv_capacity_tokens=512, block_size=4, **options)
    sequence, scores = engine_logprobs(llm, prompt)
    assert len(sequence) <= LONGROPE_PRETRAINED_CONTEXT or len(prompt) > LONGROPE_PRETRAINED_CONTEXT
    assert scores == pytest.approx(prompt_logprobs(model, sequence), abs=1e-4)


def test_an_engine_past_the_pretrained_context_uses_the_long_factors_everywhere(phi4_mini):
    """vLLM's choice: a short sequence served by an engine of 256 positions is rotated by the long factors,
    where transformers (its longest position within 64) uses the short ones: the log-probabilities part."""
    path, model = phi4_mini
    sequence, scores = engine_logprobs(LLM(str(path), kv_capacity_tokens=512), SHORT_PROMPT)
    assert max(abs(a - b) for a, b in zip(scores, prompt_logprobs(model, sequence), strict=True)) > 0.01


def test_one_loaded_model_serves_one_set_of_factors(phi4_mini):
    path, _ = phi4_mini
    loaded = load_model(str(path))
    LLMEngine(loaded, max_model_len=64, kv_capacity_tokens=256)
    LLMEngine(loaded, max_model_len=32, kv_capacity_tokens=256)  # the short factors too
    with pytest.raises(ConfigError, match="serves contexts of 64 tokens with LongRoPE's short factors .*load it again"):
        LLMEngine(loaded, max_model_len=65, kv_capacity_tokens=256)


def test_phi_3s_first_name_su_reads_as_longrope(phi4_mini, tmp_path):
    """The first 128K Phi-3 configs say ``rope_scaling.type: su`` (transformers reads it as longrope)."""
    path, model = phi4_mini
    shutil.copytree(path, tmp_path / "su")
    config = json.loads((tmp_path / "su" / "config.json").read_text())
    scaling = {k: v for k, v in config.pop("rope_parameters").items() if k.endswith("_factor")}
    config.update(rope_scaling={**scaling, "type": "su"}, rope_theta=LONGROPE["rope_theta"])
    (tmp_path / "su" / "config.json").write_text(json.dumps(config))
    sequence, scores = engine_logprobs(LLM(str(tmp_path / "su"), kv_capacity_tokens=512), LONG_PROMPT)
    assert scores == pytest.approx(prompt_logprobs(model, sequence), abs=1e-4)


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"short_factor": [1.0] * 8}, "longrope short_factor has 8 factors; the rotary embedding has 6 frequencies"),
        ({"long_factor": None}, "longrope rope scaling needs long_factor, a list of positive numbers"),
        ({"long_factor": [1.0, 2.0, 0.0, 1.0, 1.0, 1.0]}, "needs long_factor, a list of positive numbers"),
        ({"partial_rotary_factor": 1.5}, r"partial_rotary_factor must be in \(0, 1\], got 1.5"),
    ],
)
def test_bad_longrope_settings_are_one_clear_error(phi4_mini, tmp_path, change, message):
    path, _ = phi4_mini
    shutil.copytree(path, tmp_path / "bad")
    config = json.loads((tmp_path / "bad" / "config.json").read_text())
    config["rope_parameters"].update(change)
    (tmp_path / "bad" / "config.json").write_text(json.dumps(config))
    with pytest.raises(ConfigError, match=message):
        LLM(str(tmp_path / "bad"), kv_capacity_tokens=256)


def test_partial_rotary_is_refused_for_a_llama(tmp_path):
    """transformers' Llama rotates whole heads whatever partial_rotary_factor says: refused, not misread."""
    model = hf_model("llama")
    model.config.rope_parameters["partial_rotary_factor"] = 0.5
    model.save_pretrained(tmp_path)
    with pytest.raises(
        ConfigError,
        match="partial_rotary_factor 0.5 .* is not supported for llama \\(phi3, minimax_m2, glm, glm4, glm4_moe, phi, stablelm, nemotron, bamba, qwen3_next, qwen3_5_text, qwen3_5_moe_text only\\)",
    ):
        LLM(str(tmp_path), kv_capacity_tokens=256)


def write_phi4_mini_gguf(path, model, attn_factor: bool = True) -> None:
    """``model`` as llama.cpp's converter writes a Phi-4 mini: the rotated dimensions, the pretrained context,
    cos and sin's scale and the factors as two tensors."""
    from gguf_files import write_gguf

    rotary_dim = int(16 * LONGROPE["partial_rotary_factor"])
    scale = model.config.max_position_embeddings / LONGROPE_PRETRAINED_CONTEXT
    fields = {
        "add_tokenizer_model": "gpt2",
        "add_token_list": [f"t{i}" for i in range(VOCAB)],
        "add_rope_dimension_count": rotary_dim,
        "add_rope_scaling_orig_ctx_len": LONGROPE_PRETRAINED_CONTEXT,
        "add_sliding_window": 0,  # (Phi-4's: none)
    }
    if attn_factor:
        fields["add_rope_scaling_attn_factors"] = math.sqrt(1 + math.log(scale) / math.log(LONGROPE_PRETRAINED_CONTEXT))
    factors = {
        "rope_factors_long.weight": np.array(LONGROPE["long_factor"], dtype=np.float32),
        "rope_factors_short.weight": np.array(LONGROPE["short_factor"], dtype=np.float32),
    }
    write_gguf(path, model, fields, arch="phi3", tensors=factors)


@pytest.mark.parametrize(
    ("max_model_len", "prompt"), [(64, SHORT_PROMPT), (256, LONG_PROMPT)], ids=["short factors", "long factors"]
)
def test_a_gguf_file_gives_the_logprobs_of_the_model_it_was_written_from(phi4_mini, tmp_path, max_model_len, prompt):
    pytest.importorskip("gguf")
    _, model = phi4_mini
    path = tmp_path / "phi4-mini.gguf"
    write_phi4_mini_gguf(path, model)
    llm = LLM(str(path), max_model_len=max_model_len, kv_capacity_tokens=512)
    sequence, scores = engine_logprobs(llm, prompt)
    assert scores == pytest.approx(prompt_logprobs(model, sequence), abs=1e-4)


def test_a_gguf_files_longrope_reads_as_llama_cpp_reads_it(phi4_mini, tmp_path):
    """llama.cpp scales cos and sin by the file's attn_factor, 1 where it has none; it needs both tensors."""
    pytest.importorskip("gguf")
    from gguf_files import write_gguf

    from sloserve.checkpoint.gguf import read_gguf

    _, model = phi4_mini
    path = tmp_path / "unscaled.gguf"
    write_phi4_mini_gguf(path, model, attn_factor=False)
    config = read_gguf(path).hf_config
    assert config["partial_rotary_factor"] == 0.75
    assert config["rope_scaling"]["attention_factor"] == 1.0
    assert config["rope_scaling"]["short_factor"] == pytest.approx(LONGROPE["short_factor"])
    one_tensor = tmp_path / "one-tensor.gguf"
    fields = {"add_tokenizer_model": "gpt2", "add_token_list": [f"t{i}" for i in range(VOCAB)],
              "add_rope_dimension_count": 12, "add_rope_scaling_orig_ctx_len": LONGROPE_PRETRAINED_CONTEXT}  # fmt: skip
    write_gguf(one_tensor, model, fields, arch="phi3", tensors={"rope_factors_long.weight": np.ones(6, np.float32)})
    with pytest.raises(ConfigError, match="GGUF longrope scaling needs tensors .*missing: rope_factors_short.weight"):
        LLM(str(one_tensor), kv_capacity_tokens=256)


@pytest.mark.parametrize(
    ("max_model_len", "prompt"), [(64, SHORT_PROMPT), (256, LONG_PROMPT)], ids=["short factors", "long factors"]
)
def test_phi_3_5_moes_longrope_scales_by_its_own_mscales(tmp_path, max_model_len, prompt):
    """Phi-3.5-MoE (``phimoe``) scales cos and sin by its config's ``short_mscale`` or ``long_mscale`` (1.1 and
    1.35 here), not by LongRoPE's sqrt(1 + ln(s) / ln(L)), with the short or the long factors as its authors' code
    and vLLM do: transformers' log-probabilities with either set. NOTE: transformers 5.24's Phimoe turns by the
    short factors at every length (only its mscale switches): the reference for the long set is it with the long
    factors given as its short ones."""
    factors = {"short_factor": [1.0 + 0.1 * i for i in range(8)], "long_factor": [1.0 + 4.0 * i for i in range(8)]}
    rope = {"rope_type": "longrope", "rope_theta": 10000.0, **factors, "short_mscale": 1.1, "long_mscale": 1.35,
            "original_max_position_embeddings": LONGROPE_PRETRAINED_CONTEXT}  # fmt: skip
    sizes = dict(
        vocab_size=VOCAB, hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
        intermediate_size=32, num_local_experts=4, router_jitter_noise=0.3, max_position_embeddings=256,
        original_max_position_embeddings=LONGROPE_PRETRAINED_CONTEXT, initializer_range=0.2,
    )  # fmt: skip
    torch.manual_seed(5)
    model = transformers.PhimoeForCausalLM(transformers.PhimoeConfig(**sizes, rope_parameters=rope)).eval()
    model.save_pretrained(tmp_path)
    if max_model_len > LONGROPE_PRETRAINED_CONTEXT:  # (transformers' reference, its short factors the long ones)
        long_rope = {**rope, "short_factor": rope["long_factor"]}
        reference = transformers.PhimoeForCausalLM(transformers.PhimoeConfig(**sizes, rope_parameters=long_rope))
        reference.load_state_dict(model.state_dict())
        model = reference.eval()
    llm = LLM(str(tmp_path), max_model_len=max_model_len, kv_capacity_tokens=512, block_size=4)
    sequence, scores = engine_logprobs(llm, prompt)
    assert scores == pytest.approx(prompt_logprobs(model, sequence), abs=1e-4)
