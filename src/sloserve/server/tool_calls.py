"""Tool calls (OpenAI's function calling) in chat completions, served as vLLM serves them.

The request's ``tools`` go to the chat template, for the model to read; ``tool_choice`` says what
becomes of the output:

- "none": it is text.
- a named function (``{"type": "function", "function": {"name": ...}}``): it is constrained to JSON that
  validates against that function's ``parameters``, and returned as the one call's ``arguments``.
- "required": it is constrained to a JSON array of one or more ``{"name", "parameters"}`` objects, each
  a function of ``tools`` with its parameters (vLLM's schema); each becomes a call.
  ``parallel_tool_calls: false`` allows one.
- "auto" (the default when there are tools): the model decides, and the server's tool-call parser finds
  its calls: ``--tool-call-parser hermes`` (``<tool_call>{"name": ..., "arguments": ...}</tool_call>``
  blocks, the format of the Hermes, Qwen2.5 and Qwen3 templates) or ``llama3_json`` (an answer that
  opens with ``{`` or ``<|python_tag|>`` is ``{"name": ..., "parameters": ...}`` calls separated by
  ``;``, Llama 3.1-3.3's JSON tool calling) or ``pythonic`` (an answer that is a Python list of calls,
  ``[get_weather(city="Paris"), ...]``, as Llama 3.2 and 4 write them) or ``mistral`` (what follows
  ``[TOOL_CALLS]``: a JSON array of ``{"name", "arguments"}``, Mistral 7B v0.3's, or ``name{...}`` and
  ``name[ARGS]{...}`` calls, each after a ``[TOOL_CALLS]`` of its own, newer Mistral models'). A server
  without one answers "auto" with a 400, as vLLM does. With ``mistral``, call ids are 9 letters and
  digits, which Mistral's chat templates require of the ids sent back.

Each parser is incremental (``feed`` the text as it comes, then ``finish``): a streamed response sends
what it gives as it comes, and a whole response is the same deltas merged (``merge``), so the two
always agree.
"""

from __future__ import annotations

import ast
import json
import random
import re
import string
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

# vLLM's names of the parsers of "auto" tool choice: <tool_call> blocks; Llama 3's JSON calls; Python calls;
# Mistral's [TOOL_CALLS]
TOOL_CALL_PARSERS = ("hermes", "llama3_json", "pythonic", "mistral")
HERMES_OPEN, HERMES_CLOSE = "<tool_call>", "</tool_call>"
PYTHON_TAG = "<|python_tag|>"  # Llama 3's token before a call, where its template asks for one
MISTRAL_CALLS, MISTRAL_ARGS = "[TOOL_CALLS]", "[ARGS]"  # Mistral's tokens before calls, and before arguments
MISTRAL_NAME = re.compile(r"[a-zA-Z0-9_.-]+")
# The arguments of a function without ``parameters``: none. NOTE: vLLM's schema allows any object, which a
# weak model fills with made-up keys until max_tokens.
NO_PARAMETERS: dict[str, Any] = {"type": "object", "properties": {}, "additionalProperties": False}


class FunctionDefinition(BaseModel):
    name: str = Field(pattern=r"^[a-zA-Z0-9_.-]{1,64}$")  # OpenAI's names (and the dots some clients use)
    description: str | None = None
    parameters: dict[str, Any] | None = None  # a JSON schema; None: no parameters
    strict: bool | None = None


class ToolDefinition(BaseModel):
    type: Literal["function"]
    function: FunctionDefinition


class NamedFunction(BaseModel):
    name: str


class NamedToolChoice(BaseModel):
    model_config = ConfigDict(extra="forbid")
    type: Literal["function"]
    function: NamedFunction


class CalledFunction(BaseModel):
    name: str
    arguments: str  # JSON text, as the model wrote it


class ToolCallParam(BaseModel):
    """A call in an earlier assistant message of the conversation."""

    id: str
    type: Literal["function"] = "function"
    function: CalledFunction


def call_id() -> str:
    return f"call_{uuid.uuid4().hex[:24]}"


def mistral_call_id() -> str:
    """Nine letters and digits: the ids Mistral's chat templates (and mistral-common) accept."""
    return "".join(random.choices(string.ascii_letters + string.digits, k=9))


@dataclass
class ToolDelta:
    """What the parser gives of a stretch of output: text for ``content``, and OpenAI's streamed
    ``tool_calls`` entries (the first of a call has its ``id``, ``type`` and name; later ones add to
    its ``arguments``)."""

    content: str = ""
    calls: list[dict[str, Any]] = field(default_factory=list)


