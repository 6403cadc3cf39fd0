"""The sampler: greedy rows, the distribution of sampled rows (temperature, min-p, top-k, top-p), rows
independent."""

from __future__ import annotations

import math

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

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


FILTERS = {  # name -> (how many of PROBS's tokens it keeps, the params)
    "top_p=0.7": (2, SamplingParams(top_p=0.7)),  # 0.5 < 0.7 <= 0.5 + 0.3: the smallest prefix that reaches it
    "top_k=2": (2, SamplingParams(top_k=2)),
    "min_p=0.5": (2, SamplingParams(min_p=0.5)),  # 0.3 >= 0.5 x 0.5 > 0.15
    "min_p=0.3": (3, SamplingParams(min_p=0.3)),  # 0.15 >= 0.5 x 0.3 > 0.05
    "top_p=0.2": (1, SamplingParams(top_p=0.2)),  # below the largest probability: that token alone
    "top_k=1": (1, SamplingParams(top_k=1)),
    "min_p=1": (1, SamplingParams(min_p=1.0)),
    "top_k=0": (4, SamplingParams(top_k=0)),  # 0 and -1 are vLLM's "all"; k >= the vocabulary keeps all too
    "top_k=-1": (4, SamplingParams(top_k=-1)),
    "top_k=1000": (4, SamplingParams(top_k=1000)),
}


@pytest.mark.parametrize("kept,params", FILTERS.values(), ids=FILTERS.keys())
def test_a_filter_keeps_the_likeliest_tokens_renormalised(kept, params):
    freq = _frequencies(params, torch.tensor(np.log(PROBS), dtype=torch.float32))
    assert not freq[kept:].any()
    np.testing.assert_allclose(freq[:kept], PROBS[:kept] / PROBS[:kept].sum(), atol=0.014)


def test_top_k_keeps_the_tokens_tied_with_the_kth_and_min_p_is_of_the_tempered_probabilities():
    tied = torch.tensor(np.log([0.4, 0.2, 0.2, 0.2]), dtype=torch.float32)
    np.testing.assert_allclose(_frequencies(SamplingParams(top_k=2), tied), [0.4, 0.2, 0.2, 0.2], atol=0.014)
    # at temperature 2 the probabilities are flatter: min_p 0.3 keeps all four
    hot = PROBS**0.5 / (PROBS**0.5).sum()
    logits = torch.tensor(np.log(PROBS), dtype=torch.float32)
    np.testing.assert_allclose(_frequencies(SamplingParams(temperature=2.0, min_p=0.3), logits), hot, atol=0.014)


def test_filters_apply_in_vllms_order_min_p_top_k_then_top_p_of_what_is_left():
    probs = np.array([0.4, 0.25, 0.2, 0.1, 0.05])
    logits = torch.tensor(np.log(probs), dtype=torch.float32)
    # min_p 0.2 drops 0.05 (< 0.08); top_k 3 drops 0.1; top_p 0.7 of the 0.85 left is 0.595 <=
    # 0.4 + 0.25, so two tokens stay (0.7 of the whole vocabulary's mass would keep three).
    freq = _frequencies(SamplingParams(temperature=1.0, min_p=0.2, top_k=3, top_p=0.7), logits)
    assert freq[2] == freq[3] == freq[4] == 0
    np.testing.assert_allclose(freq[:2], [0.4 / 0.65, 0.25 / 0.65], atol=0.014)


