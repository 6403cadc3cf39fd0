"""The online engine (``AsyncLLMEngine``) and aborts: an aborted request frees its KV under every
registered policy and the other requests still get exactly the tokens they get without the abort;
streams carry every token once, stop strings end a request, the queue bound holds and a shutdown
ends every accepted request."""

from __future__ import annotations

import asyncio
import dataclasses
import functools
import multiprocessing
import os
import signal
import threading
import time

import pytest
from hypothesis import given
from hypothesis import strategies as st

torch = pytest.importorskip("torch")

from core_pipe import CorePipe  # noqa: E402

from sloserve.core.errors import ConfigError  # noqa: E402
from sloserve.core.request import SLO, RequestClass  # noqa: E402
from sloserve.engine.async_engine import (  # noqa: E402
    AsyncLLMEngine,
    EngineDeadError,
    QueueFullError,
    ServedRequest,
    ShuttingDownError,
    StreamDelta,
)
from sloserve.engine.engine_core import AddRequest, EngineCore, EngineSpec  # noqa: E402
from sloserve.engine.llm_engine import LLMEngine  # noqa: E402
from sloserve.engine.loader import load_model  # noqa: E402
from sloserve.engine.sampler import SamplingParams  # noqa: E402
from sloserve.engine.tokenizer import ByteTokenizer  # noqa: E402
from sloserve.sched import scheduler_names  # noqa: E402

PROMPTS = [[(7 * i + 3 * j) % 250 + 1 for j in range(10 + 9 * i)] for i in range(8)]
MAX_TOKENS = [12, 20, 8, 16, 24, 10, 14, 18]
ABORT_AT_STEP = {1: 3, 4: 6, 6: 0}  # request index -> step after which it is aborted (6: still waiting)


@functools.cache
def tiny():
    return load_model("random:tiny-llama")


def _run(scheduler: str, aborts: dict[int, int]) -> tuple[list[list[int]], list[str], LLMEngine]:
    engine = LLMEngine(tiny(), scheduler, kv_capacity_tokens=384)
    # (every other one penalized: its counts are kept from step to step, and freed with it)
    params = [SamplingParams(max_tokens=n, temperature=0, ignore_eos=True, presence_penalty=(i % 2) * 0.5)
              for i, n in enumerate(MAX_TOKENS)]  # fmt: skip
    requests = [engine.add_request(p, s) for p, s in zip(PROMPTS, params, strict=True)]
    tokens: dict[int, list[int]] = {}
    reasons: dict[int, str] = {}
    step = 0
    while engine.has_unfinished():
        for i, at in aborts.items():
            if at == step:
                engine.abort(requests[i])
        for request in engine.step():
            seq = engine.release(request)
            tokens[request.request_id], reasons[request.request_id] = seq.output_token_ids, seq.finish_reason
        engine.scheduler.check_integrity()
        step += 1
    ids = [r.request_id for r in requests]
    return [tokens[i] for i in ids], [reasons[i] for i in ids], engine


@functools.cache
def _reference(scheduler: str) -> list[list[int]]:
    return _run(scheduler, {})[0]


@pytest.mark.parametrize("scheduler", scheduler_names())
def test_aborted_requests_free_their_kv_and_leave_the_others_exact(scheduler):
    tokens, reasons, engine = _run(scheduler, ABORT_AT_STEP)
    kv = engine.scheduler.kv
    assert kv.num_free_blocks == kv.gpu.num_blocks, "an aborted request kept KV"
    assert not engine.executor.sequences and not engine.executor.penalties
    reference = _reference(scheduler)
    for i, (got, want) in enumerate(zip(tokens, reference, strict=True)):
        if i in ABORT_AT_STEP:
            assert reasons[i] == "abort" and want[: len(got)] == got, i
        else:
            assert reasons[i] == "length" and got == want, i


def test_aborted_requests_teach_the_length_predictor_nothing():
    _, _, engine = _run("infermax", ABORT_AT_STEP)
    observed = engine.scheduler.predictor._all
    assert sorted(observed) == sorted(n for i, n in enumerate(MAX_TOKENS) if i not in ABORT_AT_STEP)


async def _collect(served):
    parts, ids, reason = [], [], None
    async for delta in served:
        parts.append(delta.text)
        ids.extend(delta.token_ids)
        reason = delta.finish_reason
    return "".join(parts), ids, reason


