"""Async scheduling (``engine/async_scheduling.py``): steps launched before the step before's tokens are on
the host give every request the tokens and the finish it gets without, under every registered policy,
through stops found a step late (stop tokens, stop strings), seeded sampling, preemption and aborts, and
for any mix of sampling options; log-probabilities and score controls come out as without it; a
grammar's matcher takes the step before's tokens before the step samples; the served engine's loop
publishes every token once."""

from __future__ import annotations

import dataclasses
import multiprocessing
import re
import time

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

torch = pytest.importorskip("torch")

from core_pipe import CorePipe  # noqa: E402

from sloserve import LLM, SamplingParams  # noqa: E402
from sloserve.core.errors import ConfigError  # noqa: E402
from sloserve.core.request import SLO, Request, RequestClass  # noqa: E402
from sloserve.engine.async_scheduling import InputStaging  # noqa: E402
from sloserve.engine.engine_core import AddRequest, EngineCore, EngineSpec  # noqa: E402
from sloserve.engine.llm_engine import LLMEngine, default_async_scheduling  # noqa: E402
from sloserve.engine.loader import load_model  # noqa: E402
from sloserve.engine.sampler import StructuredOutputsParams  # noqa: E402
from sloserve.metrics.summary import request_table  # noqa: E402
from sloserve.sched import scheduler_names  # noqa: E402

_rng = np.random.default_rng(0)
PROMPTS = [_rng.integers(0, 250, size=int(n)).tolist() for n in _rng.integers(2, 40, size=12)]
PROMPTS[3] = PROMPTS[2][:20] + [7, 8]  # a shared prefix (prefix caching)
STOP_TOKENS = list(range(0, 256, 9))  # frequent enough to end requests early


def _params() -> list[SamplingParams]:
    """Each prompt's: max_tokens from 1 to 30; every third seeded at temperature 0.8; every fourth ends
    on a stop token."""
    params = []
    for i in range(len(PROMPTS)):
        options = {"max_tokens": [1, 5, 12, 20, 30][i % 5]}
        if i % 3 == 1:
            options.update(temperature=0.8, seed=i)
        if i % 4 == 2:
            options.update(stop_token_ids=STOP_TOKENS)
        params.append(SamplingParams(**options))
    return params


def _generate(scheduler: str, async_scheduling: bool, params=None, **options) -> tuple[list[tuple], LLM]:
    """Each prompt's (output tokens, finish reason, logprobs, prompt logprobs) and the LLM."""
    llm = LLM("random:tiny-llama", scheduler, async_scheduling=async_scheduling, **options)
    outputs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], params or _params())
    got = [
        (o.outputs[0].token_ids, o.outputs[0].finish_reason, o.outputs[0].logprobs, o.prompt_logprobs) for o in outputs
    ]
    return got, llm


@pytest.mark.parametrize("scheduler", scheduler_names())
def test_every_scheduler_gives_the_tokens_and_finishes_it_gives_without(scheduler):
    """Under KV pressure (preemptions under most policies), with requests that stop early: every token
    and finish reason as without async scheduling, most steps launched early, all KV freed."""
    want, _ = _generate(scheduler, False, kv_capacity_tokens=100, block_size=4)
    got, llm = _generate(scheduler, True, kv_capacity_tokens=100, block_size=4)
    assert got == want
    assert {reason for _, reason, _, _ in want} == {"stop", "length"}
    engine = llm.engine
    assert engine.executor.num_early_launches > 0
    assert not engine.has_unfinished() and engine.executor.in_flight is None
    assert engine.scheduler.kv.allocated_tokens == 0
    engine.scheduler.check_integrity()


@pytest.mark.parametrize(
    "scheduler,options",
    [("vllm", dict(preemption_mode="swap")), ("sarathi", dict(prefill_token_budget=8)), ("bros", {})],
)
def test_preemption_and_chunks_lose_nothing(scheduler, options):
    """Swapped-out and chunked requests whose last token is still on the device come back whole."""
    want, _ = _generate(scheduler, False, kv_capacity_tokens=96, block_size=4, **options)
    got, llm = _generate(scheduler, True, kv_capacity_tokens=96, block_size=4, **options)
    assert got == want and llm.engine.executor.num_early_launches > 0


def _assert_same(got: list[tuple], want: list[tuple]) -> None:
    """Tokens and finishes equal; log-probabilities equal in their tokens and ranks, their values within
    float32's noise (a token more of a stopped request in a step changes the batch's matmul shapes)."""
    assert [g[:2] for g in got] == [w[:2] for w in want]
    for g, w in zip(got, want, strict=True):
        assert g[2] is None or len(g[2]) == len(g[0]), "a log-probability for every token"
        for got_entries, want_entries in zip(g[2:], w[2:], strict=True):
            assert (got_entries is None) == (want_entries is None)
            for x, y in zip(got_entries or [], want_entries or [], strict=True):
                if x is None or y is None:  # (the prompt's first token has none)
                    assert x is y
                    continue
                assert (x.token_id, x.top_token_ids, x.rank) == (y.token_id, y.top_token_ids, y.rank)
                assert x.logprob == pytest.approx(y.logprob, abs=1e-5)
                assert x.top_logprobs == pytest.approx(y.top_logprobs, abs=1e-5)


