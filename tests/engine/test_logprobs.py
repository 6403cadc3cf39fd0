"""Log-probabilities of sampled and prompt tokens against transformers' log-softmax, in float32: the
same values whatever the policy, chunking, preemption or sampling temperature (they are the model's
raw distribution, as vLLM v1 reports by default)."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from hf_models import hf_model  # noqa: E402
from sloserve import LLM, SamplingParams  # noqa: E402
from sloserve.core.errors import ConfigError  # noqa: E402

PROMPTS = [[5, 17, 33, 2, 99, 120, 7], [i * 7 % 300 for i in range(1, 41)], [42, 43]]


@pytest.fixture(scope="module")
def llama(tmp_path_factory):
    path = tmp_path_factory.mktemp("hf-llama-logprobs")
    model = hf_model("llama")
    model.save_pretrained(path)
    return str(path), model


def hf_logprobs(model, token_ids: list[int]) -> torch.Tensor:  # (len - 1, vocab): position p + 1 given 0..p
    with torch.no_grad():
        logits = model(torch.tensor([token_ids])).logits[0].float()
    return torch.log_softmax(logits, dim=-1)[:-1]


def check(entry, expected: torch.Tensor, token_id: int, num_top: int) -> None:
    """One position's ``Logprobs`` against the reference row ``expected`` (vocab,)."""
    assert entry.token_id == token_id
    assert entry.logprob == pytest.approx(float(expected[token_id]), abs=1e-4)
    values, ids = expected.topk(num_top)
    assert len(entry.top_token_ids) == num_top
    assert entry.top_logprobs == pytest.approx(values.tolist(), abs=1e-4)
    # the same tokens, except where two of them tie within the tolerance
    for got, want, value in zip(entry.top_token_ids, ids.tolist(), values.tolist(), strict=True):
        assert got == want or float(expected[got]) == pytest.approx(value, abs=1e-4)


@pytest.mark.parametrize(
    ("scheduler", "options"),
    [
        ("vllm", {}),
        ("sarathi", {"prefill_token_budget": 8, "block_size": 4}),  # prompts scored over several chunks
        ("vllm", {"preemption_mode": "recompute", "block_size": 4}),  # refills must not score twice
    ],
)
def test_sampled_and_prompt_logprobs_equal_transformers(llama, scheduler, options):
    path, model = llama
    capacity = 64 if "preemption_mode" in options else None
    llm = LLM(path, scheduler, kv_capacity_tokens=capacity, **options)
    params = [
        SamplingParams(max_tokens=10, temperature=0, logprobs=3, prompt_logprobs=2, ignore_eos=True),
        SamplingParams(max_tokens=6, temperature=0.8, seed=1, logprobs=0, prompt_logprobs=0, ignore_eos=True),
        SamplingParams(max_tokens=12, temperature=1.5, seed=2, logprobs=5, ignore_eos=True),
    ]
    outputs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], params)
    assert (llm.engine.scheduler.num_preemptions > 0) == (capacity is not None)
    for out, prompt, p in zip(outputs, PROMPTS, params, strict=True):
        completion = out.outputs[0]
        tokens = prompt + completion.token_ids
        expected = hf_logprobs(model, tokens)
        assert len(completion.logprobs) == len(completion.token_ids)
        for i, (entry, token) in enumerate(zip(completion.logprobs, completion.token_ids, strict=True)):
            check(entry, expected[len(prompt) - 1 + i], token, p.logprobs)
        assert completion.cumulative_logprob == pytest.approx(sum(e.logprob for e in completion.logprobs))
        if p.prompt_logprobs is None:
            assert out.prompt_logprobs is None
            continue
        assert out.prompt_logprobs[0] is None and len(out.prompt_logprobs) == len(prompt)
        for position in range(1, len(prompt)):
            check(out.prompt_logprobs[position], expected[position - 1], prompt[position], p.prompt_logprobs)


