"""``POST /v1/responses``: OpenAI's Responses API, served through the chat path.

A request's ``instructions`` and ``input`` (a string, or items: messages, earlier ``function_call``\\ s
and their ``function_call_output``\\ s) become chat messages, its ``tools``, ``tool_choice`` and
``text.format`` the chat request's, so it is scheduled, templated, constrained and parsed as a chat
completion is (``--reasoning-parser`` and ``--tool-call-parser`` too). The answer is a response
object whose ``output`` holds a ``reasoning`` item, a ``message`` item and ``function_call`` items, in
the order the model wrote them; streamed, as OpenAI's events (``response.created``, then each item's
``output_item.added``, its deltas and ``output_item.done``, then ``response.completed``, or
``response.incomplete`` when ``max_output_tokens`` cut it). A whole response is the same events' last
snapshot, so the two agree.

A finished response is stored unless ``store`` is false (``response_store.py``): ``GET`` and ``DELETE
/v1/responses/{id}``, ``GET /v1/responses/{id}/input_items``, and ``previous_response_id``, which
continues it: its conversation (each earlier turn's input and output items) comes before the new
input; its ``instructions`` do not carry over (OpenAI's rule). ``conversation`` and ``background``
are refused, as are tools other than functions.

vLLM's sampling extensions (``SAMPLING_EXTRAS``: ``seed``, ``stop``, ``ignore_eos``, ``logit_bias``,
...) apply as in a chat request. ``include: ["message.output_text.logprobs"]`` (with ``top_logprobs``
alternatives, 0-20) gives each answer token's logprob in the message's ``output_text`` (and each
``output_text.delta`` the logprobs of the tokens it brings): under ``--reasoning-parser``, those after
the thinking's ``</think>`` token (refused where the tags are not tokens of the vocabulary); with tools,
whose calls are cut out of the text, the request is refused (``include``).
"""

from __future__ import annotations

import asyncio
import json
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable, Mapping, Sequence
from typing import Annotated, Any, Literal

from fastapi import APIRouter, Depends, Query, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from pydantic import BaseModel, ConfigDict, Discriminator, Field, TypeAdapter, ValidationError, field_validator

from sloserve.core.request import RequestClass
from sloserve.server.auth import request_owner
from sloserve.server.bodies import openapi_body, validated_off_loop
from sloserve.server.chat_output import ChatOutputParser, MessageDelta
from sloserve.server.protocol import (
    ChatCompletionRequest,
    ParameterError,
    RequestBody,
    now_unix,
    nulls_unset,
    sent_or_default,
)
from sloserve.server.reasoning import THINK_CLOSE, THINK_OPEN, AnswerTokens
from sloserve.server.response_store import PreviousResponseNotFound, ResponseStore
from sloserve.server.responses import json_error, until_done_or_gone
from sloserve.server.serving import ApiError, Generated, OpenAIServing, Submission, ended_early
from sloserve.server.tool_calls import FunctionDefinition

# The chat request's fields a refusal may name, by their names here
CHAT_FIELDS = {
    "max_tokens": "max_output_tokens",
    "max_completion_tokens": "max_output_tokens",
    "response_format": "text.format",
    "messages": "input",
}
# Fields of OpenAI's request this server refuses unless at these values (null always passes)
NOT_SERVED: dict[str, tuple[Any, ...]] = {
    "conversation": (),
    "background": (False,),
    "prompt": (),
    "truncation": ("disabled",),
    "max_tool_calls": (),
}
# vLLM's sampling extensions of a Responses request (and our slo, vLLM's cache_salt): passed on to the chat request
SAMPLING_EXTRAS = ("seed", "stop", "ignore_eos", "slo", "presence_penalty", "frequency_penalty", "logit_bias",
                   "priority", "top_k", "min_p", "repetition_penalty", "min_tokens", "stop_token_ids",
                   "allowed_token_ids", "bad_words", "include_stop_str_in_output", "skip_special_tokens",
                   "cache_salt")  # fmt: skip
# OpenAI's ``include`` values; only the logprobs change an answer here (the others name outputs of
# tools this server does not run, or encrypted reasoning, which it does not make)
INCLUDABLE = Literal[
    "message.output_text.logprobs",
    "reasoning.encrypted_content",
    "web_search_call.action.sources",
    "code_interpreter_call.outputs",
    "computer_call_output.output.image_url",
    "file_search_call.results",
    "message.input_image.image_url",
]