# Sampling options that read the tokens on the device, or report on them, without the steps waiting
ON_THE_DEVICE = {
    "logprobs": dict(logprobs=3),
    "prompt_logprobs": dict(prompt_logprobs=2, logprobs=0),
    "penalties": dict(repetition_penalty=1.5, frequency_penalty=0.8, presence_penalty=0.6),
    "min_tokens": dict(min_tokens=12, stop_token_ids=STOP_TOKENS),
    "logit_bias": dict(logit_bias={3: 4.0, 17: -100.0}),
    "allowed_tokens": dict(allowed_token_ids=list(range(40, 90))),
    "one-token bad words": dict(bad_words_token_ids=((5,), (9,))),
}


def _with(params: SamplingParams, options: dict) -> SamplingParams:
    if "min_tokens" in options:
        options = {**options, "min_tokens": min(options["min_tokens"], params.max_tokens)}
    return dataclasses.replace(params, **options)


EVERY_PATH = pytest.mark.parametrize(
    "scheduler,options",
    [
        ("vllm", {}),
        ("sarathi", dict(prefill_token_budget=8)),
        ("sarathi", dict(prefill_token_budget=8, kv_capacity_tokens=96, block_size=4, preemption_mode="recompute")),
        ("bros", dict(kv_capacity_tokens=96, block_size=4)),  # decodes named one by one, bidirectional blocks
    ],
    ids=["vllm", "sarathi", "sarathi-preempting", "bros"],
)


@EVERY_PATH
@pytest.mark.parametrize("sampling", ON_THE_DEVICE.values(), ids=ON_THE_DEVICE.keys())
def test_logprobs_and_score_controls_run_on_tokens_still_on_the_device(sampling, scheduler, options):
    """Half the requests with log-probabilities or score controls (penalties counting the token still on
    the device, ``min_tokens`` counting it) among plain ones, some of them seeded: steps launched early,
    and every request's tokens, finish, log-probabilities and prompt log-probabilities (across Sarathi's
    chunks too, and refills after recompute preemptions) as without async scheduling."""
    params = [_with(p, sampling) if i % 2 == 0 else p for i, p in enumerate(_params())]
    want, _ = _generate(scheduler, False, params, **options)
    got, llm = _generate(scheduler, True, params, **options)
    _assert_same(got, want)
    assert llm.engine.executor.num_early_launches > 0
    if "preemption_mode" in options:
        assert llm.engine.scheduler.num_preemptions > 0
    plain, _ = _generate(scheduler, False, None, **options)
    changed = [w[:2] for w in want] != [p[:2] for p in plain]
    assert changed or "logprobs" in str(sampling)  # (the controls change some request's tokens)


@EVERY_PATH
def test_bad_words_of_several_tokens_match_the_last_token_on_the_device(scheduler, options):
    """Requests barred from words of two and three tokens their plain outputs contain (so each word's
    last-but-one token is the one still on the device when its last would be sampled), and from words
    not in force there (one that bars the same token after another token; one whose first token differs
    from the output's): steps launched early, and every request's tokens as without async scheduling,
    other than without the words."""
    plain, _ = _generate(scheduler, False, None, **options)
    params = []
    for i, p in enumerate(_params()):
        out = plain[i][0]
        if i % 4 == 0 and len(out) >= 5:
            decoy = ((out[1] + 1) % 256, out[2])
            p = dataclasses.replace(p, bad_words_token_ids=((out[1], out[2]), tuple(out[2:5]), decoy))
        elif i % 4 == 2 and len(out) >= 4:
            p = dataclasses.replace(p, bad_words_token_ids=(((out[1] + 1) % 256, out[2], out[3]),))
        params.append(p)
    want, _ = _generate(scheduler, False, params, **options)
    got, llm = _generate(scheduler, True, params, **options)
    assert got == want
    assert llm.engine.executor.num_early_launches > 0
    assert [w[:2] for w in want] != [p[:2] for p in plain]


GRAMMARS = [
    StructuredOutputsParams(choice=["yes", "no", "maybe not"]),
    StructuredOutputsParams(regex="[a-z]{2,6}( [a-z]{2,6}){1,3}"),
    StructuredOutputsParams(json={"type": "object", "properties": {"n": {"type": "integer"}}, "required": ["n"]}),
]


