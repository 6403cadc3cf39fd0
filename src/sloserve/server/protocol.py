"""Request and response bodies of the OpenAI API as ``sloserve serve`` implements it (pydantic).

Fields a client may send that we do not implement with a different meaning (``suffix``, those of
``FIELDS_NOT_SERVED``) are refused with a 400 naming them; fields that change
nothing here (``user``, ``metadata``) are accepted and ignored, as vLLM does.
"""

from __future__ import annotations

import time
from collections.abc import Mapping
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from sloserve.core.errors import ConfigError
from sloserve.core.request import SLO, RequestClass
from sloserve.engine.beam_search import MAX_BEAM_WIDTH
from sloserve.engine.chat_template import ChatOptionError, check_render_options
from sloserve.engine.sampler import MAX_CHOICES, MAX_LOGPROBS, MAX_REPETITION_PENALTY, StructuredOutputsParams
from sloserve.server.tool_calls import (
    NO_PARAMETERS,
    NamedToolChoice,
    ToolCallParam,
    ToolDefinition,
    ToolUse,
    required_schema,
)
from sloserve.workload.limits import MAX_PRIORITY

# The fields beam search does not honour (refused unless at their defaults); temperature, top_p and seed
# change nothing in it and are accepted, as vLLM does.
BEAM_SEARCH_IGNORES = ("stop", "stop_token_ids", "logit_bias", "presence_penalty", "frequency_penalty",
                       "repetition_penalty", "min_tokens", "allowed_token_ids", "bad_words", "top_k", "min_p",
                       "best_of", "echo", "prompt_logprobs")  # fmt: skip
# OpenAI's service tiers: "flex" is the cheaper, slower tier: our best-effort (BE) class.
BE_TIERS = frozenset({"flex"})
MAX_STOP_STRINGS = 16
# A choice: the engine reads and indexes a request's bad words when it adds it, no step running meanwhile
# (measured on the 2-core VM: 1.0 s for 200,000 words, 15 ms for this many); a list of banned words is
# hundreds.
MAX_BAD_WORDS = 10_000
# vLLM's request fields this server does not implement (and OpenAI's deprecated function calling), with
# the values that mean "unused" (null always does), and what to use instead: a request that sets
# another value is refused, not served as if the field were absent.
FIELDS_NOT_SERVED: dict[str, tuple[tuple[Any, ...], str]] = {
    "functions": (([],), "tools"),
    "function_call": (("none",), "tool_choice"),
    "logits_processors": (([],), ""),
    "spaces_between_special_tokens": ((True,), ""),
    "guided_whitespace_pattern": ((), ""),
    "logprob_token_ids": (([],), "logprobs"),
    "repetition_detection": ((), ""),
    "thinking_token_budget": ((-1,), ""),
    "prompt_embeds": (([],), "prompt"),
}


def invalid_unicode_at(value: Any) -> str | None:
    """Where in ``value`` (parsed JSON) a string or key that is not valid Unicode is, as a dotted path
    ("" for ``value`` itself), or None. JSON can escape a lone UTF-16 surrogate (``"\\ud800"``); Python's
    parser keeps it, and no tokenizer, SQLite text or UTF-8 answer can hold it."""
    # NOTE: a path is built only for the string found: a prompt of token ids is a list of a few thousand
    # numbers, whose paths cost the server 6% of its CPU time in an offline burst (2026-12-05)
    pending: list[tuple[Any, tuple | None]] = [(value, None)]  # (an item to check, its (key, parent's entry))
    while pending:
        entry = pending.pop()
        item = entry[0]
        if isinstance(item, str):
            if not _valid_unicode(item):
                return _path(entry)
        elif isinstance(item, dict):
            for key, child in item.items():
                if isinstance(key, str) and not _valid_unicode(key):
                    return _path((key, (key, entry)))
                if isinstance(child, _MAY_HOLD_TEXT):
                    pending.append((child, (key, entry)))
        elif isinstance(item, list):
            pending.extend((child, (i, entry)) for i, child in enumerate(item) if isinstance(child, _MAY_HOLD_TEXT))
    return None


_MAY_HOLD_TEXT = (str, dict, list)


def _valid_unicode(text: str) -> bool:
    if text.isascii():
        return True
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True