@given(
    st.lists(st.floats(-8, 8), min_size=2, max_size=40),
    st.floats(0.1, 3),
    st.integers(-1, 45),
    st.floats(0, 1),
    st.floats(0.01, 1),
    st.integers(0, 2**32 - 1),
)
@settings(max_examples=200, deadline=None)
def test_a_filtered_token_is_one_the_filters_keep(scores, temperature, top_k, min_p, top_p, seed):
    """Against a plain numpy reading of the rule: the token drawn is never one a filter removes."""
    params = SamplingParams(temperature=temperature, top_k=top_k, min_p=min_p, top_p=top_p)
    logits = torch.tensor([scores], dtype=torch.float32)
    token = sample(logits, [params], [np.random.default_rng(seed)])[0]
    p = torch.softmax(logits[0] / temperature, dim=-1).double().numpy()
    order = np.argsort(-p, kind="stable")
    rank = int(np.nonzero(order == token)[0][0])
    slack = 1e-5  # float32 against float64 at the boundaries
    assert p[token] >= min_p * p.max() - slack
    if top_k > 0:
        assert p[token] >= np.sort(p)[::-1][min(top_k, len(p)) - 1] - slack
    kept = p[order] * (p[order] >= min_p * p.max() - slack)
    if top_k > 0:
        kept = kept * (p[order] >= p[order][min(top_k, len(p)) - 1] - slack)
    assert kept[:rank].sum() < top_p * kept.sum() + slack


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
    from sloserve.engine.penalties import PenaltyCounts
    from sloserve.engine.sampler import apply_controls

    logits = torch.tensor([[2.0, -1.0, 0.5, 3.0, -0.5]] * 3)
    params = [
        SamplingParams(logit_bias={4: 2.0}, repetition_penalty=1.5, frequency_penalty=0.4, presence_penalty=0.3),
        SamplingParams(min_tokens=3, stop_token_ids=(0,)),
        SamplingParams(),
    ]
    history = [0, 2, 3, 3, 1]  # prompt [0, 2], output [3, 3, 1]
    token_ids = [history, [0, 2, 3], history]
    apply_controls(logits, params, token_ids, [2, 2, 2], frozenset({4}))
    PenaltyCounts(torch.device("cpu")).apply(logits, range(3), params, token_ids, [2, 2, 2])
    # token 0: in the prompt, 2 / 1.5; token 1: -1 * 1.5 - 0.4 x 1 - 0.3; token 2: 0.5 / 1.5;
    # token 3: 3 / 1.5 - 0.4 x 2 - 0.3; token 4: -0.5 + 2 (not seen: no repetition penalty)
    expected = [2 / 1.5, -1.5 - 0.4 - 0.3, 0.5 / 1.5, 2.0 - 0.8 - 0.3, 1.5]
    np.testing.assert_allclose(logits[0].numpy(), expected, rtol=1e-6)
    assert sample(logits[:1], [SamplingParams(temperature=0)], [None]) == [4]  # greedy moved off token 3
    assert logits[1, 0] == logits[1, 4] == -math.inf and logits[1, 3] == 3.0
    assert logits[2].tolist() == [2.0, -1.0, 0.5, 3.0, -0.5]


def test_whole_number_settings_act_as_their_floats():
    """A logit bias, a penalty or a temperature given as an int (``{3: 2}``, as JSON writes them) acts as
    the same float; an integer bias was refused mid-step before (an int64 tensor put into float scores)."""
    from sloserve.engine.penalties import PenaltyCounts
    from sloserve.engine.sampler import apply_controls

    logits = torch.tensor([[2.0, -1.0, 0.5, 3.0, -0.5]] * 2)
    as_ints = SamplingParams(logit_bias={4: 2}, repetition_penalty=2, presence_penalty=1)
    as_floats = SamplingParams(logit_bias={4: 2.0}, repetition_penalty=2.0, presence_penalty=1.0)
    for row, params in enumerate((as_ints, as_floats)):  # (a batch of each alone: no float among the ints)
        apply_controls(logits[row : row + 1], [params], [[0, 2, 3]], [2], frozenset())
        PenaltyCounts(torch.device("cpu")).apply(logits[row : row + 1], ["r"], [params], [[0, 2, 3]], [2])
    assert logits[0].tolist() == logits[1].tolist() == [1.0, -1.0, 0.25, 0.5, 1.5]
    for seed in range(20):
        drawn = [sample(logits[:1], [SamplingParams(temperature=t)], [np.random.default_rng(seed)]) for t in (2, 2.0)]
        assert drawn[0] == drawn[1]