class TextPart(BaseModel):
    type: Literal["input_text", "output_text", "text"]
    text: str


class InputMessage(BaseModel):
    model_config = ConfigDict(extra="ignore")
    type: Literal["message"] = "message"
    role: Literal["user", "assistant", "system", "developer"]
    content: str | list[TextPart]

    def text(self) -> str:
        return self.content if isinstance(self.content, str) else "".join(p.text for p in self.content)


class FunctionCallItem(BaseModel):
    model_config = ConfigDict(extra="ignore")
    type: Literal["function_call"]
    call_id: str
    name: str
    arguments: str


class FunctionCallOutputItem(BaseModel):
    model_config = ConfigDict(extra="ignore")
    type: Literal["function_call_output"]
    call_id: str
    output: str


class ReasoningItem(BaseModel):
    """An earlier answer's reasoning: not given to the model again (chat templates drop it too)."""

    model_config = ConfigDict(extra="ignore")
    type: Literal["reasoning"]


InputItem = Annotated[InputMessage | FunctionCallItem | FunctionCallOutputItem | ReasoningItem, Discriminator("type")]
# A stored conversation's items (earlier inputs, and outputs: messages, calls, reasoning) read back as input
INPUT_ITEMS = TypeAdapter(list[InputItem])


class FunctionTool(FunctionDefinition):
    """A Responses function tool: a chat function's fields, flat."""

    type: Literal["function"]


class NamedFunction(BaseModel):
    model_config = ConfigDict(extra="forbid")
    type: Literal["function"]
    name: str


class TextFormat(BaseModel):
    type: Literal["text", "json_object", "json_schema"]
    name: str | None = None
    schema_: dict[str, Any] | None = Field(default=None, alias="schema")
    strict: bool | None = None
    description: str | None = None


class TextConfig(BaseModel):
    model_config = ConfigDict(extra="ignore")
    format: TextFormat | None = None


class ReasoningConfig(BaseModel):
    """OpenAI's ``reasoning``: ``effort`` is the chat template's ``reasoning_effort`` (gpt-oss's); a reasoning
    item holds the thinking's text, and no summary is made (``summary`` is echoed, as vLLM accepts it)."""

    model_config = ConfigDict(extra="ignore")
    effort: Literal["low", "medium", "high"] | None = None
    summary: Literal["auto", "concise", "detailed"] | None = None