def _path(entry: tuple[Any, tuple | None]) -> str:
    """The dotted path of an ``invalid_unicode_at`` entry, a bad key escaped (\\ud800) so that the answer
    naming it can be sent."""
    keys = []
    while entry[1] is not None:
        key, entry = entry[1]
        keys.append(str(key))
    return ".".join(reversed(keys)).encode("utf-8", "backslashreplace").decode("utf-8")


class RequestBody(BaseModel):
    """A request's JSON body. NOTE: its strings are valid Unicode (``invalid_unicode_at``): FastAPI parses
    with Python's json, which keeps a lone surrogate; pydantic's own parser, the Batch API's, refuses it."""

    @model_validator(mode="before")
    @classmethod
    def _valid_unicode(cls, data: Any) -> Any:
        where = invalid_unicode_at(data)
        if where is not None:
            raise ValueError(f"{where or 'the body'}: not valid Unicode (a lone UTF-16 surrogate such as \\ud800)")
        return data


def nulls_unset(*fields: str) -> Any:
    """A validator (assigned in a model's body) by which ``fields`` sent as null count as not sent: each
    takes its default (the sampling ones: the model's, from its generation config). NOTE: OpenAI's API
    lets them be null (the SDK sends a None it is handed), and vLLM reads null so; pydantic would refuse
    it ("Input should be a valid number")."""

    def drop_nulls(cls: type[BaseModel], data: Any) -> Any:
        if isinstance(data, dict) and any(data.get(name, 0) is None for name in fields):
            return {name: value for name, value in data.items() if not (value is None and name in fields)}
        return data

    return model_validator(mode="before")(classmethod(drop_nulls))


def sent_or_default(body: BaseModel, name: str, defaults: Mapping[str, Any]) -> Any:
    """``body``'s ``name`` where the request set it, else ``defaults``' (the model's, from its generation
    config), else the field's own default."""
    return defaults[name] if name in defaults and name not in body.model_fields_set else getattr(body, name)


class StreamOptions(BaseModel):
    include_usage: bool = False
    continuous_usage_stats: bool = False  # vLLM's: usage in every chunk, its choice's tokens so far


class SLOField(BaseModel):
    """Extension: the request's latency objectives (default: the server's ``--rt-ttft-ms``/``--rt-tpot-ms``)."""

    model_config = ConfigDict(extra="forbid")
    ttft_ms: float | None = Field(default=None, gt=0, allow_inf_nan=False)
    tpot_ms: float | None = Field(default=None, gt=0, allow_inf_nan=False)


class JsonSchemaFormat(BaseModel):
    name: str | None = None
    description: str | None = None
    json_schema: dict[str, Any] | None = Field(default=None, alias="schema")
    strict: bool | None = None


class ResponseFormat(BaseModel):
    """OpenAI's ``response_format``: plain text, any JSON object, or JSON that validates against a schema."""

    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None


class StructuredOutputs(BaseModel):
    """vLLM's ``structured_outputs``: one constraint on the output (its older request fields
    ``guided_json``, ``guided_regex``, ``guided_choice`` and ``guided_grammar`` say the same)."""

    model_config = ConfigDict(extra="forbid", populate_by_name=True)
    json_schema: dict[str, Any] | str | None = Field(default=None, alias="json")  # a schema, or its JSON text
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None  # Lark, as vLLM's guidance backend reads it
    json_object: bool | None = None


# The structured output a request asks for: (the field that asked, the kind, its value)
Constraint = tuple[str, Literal["json", "regex", "choice", "grammar"], Any]


