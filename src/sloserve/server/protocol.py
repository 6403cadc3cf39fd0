"""Request and response bodies of the OpenAI API as ``sloserve serve`` implements it (pydantic).

Fields a client may send that we do not implement with a different meaning (``logprobs``, ``echo``,
``suffix``, ``n`` > 1, ``best_of`` > 1, tools) are refused with a 400 naming them; fields that change
nothing here (``user``, ``metadata``, penalties at 0) are accepted and ignored, as vLLM does.
"""

from __future__ import annotations

import time
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator

from sloserve.core.errors import ConfigError
from sloserve.core.request import SLO, RequestClass

# OpenAI's service tiers: "flex" is the cheaper, slower tier: our best-effort (BE) class.
BE_TIERS = frozenset({"flex"})
MAX_STOP_STRINGS = 16


class StreamOptions(BaseModel):
    include_usage: bool = False


class SLOField(BaseModel):
    """Extension: the request's latency objectives (default: the server's ``--rt-ttft-ms``/``--rt-tpot-ms``)."""

    model_config = ConfigDict(extra="forbid")
    ttft_ms: float | None = Field(default=None, gt=0, allow_inf_nan=False)
    tpot_ms: float | None = Field(default=None, gt=0, allow_inf_nan=False)


class SamplingRequest(BaseModel):
    """The fields completions and chat share."""

    model_config = ConfigDict(extra="ignore")

    model: str
    temperature: float = Field(default=1.0, ge=0, le=2, allow_inf_nan=False)
    top_p: float = Field(default=1.0, gt=0, le=1, allow_inf_nan=False)
    seed: int | None = None
    stop: str | list[str] | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    n: int = 1
    ignore_eos: bool = False  # extension (vLLM's)
    service_tier: Literal["auto", "default", "flex", "priority"] | None = None
    slo: SLOField | None = None  # extension
    # Accepted only with the values that mean "off":
    logprobs: Any = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    user: str | None = None

    @field_validator("stop")
    @classmethod
    def _stop_list(cls, value: str | list[str] | None) -> str | list[str] | None:
        if isinstance(value, list) and len(value) > MAX_STOP_STRINGS:
            raise ValueError(f"at most {MAX_STOP_STRINGS} stop strings, got {len(value)}")
        return value

    def check_supported(self) -> None:
        """Refuse, naming the field, what this server would otherwise silently do differently."""
        if self.n != 1:
            raise ParameterError("n", f"n={self.n} is not supported: this server returns one choice per request")
        if self.logprobs not in (None, False):
            raise ParameterError("logprobs", "logprobs are not supported")
        for name in ("presence_penalty", "frequency_penalty"):
            if getattr(self, name) != 0:
                raise ParameterError(name, f"{name} is not supported (only 0)")
        if self.stream_options is not None and not self.stream:
            raise ParameterError("stream_options", "stream_options is only allowed with stream: true")

    def stop_strings(self) -> tuple[str, ...]:
        if self.stop is None:
            return ()
        return (self.stop,) if isinstance(self.stop, str) else tuple(self.stop)

    def request_class(self) -> RequestClass:
        return RequestClass.BE if self.service_tier in BE_TIERS else RequestClass.RT

    def slo_for(self, request_class: RequestClass, rt_ttft_ms: float | None, rt_tpot_ms: float | None) -> SLO:
        """The request's own ``slo``, else the server's RT defaults for RT requests (BE: none)."""
        if self.slo is not None:
            ttft, tpot = self.slo.ttft_ms, self.slo.tpot_ms
        elif request_class is RequestClass.RT:
            ttft, tpot = rt_ttft_ms, rt_tpot_ms
        else:
            ttft = tpot = None
        return SLO(ttft_s=None if ttft is None else ttft / 1000, tpot_s=None if tpot is None else tpot / 1000)

    @property
    def include_usage(self) -> bool:
        return self.stream_options is not None and self.stream_options.include_usage


class CompletionRequest(SamplingRequest):
    """``POST /v1/completions``: one prompt, as text or token ids."""

    prompt: str | list[int] | list[str] | list[list[int]]
    max_tokens: int | None = Field(default=16, ge=1)  # OpenAI's default for completions
    echo: bool = False
    suffix: str | None = None
    best_of: int | None = None

    def check_supported(self) -> None:
        super().check_supported()
        if self.echo:
            raise ParameterError("echo", "echo is not supported")
        if self.suffix:
            raise ParameterError("suffix", "suffix is not supported")
        if self.best_of not in (None, 1):
            raise ParameterError("best_of", "best_of > 1 is not supported")

    def single_prompt(self) -> str | list[int]:
        """The one prompt (a list of one prompt counts as it)."""
        prompt = self.prompt
        if isinstance(prompt, list) and prompt and isinstance(prompt[0], (str, list)):
            if len(prompt) != 1:
                raise ParameterError("prompt", f"{len(prompt)} prompts in one request; send one per request")
            prompt = prompt[0]
        if len(prompt) == 0:
            raise ParameterError("prompt", "the prompt is empty")
        return prompt  # type: ignore[return-value]


class TextPart(BaseModel):
    type: Literal["text"]
    text: str


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="ignore")
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[TextPart] | None = None
    name: str | None = None

    def text(self) -> str:
        if self.content is None:
            return ""
        if isinstance(self.content, str):
            return self.content
        return "".join(part.text for part in self.content)


class ChatCompletionRequest(SamplingRequest):
    """``POST /v1/chat/completions``."""

    messages: list[ChatMessage] = Field(min_length=1)
    max_tokens: int | None = Field(default=None, ge=1)  # deprecated by OpenAI, still sent by many clients
    max_completion_tokens: int | None = Field(default=None, ge=1)
    tools: list[Any] | None = None
    top_logprobs: int | None = None

    def check_supported(self) -> None:
        super().check_supported()
        if self.tools:
            raise ParameterError("tools", "tools are not supported")
        if self.top_logprobs is not None:
            raise ParameterError("top_logprobs", "logprobs are not supported")

    @property
    def output_cap(self) -> int | None:
        return self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens


class ParameterError(ConfigError):
    """A request parameter this server refuses; ``param`` names it for the error body."""

    def __init__(self, param: str, message: str) -> None:
        super().__init__(message)
        self.param = param


def usage(prompt_tokens: int, completion_tokens: int, cached_tokens: int = 0) -> dict[str, Any]:
    """OpenAI's usage object; ``cached_tokens``: the prompt tokens found in the prefix cache."""
    return {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
        "prompt_tokens_details": {"cached_tokens": cached_tokens},
    }


def error_body(message: str, type_: str, param: str | None = None, code: str | None = None) -> dict[str, Any]:
    """OpenAI's error object."""
    return {"error": {"message": message, "type": type_, "param": param, "code": code}}


def now_unix() -> int:
    return int(time.time())
