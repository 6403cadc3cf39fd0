"""From an OpenAI request body to engine requests (a ``Submission``: one per choice of each prompt), and
from their deltas to OpenAI's response objects (choices, logprobs, echo, usage).

The HTTP routes (``app``) and the Batch API's runner (``batch_runner``) both go through
``OpenAIServing``, so a batch line is validated, tokenized, submitted and answered exactly as the same
body sent online, and fails with the same error object (``error_response``).
"""

from __future__ import annotations

import asyncio
import functools
import json
import uuid
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any, TypeVar

from sloserve.core.errors import ConfigError, SloserveError
from sloserve.core.request import RequestClass
from sloserve.engine.async_engine import (
    AsyncLLMEngine,
    EngineDeadError,
    QueueFullError,
    ServedRequest,
    ShuttingDownError,
)
from sloserve.engine.chat_template import ChatTemplate
from sloserve.engine.logprobs import Logprobs, cumulative_logprob
from sloserve.engine.sampler import SamplingParams
from sloserve.engine.structured_output import GrammarMatchers, compile_grammar, thinking_first
from sloserve.engine.tokenizer import HFTokenizer
from sloserve.server.chat_output import ChatOutputParser
from sloserve.server.logprobs import LogprobsFormat
from sloserve.server.protocol import (
    ChatCompletionRequest,
    ChatMessage,
    ChatTemplateFields,
    CompletionRequest,
    DetokenizeRequest,
    ParameterError,
    SamplingRequest,
    TokenizeRequest,
    error_body,
    now_unix,
    sent_or_default,
    usage,
)
from sloserve.server.reasoning import THINK_CLOSE, THINK_OPEN, starts_thinking
from sloserve.server.tool_calls import ToolUse

# Requests' own chat templates kept compiled (--trust-request-chat-template).
REQUEST_TEMPLATES_CACHED = 16
# Seconds a client is told to wait after a 429 (Retry-After).
RETRY_AFTER_S = 1
# Threads that render and tokenize prompts off the event loop, as vLLM's tokenizer executor does (a
# prompt of megabytes takes seconds). A choice: more than one, so that a short prompt does not wait
# behind a long one; few, as each long prompt holds a core the engine process may want.
TOKENIZER_THREADS = 4

T = TypeVar("T")


@dataclass
class ServerConfig:
    """What the HTTP layer needs besides the engine."""

    model_name: str  # the name clients must send as ``model``
    rt_ttft_ms: float | None = None  # default SLOs of RT requests
    rt_tpot_ms: float | None = None
    tool_call_parser: str | None = None  # finds the calls of tool_choice "auto" (None: "auto" is refused)
    reasoning_parser: str | None = None  # splits chat outputs into reasoning_content and content
    trust_request_chat_template: bool = False  # a request may bring its own chat_template
    priority_scheduling: bool = False  # the scheduler orders by vLLM's request priority (waiting_order=priority)
    # what a request that does not set temperature, top_p, top_k, min_p or repetition_penalty samples
    # with, and max_tokens: that of one that sets none (the model's generation config:
    # checkpoint/generation_config.py; empty: the API's defaults)
    sampling_defaults: dict[str, float] = field(default_factory=dict)
    # --stream-interval: a streamed choice's tokens after its first go out at least this many at a time
    # (vLLM's); a choice that is not streamed is handed over whole, once it ends
    stream_interval: int = 1


class ModelNotFoundError(ConfigError):
    pass


class ApiError(SloserveError):
    """A refusal with its own HTTP status (the Files and Batches routes: 404 unknown id, 413 too large...)."""

    def __init__(self, status: int, message: str, param: str | None = None, code: str | None = None) -> None:
        super().__init__(message)
        self.status, self.param, self.code = status, param, code


@dataclass(frozen=True)
class ErrorResponse:
    """An OpenAI error object with its HTTP status; ``rejected`` is the metrics' reason (None: not a rejection)."""

    status: int
    body: dict[str, Any]
    headers: dict[str, str] | None = None
    rejected: str | None = None


def error_response(exc: Exception) -> ErrorResponse | None:
    """The answer to an exception raised while accepting a request (None: not one of ours: a bug)."""
    if isinstance(exc, ApiError):
        type_ = "invalid_request_error" if exc.status < 500 else "server_error"
        return ErrorResponse(exc.status, error_body(str(exc), type_, exc.param, exc.code), rejected="invalid")
    if isinstance(exc, ModelNotFoundError):
        return ErrorResponse(
            404, error_body(str(exc), "invalid_request_error", "model", "model_not_found"), rejected="invalid"
        )
    if isinstance(exc, ConfigError):
        param, code = (exc.param, exc.code) if isinstance(exc, ParameterError) else (None, None)
        return ErrorResponse(400, error_body(str(exc), "invalid_request_error", param, code), rejected="invalid")
    if isinstance(exc, QueueFullError):
        return ErrorResponse(
            429,
            error_body(str(exc), "rate_limit_error", code="queue_full"),
            {"Retry-After": str(RETRY_AFTER_S)},
            "queue_full",
        )
    if isinstance(exc, ShuttingDownError):
        return ErrorResponse(
            503, error_body(str(exc), "service_unavailable", code="shutting_down"), rejected="shutting_down"
        )
    if isinstance(exc, EngineDeadError):
        return ErrorResponse(500, error_body(str(exc), "server_error", code="engine_failed"))
    return None