class ResponsesRequest(RequestBody):
    """The fields of OpenAI's ``POST /v1/responses`` this server serves (``NOT_SERVED``: refused)."""

    model_config = ConfigDict(extra="allow")  # NOTE: kept to check against NOT_SERVED, else unused
    model: str
    input: str | list[InputItem]
    instructions: str | None = None
    max_output_tokens: int | None = Field(default=None, ge=1)
    temperature: float = Field(default=1.0, ge=0, le=2, allow_inf_nan=False)
    top_p: float = Field(default=1.0, gt=0, le=1, allow_inf_nan=False)
    stream: bool = False
    tools: list[FunctionTool] | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedFunction | None = None
    parallel_tool_calls: bool | None = None
    text: TextConfig | None = None
    service_tier: Literal["auto", "default", "flex", "priority"] | None = None
    store: bool | None = None  # None: true, as OpenAI's default
    previous_response_id: str | None = None
    metadata: dict[str, str] | None = None
    user: str | None = None
    include: list[INCLUDABLE] | None = None
    top_logprobs: int | None = Field(default=None, ge=0, le=20)
    reasoning: ReasoningConfig | None = None

    _nulls = nulls_unset("temperature", "top_p", "stream")

    @field_validator("input", mode="before")
    @classmethod
    def _messages_without_type(cls, value: Any) -> Any:
        # NOTE: OpenAI's "easy" messages ({"role", "content"}) carry no type
        if isinstance(value, list):
            return [{"type": "message", **v} if isinstance(v, dict) and "type" not in v else v for v in value]
        return value

    @field_validator("tools", mode="before")
    @classmethod
    def _function_tools_only(cls, value: Any) -> Any:
        if not isinstance(value, list):
            return value  # a wrong type: the field's own validation names it
        for i, tool in enumerate(value):
            kind = tool.get("type") if isinstance(tool, dict) else None
            if kind != "function":
                raise ValueError(f"tool {i} is of type {kind!r}: this server runs function tools only")
        return value

    def check_supported(self) -> None:
        for name, value in (self.model_extra or {}).items():
            if name in NOT_SERVED and value is not None and value not in NOT_SERVED[name]:
                why = ": send the conversation in input, or continue a response with previous_response_id"
                raise ParameterError(name, f"{name} is not supported{why if name == 'conversation' else ''}")
        if isinstance(self.input, list) and not self.input:
            raise ParameterError("input", "input is empty")
        text_format = self.text.format if self.text is not None else None
        if text_format is not None and text_format.type == "json_schema" and text_format.schema_ is None:
            raise ParameterError("text.format", "text.format of type json_schema needs schema: the JSON schema")

    @property
    def wants_logprobs(self) -> bool:
        return "message.output_text.logprobs" in (self.include or ())

    @property
    def keeps(self) -> bool:
        """Whether the response is stored (``store``: OpenAI's default is true)."""
        return self.store is not False

    def input_items(self) -> list[InputItem]:
        return [InputMessage(role="user", content=self.input)] if isinstance(self.input, str) else self.input

    def stored_input(self) -> list[dict[str, Any]]:
        """The request's input items as they are stored and listed (OpenAI's shapes, each with an id);
        reasoning items are left out (they never reach the model)."""
        stored: list[dict[str, Any]] = []
        for item in self.input_items():
            if isinstance(item, InputMessage):
                part = "output_text" if item.role == "assistant" else "input_text"
                stored.append({"id": _id("msg"), "type": "message", "role": item.role,
                               "content": [{"type": part, "text": item.text()}]})  # fmt: skip
            elif not isinstance(item, ReasoningItem):
                stored.append({"id": _id("fc" if isinstance(item, FunctionCallItem) else "fco"), **item.model_dump()})
        return stored

    def chat_request(self, earlier: Sequence[dict[str, Any]] = ()) -> ChatCompletionRequest:
        """The same request as a chat completion; ``earlier``: the stored conversation it continues
        (``previous_response_id``), put before its input."""
        self.check_supported()
        messages: list[dict[str, Any]] = []
        if self.instructions:
            messages.append({"role": "system", "content": self.instructions})
        earlier_items = INPUT_ITEMS.validate_python(list(earlier))
        call_ids: set[str] = set()  # of the function calls made so far
        for position, item in enumerate(earlier_items + self.input_items()):
            if isinstance(item, InputMessage):
                messages.append({"role": item.role, "content": item.text()})
            elif isinstance(item, FunctionCallItem):
                call = {"id": item.call_id, "type": "function",
                        "function": {"name": item.name, "arguments": item.arguments}}  # fmt: skip
                if messages and messages[-1]["role"] == "assistant" and "tool_calls" in messages[-1]:
                    messages[-1]["tool_calls"].append(call)  # parallel calls: one assistant message
                else:
                    messages.append({"role": "assistant", "content": None, "tool_calls": [call]})
                call_ids.add(item.call_id)
            elif isinstance(item, FunctionCallOutputItem):
                # NOTE: OpenAI's 400 too (a chat template would render it); the stored conversation was
                # accepted as it is, so only the new input is checked
                if item.call_id not in call_ids and position >= len(earlier_items):
                    raise ParameterError(
                        f"input.{position - len(earlier_items)}.call_id",
                        f"no function call with call_id {item.call_id!r} comes before this function_call_output "
                        "(in input, or in the conversation of previous_response_id)",
                    )
                messages.append({"role": "tool", "tool_call_id": item.call_id, "content": item.output})
        if not messages:
            raise ParameterError("input", "input holds no message")
        chat: dict[str, Any] = {
            "model": self.model,
            "messages": messages,
            "max_completion_tokens": self.max_output_tokens,
            # NOTE: only as sent: what is not takes the model's default (its generation config)
            **{name: getattr(self, name) for name in ("temperature", "top_p") if name in self.model_fields_set},
            "stream": self.stream,
            "service_tier": self.service_tier,
            "parallel_tool_calls": self.parallel_tool_calls,
            "reasoning_effort": self.reasoning.effort if self.reasoning is not None else None,
            **{name: value for name, value in (self.model_extra or {}).items() if name in SAMPLING_EXTRAS},
        }
        if self.wants_logprobs:
            if self.tools and self.tool_choice != "none":
                raise ParameterError(
                    "include", "message.output_text.logprobs is served for answers that are all text, not with tools"
                )
            chat |= {"logprobs": True, "top_logprobs": self.top_logprobs or 0}
        if self.tools:
            chat["tools"] = [
                {"type": "function", "function": t.model_dump(exclude={"type"}, exclude_none=True)} for t in self.tools
            ]
        if isinstance(self.tool_choice, NamedFunction):
            chat["tool_choice"] = {"type": "function", "function": {"name": self.tool_choice.name}}
        elif self.tool_choice is not None:
            chat["tool_choice"] = self.tool_choice
        text_format = self.text.format if self.text is not None else None
        if text_format is not None and text_format.type == "json_schema":
            chat["response_format"] = {"type": "json_schema", "json_schema": {"name": text_format.name,
                                       "schema": text_format.schema_, "strict": text_format.strict}}  # fmt: skip
        elif text_format is not None:
            chat["response_format"] = {"type": text_format.type}
        try:
            return ChatCompletionRequest.model_validate(chat)
        except ValidationError as e:  # NOTE: the sampling extras are checked here; the fields above pass
            error = e.errors()[0]
            field = str(error["loc"][0]) if error["loc"] else ""
            if field in SAMPLING_EXTRAS:
                where = ".".join(map(str, error["loc"]))
                raise ParameterError(where, f"{where}: {error['msg']}, got {error.get('input')!r}") from None
            raise ParameterError("input", f"cannot be served as a chat request: {error['msg']}") from None

    def echoed(self, sampling_defaults: Mapping[str, float]) -> dict[str, Any]:
        """The request's settings, as a response repeats them; ``temperature`` and ``top_p`` as sampled:
        the model's (``sampling_defaults``, its generation config) where the request did not set them."""
        return {
            "instructions": self.instructions,
            "max_output_tokens": self.max_output_tokens,
            "temperature": sent_or_default(self, "temperature", sampling_defaults),
            "top_p": sent_or_default(self, "top_p", sampling_defaults),
            "tools": [t.model_dump(exclude_none=True) for t in self.tools or ()],
            "tool_choice": (
                self.tool_choice.model_dump()
                if isinstance(self.tool_choice, NamedFunction)
                else self.tool_choice or "auto"
            ),
            "parallel_tool_calls": self.parallel_tool_calls is not False,
            "text": {"format": self.text.format.model_dump(by_alias=True, exclude_none=True)}
            if self.text is not None and self.text.format is not None
            else {"format": {"type": "text"}},
            "metadata": self.metadata or {},
            "user": self.user,
            "store": self.keeps,
            "truncation": "disabled",
            "top_logprobs": self.top_logprobs,
            "previous_response_id": self.previous_response_id,
            "reasoning": (self.reasoning or ReasoningConfig()).model_dump(),
            "error": None,
        }