@pytest.mark.parametrize("scheduler", ["vllm", "bros"])  # decodes as a cohort, and named one by one
def test_grammars_take_the_tokens_before_this_step_samples_and_launch_early(chat_model_dir, scheduler):
    """Requests with grammars (a choice, a regular expression, a JSON schema; their matchers take each
    token on the host) among plain ones with a frequency penalty, on a model with a tokenizer: steps
    launched early, each waiting for the step before's tokens only before it samples, and every
    request's tokens and text as without async scheduling; the grammars' outputs are theirs (a choice
    that completes ends the request a step before the policy hears of it)."""
    params = [SamplingParams(max_tokens=16, structured_outputs=g) for g in GRAMMARS] + [
        # (each token counted once, with the step before's on the host by the time it samples)
        SamplingParams(max_tokens=10, temperature=0.8, seed=3, frequency_penalty=-1),
        SamplingParams(max_tokens=12, temperature=0, frequency_penalty=-1),
    ]
    prompts = ["Hello there", "Is it?", "Say yes or no", "One more thing", "And the last"]
    outputs = {}
    for async_scheduling in (False, True):
        llm = LLM(str(chat_model_dir), scheduler, kv_capacity_tokens=4096, async_scheduling=async_scheduling)
        got = llm.generate(prompts, params)
        outputs[async_scheduling] = [
            (o.outputs[0].token_ids, o.outputs[0].text, o.outputs[0].finish_reason) for o in got
        ]
    assert outputs[True] == outputs[False]
    assert llm.engine.executor.num_early_launches > 0
    (_, choice, reason), (_, words, _), (_, obj, _) = outputs[True][:3]
    assert choice in ("yes", "no", "maybe not") and reason == "stop"
    assert re.fullmatch("[a-z]{2,6}( [a-z]{2,6}){0,3}", words)  # (max_tokens may cut it)


@pytest.mark.parametrize("scheduler", ["vllm", "bros"])
def test_stop_strings_end_the_text_as_without(scheduler):
    """Stop strings (found by ``LLM``'s detokenizer on the host, a step after their token was sampled;
    the policy finishes a request at its ``max_tokens``-th token a step before that token is on the
    host): one completed by a request's last token, one by the token before it (the engine samples one
    more before it hears), others anywhere: every text, its tokens (and their logprobs) up to the stop,
    finish and stop reason as without async scheduling."""
    params = SamplingParams(max_tokens=30)
    prompts = [{"prompt_token_ids": p} for p in PROMPTS]
    llm = LLM("random:tiny-llama", scheduler)
    plain = [o.outputs[0] for o in llm.generate(prompts, params)]
    decode = llm.engine.loaded.tokenizer.decode

    def ending(ids: list[int]) -> str | None:
        """The text's last character, if whole (not a random byte's replacement) and nowhere before it."""
        text = decode(ids)
        return text[-1] if text and text[-1] != "\ufffd" and text.find(text[-1]) == len(text) - 1 else None

    whole = [o for o in plain if len(o.token_ids) == 30]
    last = next(o for o in whole if ending(o.token_ids) and ending(o.token_ids) not in decode(o.token_ids[:-1]))
    before_last = next(o for o in whole if o is not last and ending(o.token_ids[:-1]))
    stops = [ending(last.token_ids), ending(before_last.token_ids[:-1])]
    before = (decode(last.token_ids)[:-1], decode(before_last.token_ids[:-1])[:-1])  # (their texts before them)
    stops += [o.text[3:5] for o in plain if len(o.text) > 8 and "\ufffd" not in o.text[3:5]]
    stops = [s for s in stops if s not in before[0] and s not in before[1]]
    outputs = {}
    for async_scheduling in (False, True):
        llm = LLM("random:tiny-llama", scheduler, async_scheduling=async_scheduling)
        got = llm.generate(prompts, dataclasses.replace(params, stop=stops, logprobs=1))
        assert all(len(o.outputs[0].logprobs) == len(o.outputs[0].token_ids) for o in got)
        outputs[async_scheduling] = [
            (o.outputs[0].token_ids, o.outputs[0].text, o.outputs[0].finish_reason, o.outputs[0].stop_reason)
            for o in got
        ]
    assert outputs[True] == outputs[False]
    assert (last.token_ids, before[0], "stop", stops[0]) in outputs[False]
    assert (before_last.token_ids[:-1], before[1], "stop", stops[1]) in outputs[False]
    assert sum(reason == "stop" for _, _, reason, _ in outputs[False]) >= 4


def test_aborts_between_steps_free_the_kv_and_leave_the_others_exact():
    """A request aborted while its last token is on the device ends with "abort"; the others as without."""

    def run(async_scheduling: bool) -> dict[int, tuple[list[int], str]]:
        llm = LLM("random:tiny-llama", "vllm", async_scheduling=async_scheduling, kv_capacity_tokens=200)
        engine = llm.engine
        requests = [engine.add_request(p, s) for p, s in zip(PROMPTS, _params(), strict=True)]
        ended, step = {}, 0
        while engine.has_unfinished():
            if step == 4:
                engine.abort(requests[4])
            for request in engine.step():
                seq = engine.release(request)
                ended[request.request_id] = (seq.output_token_ids, seq.finish_reason)
            step += 1
        assert engine.scheduler.kv.allocated_tokens == 0
        return ended

    want, got = run(False), run(True)
    assert got.pop(4) == (want[4][0][:-1], "abort")  # aborted with its token of step 4 on the device
    assert want.pop(4)[1] == "abort" and got == want