PENALTIES = st.sampled_from(
    [
        SamplingParams(),
        SamplingParams(repetition_penalty=1.5),
        SamplingParams(frequency_penalty=0.5, presence_penalty=-0.25),
        SamplingParams(repetition_penalty=0.8, frequency_penalty=-1.0, presence_penalty=0.5),
    ]
)


@settings(max_examples=100, deadline=None)
@given(data=st.data())
def test_penalties_from_kept_counts_equal_a_count_of_the_whole_context(data):
    """Requests arrive, sample in some steps and not others, gain output tokens on the host (any number
    between two of their steps) and on the device (async scheduling's late token, on the host by their
    next step), and finish (their rows reused): every step's scores equal vLLM's formulas over counts of
    the whole prompt and output made afresh, row by row."""
    from sloserve.engine.penalties import PenaltyCounts

    vocab, tokens = 6, st.integers(0, 5)
    penalties = PenaltyCounts(torch.device("cpu"))
    live: dict[int, tuple[SamplingParams, list[int], int]] = {}  # key -> params, its tokens, prompt length
    late: dict[int, int] = {}  # key -> its token still on the device
    most_live, holders = 0, set()  # the live requests with penalties that sampled: each holds a row
    for key in range(data.draw(st.integers(1, 12))):  # a step: one more request, then some of them sample
        prompt = data.draw(st.lists(tokens, max_size=4))
        live[key] = (data.draw(PENALTIES), prompt, len(prompt))
        most_live = max(most_live, len(live))
        sampling = data.draw(st.lists(st.sampled_from(sorted(live)), min_size=1, unique=True))
        for k in sampling:
            if k in late:  # back on the host
                live[k][1].append(late.pop(k))
            live[k][1].extend(data.draw(st.lists(tokens, max_size=2)))
        now_late = [row for row, k in enumerate(sampling) if data.draw(st.booleans())]
        late_tokens = [data.draw(tokens) for _ in now_late]
        logits = torch.tensor(data.draw(st.lists(st.lists(st.sampled_from([-2.0, -0.5, 0.0, 1.5]), min_size=vocab,
                                                          max_size=vocab), min_size=len(sampling), max_size=len(sampling))))  # fmt: skip
        expected = logits.clone()
        for row, k in enumerate(sampling):
            params, token_ids, num_prompt = live[k]
            output = token_ids[num_prompt:] + [t for r, t in zip(now_late, late_tokens, strict=True) if r == row]
            for t in range(vocab):
                x = expected[row, t].item()
                if t in token_ids[:num_prompt] or t in output:
                    x = x / params.repetition_penalty if x > 0 else x * params.repetition_penalty
                x -= params.frequency_penalty * output.count(t) + params.presence_penalty * (t in output)
                expected[row, t] = x
        penalties.apply(logits, sampling, [live[k][0] for k in sampling], [live[k][1] for k in sampling],
                        [live[k][2] for k in sampling], (now_late, torch.tensor(late_tokens, dtype=torch.int64)))  # fmt: skip
        torch.testing.assert_close(logits, expected)
        holders |= {k for k in sampling if live[k][0].penalizes}
        late.update({sampling[row]: token for row, token in zip(now_late, late_tokens, strict=True)})
        for k in data.draw(st.lists(st.sampled_from(sorted(live)), unique=True)):  # finished
            penalties.release(k)
            del live[k]
            late.pop(k, None)
            holders.discard(k)
    assert len(penalties) == len(holders)
    assert penalties.output_counts.shape[0] < 2 * most_live  # rows of finished requests reused


