"""From an OpenAI request body to an engine request, and from its deltas to OpenAI's response objects.

The HTTP routes (``app``) and the Batch API's runner (``batch_runner``) both go through
``OpenAIServing``, so a batch line is validated, tokenized, submitted and answered exactly as the same
body sent online, and fails with the same error object (``error_response``).
"""

from __future__ import annotations

import json
import uuid
from dataclasses import dataclass
from typing import Any

from sloserve.core.errors import ConfigError, SloserveError
from sloserve.core.request import RequestClass
from sloserve.engine.async_engine import (
    AsyncLLMEngine,
    EngineDeadError,
    QueueFullError,
    ServedRequest,
    ShuttingDownError,
)
from sloserve.engine.sampler import SamplingParams
from sloserve.server.chat_template import ChatTemplate
from sloserve.server.protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    ParameterError,
    SamplingRequest,
    error_body,
    now_unix,
)

# Seconds a client is told to wait after a 429 (Retry-After).
RETRY_AFTER_S = 1


@dataclass
class ServerConfig:
    """What the HTTP layer needs besides the engine."""

    model_name: str  # the name clients must send as ``model``
    rt_ttft_ms: float | None = None  # default SLOs of RT requests
    rt_tpot_ms: float | None = None


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
        param = exc.param if isinstance(exc, ParameterError) else None
        code = "context_length_exceeded" if param == "max_tokens" else None
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


def validation_error(errors: list[dict[str, Any]]) -> dict[str, Any]:
    """The 400 body of a body pydantic refused (``errors`` as ``ValidationError.errors()``): the first
    error, its field named as a dotted path."""
    first = errors[0] if errors else {"loc": (), "msg": "invalid request"}
    if first.get("type") == "json_invalid":
        return error_body(f"the request body is not valid JSON: {first.get('msg')}", "invalid_request_error")
    param = ".".join(str(x) for x in first.get("loc", ()) if x not in ("body", "query", "path")) or None
    return error_body(f"{param + ': ' if param else ''}{first.get('msg')}", "invalid_request_error", param)


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

    def __init__(self, chat: bool, model: str) -> None:
        self.chat = chat
        self.head = {"id": f"{'chatcmpl' if chat else 'cmpl'}-{uuid.uuid4().hex}",
                     "object": "chat.completion.chunk" if chat else "text_completion", "created": now_unix(),
                     "model": model}  # fmt: skip
        # NOTE: a token chunk differs from the next only in its text, so it is formatted around the
        # JSON of the text rather than serialized whole (that was a fifth of the event loop's time).
        empty = json.dumps(self.chunk("", None))
        marker = '"content": ""' if chat else '"text": ""'
        before, after = empty.split(marker)
        self._text_event = (f"data: {before}{marker[:-2]}", f"{after}\n\n")

    def chunk(self, text: str, finish_reason: str | None, role: bool = False) -> dict[str, Any]:
        if self.chat:
            delta: dict[str, Any] = {"role": "assistant"} if role else {}
            if text or finish_reason is None:
                delta["content"] = text
            choice = {"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish_reason}
        else:
            choice = {"index": 0, "text": text, "logprobs": None, "finish_reason": finish_reason}
        return {**self.head, "choices": [choice]}

    def text_event(self, text: str) -> str:
        """The SSE event of a chunk of ``text`` that does not finish the response."""
        before, after = self._text_event
        return f"{before}{json.dumps(text)}{after}"

    def usage_chunk(self, counts: dict[str, int]) -> dict[str, Any]:
        return {**self.head, "choices": [], "usage": counts}

    def whole(self, text: str, finish_reason: str, counts: dict[str, int]) -> dict[str, Any]:
        """The non-streamed response."""
        if self.chat:
            choice = {
                "index": 0,
                "message": {"role": "assistant", "content": text},
                "logprobs": None,
                "finish_reason": finish_reason,
            }
        else:
            choice = {"index": 0, "text": text, "logprobs": None, "finish_reason": finish_reason}
        obj = "chat.completion" if self.chat else "text_completion"
        return {**self.head, "object": obj, "choices": [choice], "usage": counts}


class OpenAIServing:
    """Turns completion and chat bodies into engine requests of ``engine``. Each ``submit_*`` raises
    the exceptions ``error_response`` answers; nothing is queued then."""

    def __init__(self, engine: AsyncLLMEngine, config: ServerConfig, chat_template: ChatTemplate) -> None:
        self.engine = engine
        self.config = config
        self.chat_template = chat_template

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

    def submit_completion(self, body: CompletionRequest, request_class: RequestClass | None = None) -> ServedRequest:
        """``request_class`` overrides the body's (``service_tier``): batch lines are best-effort."""
        self.check_model(body.model)
        body.check_supported()
        prompt = body.single_prompt()
        prompt_ids = self.encode(prompt) if isinstance(prompt, str) else list(prompt)
        return self._submit(body, prompt_ids, body.max_tokens, request_class)

    def submit_chat(self, body: ChatCompletionRequest, request_class: RequestClass | None = None) -> ServedRequest:
        self.check_model(body.model)
        body.check_supported()
        messages = [
            {"role": m.role, "content": m.text(), **({"name": m.name} if m.name else {})} for m in body.messages
        ]
        prompt = self.chat_template.render(messages)
        prompt_ids = self.encode(prompt, add_special_tokens=not self.chat_template.from_model)
        return self._submit(body, prompt_ids, body.output_cap, request_class)

    def _submit(
        self, body: SamplingRequest, prompt_ids: list[int], max_tokens: int | None, request_class: RequestClass | None
    ) -> ServedRequest:
        max_model_len = self.engine.max_model_len
        if not prompt_ids:
            raise ParameterError("prompt", "the prompt is empty")
        room = max_model_len - len(prompt_ids)
        if max_tokens is not None and max_tokens > room:
            raise ParameterError(
                "max_tokens",
                f"This model's maximum context length is {max_model_len} tokens. However, you requested "
                f"{len(prompt_ids) + max_tokens} tokens ({len(prompt_ids)} in the prompt, {max_tokens} in the "
                "completion). Please reduce the prompt or the completion length.",
            )
        if room < 1:
            raise ParameterError(
                "prompt",
                f"the prompt has {len(prompt_ids)} tokens: the model's context is "
                f"{max_model_len} tokens, which leaves none to generate",
            )
        params = SamplingParams(
            max_tokens=max_tokens or room,
            temperature=body.temperature,
            top_p=body.top_p,
            seed=body.seed,
            ignore_eos=body.ignore_eos,
        )
        cls = request_class or body.request_class()
        slo = body.slo_for(cls, self.config.rt_ttft_ms, self.config.rt_tpot_ms)
        return self.engine.submit(prompt_ids, params, request_class=cls, stop=body.stop_strings(), slo=slo)


async def collect(served: ServedRequest) -> tuple[str, str]:
    """(the whole text, the finish reason) once ``served`` ends."""
    parts, reason = [], "error"
    async for delta in served:
        parts.append(delta.text)
        reason = delta.finish_reason or reason
    return "".join(parts), reason