def call_head(index: int, name: str, arguments: str, new_id: Callable[[], str] = call_id) -> dict[str, Any]:
    return {"index": index, "id": new_id(), "type": "function", "function": {"name": name, "arguments": arguments}}


def _arguments_text(arguments: Any) -> str:
    """A call's arguments as OpenAI sends them: JSON text (a model may have written them as a string)."""
    return arguments if isinstance(arguments, str) else json.dumps(arguments, ensure_ascii=False)


def merge(deltas: list[ToolDelta]) -> tuple[str | None, list[dict[str, Any]]]:
    """The whole message of ``deltas``: its content (None when there is none) and its calls."""
    content = "".join(d.content for d in deltas)
    calls: dict[int, dict[str, Any]] = {}
    for delta in deltas:
        for entry in delta.calls:
            index = entry["index"]
            if index not in calls:
                calls[index] = {"id": entry["id"], "type": "function", "function": dict(entry["function"])}
            else:
                calls[index]["function"]["arguments"] += entry["function"]["arguments"]
    return (content or None), [calls[i] for i in sorted(calls)]


class ToolCallParser:
    """Finds the calls in one choice's output as it comes."""

    num_calls = 0
    new_id: Callable[[], str] = staticmethod(call_id)  # the ids of its calls (ToolUse sets Mistral's)

    def head(self, name: str, arguments: str) -> dict[str, Any]:
        """The first entry of the next call."""
        self.num_calls += 1
        return call_head(self.num_calls - 1, name, arguments, self.new_id)

    def feed(self, text: str) -> ToolDelta:
        raise NotImplementedError

    def feed_in_order(self, text: str) -> list[ToolDelta]:
        """``feed``'s delta cut so that none holds content that follows one of its calls."""
        return [self.feed(text)]

    def finish(self) -> ToolDelta:
        """What is left once the output has ended."""
        return ToolDelta()


class NamedCallParser(ToolCallParser):
    """The whole output is the arguments of the named function's one call."""

    def __init__(self, name: str) -> None:
        self.name = name

    def feed(self, text: str) -> ToolDelta:
        if self.num_calls == 0:
            return ToolDelta(calls=[self.head(self.name, text)])
        if not text:
            return ToolDelta()
        return ToolDelta(calls=[{"index": 0, "function": {"arguments": text}}])

    def finish(self) -> ToolDelta:
        return self.feed("") if self.num_calls == 0 else ToolDelta()


class RequiredCallsParser(ToolCallParser):
    """The output is a JSON array of ``{"name", "parameters"}`` objects: each is a call, sent once its
    object has closed. Cut short (``max_tokens``), the calls that closed stay and the whole output is
    also the content, for the client to see what was written."""

    def __init__(self) -> None:
        self.text = ""
        self.position = 0  # where the next element may start
        self.closed = False
        self._decoder = json.JSONDecoder()

    def feed(self, text: str) -> ToolDelta:
        self.text += text
        calls = []
        while not self.closed:
            rest = self.text[self.position :]
            skipped = len(rest) - len(rest.lstrip(" \t\r\n[,"))
            start = self.position + skipped
            if self.text[start : start + 1] == "]":
                self.closed = True
                break
            try:
                element, end = self._decoder.raw_decode(self.text, start)
            except json.JSONDecodeError:
                break  # not closed yet
            self.position = end
            if not isinstance(element, dict):  # NOTE: the schema allows objects only
                continue
            arguments = json.dumps(element.get("parameters", {}), ensure_ascii=False)
            calls.append(self.head(str(element.get("name", "")), arguments))
        return ToolDelta(calls=calls)

    def finish(self) -> ToolDelta:
        return ToolDelta() if self.closed else ToolDelta(content=self.text)