@pytest.mark.parametrize("scheduler", ["vllm", "sarathi", "bros", "econoserve"])
def test_a_request_counts_the_tokens_it_keeps(scheduler):
    """A stop token found a step late: the token the next step ran for its request is dropped and not
    counted; nor is the step of an aborted request. Each request's output count is its tokens', so its
    metrics (output length, TPOT: none for a single token) are those of the synchronous engine."""

    def run(async_scheduling: bool) -> tuple[list[int], list[bool]]:
        llm = LLM(
            "random:tiny-llama", scheduler, async_scheduling=async_scheduling, kv_capacity_tokens=100, block_size=4
        )
        engine = llm.engine
        requests = [engine.add_request(p, s) for p, s in zip(PROMPTS, _params(), strict=True)]
        step = 0
        while engine.has_unfinished():
            if step == 4:
                engine.abort(requests[4])
            for request in engine.step():
                assert request.num_output_tokens == len(engine.release(request).output_token_ids), request
            step += 1
        engine.scheduler.check_integrity()
        assert engine.scheduler.kv.allocated_tokens == 0
        table = request_table(requests)
        return table["output_tokens"].tolist(), np.isnan(table["tpot_s"]).tolist()

    (want, want_no_tpot), (got, got_no_tpot) = run(False), run(True)
    del want[4], got[4], want_no_tpot[4], got_no_tpot[4]  # (aborted: its tokens may differ by the one in flight)
    assert got == want and got_no_tpot == want_no_tpot
    assert 1 in want, "a request that a stop token ended after one token (no TPOT)"


_token = st.integers(0, 511)
SAMPLING_OPTIONS = st.fixed_dictionaries(
    {"max_tokens": st.sampled_from([1, 2, 5, 9, 17, 25])},
    optional={
        "temperature": st.sampled_from([0.0, 0.7, 1.0]),
        "seed": st.integers(0, 99),
        "stop_token_ids": st.builds(
            lambda first, step: list(range(first, 512, step)), st.integers(0, 4), st.sampled_from([7, 11, 17])
        ),
        "min_tokens": st.integers(0, 5),
        "logprobs": st.sampled_from([0, 2]),
        "prompt_logprobs": st.just(1),
        "repetition_penalty": st.sampled_from([0.8, 1.3]),
        "frequency_penalty": st.sampled_from([-1.0, 0.5]),
        "presence_penalty": st.sampled_from([-0.5, 0.3]),
        "bad_words_token_ids": st.lists(
            st.lists(_token, min_size=1, max_size=3).map(tuple), min_size=1, max_size=3
        ).map(tuple),
        "logit_bias": st.dictionaries(_token, st.sampled_from([-100.0, 5.0]), min_size=1, max_size=3),
        "n": st.just(2),
        "ignore_eos": st.just(True),
        "stop": st.lists(st.sampled_from("abcdefghijklmnopqrstuvwxyz0123456789"), min_size=1, max_size=4),
    },
)


@settings(max_examples=8, deadline=None)
@given(
    scheduler=st.sampled_from(scheduler_names()),
    kv_capacity_tokens=st.sampled_from([96, 2048]),
    options=st.lists(SAMPLING_OPTIONS, min_size=len(PROMPTS), max_size=len(PROMPTS)),
)
def test_any_mix_of_sampling_options_gives_what_it_gives_without(scheduler, kv_capacity_tokens, options):
    """Each prompt with its own draw of sampling options (stop strings among them), under a policy and a
    KV size drawn too (96 tokens: preemptions): every sequence's tokens, text, finish and stop reason,
    and its log-probabilities' tokens and ranks, as without async scheduling; all KV and penalty rows freed."""
    params = [SamplingParams(**{**o, "min_tokens": min(o.get("min_tokens", 0), o["max_tokens"])}) for o in options]
    prompts = [{"prompt_token_ids": p} for p in PROMPTS]
    got = {}
    for async_scheduling in (False, True):
        llm = LLM(
            "random:tiny-llama",
            scheduler,
            async_scheduling=async_scheduling,
            kv_capacity_tokens=kv_capacity_tokens,
            block_size=4,
        )
        got[async_scheduling] = [
            [
                (
                    c.token_ids,
                    c.text,
                    c.finish_reason,
                    c.stop_reason,
                    c.logprobs and [(x.token_id, x.rank) for x in c.logprobs],
                )
                for c in o.outputs
            ]
            for o in llm.generate(prompts, params)
        ]
        assert llm.engine.scheduler.kv.allocated_tokens == 0 and not llm.engine.executor.penalties
    assert got[True] == got[False]


def _serve_on_core(engine, prompts, params, overlap_publish: bool, read=None) -> tuple[CorePipe, EngineCore]:
    """``serve``'s engine loop (``EngineCore``) over ``engine``, every prompt added at once (their grammars
    compiled first): steps until every request ended, reading the pipe after each step and after the last
    flush (``read(sent, core)``, else a plain read). Returns what it read, and the loop."""
    server, pipe = multiprocessing.Pipe()
    core = EngineCore(engine, time.perf_counter(), pipe, overlap_publish=overlap_publish)
    for i, (prompt, p) in enumerate(zip(prompts, params, strict=True)):
        core.apply(("add", AddRequest(i, prompt, p, RequestClass.BE, SLO(), core.clock())))
    deadline = time.monotonic() + 60
    while core.num_compiling:
        assert time.monotonic() < deadline, "the grammars never compiled"
        time.sleep(0.001)
        core.add_compiled()
    sent = CorePipe(server)
    read = read or (lambda sent, core: sent.read())
    while engine.has_unfinished():
        core.run_step()
        read(sent, core)
    core.flush()
    read(sent, core)
    return sent, core