def test_allowed_token_ids_bar_every_other_token_before_the_other_controls():
    """vLLM's whitelist: the other tokens' scores (EOS's too) are -inf, and the controls that follow
    (here a logit bias) act on what is left; a row without one is untouched."""
    from sloserve.engine.sampler import apply_controls

    logits = torch.tensor([[2.0, -1.0, 0.5, 3.0, -0.5]] * 3)
    params = [SamplingParams(allowed_token_ids=[1, 2]), SamplingParams(allowed_token_ids=(1, 2), logit_bias={1: 2.0}),
              SamplingParams()]  # fmt: skip
    apply_controls(logits, params, [[0, 3]] * 3, [2] * 3, frozenset({4}))
    inf = math.inf
    assert logits.tolist() == [[-inf, -1.0, 0.5, -inf, -inf], [-inf, 1.0, 0.5, -inf, -inf], [2.0, -1.0, 0.5, 3.0, -0.5]]
    assert sample(logits, [SamplingParams(temperature=0)] * 3, [None] * 3) == [2, 1, 3]
    freq = _frequencies(SamplingParams(temperature=1.0), logits[0])  # sampled: the two allowed, by their softmax
    np.testing.assert_allclose(freq, [0, 1 / (1 + math.exp(1.5)), 1 / (1 + math.exp(-1.5)), 0, 0], atol=0.014)


def test_bad_words_bar_a_words_last_token_after_its_others_in_the_output():
    """vLLM's rule: a one-token word is always barred; a longer one's last token only where the
    output (not the prompt) ends with the tokens before it."""
    from sloserve.engine.sampler import apply_controls

    words = ((4,), (1, 2, 3))
    params = [SamplingParams(bad_words=["x"], bad_words_token_ids=words)] * 3
    histories = [[1, 2, 0, 1, 2], [1, 2, 0, 1], [1, 2, 0]]  # prompt [1, 2]; outputs [0, 1, 2], [0, 1], [0]
    logits = torch.zeros(3, 5)
    apply_controls(logits, params, histories, [2, 2, 2], frozenset({0}))
    inf = math.inf
    assert logits.tolist() == [[0, 0, 0, -inf, -inf], [0, 0, 0, 0, -inf], [0, 0, 0, 0, -inf]]


@settings(max_examples=100, deadline=None)
@given(
    rows=st.lists(
        st.tuples(
            st.none() | st.lists(st.integers(0, 5), min_size=1, max_size=6),
            st.none() | st.dictionaries(st.integers(0, 5), st.sampled_from([-3.0, 1.5, 100.0]), min_size=1),
        ),
        min_size=1,
        max_size=5,
    )
)
def test_allowed_tokens_and_biases_of_a_batch_land_on_their_own_rows(rows):
    """Each row's ``allowed_token_ids`` and ``logit_bias`` (tensors made once per request) act on that row
    alone, as the rule says: the tokens not allowed at -inf, then each bias added."""
    from sloserve.engine.sampler import apply_controls

    logits = torch.zeros(len(rows), 6)
    params = [SamplingParams(allowed_token_ids=allowed, logit_bias=bias) for allowed, bias in rows]
    apply_controls(logits, params, [[0, 1]] * len(rows), [1] * len(rows), frozenset())
    for row, (allowed, bias) in zip(logits.tolist(), rows, strict=True):
        expected = [0.0 if allowed is None or t in allowed else -math.inf for t in range(6)]
        assert row == [e + (bias or {}).get(t, 0.0) for t, e in enumerate(expected)]


@settings(max_examples=100, deadline=None)
@given(
    rows=st.lists(
        st.tuples(st.integers(0, 4), st.lists(st.integers(0, 7), max_size=5).map(tuple), st.integers(0, 6)),
        min_size=1,
        max_size=6,
    ),
    eos=st.frozensets(st.integers(0, 7), max_size=2),
)
def test_min_tokens_bars_eos_and_each_rows_own_stop_tokens(rows, eos):
    """A row whose output is shorter than its ``min_tokens`` has EOS and its own ``stop_token_ids`` barred
    (tensors made once per request), and nothing else; a row past it is untouched."""
    from sloserve.engine.sampler import apply_controls

    params = [SamplingParams(min_tokens=m, stop_token_ids=stop, max_tokens=8) for m, stop, _ in rows]
    logits = torch.zeros(len(rows), 8)
    apply_controls(logits, params, [[9] * (2 + n) for _, _, n in rows], [2] * len(rows), eos)
    for row, (min_tokens, stop, num_output) in zip(logits.tolist(), rows, strict=True):
        barred = {*eos, *stop} if num_output < min_tokens else set()
        assert row == [-math.inf if t in barred else 0.0 for t in range(8)]