def validation_error(errors: list[dict[str, Any]], body: Any) -> dict[str, Any]:
    """The 400 body of a ``body`` pydantic refused (``errors`` as ``ValidationError.errors()``): one error,
    its field named as a dotted path into ``body``. Of several (each branch of a union refuses the value:
    ``input`` is neither a string nor a list of valid items), the one whose field is deepest in ``body``,
    that is of the branch that matched it furthest; of those, the first."""
    if not errors:
        return error_body("invalid request", "invalid_request_error")
    if errors[0].get("type") == "json_invalid":
        return error_body(f"the request body is not valid JSON: {errors[0].get('msg')}", "invalid_request_error")
    paths = [_path_in(body, error) for error in errors]
    deepest = max(range(len(errors)), key=lambda i: len(paths[i]))  # NOTE: max keeps the first of equals
    param = ".".join(str(x) for x in paths[deepest]) or None
    message = str(errors[deepest].get("msg")).removeprefix("Value error, ")  # pydantic's prefix to a validator's
    return error_body(f"{param + ': ' if param else ''}{message}", "invalid_request_error", param)


def _path_in(body: Any, error: dict[str, Any]) -> list[str | int]:
    """``error``'s location as the keys and indices that lead to its field in ``body``: without FastAPI's
    "body" and pydantic's union branch tags ("str", "list[...]", a tagged union's tag), which are no
    key of the value they follow. A missing field's name is kept, as the last. (A query or path
    parameter's location is its name.)"""
    loc = list(error.get("loc", ()))
    if loc and loc[0] in ("query", "path", "header"):
        return loc[1:]
    if loc and loc[0] == "body":
        loc = loc[1:]
    path: list[str | int] = []
    value = body
    for at, key in enumerate(loc):
        if isinstance(value, dict) and key in value:
            value = value[key]
        elif isinstance(value, list) and isinstance(key, int) and 0 <= key < len(value):
            value = value[key]
        elif not (at == len(loc) - 1 and error.get("type") == "missing"):
            continue  # a branch tag
        path.append(key)
    return path


def ended_early(reason: str, engine_error: str | None) -> ErrorResponse:
    """The answer of a request the engine ended without finishing it ("abort" or "error")."""
    if reason == "abort":
        return ErrorResponse(
            503,
            error_body(
                "the request was aborted: the server shut down before it finished",
                "service_unavailable",
                code="shutting_down",
            ),
        )
    return ErrorResponse(
        500,
        error_body(
            f"the engine failed while serving this request: {engine_error}", "server_error", code="engine_failed"
        ),
    )