class HermesParser(ToolCallParser):
    """``<tool_call>{"name": ..., "arguments": {...}}</tool_call>`` blocks (vLLM's ``hermes`` parser).

    Text outside the blocks is the content; whitespace next to a call is dropped. A block is sent as
    a call once it closes (or the output ends), when its body is a JSON object with a string
    ``name``; else it is content as written, tags and all. NOTE: text that may be the start of a tag is held
    back until the next text shows whether it is one.
    """

    def __init__(self) -> None:
        self.pending = ""  # outside a block: held back text; inside: the block's body so far
        self.inside = False
        self.gap = ""  # the whitespace before the open block: content again if the block is not a call
        self.after_block = False  # drop the whitespace that follows a call

    def feed(self, text: str) -> ToolDelta:
        parts = self.feed_in_order(text)
        return ToolDelta("".join(p.content for p in parts), [c for p in parts for c in p.calls])

    def feed_in_order(self, text: str) -> list[ToolDelta]:
        self.pending += text
        parts = [ToolDelta()]
        while True:
            out = parts[-1]
            if self.inside:
                end = self.pending.find(HERMES_CLOSE)
                if end < 0:
                    return parts
                self.after_block = self._block(self.pending[:end], HERMES_CLOSE, out)
                if self.after_block:  # what follows the call goes in a part of its own
                    parts.append(ToolDelta())
                self.pending = self.pending[end + len(HERMES_CLOSE) :]
                self.inside = False
                continue
            if self.after_block:
                self.pending = self.pending.lstrip()
                if not self.pending:
                    return parts
                self.after_block = False
            start = self.pending.find(HERMES_OPEN)
            if start >= 0:
                before = self.pending[:start]
                out.content += before.rstrip()
                self.gap = before[len(before.rstrip()) :]
                self.pending = self.pending[start + len(HERMES_OPEN) :]
                self.inside = True
                continue
            # send all but what may begin a tag, and trailing whitespace (it may precede one)
            keep = held_back_length(self.pending, HERMES_OPEN)
            body = self.pending[: len(self.pending) - keep]
            sent = body.rstrip()
            out.content += sent
            self.pending = self.pending[len(sent) :]
            return parts

    def finish(self) -> ToolDelta:
        out = ToolDelta()
        if self.inside:
            self._block(self.pending, "", out)
        else:  # NOTE: after a block, what is left is whitespace, or nothing
            out.content = self.pending.rstrip()
        self.pending = ""
        return out

    def _block(self, body: str, close: str, out: ToolDelta) -> bool:
        """Send a block as a call (True) or, when it is not one, as content."""
        try:
            call = json.loads(body)
        except json.JSONDecodeError:
            call = None
        if isinstance(call, dict) and isinstance(call.get("name"), str):
            out.calls.append(self.head(call["name"], _arguments_text(call.get("arguments", {}))))
            return True
        out.content += self.gap + HERMES_OPEN + body + close
        return False


class Llama3JsonParser(ToolCallParser):
    """Llama 3's JSON tool calls (vLLM's ``llama3_json``): an output that opens (after blanks) with
    ``{`` or ``<|python_tag|>`` is calls, ``{"name": ..., "parameters": {...}}`` (or ``"arguments"``)
    separated by ``;``, each sent once its object closes; any other output is content. What follows the
    calls and is not one (or a call cut by ``max_tokens``) is content at the end."""

    def __init__(self) -> None:
        self.text = ""
        self.mode = "start"  # "start": undecided; "calls"; "content"
        self.position = 0  # calls: where the next one may start
        self._decoder = json.JSONDecoder()

    def feed(self, text: str) -> ToolDelta:
        self.text += text
        if self.mode == "start":
            opening = self.text.lstrip()
            if opening.startswith("{") or opening.startswith(PYTHON_TAG):
                self.mode = "calls"
                self.position = len(self.text) - len(opening) + (len(PYTHON_TAG) if opening[0] == "<" else 0)
            elif not opening or PYTHON_TAG.startswith(opening):
                return ToolDelta()  # blanks, or the start of the tag: not decided yet
            else:
                self.mode = "content"
                return ToolDelta(content=self.text)
        if self.mode == "content":
            return ToolDelta(content=text)
        calls = []
        while True:
            rest = self.text[self.position :]
            start = self.position + len(rest) - len(rest.lstrip(" \t\r\n;"))
            try:
                call, end = self._decoder.raw_decode(self.text, start)
            except json.JSONDecodeError:
                return ToolDelta(calls=calls)  # not closed yet, or not JSON (content, at the end)
            if not (isinstance(call, dict) and isinstance(call.get("name"), str)):
                return ToolDelta(calls=calls)  # not a call: the rest is content, at the end
            calls.append(self.head(call["name"], _arguments_text(call.get("parameters", call.get("arguments", {})))))
            self.position = end

    def finish(self) -> ToolDelta:
        if self.mode == "calls":
            rest = self.text[self.position :].strip(" \t\r\n;")
            return ToolDelta(content=rest)
        return ToolDelta(content=self.text if self.mode == "start" else "")