class SamplingRequest(RequestBody):
    """The fields completions and chat share."""

    model_config = ConfigDict(extra="allow")  # NOTE: kept to check against FIELDS_NOT_SERVED, else unused

    model: str
    temperature: float = Field(default=1.0, ge=0, le=2, allow_inf_nan=False)
    top_p: float = Field(default=1.0, gt=0, le=1, allow_inf_nan=False)
    seed: int | None = Field(default=None, ge=-(2**63), le=2**63 - 1)  # OpenAI's range (int64)
    stop: str | list[str] | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    n: int = Field(default=1, ge=1, le=MAX_CHOICES)
    ignore_eos: bool = False  # extension (vLLM's)
    service_tier: Literal["auto", "default", "flex", "priority"] | None = None
    slo: SLOField | None = None  # extension
    presence_penalty: float = Field(default=0.0, ge=-2, le=2, allow_inf_nan=False)
    frequency_penalty: float = Field(default=0.0, ge=-2, le=2, allow_inf_nan=False)
    logit_bias: dict[str, float] | None = None
    # vLLM's extensions
    # the lower, the sooner: under a scheduler with waiting_order=priority only; bounded as a trace's is, so
    # that the request log replays (simulate --trace requests.jsonl)
    priority: int = Field(default=0, ge=-MAX_PRIORITY, le=MAX_PRIORITY)
    # its prompt's cached blocks are shared only with requests of the same salt (another tenant cannot time
    # its way to them)
    cache_salt: str | None = Field(default=None, min_length=1)
    # the tokenizer's special tokens (BOS) around a text prompt: a completion's by default, a chat's where its
    # template is not the model's own (the model's writes them); true or false says so
    add_special_tokens: bool | None = None
    prompt_logprobs: int | None = Field(default=None, ge=0, le=MAX_LOGPROBS)  # each prompt token's, and the k best
    return_tokens_as_token_ids: bool = False  # logprobs' tokens as "token_id:N"
    return_token_ids: bool = False  # each choice's token ids and its prompt's beside the text (streamed: as they come)
    request_id: str | None = Field(default=None, min_length=1, max_length=256)  # the response's id ends with it
    truncate_prompt_tokens: int | None = Field(default=None, ge=-1)  # keep the prompt's last k (-1: the context)
    truncation_side: Literal["left", "right"] | None = None  # right: keep the first k instead
    use_beam_search: bool = False  # n beams (beam_search.py), not sampled
    length_penalty: float = Field(default=1.0, allow_inf_nan=False)  # beam search's score: logprob / length**it
    top_k: int | None = Field(default=None, ge=-1)  # None, 0 or -1: every token
    min_p: float | None = Field(default=None, ge=0, le=1, allow_inf_nan=False)
    repetition_penalty: float = Field(default=1.0, gt=0, le=MAX_REPETITION_PENALTY, allow_inf_nan=False)
    min_tokens: int = Field(default=0, ge=0)
    stop_token_ids: list[int] | None = None
    allowed_token_ids: list[int] | None = None
    bad_words: list[str] | None = Field(default=None, max_length=MAX_BAD_WORDS)
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True
    response_format: ResponseFormat | None = None
    structured_outputs: StructuredOutputs | None = None
    guided_json: dict[str, Any] | str | None = None
    guided_regex: str | None = None
    guided_choice: list[str] | None = None
    guided_grammar: str | None = None
    user: str | None = None

    _nulls = nulls_unset(
        "temperature",
        "top_p",
        "top_k",
        "min_p",
        "stream",
        "n",
        "presence_penalty",
        "frequency_penalty",
        "repetition_penalty",
    )

    @field_validator("stop", mode="before")
    @classmethod
    def _stop_list(cls, value: Any) -> Any:
        # NOTE: before the union's own check, whose complaint would name its first member ("stop.str: ...")
        if value is None:
            return value
        if isinstance(value, str):
            value = [value]
        if not isinstance(value, list) or not all(isinstance(s, str) for s in value):
            raise ValueError("must be a string or a list of strings")
        if "" in value:  # NOTE: vLLM's 400 too: every text would end at once
            raise ValueError("a stop string cannot be empty")
        if len(value) > MAX_STOP_STRINGS:
            raise ValueError(f"at most {MAX_STOP_STRINGS} stop strings, got {len(value)}")
        return value

    def check_supported(self) -> None:
        """Refuse, naming the field, what this server would otherwise silently do differently."""
        for name, value in (self.model_extra or {}).items():
            unused, instead = FIELDS_NOT_SERVED.get(name, (None, ""))
            if unused is not None and value is not None and value not in unused:
                raise ParameterError(name, f"{name} is not supported" + (f"; use {instead}" if instead else ""))
        for token, bias in (self.logit_bias or {}).items():
            if not token.isdigit():
                raise ParameterError("logit_bias", f"logit_bias keys are token ids, got {token!r}")
            if not -100 <= bias <= 100:
                raise ParameterError("logit_bias", f"logit_bias[{token}] must be in [-100, 100], got {bias}")
        if any(t < 0 for t in self.stop_token_ids or ()):
            raise ParameterError("stop_token_ids", "stop_token_ids must be token ids >= 0")
        if self.allowed_token_ids is not None and (not self.allowed_token_ids or min(self.allowed_token_ids) < 0):
            raise ParameterError("allowed_token_ids", "allowed_token_ids must be a non-empty list of token ids >= 0")
        response_format = self.response_format
        if response_format is not None and response_format.type == "json_schema":
            if response_format.json_schema is None or response_format.json_schema.json_schema is None:
                raise ParameterError(
                    "response_format", "response_format of type json_schema needs json_schema.schema: the schema"
                )
        if self.stream_options is not None and not self.stream:
            raise ParameterError("stream_options", "stream_options is only allowed with stream: true")
        if self.prompt_logprobs is not None and self.stream:
            raise ParameterError("prompt_logprobs", "prompt_logprobs cannot be streamed (as in vLLM)")
        if self.truncate_prompt_tokens == 0:
            raise ParameterError("truncate_prompt_tokens", "truncate_prompt_tokens must be >= 1, or -1 (the context)")
        if not self.use_beam_search and self.length_penalty != 1.0:
            raise ParameterError("length_penalty", "length_penalty applies to beam search: use_beam_search: true")

    def check_beam_search(self) -> None:
        """A 400 naming what beam search would not honour: it ranks by the raw log-probabilities, with
        no sampling controls, stop strings or grammar."""
        if not 1 <= self.n <= MAX_BEAM_WIDTH:
            raise ParameterError("n", f"with use_beam_search, n is the beam width: 1..{MAX_BEAM_WIDTH}, got {self.n}")
        fields = type(self).model_fields
        for name in BEAM_SEARCH_IGNORES:
            if name in fields and getattr(self, name) not in (fields[name].default, None, []):
                raise ParameterError(name, f"{name} does not apply to beam search (use_beam_search: true)")
        if getattr(self, "tools", None) and getattr(self, "tool_choice", None) != "none":
            raise ParameterError("tool_choice", 'beam search answers text: with tools, send tool_choice "none"')
        if self.constraint() is not None:
            raise ParameterError("use_beam_search", "beam search cannot follow a structured output")

    def truncated(self, prompt_ids: list[int], max_model_len: int) -> list[int]:
        """vLLM's ``truncate_prompt_tokens``: the prompt's last k tokens (-1: as many as the context holds), or
        its first k with ``truncation_side: right``."""
        k = self.truncate_prompt_tokens
        if k is None:
            return prompt_ids
        if k > max_model_len:
            raise ParameterError(
                "truncate_prompt_tokens",
                f"truncate_prompt_tokens ({k}) is above the model's context ({max_model_len} tokens)",
            )
        kept = max_model_len if k == -1 else k
        return prompt_ids[:kept] if self.truncation_side == "right" else prompt_ids[-kept:]

    def response_id(self, headers: Mapping[str, str] | None = None) -> str | None:
        """What names the response (vLLM's rule): the ``X-Request-Id`` header, else ``request_id`` (None: neither)."""
        return (headers or {}).get("x-request-id") or self.request_id

    def constraint(self) -> Constraint | None:
        """The one structured output the request asks for (None: plain text); a 400 naming the
        second field when it asks for two."""
        found: list[Constraint] = []
        response_format = self.response_format
        if response_format is not None and response_format.type != "text":
            schema = response_format.json_schema.json_schema if response_format.type == "json_schema" else None
            found.append(("response_format", "json", schema))
        for kind in ("json", "regex", "choice", "grammar"):
            value = getattr(self, f"guided_{kind}")
            if value is not None:
                found.append((f"guided_{kind}", kind, value))
        if self.structured_outputs is not None:
            fields = self.structured_outputs.model_dump(by_alias=True)
            try:
                kind, value = StructuredOutputsParams(**fields).constraint()
            except ConfigError as e:
                raise ParameterError("structured_outputs", str(e)) from None
            found.append(("structured_outputs", kind, value))
        if len(found) > 1:
            raise ParameterError(
                found[1][0], f"one structured output per request: {found[0][0]} and {found[1][0]} both ask for one"
            )
        return found[0] if found else None

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

    @property
    def continuous_usage(self) -> bool:
        return self.stream_options is not None and self.stream_options.continuous_usage_stats

    @property
    def num_logprobs(self) -> int | None:
        """The likeliest tokens to show beside each sampled token's logprob (None: no logprobs)."""
        raise NotImplementedError

    @property
    def num_choices(self) -> int:
        """Sequences sampled per prompt: ``n``, or ``best_of`` to rank."""
        return self.n