def _online(scheduler: str = "vllm", kv: int = 2048, overlap_publish: bool | None = None, **kwargs) -> AsyncLLMEngine:
    """An online engine of random:tiny-llama (the same weights as ``tiny()``: one seed), started.
    ``overlap_publish``: as on a GPU, each step's tokens go out during the next step's forward pass."""
    spec = EngineSpec("random:tiny-llama", scheduler, kv_capacity_tokens=kv, overlap_publish=overlap_publish)
    online = AsyncLLMEngine(spec, **kwargs)
    online.start()
    return online


def _all_freed(online: AsyncLLMEngine) -> bool:
    stats = online.last_stats
    return stats.kv_used_tokens == 0 and stats.kv_allocated_tokens == 0 and stats.num_running == 0


# Each request's stream interval in the test below: each step's tokens, 3 at a time, the whole output at once
STREAM_INTERVALS = [1, 3, None, 1, 3, None, 5, 1]


@pytest.mark.parametrize("overlap_publish", [False, True])
def test_streams_carry_every_token_once_and_match_offline_generation(overlap_publish):
    params = [SamplingParams(max_tokens=n, temperature=0, ignore_eos=True) for n in MAX_TOKENS]
    offline = LLMEngine(tiny(), "vllm", kv_capacity_tokens=2048)
    reference = [offline.add_request(p, s) for p, s in zip(PROMPTS, params, strict=True)]
    while offline.has_unfinished():
        offline.step()
    want = [offline.output_token_ids(r) for r in reference]

    async def main():
        online = _online(overlap_publish=overlap_publish)

        async def collect(served):  # (``_collect``, and the token counts of the deltas)
            parts, ids, reason, sizes = [], [], None, []
            async for delta in served:
                sizes.append(len(delta.token_ids))
                parts.append(delta.text)
                ids.extend(delta.token_ids)
                reason = delta.finish_reason
            return "".join(parts), ids, reason, sizes

        try:
            streams = [
                online.submit(p, s, stream_interval=n)
                for p, s, n in zip(PROMPTS, params, STREAM_INTERVALS, strict=True)
            ]
            return await asyncio.gather(*(collect(s) for s in streams)), online
        finally:
            await asyncio.to_thread(online.drain, 5.0)

    results, online = asyncio.run(main())
    for (text, ids, reason, sizes), expected, interval in zip(results, want, STREAM_INTERVALS, strict=True):
        assert ids == expected and reason == "length"
        assert text == ByteTokenizer().decode(expected)
        if interval is None:  # not streamed: one delta, the whole output
            assert sizes == [len(expected)]
        else:  # (the loop joins deltas that wait for it: never smaller ones)
            assert all(n >= interval for n in sizes[1:-1]), sizes
    assert online.num_unfinished == 0 and _all_freed(online)


@given(
    sizes=st.lists(st.integers(0, 4), min_size=1, max_size=30),
    interval=st.one_of(st.none(), st.integers(1, 6)),
)
def test_a_stream_interval_hands_over_every_token_once_first_at_once_then_at_least_n_at_a_time(sizes, interval):
    """``ServedRequest.release`` on deltas of random token counts (0: a step that gave a request no
    token), the last one ending it."""
    served = ServedRequest(0, 0.0, [1], SamplingParams(), RequestClass.RT, SLO(), None, stream_interval=interval)
    tokens = iter(range(1000))
    came = [
        StreamDelta(f"<{n}>", [next(tokens) for _ in range(n)], "length" if i == len(sizes) - 1 else None)
        for i, n in enumerate(sizes)
    ]
    handed = [d for d in map(served.release, came) if d is not None]
    assert StreamDelta.joined(handed) == StreamDelta.joined(came)  # everything, once, in order
    assert handed[-1].finish_reason == "length" and all(d.finish_reason is None for d in handed[:-1])
    with_tokens = [d for d in handed if d.token_ids]
    if interval is None:
        assert len(handed) == 1
    elif interval == 1:
        assert handed == came
    elif with_tokens:
        first = next(d for d in came if d.token_ids)
        assert with_tokens[0].token_ids == first.token_ids  # the first token's step at once
        assert all(len(d.token_ids) >= interval for d in handed[1:-1] if d is not with_tokens[0])