class PythonicParser(ToolCallParser):
    """Python calls (vLLM's ``pythonic``): an answer that is, whole, a list of calls with literal keyword
    arguments, ``[get_weather(city="Paris", days=2), now()]``; anything else is content. An answer that
    opens with ``[`` is held back to its end (only then is it known to be such a list); others stream."""

    def __init__(self) -> None:
        self.text = ""
        self.mode = "start"  # "start": undecided (blanks so far); "calls"; "content"

    def feed(self, text: str) -> ToolDelta:
        self.text += text
        if self.mode == "start":
            opening = self.text.lstrip()
            if not opening:
                return ToolDelta()
            self.mode = "calls" if opening.startswith("[") else "content"
            return ToolDelta(content=self.text) if self.mode == "content" else ToolDelta()
        return ToolDelta(content=text) if self.mode == "content" else ToolDelta()

    def finish(self) -> ToolDelta:
        if self.mode == "content":
            return ToolDelta()
        calls = python_calls(self.text)
        if calls is None:
            return ToolDelta(content=self.text)
        return ToolDelta(
            calls=[self.head(name, json.dumps(arguments, ensure_ascii=False)) for name, arguments in calls]
        )


class MistralParser(ToolCallParser):
    """Mistral's calls (vLLM's ``mistral``): the text before the first ``[TOOL_CALLS]`` is the content;
    after it, calls as Mistral 7B v0.3 writes them (a JSON array of ``{"name", "arguments"}``) or as
    newer models do (``name{...}`` or ``name[ARGS]{...}``, another ``[TOOL_CALLS]`` before each next
    one). Each is sent once its JSON closes. What follows that is not a call (a call cut by
    ``max_tokens`` too) is content at the end; with no call at all, tag and all. Whitespace next to
    the tag is dropped; text that may begin it is held back."""

    def __init__(self) -> None:
        self.text = ""
        self.sent = 0  # before the tag: the characters sent as content
        self.tag = -1  # where the first tag starts (-1: not seen)
        self.position = 0  # after it: where the next call may start
        self.resume = 0  # after the last call (or array) that closed: what is content if nothing more is a call
        self.in_array = False
        self.stopped = False  # what follows is not a call: content at the end
        self._decoder = json.JSONDecoder()

    def feed(self, text: str) -> ToolDelta:
        self.text += text
        if self.tag >= 0:
            return ToolDelta(calls=self._calls())
        start = self.text.find(MISTRAL_CALLS, self.sent)
        if start < 0:  # send all but what may begin the tag, and trailing whitespace (it may precede one)
            sent = self.text[self.sent : len(self.text) - held_back_length(self.text, MISTRAL_CALLS)].rstrip()
            self.sent += len(sent)
            return ToolDelta(content=sent)
        content = self.text[self.sent : start].rstrip()
        self.sent += len(content)  # NOTE: the whitespace before the tag is content again if no call follows
        self.tag, self.position = start, start + len(MISTRAL_CALLS)
        return ToolDelta(content=content, calls=self._calls())

    def finish(self) -> ToolDelta:
        if self.tag < 0 or self.num_calls == 0:  # no tag, or it led to no call: as written
            return ToolDelta(content=self.text[self.sent :].rstrip())
        return ToolDelta(content=self.text[self.resume :].strip())

    def _calls(self) -> list[dict[str, Any]]:
        calls = []
        while not self.stopped:
            rest = self.text[self.position :]
            at = self.position + len(rest) - len(rest.lstrip())
            head = self.text[at:]
            if not head:
                return calls
            if self.in_array and head[0] in ",]":
                self.position, self.in_array = at + 1, head[0] == ","
                if head[0] == "]":
                    self.resume = self.position
                continue
            if not self.in_array and head.startswith(MISTRAL_CALLS):  # the next call
                self.position = at + len(MISTRAL_CALLS)
                continue
            if not self.in_array and MISTRAL_CALLS.startswith(head):
                return calls  # it may be the tag
            if not self.in_array and head[0] == "[":  # Mistral 7B v0.3's array
                self.position, self.in_array = at + 1, True
                continue
            if self.in_array or head[0] == "{":  # {"name", "arguments"}, in the array or alone
                name, arguments, end = self._object_call(at)
            else:  # name{...} or name[ARGS]{...}
                name, arguments, end = self._named_call(at)
            if end < 0:
                return calls
            calls.append(self.head(name, _arguments_text(arguments)))
            self.position = self.resume = end
        return calls

    def _object_call(self, at: int) -> tuple[str, Any, int]:
        call, end = self._json(at)
        if end >= 0 and not (isinstance(call, dict) and isinstance(call.get("name"), str)):
            self.stopped, end = True, -1
        return (call["name"], call.get("arguments", {}), end) if end >= 0 else ("", None, -1)

    def _named_call(self, at: int) -> tuple[str, Any, int]:
        name = MISTRAL_NAME.match(self.text, at)
        if name is None:
            self.stopped = True
            return "", None, -1
        after = name.end()
        if self.text.startswith(MISTRAL_ARGS, after):
            after += len(MISTRAL_ARGS)
        elif after == len(self.text) or MISTRAL_ARGS.startswith(self.text[after:]):
            return "", None, -1  # the name or the tag may go on
        arguments, end = self._json(after)
        if end >= 0 and not isinstance(arguments, dict):
            self.stopped, end = True, -1
        return name.group(), arguments, end

    def _json(self, at: int) -> tuple[Any, int]:
        """The JSON value at ``at`` and where it ends; -1 while it has not closed (or never will: then
        the rest is content at the end)."""
        try:
            return self._decoder.raw_decode(self.text, at)
        except json.JSONDecodeError:
            return None, -1