def _id(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex}"


class ResponseBuilder:
    """A response's events from its message's deltas (``chat_output.MessageDelta``): each kind of
    output (reasoning, text, a call) opens an item, which closes when another kind comes or the
    output ends."""

    def __init__(
        self,
        request: ResponsesRequest,
        model: str,
        service_tier: str,
        answer: AnswerTokens | None = None,
        sampling_defaults: Mapping[str, float] | None = None,
    ) -> None:
        self.request = request
        self.sampling_defaults = sampling_defaults or {}  # the model's (its generation config)
        self.answer = answer  # which tokens are the answer's (a reasoning model's); None: all of them
        self.head = {"id": _id("resp"), "object": "response", "created_at": now_unix(), "model": model,
                     "service_tier": service_tier}  # fmt: skip
        self.output: list[dict[str, Any]] = []
        self.open: dict[str, Any] | None = None  # the item being written
        self.sequence = 0
        self.unshown_logprobs: list[dict[str, Any]] = []  # of the tokens sampled since the last text delta

    def add_logprobs(self, token_ids: list[int], entries: list[dict[str, Any]], finished: bool = False) -> None:
        """The logprobs of tokens just sampled (``include`` asked for them; ``finished``: the last ones):
        the answer's are shown with the next text delta, or, if none comes, in the message's text when
        it closes."""
        if self.answer is not None:
            entries = self.answer.answer(token_ids, [e["token"] for e in entries], entries)
            if finished:
                entries += self.answer.finish()
        self.unshown_logprobs += entries

    def response(self, status: str, usage: dict[str, Any] | None = None, reason: str | None = None) -> dict:
        return {**self.head, "status": status, "output": self.output,
                "incomplete_details": {"reason": reason} if reason else None, "usage": usage,
                **self.request.echoed(self.sampling_defaults)}  # fmt: skip

    def event(self, kind: str, **fields: Any) -> dict[str, Any]:
        event = {"type": kind, "sequence_number": self.sequence, **fields}
        self.sequence += 1
        return json.loads(json.dumps(event))  # NOTE: a snapshot: the items go on changing

    def start(self) -> list[dict[str, Any]]:
        return [self.event(kind, response=self.response("in_progress"))
                for kind in ("response.created", "response.in_progress")]  # fmt: skip

    def feed(self, delta: MessageDelta) -> list[dict[str, Any]]:
        events = self._text("reasoning", delta.reasoning) + self._text("message", delta.content)
        for entry in delta.calls:
            if "id" in entry:  # a new call
                events += self._close("completed")
                item = {"id": _id("fc"), "type": "function_call", "call_id": entry["id"],
                        "name": entry["function"]["name"], "arguments": "", "status": "in_progress"}  # fmt: skip
                events += self._open(item)
            events += self._arguments(entry["function"]["arguments"])
        return events

    def finish(self, finish_reason: str, usage: dict[str, Any]) -> list[dict[str, Any]]:
        """The last events: the open item closed, then the whole response."""
        cut = finish_reason == "length"
        events = self._close("incomplete" if cut else "completed")
        counts = {"input_tokens": usage["prompt_tokens"], "output_tokens": usage["completion_tokens"],
                  "total_tokens": usage["total_tokens"], "input_tokens_details": usage["prompt_tokens_details"],
                  "output_tokens_details": {"reasoning_tokens": 0}}  # fmt: skip
        if cut:
            whole = self.response("incomplete", counts, "max_output_tokens")
            return [*events, self.event("response.incomplete", response=whole)]
        return [*events, self.event("response.completed", response=self.response("completed", counts))]

    def _text(self, kind: str, text: str) -> list[dict[str, Any]]:
        if not text:
            return []
        events: list[dict[str, Any]] = []
        if self.open is None or self.open["type"] != kind:
            events += self._close("completed")
            if kind == "reasoning":
                item = {"id": _id("rs"), "type": "reasoning", "summary": [], "content": []}
            else:
                item = {"id": _id("msg"), "type": "message", "status": "in_progress", "role": "assistant",
                        "content": []}  # fmt: skip
            events += self._open(item)
            part = {"type": "reasoning_text", "text": ""} if kind == "reasoning" else {
                "type": "output_text", "text": "", "annotations": [], "logprobs": []}  # fmt: skip
            item["content"].append(part)
            if kind == "message":
                events.append(self._item_event("response.content_part.added", content_index=0, part=part))
        part = self.open["content"][0]
        part["text"] += text
        if kind == "reasoning":
            return [*events, self._item_event("response.reasoning_text.delta", content_index=0, delta=text)]
        logprobs = self._show_logprobs(part)
        return [*events, self._item_event("response.output_text.delta", content_index=0, delta=text, logprobs=logprobs)]

    def _show_logprobs(self, part: dict[str, Any]) -> list[dict[str, Any]]:
        """The logprobs not yet shown, now in the message's text ``part``."""
        shown, self.unshown_logprobs = self.unshown_logprobs, []
        part["logprobs"] += shown
        return shown

    def _arguments(self, text: str) -> list[dict[str, Any]]:
        if not text:
            return []
        self.open["arguments"] += text
        return [self._item_event("response.function_call_arguments.delta", delta=text)]

    def _open(self, item: dict[str, Any]) -> list[dict[str, Any]]:
        self.output.append(item)
        self.open = item
        added = {**item, "content": []} if "content" in item else item
        return [self.event("response.output_item.added", output_index=len(self.output) - 1, item=added)]

    def _close(self, status: str) -> list[dict[str, Any]]:
        item, self.open = self.open, None
        if item is None:
            return []
        if item["type"] != "reasoning":
            item["status"] = status
        events = []
        if item["type"] == "message":
            part = item["content"][0]
            self._show_logprobs(part)  # NOTE: tokens that brought no text (the EOS) end its logprobs
            events.append(self._item_event("response.output_text.done", content_index=0, text=part["text"],
                                           logprobs=part["logprobs"], item=item))  # fmt: skip
            events.append(self._item_event("response.content_part.done", content_index=0, part=part, item=item))
        elif item["type"] == "reasoning":
            text = item["content"][0]["text"]
            events.append(self._item_event("response.reasoning_text.done", content_index=0, text=text, item=item))
        else:
            events.append(self._item_event("response.function_call_arguments.done", arguments=item["arguments"],
                                           name=item["name"], item=item))  # fmt: skip
        events.append(self.event("response.output_item.done", output_index=self.output.index(item), item=item))
        return events

    def _item_event(self, kind: str, item: dict[str, Any] | None = None, **fields: Any) -> dict[str, Any]:
        item = item if item is not None else self.open
        return self.event(kind, item_id=item["id"], output_index=self.output.index(item), **fields)