@settings(max_examples=200, deadline=None)
@given(
    words=st.lists(st.lists(st.integers(0, 5), min_size=1, max_size=4).map(tuple), max_size=12),
    history=st.lists(st.integers(0, 5), max_size=8),
    num_prompt_tokens=st.integers(0, 3),
)
def test_bad_words_bar_what_each_word_bars_alone(words, history, num_prompt_tokens):
    """The words looked up by their endings (``SamplingParams.bad_word_endings``) bar what each word would
    bar checked alone: its last token, where the output ends with the others."""
    from sloserve.engine.sampler import apply_controls

    history = list(range(6, 6 + num_prompt_tokens)) + history  # the prompt's tokens are not the words'
    logits = torch.zeros(1, 6)
    apply_controls(logits, [SamplingParams(bad_words=["x"], bad_words_token_ids=tuple(words))], [history],
                   [num_prompt_tokens], frozenset({9}))  # fmt: skip
    output = history[num_prompt_tokens:]
    barred = {w[-1] for w in words if len(w) - 1 <= len(output) and tuple(output[len(output) - len(w) + 1 :]) == w[:-1]}
    assert [t for t in range(6) if logits[0, t] == -math.inf] == sorted(barred)


def test_bad_words_are_tokenized_at_the_start_and_after_a_space_as_vllm_does():
    from sloserve.engine.tokenizer import ByteTokenizer

    params = SamplingParams(bad_words=[" ab", "c"]).tokenize_bad_words(ByteTokenizer())
    # bytes: " ab" -> "ab" (97, 98); after a space (32, 97, 98) has another length: not added
    assert params.bad_words_token_ids == ((97, 98), (99,))
    assert params.tokenize_bad_words(ByteTokenizer()) is params  # once


def test_a_row_with_no_mass_left_takes_its_argmax_and_the_likeliest_token_passes_any_top_p():
    """Once an index one past the vocabulary, which killed the engine for every request: a top_p that is 0
    in float32 (1e-300), a temperature that is (1e-320), and a row whose controls barred every token."""
    logits = torch.tensor([[0.5, 2.0, -1.0, 1.0]] * 4)
    logits[3] = -math.inf  # every token barred: NaN probabilities
    params = [SamplingParams(top_p=1e-300), SamplingParams(temperature=1e-320), SamplingParams(temperature=1e-320,
              top_k=2), SamplingParams(top_p=0.5)]  # fmt: skip
    for seed in range(20):
        assert sample(logits, params, [np.random.default_rng([seed, i]) for i in range(4)]) == [1, 1, 1, 0]
    assert sample(logits[3:], [SamplingParams()], [np.random.default_rng(0)]) == [0]  # unfiltered too


def test_controls_that_leave_no_token_are_named():
    """Seen before the request runs (a 400 on the server), where the sampler could only make up a token."""
    barred = SamplingParams(allowed_token_ids=[4, 5], bad_words=["x"], bad_words_token_ids=((4,), (5,)))
    assert "every token of allowed_token_ids is a bad word" in barred.leaves_no_token({0})
    held = SamplingParams(allowed_token_ids=[0, 7], stop_token_ids=(7,), min_tokens=1)
    assert "min_tokens 1 holds back EOS and stop_token_ids" in held.leaves_no_token({0})
    assert SamplingParams(allowed_token_ids=[0, 7], min_tokens=1).leaves_no_token({0}) is None  # 7 is left
    assert SamplingParams(allowed_token_ids=[0], bad_words_token_ids=((1, 0),)).leaves_no_token({2}) is None
    assert SamplingParams(bad_words_token_ids=((4,),), min_tokens=3).leaves_no_token({4}) is None


