"""Log-probabilities in OpenAI's shapes: the legacy completions object (``tokens``, ``token_logprobs``,
``top_logprobs``, ``text_offset``) and chat's ``content`` list (``token``, ``logprob``, ``bytes``,
``top_logprobs``), from the engine's ``Logprobs`` (``engine/sampler.py``).

A token's string is its text decoded alone, special tokens included, as vLLM shows it (a byte-level
token that is part of a character decodes to U+FFFD); ``token_id:N`` when the model has no tokenizer
or the request asks for vLLM's ``return_tokens_as_token_ids``.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from sloserve.engine.logprobs import Logprobs
from sloserve.engine.tokenizer import Tokenizer

# The floor of a reported logprob: a token of probability 0 has -inf, which JSON cannot carry (vLLM
# reports -9999.0 too).
MIN_LOGPROB = -9999.0


class LogprobsFormat:
    """Formats ``Logprobs`` with ``tokenizer``'s token strings (cached: a vocabulary's tokens recur)."""

    def __init__(self, tokenizer: Tokenizer | None) -> None:
        self.tokenizer = tokenizer
        self._strings: dict[int, str] = {}

    def token(self, token_id: int) -> str:
        text = self._strings.get(token_id)
        if text is None:
            if self.tokenizer is None:
                text = f"token_id:{token_id}"
            else:
                text = self.tokenizer.decode([token_id], skip_special_tokens=False)
            self._strings[token_id] = text
        return text

    def completion(
        self, token_ids: Sequence[int], entries: Sequence[Logprobs | None], text_offset: int
    ) -> dict[str, Any]:
        """The completions ``logprobs`` object of ``token_ids`` (an entry None: the prompt's first
        token, which has none); offsets count from ``text_offset``."""
        tokens = [self.token(t) for t in token_ids]
        offsets = []
        for text in tokens:
            offsets.append(text_offset)
            text_offset += len(text)
        return {
            "tokens": tokens,
            "token_logprobs": [None if e is None else _value(e.logprob) for e in entries],
            "top_logprobs": [None if e is None else self._top_dict(e) for e in entries],
            "text_offset": offsets,
        }

    def _top_dict(self, entry: Logprobs) -> dict[str, float]:
        """The likeliest tokens and the chosen one (vLLM lists it too, ranked or not)."""
        top = {self.token(t): _value(lp) for t, lp in zip(entry.top_token_ids, entry.top_logprobs, strict=True)}
        top.setdefault(self.token(entry.token_id), _value(entry.logprob))
        return top

    def prompt(self, entries: Sequence[Logprobs | None]) -> list[dict[str, dict[str, Any]] | None]:
        """vLLM's ``prompt_logprobs``: for each prompt token (the first: None), by token id, its logprob,
        rank and text, then the likeliest tokens'."""
        shown: list[dict[str, dict[str, Any]] | None] = []
        for e in entries:
            if e is None:
                shown.append(None)
                continue
            ranked = [(e.token_id, e.logprob, e.rank)]
            ranked += [(t, lp, r) for r, (t, lp) in enumerate(zip(e.top_token_ids, e.top_logprobs, strict=True), 1)]
            shown.append(
                {
                    str(t): {"logprob": _value(lp), "rank": rank, "decoded_token": self.token(t)}
                    for t, lp, rank in ranked
                }
            )
        return shown

    def chat(self, entries: Sequence[Logprobs]) -> dict[str, Any]:
        """The chat ``logprobs`` object: ``{"content": [...]}``, one item per token."""
        return {
            "content": [
                {
                    **self._chat_token(e.token_id, e.logprob),
                    "top_logprobs": [
                        self._chat_token(t, lp) for t, lp in zip(e.top_token_ids, e.top_logprobs, strict=True)
                    ],
                }
                for e in entries
            ]
        }

    def _chat_token(self, token_id: int, logprob: float) -> dict[str, Any]:
        text = self.token(token_id)
        return {"token": text, "logprob": _value(logprob), "bytes": list(text.encode("utf-8"))}


def _value(logprob: float) -> float:
    return max(logprob, MIN_LOGPROB)
