"""vLLM's ``use_beam_search`` on the completions and chat routes: the ``n`` best beams of each prompt
(``engine/beam_search.py``), each step one engine request of one token per live beam, answered whole
(not streamed). ``length_penalty`` weighs the score; the sampling controls, stop strings and
structured outputs do not apply and are refused (``SamplingRequest.check_beam_search``). A client that
leaves ends its search (the step's requests are aborted).
"""

from __future__ import annotations

import asyncio
from collections.abc import Coroutine
from typing import Any

from fastapi import Request
from fastapi.responses import JSONResponse, Response

from sloserve.core.request import RequestClass
from sloserve.engine.beam_search import Beam, BeamSearchParams, search
from sloserve.server.protocol import ChatCompletionRequest, CompletionRequest, usage
from sloserve.server.responses import unless_gone
from sloserve.server.serving import (
    ApiError,
    Choice,
    OpenAIServing,
    ResponseObjects,
    collect,
    ended_early,
    service_tier,
)


async def beam_search_response(
    serving: OpenAIServing, body: CompletionRequest | ChatCompletionRequest, raw: Request
) -> Response:
    """The response to ``body`` (``use_beam_search``); the searches end if the client leaves first."""
    response = await unless_gone(raw, beam_search(serving, body))
    if response is None:  # the client left: nobody reads this
        return Response(status_code=499)
    return JSONResponse(response)


async def beam_search(
    serving: OpenAIServing, body: CompletionRequest | ChatCompletionRequest, request_class: RequestClass | None = None
) -> dict[str, Any]:
    """The response body of ``body`` (``use_beam_search``): ``n`` choices per prompt, best first. A
    refusal is raised before the first step; ``request_class``: the class of its engine requests
    (None: the body's)."""
    serving.check_model(body.model)
    body.check_supported()
    body.check_beam_search()
    chat = isinstance(body, ChatCompletionRequest)
    prompts = [serving.chat_prompt(body)] if chat else serving.completion_prompts(body)[0]
    max_tokens = body.output_cap if chat else body.max_tokens
    fits = [
        serving.sampling_params(body, ids, max_tokens, None, i if len(prompts) > 1 else None).max_tokens
        for i, ids in enumerate(prompts)
    ]
    width = body.n
    serving.check_priority(body.priority)
    serving.engine.check_room(width * len(prompts))
    eos = frozenset(serving.engine.info.eos_token_ids)
    request_class = request_class or body.request_class()
    searches = [
        _search(serving, body, request_class, ids, BeamSearchParams(width, fit, body.ignore_eos, body.length_penalty),
                eos)
        for ids, fit in zip(prompts, fits, strict=True)
    ]  # fmt: skip
    results = await _all(searches)
    choices = [
        _choice(serving, body, p * width + j, beam) for p, beams in enumerate(results) for j, beam in enumerate(beams)
    ]
    objects = ResponseObjects(chat, serving.config.model_name, service_tier(request_class, body.service_tier))
    num_output = sum(len(b.output_token_ids) for beams in results for b in beams)
    return objects.whole(choices, usage(sum(len(ids) for ids in prompts), num_output))


async def _all(searches: list[Coroutine[Any, Any, list[Beam]]]) -> list[list[Beam]]:
    """Each search's beams; one that fails (or a cancellation) ends the others."""
    try:
        async with asyncio.TaskGroup() as group:
            tasks = [group.create_task(s) for s in searches]
    except ExceptionGroup as failed:
        raise failed.exceptions[0] from None
    return [task.result() for task in tasks]


async def _search(
    serving: OpenAIServing,
    body,
    request_class: RequestClass,
    prompt_ids: list[int],
    params: BeamSearchParams,
    eos: frozenset[int],
) -> list[Beam]:
    """One prompt's beams: each step, every live beam's next token from the engine."""
    engine = serving.engine
    step = params.step_params()
    slo = body.slo_for(request_class, serving.config.rt_ttft_ms, serving.config.rt_tpot_ms)
    searching = search(prompt_ids, params, eos)
    batch = next(searching)
    while True:
        served = [
            engine.submit(ids, step, request_class=request_class, slo=slo, priority=body.priority) for ids in batch
        ]
        try:
            generated = await asyncio.gather(*(collect(s) for s in served))
        except asyncio.CancelledError:  # the client left, or another search failed
            for s in served:
                engine.abort(s)
            raise
        for s, g in zip(served, generated, strict=True):
            if g.finish_reason in ("abort", "error"):
                error = ended_early(g.finish_reason, s.error or engine.error)
                raise ApiError(error.status, error.body["error"]["message"], code=error.body["error"]["code"])
        try:
            batch = searching.send([g.logprobs[0] for g in generated])
        except StopIteration as done:
            return done.value


def _choice(serving: OpenAIServing, body, index: int, beam: Beam) -> Choice:
    """A beam as a choice: its text, how it ended, and its tokens' logprobs where asked."""
    tokenizer = serving.engine.tokenizer
    output = beam.output_token_ids
    text = tokenizer.decode(output, body.skip_special_tokens) if tokenizer is not None else ""
    k = body.num_logprobs
    logprobs: dict[str, Any] | None = None
    if k is not None:
        entries = [e.with_top(k) for e in beam.logprobs]
        fmt = serving.logprobs_format_for(body)
        logprobs = fmt.chat(entries) if isinstance(body, ChatCompletionRequest) else fmt.completion(output, entries, 0)
    return Choice(index, text, "stop" if beam.finished else "length", logprobs)