def responses_router(serving: OpenAIServing, store: ResponseStore) -> APIRouter:
    router = APIRouter()

    body_as_model = Depends(validated_off_loop(serving, ResponsesRequest))

    @router.post("/v1/responses", openapi_extra=openapi_body(ResponsesRequest))
    async def responses(raw: Request, body: ResponsesRequest = body_as_model) -> Response:
        owner = request_owner(raw)
        earlier: list[dict[str, Any]] = []
        if body.previous_response_id is not None:
            try:
                earlier = await asyncio.to_thread(store.conversation, body.previous_response_id, owner)
            except PreviousResponseNotFound as e:
                raise ApiError(400, f"Previous response with id '{e.response_id}' not found.",
                               "previous_response_id", "previous_response_not_found") from None  # fmt: skip
        submission = await submit_response(serving, body, earlier)

        async def keep(response: dict[str, Any]) -> None:
            if body.keeps:
                await asyncio.to_thread(store.put, response, body.stored_input(), body.previous_response_id, owner)

        if body.stream:
            builder = response_builder(serving, body, submission)
            events = _events(serving, submission, builder, submission.output_parser(), keep)
            return StreamingResponse(events, media_type="text/event-stream")
        results = await until_done_or_gone(serving.engine, raw, submission)
        if results is None:  # the client left
            return Response(status_code=499)
        [result] = results
        if result.finish_reason in ("abort", "error"):
            return json_error(ended_early(result.finish_reason, submission.served[0].error or serving.engine.error))
        response = whole_response(serving, body, submission, result)
        await keep(response)
        return JSONResponse(response)

    @router.get("/v1/responses/{response_id}")
    async def retrieve(response_id: str, raw: Request) -> dict[str, Any]:
        response = await asyncio.to_thread(store.get, response_id, request_owner(raw))
        if response is None:
            raise _not_found(response_id)
        return response

    @router.delete("/v1/responses/{response_id}")
    async def delete(response_id: str, raw: Request) -> dict[str, Any]:
        if not await asyncio.to_thread(store.delete, response_id, request_owner(raw)):
            raise _not_found(response_id)
        return {"id": response_id, "object": "response", "deleted": True}

    @router.get("/v1/responses/{response_id}/input_items")
    async def input_items(
        response_id: str,
        raw: Request,
        after: str | None = None,
        limit: int = Query(default=20, ge=1, le=100),
        order: Literal["asc", "desc"] = "desc",
    ) -> dict[str, Any]:
        """The input items of the response's own request (OpenAI's list, newest first by default)."""
        items = await asyncio.to_thread(store.input_items, response_id, request_owner(raw))
        if items is None:
            raise _not_found(response_id)
        if order == "desc":
            items.reverse()
        if after is not None:
            ids = [item["id"] for item in items]
            if after not in ids:
                raise ApiError(400, f"after: no input item {after!r} in response {response_id}", "after")
            items = items[ids.index(after) + 1 :]
        page = items[:limit]
        return {"object": "list", "data": page, "first_id": page[0]["id"] if page else None,
                "last_id": page[-1]["id"] if page else None, "has_more": len(items) > limit}  # fmt: skip

    return router