@pytest.mark.parametrize("overlap_publish", [False, True])
def test_the_served_engine_core_publishes_every_token_once(overlap_publish):
    """``serve``'s engine loop (``EngineCore``) with async scheduling, publishing after each step or
    during the next one's forward pass: every request's tokens reach the pipe once, in order, as offline
    without async scheduling, and its finish with its last token (a stop token found a step late goes out
    with its finish, before the policy ends the request); its times are when its tokens went out."""
    params = [
        dataclasses.replace(p, logprobs=2, prompt_logprobs=1) if i % 3 == 0 else p for i, p in enumerate(_params())
    ]
    want, _ = _generate("vllm", False, params, kv_capacity_tokens=2048)
    engine = EngineSpec("random:tiny-llama", "vllm", kv_capacity_tokens=2048, async_scheduling=True).build()
    last_read = 0.0  # when the pipe was last read (the engine's clock)

    def read(sent: CorePipe, core: EngineCore) -> None:
        nonlocal last_read
        for out in sent.read():
            # NOTE: a token's time is when it reached the host (after the pipe was last read), not the end
            # of the step that sampled it
            assert not out.token_ids or last_read <= out.last_token_time <= core.clock()
            if out.finish_reason is not None:
                assert out.token_ids, "a finish after its last token"
                assert out.first_token_time <= out.last_token_time <= out.finish_time <= core.clock()
        last_read = core.clock()

    sent, core = _serve_on_core(engine, PROMPTS, params, overlap_publish, read)
    got = [
        (sent.tokens[i], sent.reasons[i], sent.logprobs.get(i), sent.prompt_logprobs.get(i))
        for i in range(len(PROMPTS))
    ]
    _assert_same(got, [(*w[:3], w[3] and w[3][1:]) for w in want])  # (the pipe's prompt entries: from the second)
    assert sum(lp is not None for _, _, lp, _ in got) == 4
    assert engine.executor.num_early_launches > 0 and not core.live


@pytest.mark.parametrize("overlap_publish", [False, True])
def test_the_served_engine_core_with_grammars_publishes_what_offline_gives(chat_model_dir, overlap_publish):
    """``serve``'s engine loop with async scheduling and requests with grammars among plain ones (the
    step before's tokens taken back before a step samples, its news published after the step or during
    the next one's forward pass): every request's tokens and finish through the pipe, once each, as
    offline without async scheduling; steps launched early."""
    params = [SamplingParams(max_tokens=16, structured_outputs=g) for g in GRAMMARS] + [
        SamplingParams(max_tokens=10, temperature=0.8, seed=3),
        SamplingParams(max_tokens=12, stop_token_ids=list(range(3, 300, 11))),
    ]
    prompts = [[1, 40 + i, 41, 42] for i in range(len(params))]
    llm = LLM(str(chat_model_dir), "vllm", kv_capacity_tokens=2048)
    want = [
        (o.outputs[0].token_ids, o.outputs[0].finish_reason)
        for o in llm.generate([{"prompt_token_ids": p} for p in prompts], params)
    ]
    engine = EngineSpec(str(chat_model_dir), "vllm", kv_capacity_tokens=2048, async_scheduling=True).build()
    sent, core = _serve_on_core(engine, prompts, params, overlap_publish)
    assert [(sent.tokens[i], sent.reasons[i]) for i in range(len(prompts))] == want
    assert engine.executor.num_early_launches > 0 and not core.live


def test_each_request_comes_back_one_step_later_and_only_stopped_ones_run_a_token_more():
    """With the same steps (vLLM's policy, KV to spare), ``step`` returns each request one step after it
    does without async scheduling (its last token comes back during the next step); a request that
    sampled a stop token before its ``max_tokens``-th ran one token more (dropped), the others none."""

    def run(async_scheduling: bool) -> tuple[dict[int, int], dict[int, tuple], int]:
        llm = LLM("random:tiny-llama", "vllm", async_scheduling=async_scheduling, kv_capacity_tokens=2048)
        engine = llm.engine
        for prompt, params in zip(PROMPTS, _params(), strict=True):
            engine.add_request(prompt, params)
        returned, outputs, step = {}, {}, 0
        while engine.has_unfinished():
            for request in engine.step():
                seq = engine.release(request)
                returned[request.request_id] = step
                outputs[request.request_id] = (seq.output_token_ids, seq.finish_reason)
            step += 1
        return returned, outputs, engine.executor.num_forward_tokens

    want_steps, want, want_tokens = run(False)
    got_steps, got, got_tokens = run(True)
    assert got == want
    assert got_steps == {i: step + 1 for i, step in want_steps.items()}
    params = _params()
    stopped_early = [i for i, (ids, reason) in want.items() if reason == "stop" and len(ids) < params[i].max_tokens]
    assert stopped_early and got_tokens == want_tokens + len(stopped_early)


