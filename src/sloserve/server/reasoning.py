"""Reasoning models' thinking, apart from their answer: ``--reasoning-parser`` splits a chat choice's
output into ``reasoning_content`` (the text between ``<think>`` and ``</think>``) and ``content``, as
vLLM's reasoning parsers do.

- ``deepseek_r1``: the output starts thinking (DeepSeek-R1's template opens ``<think>`` in the prompt;
  one the model writes itself is dropped) and answers after the first ``</think>``; an output that
  never closes it is all reasoning (vLLM's rule).
- ``qwen3``: the output thinks only if it opens with ``<think>`` (Qwen3 with ``enable_thinking``; with
  it off, the template closes an empty one in the prompt and the output is all answer). NOTE: an
  unclosed ``<think>`` is reasoning here, streamed or not; vLLM's whole response calls it content,
  its streamed one reasoning.

The parser is incremental, as the tool-call parsers (``tool_calls.py``): a streamed response sends
what it gives as it comes, a whole one the same put together. Tool calls are looked for in the content
only. A request with a structured output (a JSON schema, a named or required tool choice) thinks
first, as vLLM's: its grammar holds from the token after ``</think>`` (``thinking_first`` of
structured_output.py).
"""

from __future__ import annotations

from sloserve.server.tool_calls import held_back_length

REASONING_PARSERS = ("deepseek_r1", "qwen3")
THINK_OPEN, THINK_CLOSE = "<think>", "</think>"


def starts_thinking(name: str) -> bool:
    """Whether the outputs of reasoning parser ``name`` start thinking (else only one opened by ``<think>`` does)."""
    return name == "deepseek_r1"


class ReasoningParser:
    """Splits one choice's output into (reasoning, content) as it comes."""

    def __init__(self, name: str) -> None:
        self.starts_thinking = starts_thinking(name)
        self.state = "start"  # "start": before the first text that decides; "thinking"; "answering"
        self.pending = ""  # held back: text that may be the start of a tag

    def feed(self, text: str) -> tuple[str, str]:
        """The (reasoning, content) of ``text``, past what is held back."""
        self.pending += text
        reasoning = content = ""
        while True:
            if self.state == "start":
                stripped = self.pending.lstrip()
                if stripped.startswith(THINK_OPEN):
                    self.pending, self.state = stripped[len(THINK_OPEN) :], "thinking"
                elif len(stripped) < len(THINK_OPEN) and THINK_OPEN.startswith(stripped):
                    return reasoning, content  # it may yet open with <think>
                else:
                    self.state = "thinking" if self.starts_thinking else "answering"
            if self.state == "answering":
                content += self.pending
                self.pending = ""
                return reasoning, content
            end = self.pending.find(THINK_CLOSE)
            if end >= 0:
                reasoning += self.pending[:end]
                self.pending, self.state = self.pending[end + len(THINK_CLOSE) :], "answering"
                continue
            keep = held_back_length(self.pending, THINK_CLOSE)
            reasoning += self.pending[: len(self.pending) - keep]
            self.pending = self.pending[len(self.pending) - keep :]
            return reasoning, content

    def finish(self) -> tuple[str, str]:
        """What is held back, once the output has ended."""
        rest, self.pending = self.pending, ""
        if self.state == "thinking" or self.state == "start" and self.starts_thinking:
            return rest, ""
        return "", rest


class AnswerTokens:
    """Which of an output's tokens are its answer: ``ReasoningParser``'s rules read on token ids, where
    ``<think>`` and ``</think>`` are tokens of the vocabulary (DeepSeek-R1's, Qwen3's), so that each
    answer token's logprob can go with the answer (the Responses API's ``output_text.logprobs``).

    NOTE: a tag the model spells in pieces is text to this reading and a tag to the parser's; the
    vocabulary's own tag token is what models write."""

    def __init__(self, name: str, open_id: int, close_id: int) -> None:
        self.starts_thinking = starts_thinking(name)
        self.open_id, self.close_id = open_id, close_id
        self.state = "start"  # as ReasoningParser's: "start", "thinking", "answering"
        self.undecided: list = []  # whitespace before the first token that decides (the parser strips it)

    @classmethod
    def of(cls, name: str, tokenizer) -> AnswerTokens | None:
        """The reading for reasoning parser ``name`` over ``tokenizer`` (None: a tag is not a token of it)."""
        ids = [getattr(tokenizer, "added_token_id", lambda _: None)(tag) for tag in (THINK_OPEN, THINK_CLOSE)]
        return None if None in ids else cls(name, *ids)

    def answer(self, token_ids: list[int], texts: list[str], items: list) -> list:
        """The ``items`` (one per token) of the answer's tokens among the next ``token_ids``; ``texts``:
        each token's text."""
        kept = []
        for token, text, item in zip(token_ids, texts, items, strict=True):
            if self.state == "start":
                if token == self.open_id:  # NOTE: the whitespace before it is nobody's (the parser drops it)
                    self.state = "thinking"
                    self.undecided = []
                    continue
                if not text.strip():
                    self.undecided.append(item)
                    continue
                self.state = "thinking" if self.starts_thinking else "answering"
                kept += self.finish()
            if self.state == "thinking":
                self.state = "answering" if token == self.close_id else "thinking"
                continue
            kept.append(item)
        return kept

    def finish(self) -> list:
        """The undecided items that turn out to be the answer's (the output ended, or answers, before it
        decided)."""
        undecided, self.undecided = self.undecided, []
        return [] if self.starts_thinking or self.state == "thinking" else undecided
