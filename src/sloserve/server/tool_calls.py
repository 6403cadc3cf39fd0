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
  ``[get_weather(city="Paris"), ...]``, as Llama 3.2 and 4 write them). A server without one answers
  "auto" with a 400, as vLLM does.

Each parser is incremental (``feed`` the text as it comes, then ``finish``): a streamed response sends
what it gives as it comes, and a whole response is the same deltas merged (``merge``), so the two
always agree.
"""

from __future__ import annotations

import ast
import json
import uuid
from dataclasses import dataclass, field
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

# vLLM's names of the parsers of "auto" tool choice: <tool_call> blocks; Llama 3's JSON calls; Python calls
TOOL_CALL_PARSERS = ("hermes", "llama3_json", "pythonic")
HERMES_OPEN, HERMES_CLOSE = "<tool_call>", "</tool_call>"
PYTHON_TAG = "<|python_tag|>"  # Llama 3's token before a call, where its template asks for one
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


@dataclass
class ToolDelta:
    """What the parser gives of a stretch of output: text for ``content``, and OpenAI's streamed
    ``tool_calls`` entries (the first of a call has its ``id``, ``type`` and name; later ones add to
    its ``arguments``)."""

    content: str = ""
    calls: list[dict[str, Any]] = field(default_factory=list)


def call_head(index: int, name: str, arguments: str) -> dict[str, Any]:
    return {"index": index, "id": call_id(), "type": "function", "function": {"name": name, "arguments": arguments}}


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
            self.num_calls = 1
            return ToolDelta(calls=[call_head(0, self.name, text)])
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
            calls.append(call_head(self.num_calls, str(element.get("name", "")), arguments))
            self.num_calls += 1
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
            arguments = call.get("arguments", {})
            text = arguments if isinstance(arguments, str) else json.dumps(arguments, ensure_ascii=False)
            out.calls.append(call_head(self.num_calls, call["name"], text))
            self.num_calls += 1
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
            arguments = call.get("parameters", call.get("arguments", {}))
            text = arguments if isinstance(arguments, str) else json.dumps(arguments, ensure_ascii=False)
            calls.append(call_head(self.num_calls, call["name"], text))
            self.num_calls += 1
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
        heads = [
            call_head(i, name, json.dumps(arguments, ensure_ascii=False)) for i, (name, arguments) in enumerate(calls)
        ]
        self.num_calls = len(heads)
        return ToolDelta(calls=heads)


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

    def parser(self) -> ToolCallParser:
        if self.kind == "named":
            return NamedCallParser(self.function or "")
        if self.kind == "required":
            return RequiredCallsParser()
        parsers = {"hermes": HermesParser, "llama3_json": Llama3JsonParser, "pythonic": PythonicParser}
        return parsers[self.parser_name or "hermes"]()

    @property
    def shows_special_tokens(self) -> bool:
        """Whether the output's special tokens stay in its text: the <tool_call> tags are special tokens
        in some vocabularies (Hermes 2 Pro's), and the parser must see them (vLLM's hermes parser
        turns ``skip_special_tokens`` off too)."""
        return self.kind == "auto" and self.parser_name == "hermes"

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
