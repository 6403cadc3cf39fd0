"""Incremental detokenization with stop strings, for streamed outputs.

Decoding the whole output after every token costs O(n) a token; like vLLM, we decode a small window:
the tokens not yet rendered, with the tokens rendered last before them as context (a tokenizer may
render a token differently after another, e.g. SentencePiece's leading space).
"""

from __future__ import annotations

from sloserve.engine.sampler import SamplingParams
from sloserve.engine.tokenizer import Tokenizer


class Detokenizer:
    """Turns one request's output tokens into text as they come, and finds its stop strings.

    ``push(token_ids)`` appends tokens and returns the text that is now final: text that could still
    turn out to be the start of a stop string (unless ``include_stop_str_in_output``), or an incomplete
    UTF-8 character, is held back until the next token decides it. ``stopped`` is set when a stop
    string appeared (the first to end in the text); the text then ends before it (OpenAI's rule: the
    stop string is not returned), or after it with ``include_stop_str_in_output`` (vLLM's); one that
    ends within the text of the first ``min_tokens`` tokens does not count. ``skip_special_tokens``
    (vLLM's default) leaves special tokens out of the text.
    """

    def __init__(
        self,
        tokenizer: Tokenizer | None,
        stop: tuple[str, ...] = (),
        *,
        include_stop_str_in_output: bool = False,
        skip_special_tokens: bool = True,
        min_tokens: int = 0,
    ) -> None:
        self.tokenizer = tokenizer
        self.stop = tuple(s for s in stop if s)
        self.include_stop_str_in_output = include_stop_str_in_output
        self.skip_special_tokens = skip_special_tokens
        # NOTE: a stop string counts once it ends in the text of the tokens after the first min_tokens (vLLM's
        # rule, as its EOS and stop tokens wait for them)
        self.min_tokens = min_tokens
        self.token_ids: list[int] = []
        self.text = ""  # all final text so far (the stop string excluded, unless include_stop_str_in_output)
        self.num_sent_chars = 0  # chars of text already returned by push
        self.stopped = False
        self.stop_reason: str | None = None  # the stop string found
        self._prefix_offset = 0  # first token of the decode window
        self._read_offset = 0  # tokens before this are in self.text
        # NOTE: text held back, as it may begin a stop string; none when the stop string is in the output
        # (the text it ends stays), as vLLM
        longest = max((len(s) for s in self.stop), default=0)
        self._held_chars = 0 if include_stop_str_in_output else max(longest - 1, 0)
        self._min_tokens_chars: int | None = None  # the text's length after the first min_tokens tokens

    def push(self, token_ids: list[int], finished: bool = False, stop_token: bool = False) -> str:
        """Add tokens; return the new text that can be sent (all of it when ``finished``). ``stop_token``:
        the last one ended the request (EOS, a stop token): its text is left out, as vLLM leaves it,
        unless ``include_stop_str_in_output``."""
        if self.stopped or self.tokenizer is None:
            return ""
        if stop_token and not self.include_stop_str_in_output:
            token_ids = token_ids[:-1]
        self._decode(token_ids, finished)
        hold = 0 if (finished or self.stopped) else self._held_chars
        end = max(self.num_sent_chars, len(self.text) - hold)
        new = self.text[self.num_sent_chars : end]
        self.num_sent_chars = end
        return new

    def _decode(self, token_ids: list[int], finished: bool) -> None:
        """Add ``token_ids`` to the text, and look for a stop string ending in what they add."""
        self.token_ids.extend(token_ids)
        window = self.token_ids[self._prefix_offset :]
        skip = self.skip_special_tokens
        prefix_text = self.tokenizer.decode(self.token_ids[self._prefix_offset : self._read_offset], skip)
        window_text = self.tokenizer.decode(window, skip)
        if len(window_text) > len(prefix_text) and not window_text.endswith("\ufffd"):
            old_length = len(self.text)
            self.text += window_text[len(prefix_text) :]
            # NOTE: the tokens just rendered become the next window's context.
            self._prefix_offset = self._read_offset
            self._read_offset = len(self.token_ids)
            if len(self.token_ids) >= self.min_tokens:
                self._find_stop(max(old_length, self._min_tokens_length()))
        elif finished:  # an incomplete character at the very end: send it as the replacement char
            self.text += window_text[len(prefix_text) :]

    def _min_tokens_length(self) -> int:
        """The length of the text the first ``min_tokens`` tokens complete (an incomplete last character
        is completed by the tokens after them)."""
        if self._min_tokens_chars is None:
            text = self.tokenizer.decode(self.token_ids[: self.min_tokens], self.skip_special_tokens)
            self._min_tokens_chars = len(text.rstrip("\ufffd"))
        return self._min_tokens_chars

    def _find_stop(self, searched_length: int) -> None:
        """Look for a stop string ending past ``searched_length`` characters of the text (those before were
        looked at already, or are the first ``min_tokens`` tokens')."""
        found = ((self.text.find(s, max(0, searched_length - len(s) + 1)), s) for s in self.stop)
        hits = [(i + len(s), i, s) for i, s in found if i >= 0]
        if hits:
            # NOTE: the first to end in the text, as if it came a character at a time: the same stop however the
            # tokens arrive (one a push, a step's few, all at once); of two ending at one character, the longer
            end, start, stop = min(hits)
            self.text = self.text[: end if self.include_stop_str_in_output else start]
            self.stopped, self.stop_reason = True, stop

    @classmethod
    def for_params(cls, tokenizer: Tokenizer | None, params: SamplingParams) -> Detokenizer:
        return cls(
            tokenizer,
            params.stop,
            include_stop_str_in_output=params.include_stop_str_in_output,
            skip_special_tokens=params.skip_special_tokens,
            min_tokens=params.min_tokens,
        )