class ResponseObjects:
    """The OpenAI objects of one response: its id, the streamed chunks, the usage chunk, the whole body."""

    def __init__(self, chat: bool, model: str, service_tier: str = "default", request_id: str | None = None) -> None:
        """``request_id``: vLLM's (the ``X-Request-Id`` header, else the body's): the id is ``cmpl-<it>`` (chat:
        ``chatcmpl-``), else a new one."""
        self.chat = chat
        self.head = {"id": f"{'chatcmpl' if chat else 'cmpl'}-{request_id or uuid.uuid4().hex}",
                     "object": "chat.completion.chunk" if chat else "text_completion", "created": now_unix(),
                     "model": model, "service_tier": service_tier}  # fmt: skip
        # NOTE: a token chunk differs from the next only in its text, so it is formatted around the
        # JSON of the text rather than serialized whole (that was a fifth of the event loop's time).
        empty = json.dumps(self.chunk("", None))
        marker = '"content": ""' if chat else '"text": ""'
        before, after = empty.split(marker)
        self._text_event = (f"data: {before}{marker[:-2]}", f"{after}\n\n")

    def chunk(
        self,
        text: str,
        finish_reason: str | None,
        role: bool = False,
        index: int = 0,
        logprobs: dict[str, Any] | None = None,
        tool_calls: list[dict[str, Any]] | None = None,
        stop_reason: int | str | None = None,
        reasoning: str = "",
        token_ids: list[int] | None = None,
        prompt_token_ids: list[int] | None = None,
    ) -> dict[str, Any]:
        """A streamed chunk of choice ``index``; the last one (``finish_reason``) has vLLM's ``stop_reason``.
        vLLM's ``return_token_ids``: ``token_ids``, the chunk's tokens, and ``prompt_token_ids``, the prompt's (a
        completion choice's first chunk, chat's role chunk)."""
        if self.chat:
            delta: dict[str, Any] = {"role": "assistant"} if role else {}
            if reasoning:
                delta["reasoning_content"] = reasoning
            if text or finish_reason is None and not tool_calls and not reasoning:
                delta["content"] = text
            if tool_calls:
                delta["tool_calls"] = tool_calls
            choice = {"index": index, "delta": delta, "logprobs": logprobs, "finish_reason": finish_reason}
        else:
            choice = {"index": index, "text": text, "logprobs": logprobs, "finish_reason": finish_reason}
        if finish_reason is not None:
            choice["stop_reason"] = stop_reason
        if token_ids is not None:
            choice["token_ids"] = token_ids
        chunk = {**self.head, "choices": [choice]}
        if prompt_token_ids is not None:  # (chat's on the chunk, a completion's on its choice)
            (chunk if self.chat else choice)["prompt_token_ids"] = prompt_token_ids
        return chunk

    def text_event(self, text: str) -> str:
        """The SSE event of a chunk of ``text`` that does not finish choice 0 (no logprobs)."""
        before, after = self._text_event
        return f"{before}{json.dumps(text)}{after}"

    def usage_chunk(self, counts: dict[str, int]) -> dict[str, Any]:
        return {**self.head, "choices": [], "usage": counts}

    def whole(
        self, choices: list[Choice], counts: dict[str, int], prompt_logprobs: list[dict[str, Any] | None] | None = None
    ) -> dict[str, Any]:
        """The non-streamed response; ``prompt_logprobs``: chat's (vLLM's, where asked)."""
        if self.chat:
            items = [
                {"index": c.index, "message": c.message(), "logprobs": c.logprobs, "finish_reason": c.finish_reason,
                 "stop_reason": c.stop_reason, **c.ids(prompt=False)} for c in choices
            ]  # fmt: skip
        else:
            items = [
                {"index": c.index, "text": c.text, "logprobs": c.logprobs, "finish_reason": c.finish_reason,
                 "stop_reason": c.stop_reason, **({} if c.prompt_logprobs is None else
                                                   {"prompt_logprobs": c.prompt_logprobs}), **c.ids(prompt=True)}
                for c in choices
            ]  # fmt: skip
        obj = "chat.completion" if self.chat else "text_completion"
        whole = {**self.head, "object": obj, "choices": items, "usage": counts}
        if prompt_logprobs is not None:
            whole["prompt_logprobs"] = prompt_logprobs
        if self.chat and choices and choices[0].prompt_token_ids is not None:  # NOTE: chat's one prompt's
            whole["prompt_token_ids"] = choices[0].prompt_token_ids
        return whole


@dataclass
class Choice:
    """One choice of a response as the client sees it."""

    index: int
    text: str | None  # chat: None when the message is tool calls alone
    finish_reason: str
    logprobs: dict[str, Any] | None
    tool_calls: list[dict[str, Any]] | None = None
    stop_reason: int | str | None = None  # vLLM's: the stop token id or string it ended on
    prompt_logprobs: list[dict[str, Any] | None] | None = None  # completions: vLLM's, where asked
    reasoning_content: str | None = None  # chat, with --reasoning-parser: the model's thinking
    # vLLM's return_token_ids: the tokens sampled, and the prompt's (None: not asked for)
    token_ids: list[int] | None = None
    prompt_token_ids: list[int] | None = None

    def ids(self, prompt: bool) -> dict[str, list[int]]:
        """The choice's token ids as its object carries them (``prompt``: its prompt's too), where asked."""
        if self.token_ids is None:
            return {}
        ids = {"token_ids": self.token_ids}
        return {"prompt_token_ids": self.prompt_token_ids, **ids} if prompt else ids

    def message(self) -> dict[str, Any]:
        """The chat message of this choice."""
        message: dict[str, Any] = {"role": "assistant", "content": self.text}
        if self.reasoning_content is not None:
            message["reasoning_content"] = self.reasoning_content
        if self.tool_calls:
            message["tool_calls"] = self.tool_calls
        return message


@dataclass
class Generated:
    """What one engine request gave, whole: its text, tokens, their logprobs and how it ended."""

    text: str
    token_ids: list[int]
    logprobs: list[Logprobs] | None
    finish_reason: str
    stop_reason: int | str | None = None

    @property
    def cumulative_logprob(self) -> float:
        return cumulative_logprob(self.logprobs or ())