@pytest.mark.parametrize("scheduler", ["vllm", "bros"])  # decodes as a cohort, and named one by one
def test_a_grammar_arriving_mid_run_takes_the_tokens_back_before_each_step_samples(chat_model_dir, scheduler):
    """Requests launched early, some ending on stop tokens, then one with a grammar arrives: from then on
    each step brings the step before's tokens back before it samples, and a request they ended ends in
    that step (its token there dropped) or, not in it, in the next that schedules it, uncomputed; every
    request gets what it gets without async scheduling, counts the tokens it keeps, and its last token's
    time is not before the step that brought that token."""

    def run(async_scheduling: bool) -> tuple[dict[int, tuple], LLM]:
        llm = LLM(str(chat_model_dir), scheduler, async_scheduling=async_scheduling, kv_capacity_tokens=2048)
        engine = llm.engine
        stops = SamplingParams(max_tokens=20, stop_token_ids=list(range(3, 300, 11)))
        for prompt in PROMPTS[:-1]:
            engine.add_request([1, *(t % 300 for t in prompt)], stops)
        outputs = {}
        lengths: dict[Request, tuple[int, float]] = {}  # tokens so far, and the start of the step that gave the last
        for step in range(200):
            if step == 3:
                engine.add_request([1, 40, 41], SamplingParams(max_tokens=12, structured_outputs=GRAMMARS[1]))
            start = engine.replica.now
            finished = engine.step()
            for r, seq in engine.executor.sequences.items():
                if lengths.get(r, (0,))[0] != len(seq.token_ids):
                    lengths[r] = (len(seq.token_ids), start)
            for request in finished:
                assert request.last_token_time >= lengths[request][1]
                seq = engine.release(request)
                assert request.num_output_tokens == len(seq.output_token_ids)
                outputs[request.request_id] = (seq.output_token_ids, seq.finish_reason)
            if not engine.has_unfinished():
                return outputs, llm
        raise AssertionError("still unfinished after 200 steps")

    want, _ = run(False)
    got, llm = run(True)
    assert got == want
    assert sum(reason == "stop" for _, reason in want.values()) >= 3
    assert llm.engine.executor.num_early_launches > 3


@pytest.mark.skipif(not torch.cuda.is_available(), reason="pinned copies and events: needs a GPU")
def test_on_cuda_with_graphs_the_tokens_are_those_without():
    """On CUDA (decode steps on CUDA graphs, inputs copied from pinned memory without blocking, the
    tokens and log-probabilities back through an event): the tokens of seeded and greedy requests, some with
    penalties, logprobs or prompt logprobs, as without async scheduling.
    NOTE: no stops (EOS ignored): the token a stopped request runs more changes a step's batch size, and
    so its GEMMs' tiling, which could move a near tie of the random model's scores."""
    pytest.importorskip("triton")
    extras = [{}, dict(logprobs=2), dict(prompt_logprobs=1), dict(repetition_penalty=1.5, presence_penalty=0.5)]
    params = [
        SamplingParams(max_tokens=20, temperature=0.8 * (i % 2), seed=i, ignore_eos=True, **extras[i % 4])
        for i in range(len(PROMPTS))
    ]
    options = dict(device="cuda", dtype="float32", attention_backend="triton", kv_capacity_tokens=4096)
    want, _ = _generate("vllm", False, params, **options)
    got, llm = _generate("vllm", True, params, **options)
    assert llm.engine.executor.graphs is not None
    _assert_same(got, want)
    assert llm.engine.executor.num_early_launches > 0


@pytest.mark.skipif(not torch.cuda.is_available(), reason="pinned copies and events: needs a GPU")
def test_on_cuda_grammars_give_the_tokens_they_give_without(chat_model_dir):
    """On CUDA (the grammar's bitmask copied from pinned memory while the forward pass runs): the tokens
    and texts of requests with grammars among plain ones as without async scheduling."""
    pytest.importorskip("triton")
    params = [SamplingParams(max_tokens=16, structured_outputs=g) for g in GRAMMARS] + [SamplingParams(max_tokens=12)]
    prompts = ["Hello there", "Is it?", "Say yes or no", "One more thing"]
    options = dict(device="cuda", dtype="float32", attention_backend="triton", kv_capacity_tokens=4096)
    outputs = {}
    for async_scheduling in (False, True):
        llm = LLM(str(chat_model_dir), "vllm", async_scheduling=async_scheduling, **options)
        outputs[async_scheduling] = [(o.outputs[0].token_ids, o.outputs[0].text) for o in llm.generate(prompts, params)]
    assert outputs[True] == outputs[False]
    assert llm.engine.executor.num_early_launches > 0


@settings(max_examples=40, deadline=None)
@given(st.lists(st.tuples(st.integers(1, 5), st.integers(1, 8), st.booleans()), min_size=1, max_size=6))
def test_input_staging_copies_each_batch_of_inputs_whole_and_nothing_else(copies):
    """``InputStaging``, copy after copy through its alternating host buffers: each destination (all of a
    buffer, or a view of its first rows and columns, as the graphs' tables) holds exactly its values, the
    rest of the buffer what it held."""
    buffer = torch.full((5, 8), -1, dtype=torch.int64)  # (rows, columns) a static input buffer
    staging = InputStaging(buffer.device)
    for k, (rows, columns, whole) in enumerate(copies):
        want = buffer.clone()
        values = np.arange(k * 100, k * 100 + buffer.numel()).reshape(5, 8)
        if not whole:
            values = values[:rows, :columns]
        destination = buffer if whole else buffer[:rows, :columns]
        staging.copy(destination, values)
        want[: values.shape[0], : values.shape[1]] = torch.from_numpy(values)
        assert torch.equal(buffer, want)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="pinned copies and events: needs a GPU")