class CompletionRequest(SamplingRequest):
    """``POST /v1/completions``: one prompt or a list of them, as text or token ids.

    ``echo`` puts the prompt before each choice's text (and, with ``logprobs``, its tokens' logprobs
    before the choice's, the first token's None); with ``max_tokens`` 0 the choice is the prompt alone
    (how lm-eval scores a text). ``best_of`` samples that many sequences per prompt and returns the ``n``
    with the highest cumulative logprob.
    """

    prompt: str | list[int] | list[str] | list[list[int]]
    max_tokens: int | None = Field(default=16, ge=0)  # OpenAI's default for completions
    echo: bool = False
    suffix: str | None = None
    logprobs: int | None = Field(default=None, ge=0, le=MAX_LOGPROBS)
    best_of: int | None = Field(default=None, ge=1, le=MAX_CHOICES)

    _echo_null = nulls_unset("echo")

    @field_validator("prompt", mode="before")
    @classmethod
    def _prompt_forms(cls, prompt: Any) -> Any:
        # NOTE: as ``stop``'s: the union's own complaint would be "prompt.str: Input should be a valid string"
        def token_ids(value: Any) -> bool:
            return isinstance(value, list) and all(isinstance(t, int) and not isinstance(t, bool) for t in value)

        if isinstance(prompt, str) or token_ids(prompt):
            return prompt
        if isinstance(prompt, list) and (all(isinstance(p, str) for p in prompt) or all(map(token_ids, prompt))):
            return prompt
        raise ValueError("must be a string, a list of strings, a list of token ids or a list of such lists")

    def check_supported(self) -> None:
        super().check_supported()
        if self.suffix:
            raise ParameterError("suffix", "suffix is not supported")
        if self.max_tokens == 0 and not self.echo:
            raise ParameterError("max_tokens", "max_tokens 0 asks for no completion: only with echo (the prompt alone)")
        if self.best_of is not None:
            if self.best_of < self.n:
                raise ParameterError("best_of", f"best_of ({self.best_of}) must be at least n ({self.n})")
            if self.stream and self.best_of > self.n:
                raise ParameterError("best_of", "best_of > n cannot be streamed: the best are known at the end")

    def prompt_list(self) -> list[str | list[int]]:
        """The prompts: one, or each of a list."""
        prompt = self.prompt
        prompts = prompt if isinstance(prompt, list) and prompt and isinstance(prompt[0], (str, list)) else [prompt]
        for i, one in enumerate(prompts):
            if len(one) == 0:
                raise ParameterError("prompt", "the prompt is empty" if len(prompts) == 1 else f"prompt {i} is empty")
        return prompts  # type: ignore[return-value]

    @property
    def num_logprobs(self) -> int | None:
        return self.logprobs

    @property
    def num_choices(self) -> int:
        return self.best_of or self.n