def test_a_prompt_that_is_scored_is_computed_whole_even_when_cached(llama):
    """Prompt logprobs need every prompt token's hidden state: such a request finds nothing in the
    prefix cache, though the same prompt is cached."""
    llm = LLM(llama[0], block_size=4)
    prompt = {"prompt_token_ids": PROMPTS[1]}
    llm.generate(prompt, SamplingParams(max_tokens=2, temperature=0))
    again = llm.generate(prompt, SamplingParams(max_tokens=2, temperature=0))[0]
    scored = llm.generate(prompt, SamplingParams(max_tokens=2, temperature=0, prompt_logprobs=1))[0]
    assert again.num_cached_tokens > 0 and scored.num_cached_tokens == 0
    assert len(scored.prompt_logprobs) == len(PROMPTS[1])


@pytest.mark.parametrize("value", [-1, 21, True])
def test_logprobs_outside_0_to_20_are_refused(value):
    with pytest.raises(ConfigError, match=r"logprobs must be an integer in \[0, 20\]"):
        SamplingParams(logprobs=value)


@pytest.mark.parametrize("arch", ["gemma3", "mistral", "gemma2"])
@pytest.mark.parametrize("backend", ["torch", "triton"])
@pytest.mark.parametrize(("scheduler", "options"), [("vllm", {}), ("sarathi", {"prefill_token_budget": 8})])
def test_sliding_window_layers_equal_transformers_past_their_window(tmp_path, scheduler, options, backend, arch):
    """Gemma 2's and 3's sliding layer and Mistral 7B v0.1's every layer see 8 positions (Gemma 2's
    scores capped at 2, by each backend: without the cap its logprobs move by up to ~4): prompt logprobs
    (prefilled whole or in chunks of 8) and decode logprobs over contexts of 30-42 tokens equal
    transformers' (reading the whole context in such a layer moves them by up to ~2 nats), with the
    PyTorch reference and the Triton kernels (in Triton's interpreter without CUDA)."""
    if backend == "triton":
        pytest.importorskip("triton")
    model = hf_model(arch)
    model.save_pretrained(tmp_path)
    prompt = PROMPTS[1][:30]
    llm = LLM(str(tmp_path), scheduler, block_size=4, attention_backend=backend, **options)
    params = SamplingParams(max_tokens=12, temperature=0, logprobs=2, prompt_logprobs=2, ignore_eos=True)
    out = llm.generate({"prompt_token_ids": prompt}, params)[0]
    completion = out.outputs[0]
    expected = hf_logprobs(model, prompt + completion.token_ids)
    for position in range(1, len(prompt)):
        check(out.prompt_logprobs[position], expected[position - 1], prompt[position], 2)
    for i, (entry, token) in enumerate(zip(completion.logprobs, completion.token_ids, strict=True)):
        check(entry, expected[len(prompt) - 1 + i], token, 2)


def test_granites_scaled_logits_give_transformers_logprobs(tmp_path):
    """Granite divides its logits by logits_scaling (16 here): the greedy tokens do not show it, the
    log-probabilities do (they would be 16 times as sharp without it)."""
    model = hf_model("granite")
    model.save_pretrained(tmp_path)
    prompt = PROMPTS[1][:20]
    llm = LLM(str(tmp_path))
    params = SamplingParams(max_tokens=6, temperature=0, logprobs=2, prompt_logprobs=2, ignore_eos=True)
    out = llm.generate({"prompt_token_ids": prompt}, params)[0]
    expected = hf_logprobs(model, prompt + out.outputs[0].token_ids)
    for position in range(1, len(prompt)):
        check(out.prompt_logprobs[position], expected[position - 1], prompt[position], 2)
    for i, (entry, token) in enumerate(zip(out.outputs[0].logprobs, out.outputs[0].token_ids, strict=True)):
        check(entry, expected[len(prompt) - 1 + i], token, 2)