@pytest.mark.parametrize("overlap_publish", [False, True])
def test_a_stop_string_ends_the_request_and_is_not_returned(overlap_publish):
    """Greedy output of a prompt, then the same prompt with a stop string taken from that output."""
    prompt, params = PROMPTS[2], SamplingParams(max_tokens=40, temperature=0, ignore_eos=True)

    async def main():
        online = _online(overlap_publish=overlap_publish)
        try:
            full, ids, _ = await _collect(online.submit(prompt, params))
            printable = [i for i in range(len(full) - 2) if full[i : i + 2].isprintable() and full[i] != "\ufffd"]
            if not printable:
                pytest.skip("no printable pair in this random model's output")
            cut = printable[len(printable) // 2]
            stop = full[cut : cut + 2]
            text, stopped_ids, reason = await _collect(online.submit(prompt, dataclasses.replace(params, stop=(stop,))))
            return full, stop, text, stopped_ids, ids, reason
        finally:
            await asyncio.to_thread(online.drain, 5.0)

    full, stop, text, stopped_ids, ids, reason = asyncio.run(main())
    assert reason == "stop" and text == full[: full.index(stop)] and stop not in text
    assert stopped_ids == ids[: len(stopped_ids)] and len(stopped_ids) < len(ids)


def test_the_queue_bound_refuses_beyond_it_and_every_accepted_request_completes():
    """ORCA reserves prompt + max_tokens: KV for one request at a time. The first runs, two wait for
    their first token, the rest are refused."""
    params = SamplingParams(max_tokens=60, temperature=0, ignore_eos=True)

    async def main():
        online = _online("orca", kv=96, max_queued_requests=2)
        try:
            first = online.submit(PROMPTS[3][:20], params)
            stream = first.__aiter__()
            await stream.__anext__()  # it is running: it holds the KV
            accepted, refused = [first], 0
            for prompt in PROMPTS[:6]:
                try:
                    accepted.append(online.submit(prompt[:20], params))
                except QueueFullError:
                    refused += 1
            async for _ in stream:
                pass
            rest = await asyncio.gather(*(_collect(s) for s in accepted[1:]))
            return accepted, refused, rest
        finally:
            await asyncio.to_thread(online.drain, 5.0)

    accepted, refused, rest = asyncio.run(main())
    assert len(accepted) == 3 and refused == 4
    assert all(len(ids) == 60 and reason == "length" for _, ids, reason in rest)


@pytest.mark.parametrize("overlap_publish", [False, True])
def test_shutdown_refuses_new_requests_and_aborts_what_outlives_the_grace_period(overlap_publish):
    params = SamplingParams(max_tokens=900, temperature=0, ignore_eos=True)

    async def main():
        online = _online(overlap_publish=overlap_publish)
        served = online.submit(PROMPTS[0], params)
        stream = served.__aiter__()
        await stream.__anext__()
        drained = await asyncio.to_thread(online.drain, 0.05)
        with pytest.raises(ShuttingDownError):
            online.submit(PROMPTS[1], params)
        reason = None
        async for delta in stream:
            reason = delta.finish_reason
        return drained, reason, online

    drained, reason, online = asyncio.run(main())
    assert not drained and reason == "abort" and online.num_unfinished == 0 and _all_freed(online)


def test_a_request_that_can_never_run_is_refused_and_one_only_the_engine_can_refuse_ends_alone():
    """One that cannot fit the KV cache is refused at submission; a grammar on a model without a
    tokenizer.json (the server refuses it first, with a 400) reaches the engine process, which ends
    that request with "error" and the reason and serves the next one."""
    from sloserve.engine.structured_output import json_grammar

    async def main():
        online = _online(kv=64)
        try:
            with pytest.raises(ConfigError, match="KV capacity 64"):
                online.submit(PROMPTS[7], SamplingParams(max_tokens=100))
            assert online.num_queued == 0
            refused = online.submit([1, 2, 3], SamplingParams(max_tokens=4, grammar=json_grammar(None)))
            _, _, reason = await _collect(refused)
            after = await _collect(online.submit([1, 2, 3], SamplingParams(max_tokens=4, temperature=0)))
            return reason, refused.error, after, online
        finally:
            await asyncio.to_thread(online.drain, 5.0)

    reason, error, after, online = asyncio.run(main())
    assert reason == "error" and "structured output needs the model's tokenizer" in error
    assert after[2] == "length" and len(after[1]) == 4 and online.error is None


def test_a_request_waits_out_of_the_queue_while_its_grammar_compiles_and_the_others_run(chat_model_dir, monkeypatch):
    """vLLM's WAITING_FOR_FSM: a grammar compiles in a thread of the core (here held until released)
    while the engine serves the other requests; one aborted meanwhile ends at once; a compiled one runs
    as offline, where its grammar compiled at once."""
    pytest.importorskip("llguidance")
    from sloserve.engine.structured_output import GrammarMatchers, choice_grammar

    release = threading.Event()
    compile_grammar = GrammarMatchers._compile

    def held(self, grammar):
        assert release.wait(timeout=30)
        return compile_grammar(self, grammar)

    monkeypatch.setattr(GrammarMatchers, "_compile", held)
    model = load_model(str(chat_model_dir))
    engine = LLMEngine(model, "vllm", kv_capacity_tokens=1024)
    server, pipe = multiprocessing.Pipe()
    core = EngineCore(engine, time.perf_counter(), pipe)
    guided = SamplingParams(max_tokens=8, temperature=0, grammar=choice_grammar(["yes", "no way"]))
    plain = SamplingParams(max_tokens=6, temperature=0, ignore_eos=True)
    for request_id, params in enumerate((guided, plain, guided)):
        core.apply(("add", AddRequest(request_id, PROMPTS[1], params, RequestClass.BE, SLO(), core.clock())))
    core.apply(("abort", 2))
    sent = CorePipe(server)
    sent.read()
    assert sent.reasons == {2: "abort"} and core.stats().num_waiting == 2  # 0 compiling, 1 queued
    while engine.has_unfinished():
        core.add_compiled()
        core.run_step()
    sent.read()
    assert sent.reasons == {2: "abort", 1: "length"} and not sent.tokens[0]
    release.set()
    deadline = time.monotonic() + 30
    while 0 not in sent.reasons:
        assert time.monotonic() < deadline, "the compiled request never ran"
        core.add_compiled()
        if engine.has_unfinished():
            core.run_step()
        else:
            time.sleep(0.001)
        sent.read()
    reference = LLMEngine(model, "vllm", kv_capacity_tokens=1024)
    want = reference.add_request(PROMPTS[1], guided)
    while reference.has_unfinished():
        reference.step()
    assert sent.reasons[0] == "stop" and sent.tokens[0] == reference.output_token_ids(want)
    assert model.tokenizer.decode(sent.tokens[0]) in ("yes", "no way")


def test_a_prefix_cache_reset_drops_the_ended_requests_first_and_is_refused_while_one_is_served():
    """vLLM's reset_prefix_cache through the core's pipe: refused while a request runs; right after its abort
    (its scheduler frees its KV in its next step) the core drops it first and resets, so its prompt sent again
    finds nothing cached, and sent a third time finds what the second left."""
    engine = LLMEngine(tiny(), "vllm", kv_capacity_tokens=2048)
    server, pipe = multiprocessing.Pipe()
    core = EngineCore(engine, time.perf_counter(), pipe)
    sent = CorePipe(server)
    params = SamplingParams(max_tokens=30, temperature=0, ignore_eos=True)

    def add(request_id: int) -> None:
        core.apply(("add", AddRequest(request_id, PROMPTS[7], params, RequestClass.RT, SLO(), core.clock())))

    add(0)
    core.run_step()
    core.run_step()
    core.apply(("reset_prefix_cache",))
    sent.read()
    assert sent.resets == [False] and engine.has_unfinished()
    core.apply(("abort", 0))
    assert engine.scheduler.kv.allocated_tokens > 0  # (not freed yet)
    core.apply(("reset_prefix_cache",))
    outputs = sent.read()
    assert sent.resets == [False, True] and sent.reasons == {0: "abort"} and not engine.has_unfinished()
    for request_id in (1, 2):
        add(request_id)
        while engine.has_unfinished():
            core.run_step()
        outputs += sent.read()
    cached = {out.request_id: out.num_cached_tokens for out in outputs if out.finish_reason is not None}
    assert cached == {0: 0, 1: 0, 2: 64}  # 73 tokens: 4 full blocks of 16 before the last token
    assert sent.tokens[1] == sent.tokens[2]


def test_overlapped_publishing_sends_each_step_during_the_next_and_the_last_before_an_abort(monkeypatch):
    """With ``overlap_publish`` a step's tokens are kept until the next step's forward pass has been
    launched, and sent before its logits are computed; an abort first sends what the step before gave
    (here a finish), and every token reaches the pipe once, in order, as the engine generated it."""
    engine = LLMEngine(tiny(), "vllm", kv_capacity_tokens=2048)
    server, pipe = multiprocessing.Pipe()
    core = EngineCore(engine, time.perf_counter(), pipe, overlap_publish=True)
    params = [SamplingParams(max_tokens=n, temperature=0, ignore_eos=True) for n in (3, 40)]
    for i, (prompt, p) in enumerate(zip(PROMPTS[:2], params, strict=True)):
        core.apply(("add", AddRequest(i, prompt, p, RequestClass.BE, SLO(), core.clock())))
    sent_before_logits: list[bool] = []
    compute_logits = engine.executor.model.compute_logits

    def watched(hidden):
        sent_before_logits.append(server.poll())
        return compute_logits(hidden)

    monkeypatch.setattr(engine.executor.model, "compute_logits", watched)
    sent = CorePipe(server)
    got, reasons, read = sent.tokens, sent.reasons, sent.read

    core.run_step()  # the prompts: each samples its first token
    assert not server.poll(), "published before the next step"
    core.run_step()
    assert sent_before_logits == [False, True]
    read()
    assert [len(got[0]), len(got[1])] == [1, 1], "the second step's tokens went out with the first's"
    core.run_step()  # request 0 samples its third and last token
    read()
    assert [len(got[0]), len(got[1])] == [2, 2] and not reasons
    core.apply(("abort", 1))
    read()
    assert reasons == {0: "length", 1: "abort"} and [len(got[0]), len(got[1])] == [3, 3]
    while engine.has_unfinished():
        core.run_step()
    core.flush()
    read()  # the step that drops the aborted request: stats, no news for it
    reference = LLMEngine(tiny(), "vllm", kv_capacity_tokens=2048)
    want = [reference.add_request(p, s) for p, s in zip(PROMPTS[:2], params, strict=True)]
    while reference.has_unfinished():
        reference.step()
    assert got[0] == reference.output_token_ids(want[0])
    assert got[1] == reference.output_token_ids(want[1])[:3]


def test_a_bad_value_of_the_overlap_switch_stops_the_engine_at_start_naming_it(monkeypatch):
    monkeypatch.setenv("SLOSERVE_OVERLAP_PUBLISH", "yes")
    online = AsyncLLMEngine(EngineSpec("random:tiny-llama", kv_capacity_tokens=256))
    with pytest.raises(ConfigError, match="SLOSERVE_OVERLAP_PUBLISH must be 0 or 1, got 'yes'"):
        online.start()


def test_a_reset_whose_asker_gave_up_leaves_the_engine_serving():
    """A prefix cache reset cancelled before the engine answered (a timeout; the engine process paused): its
    answer comes later and is dropped; the engine goes on serving, and the next reset is answered."""
    params = SamplingParams(max_tokens=4, temperature=0, ignore_eos=True)

    async def main():
        online = _online()
        try:
            os.kill(online._process.pid, signal.SIGSTOP)
            try:
                with pytest.raises(TimeoutError):
                    await asyncio.wait_for(online.reset_prefix_cache(), 0.2)
            finally:
                os.kill(online._process.pid, signal.SIGCONT)
            # (a reader thread that died on the late answer would leave these waiting: bounded)
            _, tokens, reason = await asyncio.wait_for(_collect(online.submit(PROMPTS[0], params)), 60)
            return len(tokens), reason, await asyncio.wait_for(online.reset_prefix_cache(), 60), online.error
        finally:
            await asyncio.to_thread(online.drain, 5.0)

    assert asyncio.run(main()) == (4, "length", True, None)


def test_a_killed_engine_process_ends_every_open_request_saying_how_and_refuses_new_ones():
    """SIGKILL (what the kernel's OOM killer sends) while three requests are open: each ends with "error",
    the engine names the signal, and a new request is refused with that reason."""
    params = SamplingParams(max_tokens=900, temperature=0, ignore_eos=True)

    async def main():
        online = _online(kv=2048, max_queued_requests=8)
        try:
            served = [online.submit(prompt, params) for prompt in PROMPTS[:3]]
            stream = served[0].__aiter__()
            await stream.__anext__()  # the engine runs
            online._process.kill()
            ended = [await _collect(s) for s in served]
            with pytest.raises(EngineDeadError) as refused:
                online.submit(PROMPTS[3], params)
            return ended, [s.finish_reason for s in served], str(refused.value), online
        finally:
            await asyncio.to_thread(online.drain, 5.0)

    ended, reasons, refused, online = asyncio.run(main())
    assert [reason for _, _, reason in ended] == ["error"] * 3 and reasons == ["error"] * 3
    assert online.error == "the engine process was killed by SIGKILL" and online.error in refused
    assert online.num_unfinished == 0