@pytest.mark.parametrize(
    ("field", "value", "message"),
    [
        ("presence_penalty", 2.5, r"presence_penalty must be in \[-2, 2\]"),
        ("repetition_penalty", 0.0, r"repetition_penalty must be in \(0, 2.0\]"),
        ("logit_bias", {3: 101.0}, r"logit_bias\[3\] must be in \[-100, 100\]"),
        ("min_tokens", 17, r"min_tokens must be in \[0, max_tokens=16\]"),
        ("stop_token_ids", (-1,), "stop_token_ids must be integers >= 0"),
        ("allowed_token_ids", [], r"allowed_token_ids must be a non-empty list of integers >= 0, got \[\]"),
        ("bad_words", "word", r"bad_words must be a list of strings, got 'word'"),
        ("allowed_token_ids", [3, -1], "allowed_token_ids must be a non-empty list of integers >= 0"),
        ("top_k", -2, r"top_k must be an integer >= -1 \(0 or -1: all tokens\), got -2"),
        ("top_k", 2.5, r"top_k must be an integer >= -1"),
        ("min_p", 1.5, r"min_p must be in \[0, 1\], got 1.5"),
        ("min_p", float("nan"), r"min_p must be in \[0, 1\], got nan"),
        ("n", 0, "n must be an integer in 1..128, got 0"),
        ("n", 10**30, "n must be an integer in 1..128, got 1" + "0" * 30),  # once generate() hung on it
        ("stop", [1], r"stop must be a string or a list of strings, got \[1\]"),
        ("stop", ["\n", ""], "stop cannot hold an empty string"),  # it was ignored
    ],
)
def test_controls_out_of_range_are_refused(field, value, message):
    from sloserve.core.errors import ConfigError

    with pytest.raises(ConfigError, match=message):
        SamplingParams(**{field: value})


@pytest.mark.skipif(not torch.cuda.is_available(), reason="the device's synchronizations: needs a GPU")
def test_on_cuda_the_score_controls_and_sampling_never_wait_for_the_device():
    """Every score control and filter is launched without the host waiting for the device (CUDA's sync
    debug mode raises on any operation that would): with async scheduling the host builds the next step
    while this one's forward pass runs, and a wait here would stall it (a filter's settings made on the
    GPU from a Python list waited so, a copy from pageable memory, until 2026-11-30)."""
    from sloserve.engine.penalties import PenaltyCounts
    from sloserve.engine.sampler import apply_controls, sample_on_device

    params = [
        SamplingParams(temperature=0.8, top_p=0.9, seed=1),
        SamplingParams(temperature=0.7, top_k=20, min_p=0.05, seed=2),
        SamplingParams(repetition_penalty=1.3, presence_penalty=0.5, frequency_penalty=0.2, min_tokens=4),
        SamplingParams(logit_bias={5: 2.0}, allowed_token_ids=[5, 6, 7], bad_words_token_ids=[[3, 4], [9]]),
        SamplingParams(),
    ]
    token_ids = [[1, 2, 3] * 4 for _ in params]
    logits = torch.randn(len(params), 64, device="cuda")
    late = ([2, 3], torch.tensor([3, 4], device="cuda"))  # rows whose last token is still on the device
    generators = [np.random.default_rng(i) if not p.greedy else None for i, p in enumerate(params)]
    penalties = PenaltyCounts(torch.device("cuda"))
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        apply_controls(logits, params, token_ids, [4] * len(params), frozenset({0}), late)
        for step_late in (late, None):  # a request's counts made, then kept
            penalties.apply(logits, range(len(params)), params, token_ids, [4] * len(params), step_late)
        sampled = sample_on_device(logits, params, generators)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    assert sampled.shape == (len(params),) and sampled[3].item() in (5, 6, 7)