def test_on_cuda_input_staging_rewrites_a_host_buffer_only_after_its_copy_ran():
    """Copies queued behind a busy device: the third reuses the first's host buffer, so it waits until the
    first copy has run instead of changing what that copy reads."""
    n = 1 << 20
    staging = InputStaging(torch.device("cuda"))
    destinations = [torch.zeros(n, dtype=torch.int64, device="cuda") for _ in range(3)]
    torch.cuda._sleep(100_000_000)  # (spins for that many clock cycles: the copies queue behind it)
    for k, destination in enumerate(destinations):
        staging.copy(destination, np.full(n, k + 1, dtype=np.int64))
    torch.cuda.synchronize()
    assert [int(d.min()) for d in destinations] == [1, 2, 3] == [int(d.max()) for d in destinations]


def test_it_is_on_on_cuda_unless_switched_off_and_never_on_by_default_on_the_cpu(monkeypatch):
    """Engines on CUDA schedule asynchronously unless ``SLOSERVE_ASYNC_SCHEDULING=0`` (a profile's preset
    then prices the host's share as overlapped); on the CPU the forward pass is the host's own work; a
    bad value is refused naming the variable."""
    loaded = load_model("random:tiny-llama")
    on_cuda = dataclasses.replace(loaded, device=torch.device("cuda"))
    monkeypatch.delenv("SLOSERVE_ASYNC_SCHEDULING", raising=False)
    assert default_async_scheduling(on_cuda) and not default_async_scheduling(loaded)
    monkeypatch.setenv("SLOSERVE_ASYNC_SCHEDULING", "0")
    assert not default_async_scheduling(on_cuda)
    monkeypatch.setenv("SLOSERVE_ASYNC_SCHEDULING", "1")
    assert default_async_scheduling(on_cuda) and not default_async_scheduling(loaded)
    assert not LLMEngine(loaded, kv_capacity_tokens=256).executor.async_scheduling
    assert LLMEngine(loaded, kv_capacity_tokens=256, async_scheduling=True).executor.async_scheduling
    monkeypatch.setenv("SLOSERVE_ASYNC_SCHEDULING", "yes")
    with pytest.raises(ConfigError, match="SLOSERVE_ASYNC_SCHEDULING must be 0 or 1, got 'yes'"):
        default_async_scheduling(on_cuda)


def test_in_process_token_times_are_when_the_tokens_came_back():
    """The policy times a step's tokens when the step returns, before they exist on a GPU; with async
    scheduling a request's first and last token times (and its end) are when those tokens reached the
    host, during a later step: after that step started, never before."""
    llm = LLM("random:tiny-llama", "vllm", async_scheduling=True, kv_capacity_tokens=2048)
    engine = llm.engine
    requests = [engine.add_request(p, s) for p, s in zip(PROMPTS, _params(), strict=True)]
    came_back: dict[Request, list[float]] = {r: [] for r in requests}  # the start of the step each token came in
    while engine.has_unfinished():
        start = engine.replica.now
        engine.step()
        for r in requests:
            new = len(engine.output_token_ids(r)) - len(came_back[r])
            came_back[r] += [start] * new
    for r in requests:
        assert came_back[r][0] < r.first_token_time <= r.last_token_time == r.finish_time
        assert came_back[r][-1] < r.last_token_time


def _logged_run(device: str, async_scheduling: bool, **options) -> tuple[list, LLMEngine, int]:
    """Every prompt's output tokens through an engine that keeps a step log (as ``run --out`` does), the
    engine, and how many steps it took. NOTE: no stops: a stopped request's extra token would change
    the steps' shapes."""
    engine = LLMEngine(
        load_model("random:tiny-llama", device=device, **options),
        "vllm",
        kv_capacity_tokens=2048,
        async_scheduling=async_scheduling,
    )
    engine.executor.step_log = []
    params = [dataclasses.replace(s, stop_token_ids=[], ignore_eos=True) for s in _params()]
    requests = [engine.add_request(p, s) for p, s in zip(PROMPTS, params, strict=True)]
    steps = 0
    while engine.has_unfinished():
        engine.step()
        steps += 1
    return [engine.output_token_ids(r) for r in requests], engine, steps


def test_a_step_log_does_not_make_the_steps_wait():
    """An engine that keeps a step log (``run --out``) launches its steps early as without one, the same
    tokens as a synchronous engine's, and logs every step that ran a forward pass once, in order, with
    its time."""
    want, sync_engine, _ = _logged_run("cpu", False)
    got, engine, steps = _logged_run("cpu", True)
    assert got == want and engine.executor.num_early_launches > 0
    log = engine.executor.step_log
    assert [shape for shape, _ in log] == [shape for shape, _ in sync_engine.executor.step_log]
    assert len(log) <= steps and all(0 < t < 60 for _, t in log)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA events: needs a GPU")