class TextPart(BaseModel):
    type: Literal["text"]
    text: str


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="ignore")
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[TextPart] | None = None
    name: str | None = None
    tool_calls: list[ToolCallParam] | None = None  # an assistant's earlier calls
    tool_call_id: str | None = None  # a tool's answer: to which call

    @field_validator("content", mode="before")
    @classmethod
    def _text_parts_only(cls, content: Any) -> Any:
        # NOTE: before the union's own check, whose first complaint would be about its first member
        # ("messages.0.content.str: Input should be a valid string" for a list with an image part)
        if content is None or isinstance(content, str):
            return content
        if not isinstance(content, list):
            raise ValueError("must be a string or a list of text parts")
        for i, part in enumerate(content):
            if not isinstance(part, dict):
                raise ValueError(f'content part {i} must be an object {{"type": "text", "text": "..."}}')
            if part.get("type") != "text":
                raise ValueError(f"content part {i} is of type {part.get('type')!r}: this server takes text parts only")
            if not isinstance(part.get("text"), str):
                raise ValueError(f'content part {i} needs its "text" as a string')
        return content

    def text(self) -> str:
        if self.content is None:
            return ""
        if isinstance(self.content, str):
            return self.content
        return "".join(part.text for part in self.content)

    def for_template(self) -> dict[str, Any]:
        """The message as chat templates read it (transformers' and vLLM's keys)."""
        message: dict[str, Any] = {"role": self.role, "content": self.text()}
        if self.name:
            message["name"] = self.name
        if self.tool_calls:
            message["tool_calls"] = [call.model_dump() for call in self.tool_calls]
        if self.tool_call_id is not None:
            message["tool_call_id"] = self.tool_call_id
        return message


