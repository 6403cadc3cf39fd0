"""vLLM's ``use_beam_search`` on the completions and chat routes: the ``n`` best beams of each prompt
(``engine/beam_search.py``), each step one engine request of one token per live beam, answered whole
(streamed, as vLLM streams it: each choice in one chunk once the beams are found). ``length_penalty``
weighs the score; the sampling controls, stop strings and structured outputs do not apply and are
refused (``SamplingRequest.check_beam_search``). A client that leaves ends its search (the step's
requests are aborted).
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Coroutine, Mapping
from typing import Any

from fastapi import Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from sloserve.core.request import RequestClass
from sloserve.engine.beam_search import Beam, BeamSearchParams, search
from sloserve.server.protocol import ChatCompletionRequest, CompletionRequest, usage
from sloserve.server.responses import sse, unless_gone
from sloserve.server.serving import (
    ApiError,
    Choice,
    OpenAIServing,
    ResponseObjects,
    collect,
    ended_early,
    error_response,
    service_tier,
)


async def beam_search_response(
    serving: OpenAIServing, body: CompletionRequest | ChatCompletionRequest, raw: Request
) -> Response:
    """The response to ``body`` (``use_beam_search``); the searches end if the client leaves first."""
    search = await BeamSearch.checked(serving, body, headers=raw.headers)
    if body.stream:
        return StreamingResponse(search.events(), media_type="text/event-stream")
    results = await unless_gone(raw, search.beams())
    if results is None:  # the client left: nobody reads this
        return Response(status_code=499)
    return JSONResponse(search.whole(results))


async def beam_search(
    serving: OpenAIServing, body: CompletionRequest | ChatCompletionRequest, request_class: RequestClass | None = None
) -> dict[str, Any]:
    """The response body of ``body`` (``use_beam_search``): ``n`` choices per prompt, best first. A
    refusal is raised before the first step; ``request_class``: the class of its engine requests
    (None: the body's)."""
    search = await BeamSearch.checked(serving, body, request_class)
    return search.whole(await search.beams())


class BeamSearch:
    """One request's beam searches (one per prompt) over its ``prompts``' tokens. ``checked`` makes one
    and raises any refusal before anything runs."""

    @classmethod
    async def checked(
        cls,
        serving: OpenAIServing,
        body: CompletionRequest | ChatCompletionRequest,
        request_class: RequestClass | None = None,
        headers: Mapping[str, str] | None = None,
    ) -> BeamSearch:
        """``body``'s searches, its prompts tokenized off the event loop (``OpenAIServing.off_loop``);
        ``headers``: the HTTP request's (its ``X-Request-Id`` names the response)."""
        serving.check_model(body.model)
        body.check_supported()
        body.check_beam_search()
        serving.check_queue_holds(body, 1 if isinstance(body, ChatCompletionRequest) else len(body.prompt_list()))
        if isinstance(body, ChatCompletionRequest):
            prompts = [await serving.off_loop(serving.chat_prompt, body)]
        else:
            prompts, _ = await serving.off_loop(serving.completion_prompts, body)
        return cls(serving, body, prompts, request_class, body.response_id(headers))

    def __init__(
        self,
        serving: OpenAIServing,
        body: CompletionRequest | ChatCompletionRequest,
        prompts: list[list[int]],
        request_class: RequestClass | None = None,
        request_id: str | None = None,
    ) -> None:
        chat = isinstance(body, ChatCompletionRequest)
        self.prompts = prompts
        max_tokens = body.output_cap if chat else body.max_tokens
        fits = [
            serving.sampling_params(body, ids, max_tokens, None, i if len(self.prompts) > 1 else None).max_tokens
            for i, ids in enumerate(self.prompts)
        ]
        serving.check_priority(body.priority)
        serving.engine.check_room(body.n * len(self.prompts))
        self.serving, self.body = serving, body
        self.request_class = request_class or body.request_class()
        self.params = [BeamSearchParams(body.n, fit, body.ignore_eos, body.length_penalty) for fit in fits]
        self.objects = ResponseObjects(
            chat, serving.config.model_name, service_tier(self.request_class, body.service_tier), request_id
        )

    async def beams(self) -> list[list[Beam]]:
        """Each prompt's ``n`` beams, best first."""
        eos = frozenset(self.serving.engine.info.eos_token_ids)
        return await _all(
            [
                _search(self.serving, self.body, self.request_class, ids, params, eos)
                for ids, params in zip(self.prompts, self.params, strict=True)
            ]
        )

    def choices(self, results: list[list[Beam]]) -> list[Choice]:
        width, choices = self.body.n, []
        for p, beams in enumerate(results):
            for j, beam in enumerate(beams):
                choice = _choice(self.serving, self.body, p * width + j, beam)
                if self.body.return_token_ids:  # vLLM's
                    choice.token_ids, choice.prompt_token_ids = beam.output_token_ids, self.prompts[p]
                choices.append(choice)
        return choices

    def usage(self, results: list[list[Beam]]) -> dict[str, int]:
        num_output = sum(len(b.output_token_ids) for beams in results for b in beams)
        return usage(sum(len(ids) for ids in self.prompts), num_output)

    def whole(self, results: list[list[Beam]]) -> dict[str, Any]:
        return self.objects.whole(self.choices(results), self.usage(results))

    async def events(self) -> AsyncIterator[str]:
        """The streamed response, as vLLM streams a beam search: nothing until the beams are found, then
        each choice whole in its chunk (after its role chunk, for chat), the usage, ``[DONE]``. A client
        that leaves cancels this, and so the searches."""
        try:
            results = await self.beams()
        except ApiError as e:  # the engine ended a step's request (a shutdown, a failure)
            yield sse(error_response(e).body)
            return
        objects, body, width = self.objects, self.body, self.body.n
        for choice in self.choices(results):
            prompt_ids = choice.prompt_token_ids  # (None unless return_token_ids)
            chunks = []
            if objects.chat:
                chunks.append(objects.chunk("", None, role=True, index=choice.index, prompt_token_ids=prompt_ids))
            chunks.append(
                objects.chunk(choice.text, choice.finish_reason, index=choice.index, logprobs=choice.logprobs,
                              token_ids=choice.token_ids, prompt_token_ids=None if objects.chat else prompt_ids)
            )  # fmt: skip
            for chunk in chunks:
                if body.continuous_usage:  # vLLM's: the choice's prompt and its tokens so far
                    beam = results[choice.index // width][choice.index % width]
                    chunk["usage"] = usage(len(self.prompts[choice.index // width]), len(beam.output_token_ids))
                yield sse(chunk)
        if body.include_usage:
            yield sse(objects.usage_chunk(self.usage(results)))
        yield sse("[DONE]")


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
            engine.submit(
                ids, step, request_class=request_class, slo=slo, priority=body.priority, cache_salt=body.cache_salt
            )
            for ids in batch
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