def test_on_cuda_a_step_launched_early_logs_its_device_time():
    """On CUDA a step launched early is logged with its time on the device (from its first device work to
    its sampling) once its tokens are back: every entry filled, none longer than the run."""
    pytest.importorskip("triton")
    options = dict(dtype="float32", attention_backend="triton")
    want, sync_engine, _ = _logged_run("cuda", False, **options)
    start = time.perf_counter()
    got, engine, _ = _logged_run("cuda", True, **options)
    wall = time.perf_counter() - start
    assert got == want and engine.executor.num_early_launches > 0 and engine.executor._timed is None
    log = engine.executor.step_log
    assert [shape for shape, _ in log] == [shape for shape, _ in sync_engine.executor.step_log]
    assert log and all(0 < t < wall for _, t in log) and sum(t for _, t in log) < wall


@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA's sync debug mode: needs a GPU")
@pytest.mark.parametrize("path", ["decode graphs", "eager", "dense prefills", "piecewise graphs"])
def test_on_cuda_a_step_launched_early_waits_for_nothing_but_the_step_before(monkeypatch, path):
    """A step launched early (async scheduling) makes the host wait for the device nowhere but where it
    takes the step before's tokens (``resolve``): CUDA's sync debug mode raises on any other wait inside
    ``execute`` (a copy from pageable memory, an ``.item()``, a kernel that syncs), through prefill,
    chunked, mixed and decode steps, on each path a step can take. A wait there stalls the next step's
    preparation behind this one's forward pass (the second GPU session's py-spy found the served engine
    inside SDPA's call for 19% of its samples, unexplained); on a failure the traceback names the op."""
    pytest.importorskip("triton")
    from sloserve.engine import triton_attention
    from sloserve.engine.executor import EngineExecutor

    if path == "dense prefills":
        monkeypatch.setenv("SLOSERVE_DENSE_PREFILL", "1")
        monkeypatch.setattr(triton_attention, "DENSE_PREFILL_MIN_TOKENS", 16)
    monkeypatch.setenv("SLOSERVE_PIECEWISE_GRAPHS", "1" if path == "piecewise graphs" else "0")
    execute, resolve = EngineExecutor.execute, EngineExecutor.resolve
    checked = []

    def execute_checked(self, output, now, end_times=None):
        early = self.async_scheduling and self._launches_early(output) and not output.swap_out
        checked.append(early)
        torch.cuda.set_sync_debug_mode("error" if early else "default")
        try:
            return execute(self, output, now, end_times)
        finally:
            torch.cuda.set_sync_debug_mode("default")

    def resolve_unchecked(self):  # (its wait is the one a step launched early makes)
        mode = torch.cuda.get_sync_debug_mode()
        torch.cuda.set_sync_debug_mode("default")
        try:
            return resolve(self)
        finally:
            torch.cuda.set_sync_debug_mode(mode)

    monkeypatch.setattr(EngineExecutor, "execute", execute_checked)
    monkeypatch.setattr(EngineExecutor, "resolve", resolve_unchecked)
    llm = LLM(
        "random:tiny-llama",
        "sarathi",
        device="cuda",
        dtype="bfloat16",
        attention_backend="triton",
        kv_capacity_tokens=4096,
        cuda_graphs=path != "eager",
        async_scheduling=True,
        prefill_token_budget=64,
    )
    prompts = [{"prompt_token_ids": p * 4} for p in PROMPTS]  # (8-144 tokens: chunks of 64 beside decodes)
    params = [SamplingParams(max_tokens=12, ignore_eos=True, temperature=0.8 * (i % 2), seed=i) for i in range(12)]
    outputs = llm.generate(prompts, params)
    assert [len(o.outputs[0].token_ids) for o in outputs] == [12] * len(prompts)
    assert sum(checked) > 10 and llm.engine.executor.num_early_launches > 10
    assert (llm.engine.executor.piecewise is not None) == (path == "piecewise graphs")


def test_a_profile_times_batches_as_an_asynchronous_engine_runs_them():
    """``StepTimer`` with async scheduling: a batch's timed steps are each launched before the step before's
    tokens are back (one more step first, with nothing in flight), a batch with a prefill too (its chunks
    of new requests each step, two steps' held at most); nothing is left in flight or in the KV cache."""
    from sloserve.engine.profile import StepTimer

    loaded = load_model("random:tiny-llama")
    decodes = [30, 50, 70]
    timer = StepTimer(loaded, StepTimer.blocks_needed([(20, 10)], decodes), max_context=256, async_scheduling=True)
    calls = []
    real_execute = timer.executor.execute
    timer.executor.execute = lambda output, now: calls.append(output) or real_execute(output, now)
    assert timer.time([], decodes, repeats=2, warmup=1) > 0
    assert len(calls) == 4 and timer.executor.num_early_launches == 3  # one untimed, then each one early
    assert timer.executor.in_flight is None and not timer.executor.sequences
    assert timer.time([(20, 10)], decodes, repeats=2, warmup=1) > 0
    assert len(calls) == 8 and timer.executor.num_early_launches == 6
    prefills = [[c.request for c in output.chunks if c.num_tokens > 1] for output in calls[4:]]
    assert all(len(p) == 1 for p in prefills) and len({p[0] for p in prefills}) == 4  # a new request each step
    assert timer.executor.in_flight is None and not timer.executor.sequences
    assert timer.kv.num_free_blocks == timer.kv.gpu.num_blocks
    assert not StepTimer(loaded, 4, max_context=64).async_scheduling  # the CPU's default