class ChatTemplateFields(RequestBody):
    """vLLM's request fields for how the chat template renders the messages (chat completions and
    ``/tokenize``)."""

    add_generation_prompt: bool = True
    continue_final_message: bool = False
    chat_template_kwargs: dict[str, Any] | None = None
    tools: list[ToolDefinition] | None = None  # for the template to show the model
    documents: list[dict[str, Any]] | None = None  # for a retrieval-augmented template to show
    chat_template: str | None = None  # the request's own (--trust-request-chat-template)
    # OpenAI's: the template's ``reasoning_effort`` (gpt-oss's "Reasoning: high"), unless chat_template_kwargs
    # sets it; a template that reads none is unchanged
    reasoning_effort: Literal["low", "medium", "high"] | None = None

    def template_variables(self) -> dict[str, Any] | None:
        """What the template reads beside the messages: ``chat_template_kwargs``, and ``reasoning_effort``."""
        if self.reasoning_effort is None:
            return self.chat_template_kwargs
        return {"reasoning_effort": self.reasoning_effort, **(self.chat_template_kwargs or {})}

    def template_tools(self) -> list[dict[str, Any]] | None:
        """The tools as the client sent them, for the chat template (transformers' ``tools``)."""
        return None if not self.tools else [tool.model_dump(exclude_unset=True) for tool in self.tools]

    def check_template_fields(self, messages: list[ChatMessage]) -> None:
        try:
            check_render_options(
                messages[-1].role,
                add_generation_prompt=self.add_generation_prompt,
                continue_final_message=self.continue_final_message,
                variables=self.template_variables(),
            )
        except ChatOptionError as e:
            raise ParameterError(e.option, str(e)) from None