async def submit_response(
    serving: OpenAIServing,
    body: ResponsesRequest,
    earlier: Sequence[dict[str, Any]] = (),
    request_class: RequestClass | None = None,
) -> Submission:
    """``body`` submitted as the chat completion it maps to (after the stored conversation
    ``earlier``); a refusal names the field by its name here."""
    parser = serving.config.reasoning_parser
    if body.wants_logprobs and parser is not None and AnswerTokens.of(parser, serving.engine.tokenizer) is None:
        raise ParameterError(
            "include",
            f"message.output_text.logprobs under --reasoning-parser {parser} needs {THINK_OPEN} and {THINK_CLOSE} "
            "as tokens of the model's vocabulary, to tell the answer's tokens from the thinking's",
        )
    try:
        # NOTE: beside the event loop: a long input (or conversation before it) takes long to validate
        return await serving.submit_chat(await serving.off_loop(body.chat_request, earlier), request_class)
    except ParameterError as e:
        e.param = CHAT_FIELDS.get(e.param, e.param)
        raise


def whole_response(serving: OpenAIServing, body: ResponsesRequest, submission: Submission, result: Generated) -> dict:
    """The response object of the finished ``result``: the last snapshot of the events a stream of it
    would send."""
    builder = response_builder(serving, body, submission)
    parser = submission.output_parser()
    builder.start()
    if result.logprobs is not None:
        builder.add_logprobs(result.token_ids, submission.logprobs_format.chat(result.logprobs)["content"], True)
    # NOTE: the text, then the end, as a stream's last two deltas: the items come in the same order
    for delta in [*parser.feed_in_order(result.text), parser.feed("", finished=True)]:
        builder.feed(delta)
    [*_, last] = builder.finish(parser.finish_reason(result.finish_reason), submission.usage())
    return last["response"]


