"""The sampler: greedy rows, the distribution of sampled rows (temperature, top-p), rows independent."""

from __future__ import annotations

import math

import numpy as np
import pytest

torch = pytest.importorskip("torch")

from sloserve.engine.sampler import SamplingParams, sample  # noqa: E402

PROBS = np.array([0.5, 0.3, 0.15, 0.05])
DRAWS = 20_000


def _frequencies(params: SamplingParams, logits: torch.Tensor, seed: int = 0) -> np.ndarray:
    """Token frequencies of ``DRAWS`` rows of ``logits`` sampled at once, each with its own generator."""
    rows = logits.expand(DRAWS, -1)
    generators = [np.random.default_rng([seed, i]) for i in range(DRAWS)]
    tokens = sample(rows, [params] * DRAWS, generators)
    return np.bincount(tokens, minlength=logits.shape[-1]) / DRAWS


def test_sampled_rows_follow_the_softmax_at_their_temperature():
    logits = torch.tensor(np.log(PROBS), dtype=torch.float32)
    # 4 standard deviations of a frequency at 20k draws is at most 0.014.
    np.testing.assert_allclose(_frequencies(SamplingParams(temperature=1.0), logits), PROBS, atol=0.014)
    hot = PROBS**0.5 / (PROBS**0.5).sum()  # temperature 2: softmax(log p / 2)
    np.testing.assert_allclose(_frequencies(SamplingParams(temperature=2.0), logits), hot, atol=0.014)


def test_top_p_keeps_the_smallest_prefix_that_reaches_it():
    logits = torch.tensor(np.log(PROBS), dtype=torch.float32)
    # 0.5 < 0.7, so the second token stays; 0.5 + 0.3 >= 0.7, so the others go.
    freq = _frequencies(SamplingParams(temperature=1.0, top_p=0.7), logits)
    assert freq[2] == freq[3] == 0
    np.testing.assert_allclose(freq[:2], [0.5 / 0.8, 0.3 / 0.8], atol=0.014)
    # A top_p below the largest probability keeps that token alone.
    assert _frequencies(SamplingParams(temperature=1.0, top_p=0.2), logits)[0] == 1


def test_greedy_rows_take_the_argmax_and_rows_do_not_depend_on_each_other():
    gen = torch.Generator().manual_seed(0)
    logits = torch.randn(6, 50, generator=gen)
    params = [SamplingParams(temperature=0), SamplingParams(temperature=0.8, top_p=0.9),
              SamplingParams(temperature=1.3), SamplingParams(temperature=0),
              SamplingParams(temperature=0.5, top_p=0.5), SamplingParams(temperature=1.0)]  # fmt: skip
    tokens = sample(logits, params, [np.random.default_rng(i) for i in range(6)])
    assert tokens[0] == int(logits[0].argmax()) and tokens[3] == int(logits[3].argmax())
    for i in range(6):  # each row alone, with a generator in the same state, samples the same token
        assert sample(logits[i : i + 1], [params[i]], [np.random.default_rng(i)]) == [tokens[i]]


@pytest.mark.parametrize("temperature", [float("inf"), float("nan"), -0.5])
def test_a_temperature_that_is_not_a_finite_number_at_least_0_is_refused(temperature):
    """inf once sampled uniformly at random, silently."""
    from sloserve.core.errors import ConfigError

    with pytest.raises(ConfigError, match="temperature must be a finite number >= 0"):
        SamplingParams(temperature=temperature)


def test_score_controls_equal_a_hand_computation():
    """Row 0: logit_bias, repetition (prompt and output tokens), frequency and presence penalties, in
    vLLM's order; row 1: min_tokens masks EOS and the stop token ids; row 2: no control, untouched."""
    from sloserve.engine.sampler import apply_controls

    logits = torch.tensor([[2.0, -1.0, 0.5, 3.0, -0.5]] * 3)
    params = [
        SamplingParams(logit_bias={4: 2.0}, repetition_penalty=1.5, frequency_penalty=0.4, presence_penalty=0.3),
        SamplingParams(min_tokens=3, stop_token_ids=(0,)),
        SamplingParams(),
    ]
    history = [0, 2, 3, 3, 1]  # prompt [0, 2], output [3, 3, 1]
    apply_controls(logits, params, [history, [0, 2, 3], history], [2, 2, 2], frozenset({4}))
    # token 0: in the prompt, 2 / 1.5; token 1: -1 * 1.5 - 0.4 x 1 - 0.3; token 2: 0.5 / 1.5;
    # token 3: 3 / 1.5 - 0.4 x 2 - 0.3; token 4: -0.5 + 2 (not seen: no repetition penalty)
    expected = [2 / 1.5, -1.5 - 0.4 - 0.3, 0.5 / 1.5, 2.0 - 0.8 - 0.3, 1.5]
    np.testing.assert_allclose(logits[0].numpy(), expected, rtol=1e-6)
    assert sample(logits[:1], [SamplingParams(temperature=0)], [None]) == [4]  # greedy moved off token 3
    assert logits[1, 0] == logits[1, 4] == -math.inf and logits[1, 3] == 3.0
    assert logits[2].tolist() == [2.0, -1.0, 0.5, 3.0, -0.5]


@pytest.mark.parametrize(
    ("field", "value", "message"),
    [
        ("presence_penalty", 2.5, r"presence_penalty must be in \[-2, 2\]"),
        ("repetition_penalty", 0.0, r"repetition_penalty must be in \(0, 2.0\]"),
        ("logit_bias", {3: 101.0}, r"logit_bias\[3\] must be in \[-100, 100\]"),
        ("min_tokens", 17, r"min_tokens must be in \[0, max_tokens=16\]"),
        ("stop_token_ids", (-1,), "stop_token_ids must be integers >= 0"),
    ],
)
def test_controls_out_of_range_are_refused(field, value, message):
    from sloserve.core.errors import ConfigError

    with pytest.raises(ConfigError, match=message):
        SamplingParams(**{field: value})