def python_calls(text: str) -> list[tuple[str, dict[str, Any]]] | None:
    """The (name, keyword arguments) of ``text`` when it is a Python list of one or more calls of plain
    names with literal keyword arguments that JSON can hold (None: it is not)."""
    try:
        tree = ast.parse(text.strip(), mode="eval")
    except SyntaxError:
        return None
    if not isinstance(tree.body, ast.List):
        return None
    calls = []
    for node in tree.body.elts:
        if not (isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and not node.args):
            return None
        try:
            arguments = {k.arg: ast.literal_eval(k.value) for k in node.keywords if k.arg is not None}
        except ValueError:  # not a literal
            return None
        if len(arguments) != len(node.keywords):  # a **mapping
            return None
        try:
            json.dumps(arguments, allow_nan=False)
        except (TypeError, ValueError):  # a set, bytes, a complex number, nan: no JSON
            return None
        calls.append((node.func.id, arguments))
    return calls or None


def held_back_length(text: str, tag: str) -> int:
    """The length of the longest end of ``text`` that begins ``tag`` (held back: the tag may follow)."""
    for n in range(min(len(tag) - 1, len(text)), 0, -1):
        if text.endswith(tag[:n]):
            return n
    return 0


@dataclass(frozen=True)
class ToolUse:
    """What a chat request's ``tool_choice`` makes of its output."""

    kind: Literal["named", "required", "auto"]
    function: str | None = None  # the named function
    parser_name: str | None = None  # auto: the server's --tool-call-parser
    call_ids: Literal["openai", "mistral"] = "openai"  # "mistral": under --tool-call-parser mistral, every kind

    def parser(self) -> ToolCallParser:
        if self.kind == "named":
            parser: ToolCallParser = NamedCallParser(self.function or "")
        elif self.kind == "required":
            parser = RequiredCallsParser()
        else:
            parsers = {"hermes": HermesParser, "llama3_json": Llama3JsonParser, "pythonic": PythonicParser,
                       "mistral": MistralParser}  # fmt: skip
            parser = parsers[self.parser_name or "hermes"]()
        if self.call_ids == "mistral":
            parser.new_id = mistral_call_id
        return parser

    @property
    def shows_special_tokens(self) -> bool:
        """Whether the output's special tokens stay in its text: the tags are special tokens in some
        vocabularies (``<tool_call>`` in Hermes 2 Pro's, ``[TOOL_CALLS]`` and ``[ARGS]`` in Mistral's),
        and the parser must see them (vLLM's hermes and mistral parsers turn ``skip_special_tokens``
        off too)."""
        return self.kind == "auto" and self.parser_name in ("hermes", "mistral")

    def finish_reason(self, parser: ToolCallParser, reason: str) -> str:
        """OpenAI's: "tool_calls" when the model chose to call (auto, required) and the output ended by
        itself; a named function is called because the request said so: "stop"."""
        if reason == "stop" and parser.num_calls and self.kind != "named":
            return "tool_calls"
        return reason


def required_schema(tools: list[ToolDefinition], parallel: bool) -> dict[str, Any]:
    """vLLM's schema of "required": an array of ``{"name", "parameters"}``, each one of the tools
    (``parallel`` False: one call). NOTE: unlike vLLM's, no other properties are allowed: a weak model
    could otherwise write them until max_tokens."""
    branches = [
        {
            "type": "object",
            "properties": {
                "name": {"type": "string", "enum": [tool.function.name]},
                "parameters": tool.function.parameters or NO_PARAMETERS,
            },
            "required": ["name", "parameters"],
            "additionalProperties": False,
        }
        for tool in tools
    ]
    schema: dict[str, Any] = {"type": "array", "minItems": 1, "items": {"anyOf": branches}}
    if not parallel:
        schema["maxItems"] = 1
    return schema