class ChatCompletionRequest(SamplingRequest, ChatTemplateFields):
    """``POST /v1/chat/completions``."""

    messages: list[ChatMessage] = Field(min_length=1)
    max_tokens: int | None = Field(default=None, ge=1)  # deprecated by OpenAI, still sent by many clients
    max_completion_tokens: int | None = Field(default=None, ge=1)
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None  # None: auto with tools
    parallel_tool_calls: bool | None = None  # False: "required" makes one call
    logprobs: bool | None = False
    top_logprobs: int | None = Field(default=None, ge=0, le=MAX_LOGPROBS)
    echo: bool = False  # vLLM's: the answer begins with the last message, when it is in the answer's role
    include_reasoning: bool = True  # vLLM's: false leaves reasoning_content out (with --reasoning-parser)

    @property
    def echoed_text(self) -> str:
        """What ``echo`` puts before each choice's content: the last message's, when its role is the
        answer's (the assistant's; with ``add_generation_prompt`` false, the last message's own), as vLLM's."""
        last = self.messages[-1]
        answers_as = "assistant" if self.add_generation_prompt else last.role
        return last.text() if self.echo and last.role == answers_as else ""

    @field_validator("tool_choice", mode="before")
    @classmethod
    def _tool_choice_forms(cls, value: Any) -> Any:
        # NOTE: as ``stop``'s: the union's own complaint would name its members
        if value is None or value in ("none", "auto", "required"):
            return value
        function = value.get("function") if isinstance(value, dict) else None
        if not (
            isinstance(function, dict) and value.get("type") == "function" and isinstance(function.get("name"), str)
        ):
            raise ValueError(
                f'must be "none", "auto", "required" or {{"type": "function", "function": {{"name": ...}}}}, got {value!r}'
            )
        return value

    def check_supported(self) -> None:
        super().check_supported()
        if self.top_logprobs is not None and not self.logprobs:
            raise ParameterError("top_logprobs", "top_logprobs needs logprobs: true")
        self.check_template_fields(self.messages)
        names = [tool.function.name for tool in self.tools or ()]
        repeated = sorted({name for name in names if names.count(name) > 1})
        if repeated:
            raise ParameterError("tools", f"each tool needs a name of its own; {repeated[0]!r} is repeated")
        choice = self.tool_choice
        if choice not in (None, "none") and not self.tools:
            raise ParameterError("tool_choice", "tool_choice needs tools to choose from")
        if isinstance(choice, NamedToolChoice) and choice.function.name not in names:
            raise ParameterError(
                "tool_choice", f"tool_choice names {choice.function.name!r}, which is not one of the tools"
            )

    def tool_use(self, parser_name: str | None) -> ToolUse | None:
        """What ``tool_choice`` makes of the output (None: text); ``parser_name``: the server's
        ``--tool-call-parser``, which "auto" needs."""
        choice = self.tool_choice
        if not self.tools or choice == "none":
            return None
        call_ids = "mistral" if parser_name == "mistral" else "openai"
        if isinstance(choice, NamedToolChoice):
            return ToolUse("named", function=choice.function.name, call_ids=call_ids)
        if choice == "required":
            return ToolUse("required", call_ids=call_ids)
        if parser_name is None:
            raise ParameterError(
                "tool_choice",
                'tool_choice "auto" (the default with tools) needs the server started with --enable-auto-tool-choice '
                '--tool-call-parser hermes; or send tool_choice "required", "none" or a named function',
            )
        return ToolUse("auto", parser_name=parser_name, call_ids=call_ids)

    def constraint(self) -> Constraint | None:
        """As ``SamplingRequest.constraint``, with a named or required tool choice's schema (a 400 naming
        ``tool_choice`` beside another structured output)."""
        found = super().constraint()
        schema = self.tool_schema()
        if schema is None:
            return found
        if found is not None:
            raise ParameterError(
                "tool_choice", f"one structured output per request: {found[0]} and tool_choice both ask for one"
            )
        return ("tools", "json", schema)

    def tool_schema(self) -> dict[str, Any] | None:
        """The JSON a named or "required" tool choice constrains the output to (None: not constrained)."""
        choice = self.tool_choice
        if not self.tools:
            return None
        if isinstance(choice, NamedToolChoice):
            tool = next(t for t in self.tools if t.function.name == choice.function.name)
            return tool.function.parameters or NO_PARAMETERS
        if choice == "required":
            return required_schema(self.tools, parallel=self.parallel_tool_calls is not False)
        return None

    @property
    def num_logprobs(self) -> int | None:
        return (self.top_logprobs or 0) if self.logprobs else None

    @property
    def output_cap(self) -> int | None:
        return self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens


class TokenizeRequest(ChatTemplateFields):
    """vLLM's ``POST /tokenize``: a ``prompt``, or ``messages`` rendered by the chat template as a chat
    request's are (the tokens the model would read)."""

    model_config = ConfigDict(extra="ignore")
    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = Field(default=None, min_length=1)
    add_special_tokens: bool | None = None  # None: as a completion's prompt, or a chat's, is tokenized
    return_token_strs: bool = False

    def check_supported(self) -> None:
        if (self.prompt is None) == (self.messages is None):
            raise ParameterError("prompt", "give a prompt or messages (one of them)")
        if self.messages is not None:
            self.check_template_fields(self.messages)


class DetokenizeRequest(RequestBody):
    """vLLM's ``POST /detokenize``."""

    model_config = ConfigDict(extra="ignore")
    model: str | None = None
    tokens: list[int]


class ParameterError(ConfigError):
    """A request parameter this server refuses; ``param`` names it for the error body, ``code`` is
    OpenAI's error code where it has one (``context_length_exceeded``)."""

    def __init__(self, param: str, message: str, code: str | None = None) -> None:
        super().__init__(message)
        self.param, self.code = param, code


def usage(prompt_tokens: int, completion_tokens: int, cached_tokens: int | None = 0) -> dict[str, Any]:
    """OpenAI's usage object; ``cached_tokens``: the prompt tokens found in the prefix cache (None: not
    known yet, before the prompt is scheduled; then there are no ``prompt_tokens_details``, as in vLLM's
    chunks)."""
    counts: dict[str, Any] = {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
    }
    if cached_tokens is not None:
        counts["prompt_tokens_details"] = {"cached_tokens": cached_tokens}
    return counts


def error_body(message: str, type_: str, param: str | None = None, code: str | None = None) -> dict[str, Any]:
    """OpenAI's error object."""
    return {"error": {"message": message, "type": type_, "param": param, "code": code}}


def now_unix() -> int:
    return int(time.time())