@dataclass
class Submission:
    """The engine requests of one completions or chat request: ``num_choices`` per prompt (``n``, or
    ``best_of`` to rank), prompt i's at ``served[i * num_choices : (i + 1) * num_choices]``."""

    body: SamplingRequest
    prompt_texts: list[str]  # what ``echo`` shows of each prompt ("" without echo)
    served: list[ServedRequest]
    logprobs_format: LogprobsFormat
    tool_use: ToolUse | None = None  # chat: what tool_choice makes of each choice's output
    reasoning_parser: str | None = None  # chat: the server's

    @property
    def num_choices(self) -> int:
        return self.body.num_choices

    @property
    def echo(self) -> bool:
        return isinstance(self.body, CompletionRequest) and self.body.echo

    @property
    def chat_echo(self) -> str:
        """vLLM's chat ``echo``: the text before each choice's content."""
        return self.body.echoed_text if isinstance(self.body, ChatCompletionRequest) else ""

    @property
    def echo_only(self) -> bool:
        """``max_tokens`` 0: each choice is its prompt alone (the one token sampled is not shown)."""
        return isinstance(self.body, CompletionRequest) and self.body.max_tokens == 0

    @property
    def service_tier(self) -> str:
        return service_tier(self.served[0].request_class, self.body.service_tier)

    def abort(self, engine: AsyncLLMEngine) -> None:
        """End every request of it that has not ended."""
        for served in self.served:
            if served.finish_reason is None:
                engine.abort(served)

    def usage(self) -> dict[str, Any]:
        """Prompt tokens once per prompt, every sampled token (ranked out by best_of too: each was
        computed), cached tokens as the first choice of each prompt found them."""
        firsts = self.served[:: self.num_choices]
        completion = 0 if self.echo_only else sum(s.num_output_tokens for s in self.served)
        return usage(sum(s.num_prompt_tokens for s in firsts), completion, sum(s.num_cached_tokens for s in firsts))

    def prompt_part(self, position: int) -> tuple[str, list[int], list[Logprobs | None]]:
        """What ``echo`` puts before ``served[position]``'s output: the prompt's text, tokens and
        logprobs (the first token's None)."""
        served = self.served[position]
        if not self.echo:
            return "", [], []
        k = self.body.num_logprobs or 0  # NOTE: prompt_logprobs may have asked for more of them
        logprobs = [None, *(e.with_top(k) for e in served.prompt_logprobs or [])]
        return self.prompt_texts[position // self.num_choices], served.prompt_token_ids, logprobs

    @property
    def chat(self) -> bool:
        return isinstance(self.body, ChatCompletionRequest)

    @property
    def parses_output(self) -> bool:
        """Whether a choice's message is parsed from its output (reasoning, tool calls), not the output."""
        return self.tool_use is not None or self.reasoning_parser is not None

    def output_parser(self) -> ChatOutputParser:
        """A parser of one choice's output into its message (``parses_output``)."""
        return ChatOutputParser(self.reasoning_parser, self.tool_use)

    def whole(self, objects: ResponseObjects, results: list[Generated]) -> dict[str, Any]:
        """The non-streamed response of ``results`` (each engine request's, in order)."""
        prompt_logprobs = self.prompt_logprobs(0) if self.chat else None
        return objects.whole(self.choices(results), self.usage(), prompt_logprobs)

    def prompt_logprobs(self, position: int) -> list[dict[str, Any] | None] | None:
        """vLLM's ``prompt_logprobs`` of ``served[position]``'s prompt (None: not asked for)."""
        if self.body.prompt_logprobs is None:
            return None
        return self.logprobs_format.prompt([None, *(self.served[position].prompt_logprobs or [])])

    def shown(
        self,
        position: int,
        text: str,
        token_ids: list[int],
        logprobs: list[Logprobs] | None,
        offset: int,
        first: bool,
    ) -> tuple[str, dict[str, Any] | None]:
        """(text, logprobs object) a client sees of ``served[position]``'s new ``text`` and tokens:
        after the echoed prompt when ``first``; ``offset``: the completions ``text_offset`` of its first
        token (the characters of the token strings before it)."""
        if self.echo_only:
            text, token_ids, logprobs = "", [], []
        if first:
            prompt_text, prompt_ids, prompt_logprobs = self.prompt_part(position)
            text, token_ids = prompt_text + text, prompt_ids + token_ids
            logprobs = None if logprobs is None else prompt_logprobs + logprobs
        if self.body.num_logprobs is None or logprobs is None:
            return text, None
        if self.chat:
            return text, self.logprobs_format.chat(logprobs)
        return text, self.logprobs_format.completion(token_ids, logprobs, offset)

    def choices(self, results: list[Generated]) -> list[Choice]:
        """The non-streamed choices: each prompt's ``n`` best by cumulative logprob (``best_of``)."""
        n, k = self.body.n, self.num_choices
        choices = []
        for p in range(0, len(results), k):
            group = range(p, p + k)
            if k > n:
                group = sorted(group, key=lambda i: results[i].cumulative_logprob, reverse=True)[:n]
            for rank, i in enumerate(group):
                r = results[i]
                text, logprobs = self.shown(i, r.text, r.token_ids, r.logprobs, 0, first=True)
                choice = Choice(p // k * n + rank, text, r.finish_reason, logprobs, stop_reason=r.stop_reason)
                if self.body.return_token_ids:
                    choice.token_ids = [] if self.echo_only else r.token_ids
                    choice.prompt_token_ids = self.served[i].prompt_token_ids
                if not self.chat:  # NOTE: chat's are the response's
                    choice.prompt_logprobs = self.prompt_logprobs(i)
                if self.parses_output:
                    parser = self.output_parser()
                    choice.reasoning_content, choice.text, choice.tool_calls = parser.message(text)
                    if not self.body.include_reasoning:
                        choice.reasoning_content = None
                    choice.finish_reason = parser.finish_reason(r.finish_reason)
                if self.chat_echo:  # NOTE: not the model's: not parsed
                    choice.text = self.chat_echo + (choice.text or "")
                choices.append(choice)
        return choices


class OpenAIServing:
    """Turns completion and chat bodies into engine requests of ``engine``. Each ``submit_*`` raises
    the exceptions ``error_response`` answers; nothing is queued then. Prompts are rendered and
    tokenized in threads of its own (``off_loop``); ``close`` ends them."""

    def __init__(self, engine: AsyncLLMEngine, config: ServerConfig, chat_template: ChatTemplate) -> None:
        self.engine = engine
        self.config = config
        self.chat_template = chat_template
        self.logprobs_format = LogprobsFormat(engine.tokenizer)
        self._tokenizer_threads = ThreadPoolExecutor(TOKENIZER_THREADS, thread_name_prefix="sloserve-tokenize")

    async def off_loop(self, work: Callable[..., T], *args: Any) -> T:
        """``work(*args)`` in a tokenizer thread, the event loop serving other requests meanwhile.
        NOTE: ``work`` runs beside the loop: it may read the request and the tokenizer, and change nothing
        but what guards itself (the grammars' matchers, behind their lock); the engine is the loop's."""
        return await asyncio.get_running_loop().run_in_executor(self._tokenizer_threads, work, *args)

    def close(self) -> None:
        self._tokenizer_threads.shutdown(wait=False, cancel_futures=True)

    def check_model(self, name: str) -> None:
        if name != self.config.model_name:
            raise ModelNotFoundError(
                f"The model {name!r} does not exist; this server serves {self.config.model_name!r}"
            )

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        tokenizer = self.engine.tokenizer
        if tokenizer is None:
            raise ParameterError("prompt", "this model has no tokenizer: send the prompt as a list of token ids")
        return tokenizer.encode(text, add_special_tokens=add_special_tokens)

    async def submit_completion(self, body: CompletionRequest, request_class: RequestClass | None = None) -> Submission:
        """``request_class`` overrides the body's (``service_tier``): batch lines are best-effort."""
        self._check_request(body, len(body.prompt_list()))
        prompt_ids, texts, params = await self.off_loop(self._completion_requests, body)
        return self._submit(body, prompt_ids, params, request_class, texts)

    def _completion_requests(self, body: CompletionRequest) -> tuple[list[list[int]], list[str], list[SamplingParams]]:
        """Each prompt's tokens, what ``echo`` shows of it, and its sampling params."""
        prompt_ids, texts = self.completion_prompts(body)
        # NOTE: max_tokens 0 (echo alone) samples one token, which nobody sees (as vLLM does)
        max_tokens = 1 if body.max_tokens == 0 else body.max_tokens
        return prompt_ids, texts, self._params(body, prompt_ids, max_tokens)

    def completion_prompts(self, body: CompletionRequest) -> tuple[list[list[int]], list[str]]:
        """Each prompt's tokens (truncated as asked), and what ``echo`` shows of it ("" without echo)."""
        prompts = body.prompt_list()
        special = body.add_special_tokens is not False
        whole_ids = [self.encode(p, add_special_tokens=special) if isinstance(p, str) else list(p) for p in prompts]
        prompt_ids = [body.truncated(ids, self.engine.max_model_len) for ids in whole_ids]
        texts = [""] * len(prompts)
        if body.echo:  # the prompt as sent, or the text of the tokens read
            tokenizer = self.engine.tokenizer
            texts = [
                p if isinstance(p, str) and len(ids) == len(whole) else tokenizer.decode(ids) if tokenizer else ""
                for p, ids, whole in zip(prompts, prompt_ids, whole_ids, strict=True)
            ]
        return prompt_ids, texts

    def chat_prompt(self, body: ChatCompletionRequest) -> list[int]:
        """The tokens a chat request's model reads (truncated as asked)."""
        prompt_ids = self.chat_prompt_ids(body.messages, body, body.add_special_tokens)
        return body.truncated(prompt_ids, self.engine.max_model_len)

    async def submit_chat(self, body: ChatCompletionRequest, request_class: RequestClass | None = None) -> Submission:
        self._check_request(body, 1)
        tool_use = body.tool_use(self.config.tool_call_parser)
        if tool_use is not None and tool_use.shows_special_tokens:
            body = body.model_copy(update={"skip_special_tokens": False})
        prompt_ids, params = await self.off_loop(self._chat_requests, body)
        return self._submit(body, [prompt_ids], params, request_class, [""], tool_use)

    def _chat_requests(self, body: ChatCompletionRequest) -> tuple[list[int], list[SamplingParams]]:
        """The chat's tokens and their sampling params."""
        prompt_ids = self.chat_prompt(body)
        return prompt_ids, self._params(body, [prompt_ids], body.output_cap)

    def _check_request(self, body: SamplingRequest, num_prompts: int) -> None:
        """The checks of a completion or chat that read its body alone, before its prompts are tokenized."""
        self.check_model(body.model)
        body.check_supported()
        _refuse_beam_search(body)
        self.check_queue_holds(body, num_prompts)
        self.check_priority(body.priority)

    def check_queue_holds(self, body: SamplingRequest, num_prompts: int) -> None:
        """A 400 for a request of more sequences than the server queues at all: it is never admitted (a 429,
        the answer while the queue is full, would have its client retry it forever)."""
        total = num_prompts * body.num_choices
        if total > self.engine.max_queued_requests:
            raise ParameterError(
                "n" if body.num_choices > 1 else _prompt_field(body),
                f"{num_prompts} prompt(s) x {body.num_choices} choices = {total} sequences, more than this "
                f"server queues ({self.engine.max_queued_requests}, --max-queued-requests)",
            )

    def chat_prompt_ids(
        self, messages: list[ChatMessage], fields: ChatTemplateFields, add_special_tokens: bool | None = None
    ) -> list[int]:
        """The tokens the model reads for ``messages``: the chat template's text, tokenized without
        adding special tokens again when the model's own template wrote them (None: that rule)."""
        template = self._template_for(fields)
        prompt = template.render(
            [m.for_template() for m in messages],
            add_generation_prompt=fields.add_generation_prompt,
            continue_final_message=fields.continue_final_message,
            variables=fields.template_variables(),
            tools=fields.template_tools(),
            documents=fields.documents,
        )
        if add_special_tokens is None:
            add_special_tokens = not template.from_model
        return self.encode(prompt, add_special_tokens=add_special_tokens)

    def _template_for(self, fields: ChatTemplateFields) -> ChatTemplate:
        """The server's chat template, or the request's own ``chat_template`` where the server trusts
        its clients with one (``--trust-request-chat-template``, vLLM's rule; else a 400)."""
        if fields.chat_template is None:
            return self.chat_template
        if not self.config.trust_request_chat_template:
            raise ParameterError(
                "chat_template",
                "this server renders chats with its own template; a request's chat_template needs the server "
                "started with --trust-request-chat-template",
            )
        try:
            return self._request_template(fields.chat_template)
        except ConfigError as e:
            raise ParameterError("chat_template", str(e)) from None

    @functools.lru_cache(maxsize=REQUEST_TEMPLATES_CACHED)  # noqa: B019 - one serving object per server
    def _request_template(self, source: str) -> ChatTemplate:
        """A request's template, compiled once (clients send the same few again and again)."""
        return self.chat_template.with_source(source)

    def tokenize(self, body: TokenizeRequest) -> dict[str, Any]:
        """vLLM's ``/tokenize``: the tokens of a prompt, or of chat messages as a chat request reads them."""
        if body.model is not None:
            self.check_model(body.model)
        body.check_supported()
        if body.messages is not None:
            tokens = self.chat_prompt_ids(body.messages, body, body.add_special_tokens)
        else:
            tokens = self.encode(body.prompt, add_special_tokens=body.add_special_tokens is not False)
        strings = None
        if body.return_token_strs:
            strings = [self.engine.tokenizer.decode([t], skip_special_tokens=False) for t in tokens]
        return {"count": len(tokens), "max_model_len": self.engine.max_model_len, "tokens": tokens,
                "token_strs": strings}  # fmt: skip

    def detokenize(self, body: DetokenizeRequest) -> dict[str, Any]:
        """vLLM's ``/detokenize``: the text of token ids, special tokens included (as vLLM's, so that it
        gives back what ``/tokenize`` read)."""
        if body.model is not None:
            self.check_model(body.model)
        self._check_in_vocabulary("tokens", body.tokens)
        tokenizer = self.engine.tokenizer
        if tokenizer is None:
            raise ParameterError("tokens", "this model has no tokenizer to turn tokens into text")
        return {"prompt": tokenizer.decode(body.tokens, skip_special_tokens=False)}

    def _check_in_vocabulary(self, param: str, token_ids) -> None:
        """A 400 naming ``param`` for a token id outside the model's vocabulary."""
        outside = self._outside_vocabulary(token_ids)
        if outside is not None:
            raise ParameterError(
                param, f"token id {outside} is outside the vocabulary [0, {self.engine.info.vocab_size})"
            )

    def _outside_vocabulary(self, token_ids: list[int]) -> int | None:
        """The first of ``token_ids`` outside the model's vocabulary, or None."""
        vocab_size = self.engine.info.vocab_size
        # NOTE: min and max first: the ids of a prompt sent as tokens are thousands of numbers, all in range
        if not token_ids or (min(token_ids) >= 0 and max(token_ids) < vocab_size):
            return None
        return next(t for t in token_ids if not 0 <= t < vocab_size)

    def _params(self, body: SamplingRequest, prompts: list[list[int]], max_tokens: int | None) -> list[SamplingParams]:
        """Each prompt's sampling params, checked, with the request's grammar (compiled once for all)."""
        grammar = self._grammar(body, self._reasoning_parser(body))
        return [
            self.sampling_params(body, ids, max_tokens, grammar, i if len(prompts) > 1 else None)
            for i, ids in enumerate(prompts)
        ]

    def _reasoning_parser(self, body: SamplingRequest) -> str | None:
        return self.config.reasoning_parser if isinstance(body, ChatCompletionRequest) else None

    def _submit(
        self,
        body: SamplingRequest,
        prompts: list[list[int]],
        params: list[SamplingParams],
        request_class: RequestClass | None,
        prompt_texts: list[str],
        tool_use: ToolUse | None = None,
    ) -> Submission:
        """Submit ``num_choices`` engine requests for each prompt (all or none); ``tool_use``: what a chat
        request's tool_choice makes of its output."""
        reasoning_parser = self._reasoning_parser(body)
        total = len(prompts) * body.num_choices
        self.engine.check_room(total)
        cls = request_class or body.request_class()
        slo = body.slo_for(cls, self.config.rt_ttft_ms, self.config.rt_tpot_ms)
        served: list[ServedRequest] = []
        try:
            for ids, p in zip(prompts, params, strict=True):
                for j in range(body.num_choices):
                    served.append(
                        self.engine.submit(
                            ids,
                            p.for_choice(j),
                            request_class=cls,
                            slo=slo,
                            priority=body.priority,
                            cache_salt=body.cache_salt,
                            stream_interval=self.config.stream_interval if body.stream else None,
                        )
                    )
        except BaseException:
            for s in served:
                self.engine.abort(s)
            raise
        return Submission(body, prompt_texts, served, self.logprobs_format_for(body), tool_use, reasoning_parser)

    def check_priority(self, priority: int) -> None:
        """vLLM's rule: a request priority other than 0 needs a scheduler that orders by it."""
        if priority != 0 and not self.config.priority_scheduling:
            raise ParameterError(
                "priority",
                f"got priority {priority}, but this server's scheduler does not order by priority: serve with "
                "--set waiting_order=priority (vllm, sarathi, orca, infermax), or send service_tier: flex for "
                "best-effort",
            )

    def logprobs_format_for(self, body: SamplingRequest) -> LogprobsFormat:
        """How ``body``'s logprobs name tokens: by their text, or ``token_id:N`` where it asks for it."""
        return LogprobsFormat(None) if body.return_tokens_as_token_ids else self.logprobs_format

    def _grammar(self, body: SamplingRequest, reasoning_parser: str | None) -> str | None:
        """The grammar of the request's structured output (None: plain text), after the model's thinking
        where ``reasoning_parser`` reads some (as vLLM's); a 400 naming the field for one llguidance
        cannot compile, or a model without the tokenizer it needs."""
        constraint = body.constraint()
        if constraint is None:
            return None
        field, kind, value = constraint
        if not isinstance(self.engine.tokenizer, HFTokenizer):
            raise ParameterError(
                field, "structured output needs the model's tokenizer (tokenizer.json); this model has none"
            )
        tokenizer = self.engine.tokenizer

        def tag(text: str) -> str | int:  # its token, where the vocabulary has one
            token_id = tokenizer.added_token_id(text)
            return text if token_id is None else token_id

        try:
            grammar = compile_grammar(kind, value)
            if reasoning_parser is not None:
                grammar = thinking_first(grammar, tag(THINK_OPEN), tag(THINK_CLOSE), starts_thinking(reasoning_parser))
            self._grammar_matchers.matcher(grammar)  # NOTE: compiled for this tokenizer, as the engine will
        except ConfigError as e:
            raise ParameterError(field, str(e)) from None
        return grammar

    @functools.cached_property
    def _grammar_matchers(self) -> GrammarMatchers:
        """The engine's matchers, built here to refuse what llguidance cannot compile for this tokenizer."""
        info = self.engine.info
        return GrammarMatchers(self.engine.tokenizer.to_json(), info.vocab_size, info.eos_token_ids)

    def _room_to_generate(
        self, body: SamplingRequest, prompt_ids: list[int], max_tokens: int | None, index: int | None
    ) -> int:
        """The tokens the context leaves after ``prompt_ids``; a ParameterError where the prompt is empty,
        has a token outside the vocabulary, or leaves no room or less than ``max_tokens``."""
        chat = isinstance(body, ChatCompletionRequest)
        prompt_field = _prompt_field(body)
        where = "the prompt" if index is None else f"prompt {index}"  # a chat's: its messages, rendered
        max_model_len = self.engine.max_model_len
        if not prompt_ids:
            raise ParameterError(prompt_field, f"{where} is empty")
        outside = self._outside_vocabulary(prompt_ids)
        if outside is not None:
            raise ParameterError(
                prompt_field,
                f"{where} has token id {outside}, outside the vocabulary [0, {self.engine.info.vocab_size})",
            )
        room = max_model_len - len(prompt_ids)
        if room < 1:
            raise ParameterError(
                prompt_field,
                f"{len(prompt_ids)} tokens in {where}: the model's context is {max_model_len} tokens, which "
                "leaves none to generate",
                "context_length_exceeded",
            )
        if max_tokens is not None and max_tokens > room:
            cap_field = "max_completion_tokens" if chat and body.max_completion_tokens is not None else "max_tokens"
            raise ParameterError(
                cap_field,
                f"This model's maximum context length is {max_model_len} tokens. However, you requested "
                f"{len(prompt_ids) + max_tokens} tokens ({len(prompt_ids)} in {where}, {max_tokens} in the "
                "completion). Please reduce the prompt or the completion length.",
                "context_length_exceeded",
            )
        return room

    def sampling_params(
        self,
        body: SamplingRequest,
        prompt_ids: list[int],
        max_tokens: int | None,
        grammar: str | None,
        index: int | None,
    ) -> SamplingParams:
        """One prompt's sampling params; a ParameterError when it cannot run (``index``: its place in a list).
        A prompt too long for the context is OpenAI's ``context_length_exceeded``, naming ``max_tokens``
        (or the field the request capped its output with) where a smaller cap would fit, else the prompt's
        field (a chat's ``messages``)."""
        room = self._room_to_generate(body, prompt_ids, max_tokens, index)
        logit_bias = {int(token): bias for token, bias in (body.logit_bias or {}).items()}
        named = (("logit_bias", logit_bias), ("stop_token_ids", body.stop_token_ids or ()),
                 ("allowed_token_ids", body.allowed_token_ids or ()))  # fmt: skip
        for name, ids in named:
            self._check_in_vocabulary(name, ids)
        if max_tokens is None:  # the model's max_new_tokens where it has one (vLLM's fallback), within the room
            max_tokens = min(self.config.sampling_defaults.get("max_tokens") or room, room)
        if body.min_tokens > max_tokens:
            raise ParameterError("min_tokens", f"min_tokens ({body.min_tokens}) is above max_tokens ({max_tokens})")
        num_logprobs = body.num_logprobs
        ranked = body.num_choices > body.n  # best_of ranks by the sampled tokens' logprobs
        echo = isinstance(body, CompletionRequest) and body.echo
        prompt_logprobs = max((k for k in (num_logprobs if echo else None, body.prompt_logprobs) if k is not None),
                              default=None)  # fmt: skip

        def sampling(name: str) -> Any:
            return sent_or_default(body, name, self.config.sampling_defaults)

        params = SamplingParams(
            max_tokens=max_tokens,
            temperature=sampling("temperature"),
            top_p=sampling("top_p"),
            top_k=sampling("top_k") or 0,
            min_p=sampling("min_p") or 0.0,
            seed=body.seed,
            ignore_eos=body.ignore_eos,
            logprobs=num_logprobs if num_logprobs is not None else 0 if ranked else None,
            prompt_logprobs=prompt_logprobs,
            min_tokens=body.min_tokens,
            logit_bias=logit_bias or None,
            repetition_penalty=sampling("repetition_penalty"),
            frequency_penalty=body.frequency_penalty,
            presence_penalty=body.presence_penalty,
            stop_token_ids=tuple(body.stop_token_ids or ()),
            allowed_token_ids=body.allowed_token_ids,
            bad_words=body.bad_words or (),
            stop=body.stop or (),
            include_stop_str_in_output=body.include_stop_str_in_output,
            skip_special_tokens=body.skip_special_tokens,
            grammar=grammar,
        )
        try:
            return params.tokenize_bad_words(self.engine.tokenizer)
        except ConfigError as e:
            raise ParameterError("bad_words", str(e)) from None


def service_tier(request_class: RequestClass, asked: str | None) -> str:
    """The tier a request is served in, as OpenAI's responses report it: "flex" for best-effort
    requests (batch lines too), "priority" when asked, else "default"."""
    if request_class is RequestClass.BE:
        return "flex"
    return "priority" if asked == "priority" else "default"


def _prompt_field(body: SamplingRequest) -> str:
    """The request field that holds its prompt, for an error to name."""
    return "messages" if isinstance(body, ChatCompletionRequest) else "prompt"


def _refuse_beam_search(body: SamplingRequest) -> None:
    # NOTE: the routes and the batch runner send beam search to beam_search_api.py before they get here
    if body.use_beam_search:
        raise ParameterError("use_beam_search", "beam search is answered by beam_search_api, not submitted")


async def collect(served: ServedRequest) -> Generated:
    """What ``served`` gave, once it ends."""
    parts, token_ids, reason, stop_reason = [], [], "error", None
    logprobs: list[Logprobs] | None = [] if served.params.logprobs is not None else None
    async for delta in served:
        parts.append(delta.text)
        token_ids += delta.token_ids
        if logprobs is not None and delta.logprobs:
            logprobs += delta.logprobs
        reason, stop_reason = delta.finish_reason or reason, delta.stop_reason
    return Generated("".join(parts), token_ids, logprobs, reason, stop_reason)