def response_builder(serving: OpenAIServing, body: ResponsesRequest, submission: Submission) -> ResponseBuilder:
    """The builder of ``submission``'s response, reading which tokens are the answer's where it needs to."""
    parser = submission.reasoning_parser
    answer = AnswerTokens.of(parser, serving.engine.tokenizer) if body.wants_logprobs and parser else None
    return ResponseBuilder(
        body, serving.config.model_name, submission.service_tier, answer, serving.config.sampling_defaults
    )


def _not_found(response_id: str) -> ApiError:
    return ApiError(404, f"Response with id '{response_id}' not found.", "response_id", "response_not_found")


async def _events(
    serving: OpenAIServing,
    submission: Submission,
    builder: ResponseBuilder,
    parser: ChatOutputParser,
    keep: Callable[[dict[str, Any]], Awaitable[None]],
) -> AsyncIterator[str]:
    """The response's events as server-sent events (OpenAI's: an ``event:`` line, then ``data:``);
    the finished response is kept (``keep``) before its last event is sent, so that a client may
    continue it as soon as it has read it."""

    def sse(event: dict[str, Any]) -> str:
        return f"event: {event['type']}\ndata: {json.dumps(event)}\n\n"

    [served] = submission.served
    try:
        for event in builder.start():
            yield sse(event)
        async for delta in served:
            if delta.finish_reason in ("abort", "error"):
                error = ended_early(delta.finish_reason, served.error or serving.engine.error).body["error"]
                yield sse(builder.event("error", code=error["code"], message=error["message"], param=None))
                return
            if delta.logprobs is not None:
                entries = submission.logprobs_format.chat(delta.logprobs)["content"]
                builder.add_logprobs(delta.token_ids, entries, finished=delta.finish_reason is not None)
            for found in parser.feed_in_order(delta.text, finished=delta.finish_reason is not None):
                for event in builder.feed(found):
                    yield sse(event)
            if delta.finish_reason is not None:
                events = builder.finish(parser.finish_reason(delta.finish_reason), submission.usage())
                await keep(events[-1]["response"])
                for event in events:
                    yield sse(event)
    finally:  # NOTE: also when the client disconnects
        submission.abort(serving.engine)
