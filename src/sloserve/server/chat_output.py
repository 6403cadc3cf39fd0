"""What a chat choice's output becomes in its message: the model's thinking (``reasoning_content``,
``reasoning.py``), its text (``content``) and its tool calls (``tool_calls.py``), found as the output
comes, so that a streamed message put together is the whole one."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from sloserve.server.reasoning import ReasoningParser
from sloserve.server.tool_calls import ToolCallParser, ToolDelta, ToolUse, merge


@dataclass
class MessageDelta:
    """A stretch of a chat message: its thinking, its text, and OpenAI's streamed ``tool_calls`` entries."""

    reasoning: str = ""
    content: str = ""
    calls: list[dict[str, Any]] = field(default_factory=list)


class ChatOutputParser:
    """One choice's output split as the server's ``--reasoning-parser`` and the request's
    ``tool_choice`` say (reasoning first; tool calls are looked for in what is left)."""

    def __init__(self, reasoning_parser: str | None, tool_use: ToolUse | None) -> None:
        self.reasoning = None if reasoning_parser is None else ReasoningParser(reasoning_parser)
        self.tool_use = tool_use
        self.tools: ToolCallParser | None = None if tool_use is None else tool_use.parser()

    def feed(self, text: str, finished: bool = False) -> MessageDelta:
        """The message's part of ``text``; ``finished``: the output ends with it."""
        parts = self.feed_in_order(text, finished)
        return MessageDelta(parts[0].reasoning, "".join(p.content for p in parts), [c for p in parts for c in p.calls])

    def feed_in_order(self, text: str, finished: bool = False) -> list[MessageDelta]:
        """``feed``'s delta cut so that none holds text that follows one of its calls (the reasoning
        comes first): the Responses API's items keep the order the model wrote them in."""
        reasoning, content = ("", text) if self.reasoning is None else self.reasoning.feed(text)
        if finished and self.reasoning is not None:
            more_reasoning, more_content = self.reasoning.finish()
            reasoning, content = reasoning + more_reasoning, content + more_content
        if self.tools is None:
            return [MessageDelta(reasoning, content)]
        found = self.tools.feed_in_order(content)
        if finished:
            found.append(self.tools.finish())
        return [MessageDelta(reasoning if i == 0 else "", part.content, part.calls) for i, part in enumerate(found)]

    def finish_reason(self, reason: str) -> str:
        return reason if self.tool_use is None else self.tool_use.finish_reason(self.tools, reason)

    def message(self, text: str) -> tuple[str | None, str | None, list[dict[str, Any]]]:
        """The whole output's (reasoning, content, calls); None where there is none."""
        delta = self.feed(text, finished=True)
        content, calls = merge([ToolDelta(delta.content, delta.calls)])
        return delta.reasoning or None, content, calls
