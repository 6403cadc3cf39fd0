"""Structured output: a grammar (a JSON schema, any JSON object, a regular expression, a choice of
strings, a Lark grammar) constrains every token a request samples, through llguidance (the grammar
library vLLM offers as its ``guidance`` backend).

Each request with a grammar has a matcher. Before a step samples, each such row's matcher fills a
bitmask of the tokens that keep the output a prefix of a sentence of the grammar; the scores of the
others become -inf (after the other score controls, before temperature and top-p). The sampled token
then advances the matcher. Once the grammar is complete the matcher allows EOS alone, and the request
ends ("stop") when it is sampled. A reasoning model's grammar lets it think first (``thinking_first``).

NOTE: llguidance needs the model's tokenizer as a HuggingFace ``tokenizer.json`` (a model directory
or a GGUF file has one); ``random:`` models, with their byte tokenizer, have none.
"""

from __future__ import annotations

import json
import math
import threading
from collections import OrderedDict
from typing import Any

import torch

from sloserve.core.errors import ConfigError
from sloserve.engine.async_scheduling import index_tensor, to_device

# How the JSON is laid out: the separators of Python's json.dumps and no other whitespace. NOTE:
# llguidance's default lets whitespace run freely between tokens, and a weak model (or a random one)
# can fill max_tokens with it before the object closes (vLLM's "any whitespace" problem, which it
# answers with --disable-any-whitespace); fixed separators cannot.
JSON_LAYOUT = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}
# Grammars kept compiled by a ``GrammarMatchers``: clients send the same few schemas again and again, and
# copying a compiled matcher takes microseconds where compiling takes milliseconds (seconds for a choice of
# thousands of strings), during which the engine does not step.
GRAMMARS_CACHED = 32


def json_grammar(schema: dict[str, Any] | None) -> str:
    """The grammar of JSON texts that validate against ``schema`` (None: any JSON object); a
    ConfigError with llguidance's message for a schema it cannot compile."""
    from llguidance import LLMatcher

    try:
        grammar = LLMatcher.grammar_from_json_schema(
            schema if schema is not None else {"type": "object"}, defaults=JSON_LAYOUT
        )
    except (ValueError, TypeError) as e:
        raise ConfigError(f"the JSON schema cannot be compiled: {e}") from None
    return _validated(grammar, "the JSON schema")


def regex_grammar(regex: str) -> str:
    """The grammar of the texts that match ``regex`` whole (Rust regex syntax, as llguidance's)."""
    from llguidance import LLMatcher

    # NOTE: llguidance (1.9) drops a trailing lone backslash, serving "a\\" as "a": refused here instead
    if (len(regex) - len(regex.rstrip("\\"))) % 2:
        raise ConfigError("the regular expression cannot be compiled: it ends with a backslash that escapes nothing")
    return _validated(LLMatcher.grammar_from_regex(regex), "the regular expression")


def choice_grammar(choices: list[str]) -> str:
    """The grammar of exactly one of ``choices`` (vLLM's guided choice)."""
    from llguidance import LLMatcher

    if not choices:
        raise ConfigError("the choice needs at least one string")
    # NOTE: JSON string literals are Lark's: quotes, backslashes and newlines arrive escaped
    alternatives = " | ".join(json.dumps(choice, ensure_ascii=False) for choice in choices)
    return _validated(LLMatcher.grammar_from_lark(f"start: {alternatives}"), "the choice")


def lark_grammar(source: str) -> str:
    """A grammar in llguidance's Lark syntax (vLLM's ``grammar`` with its guidance backend)."""
    from llguidance import LLMatcher

    return _validated(LLMatcher.grammar_from_lark(source), "the grammar")


def compile_grammar(kind: str, value: Any) -> str:
    """The grammar of one structured output: ``kind`` "json" (a schema, its JSON text, or None: any
    object), "regex", "choice" or "grammar" (Lark); a ConfigError saying why it cannot be compiled."""
    if kind == "json" and isinstance(value, str):  # vLLM takes the schema as JSON text too
        try:
            value = json.loads(value)
        except json.JSONDecodeError as e:
            raise ConfigError(f"the JSON schema is not valid JSON: {e}") from None
        if not isinstance(value, dict):
            raise ConfigError("the JSON schema must be a JSON object")
    compile_kind = {"json": json_grammar, "regex": regex_grammar, "choice": choice_grammar, "grammar": lark_grammar}
    return compile_kind[kind](value)


def thinking_first(grammar: str, opener: str | int, close: str | int, starts_thinking: bool) -> str:
    """The grammar of an output that thinks before it answers (vLLM's structured outputs under a
    ``--reasoning-parser``): any text up to the first ``close`` (``</think>``), then a sentence of
    ``grammar`` from the token after it. ``starts_thinking``: the output thinks from its first token
    (its prompt opened the section; an ``opener`` it writes itself is thought too); else it thinks
    only if it opens with ``opener`` (``<think>``), and answers from its first token otherwise.

    A tag is a token id where the vocabulary has it as one added token (which llguidance reads as a
    special token: DeepSeek-R1's and Qwen3's ``<think>`` and ``</think>``), else its text. NOTE: vLLM
    leaves the thinking unmasked; here it is text that cannot end the output (EOS and special tokens,
    the tags' among them, are barred until the answer is complete)."""

    def term(tag: str | int) -> str:
        return f"<[{tag}]>" if isinstance(tag, int) else json.dumps(tag, ensure_ascii=False)  # a Lark literal

    if isinstance(close, int):
        thinking = f"thinking: /(?s:.*)/ {term(close)}"
    else:  # NOTE: a suffix makes the text lazy: the thinking ends at the first close
        thinking = f"thinking[suffix={term(close)}]: /(?s:.*)/"
    start = (
        f"start: {term(opener)}? thinking @answer" if starts_thinking else f"start: ({term(opener)} thinking)? @answer"
    )
    top = json.loads(grammar)
    answer, *others = top["grammars"]
    wrapped = {**top, "grammars": [{"lark_grammar": f"{start}\n{thinking}\n"}, {**answer, "name": "answer"}, *others]}
    return _validated(json.dumps(wrapped), "the structured output after thinking")


def _validated(grammar: str, what: str) -> str:
    from llguidance import LLMatcher

    is_error, messages = LLMatcher.validate_grammar_with_warnings(grammar)
    if is_error:
        raise ConfigError(f"{what} cannot be compiled: {' '.join(messages[0].split())}")  # one line
    return grammar


class GrammarMatchers:
    """The matchers of one engine's requests that have a grammar, over its tokenizer's vocabulary."""

    def __init__(self, tokenizer_json: str, vocab_size: int, eos_token_ids: tuple[int, ...]) -> None:
        from llguidance import LLTokenizer

        # NOTE: the model's vocabulary (its score rows) may be wider than the tokenizer's: the extra
        # ids are never allowed
        self.tokenizer = LLTokenizer(tokenizer_json, n_vocab=vocab_size, eos_token=list(eos_token_ids) or None)
        self.vocab_size = vocab_size
        # NOTE: the last GRAMMARS_CACHED grammars' matchers, as compiled (never advanced); the server's
        # threads and the engine's compiling thread share it
        self._compiled: OrderedDict[str, Any] = OrderedDict()
        self._lock = threading.Lock()

    def matcher(self, grammar: str):
        """A fresh matcher of ``grammar`` (compiled by ``compile_grammar``): a copy of one compiled once; a
        ConfigError where llguidance cannot build one over this tokenizer (the server's check, ahead of the
        engine's, so that such a grammar is a 400)."""
        with self._lock:
            compiled = self._compiled.get(grammar)
            if compiled is not None:
                self._compiled.move_to_end(grammar)
        if compiled is None:
            compiled = self._compile(grammar)  # NOTE: outside the lock: it may take seconds
            with self._lock:
                self._compiled[grammar] = compiled
                if len(self._compiled) > GRAMMARS_CACHED:
                    self._compiled.popitem(last=False)
        return compiled.deep_copy()

    def has_compiled(self, grammar: str) -> bool:
        """Whether ``matcher(grammar)`` is a copy, without compiling anything."""
        with self._lock:
            return grammar in self._compiled

    def _compile(self, grammar: str):
        from llguidance import LLMatcher

        matcher = LLMatcher(self.tokenizer, grammar, log_level=0)  # NOTE: lets go of the GIL meanwhile
        if matcher.is_error():
            # NOTE: the first line: a panic's goes on with its backtrace
            raise ConfigError(
                f"the grammar cannot be used with this model's tokenizer: {matcher.get_error().splitlines()[0]}"
            )
        return matcher

    def mask(
        self,
        scores: torch.Tensor,  # (N, vocab) float32; changed in place
        rows: list[int],  # (R,) the rows that have a matcher
        matchers: list,  # (R,) their matchers
    ) -> None:
        """Set to -inf the scores of the tokens each row's matcher does not allow next."""
        from llguidance.numpy import allocate_token_bitmask, fill_next_token_bitmask

        bitmask = allocate_token_bitmask(len(rows), self.vocab_size)  # (R, ceil(vocab / 32)) int32
        for i, matcher in enumerate(matchers):
            fill_next_token_bitmask(matcher, bitmask, i)
        # NOTE: from pinned memory without blocking: with async scheduling the forward pass is still running
        words = to_device(torch.from_numpy(bitmask), scores.device)
        shifts = torch.arange(32, dtype=torch.int32, device=scores.device)
        allowed = ((words[:, :, None] >> shifts) & 1).bool().reshape(len(rows), -1)[:, : scores.shape[1]]  # (R, vocab)
        index = index_tensor(rows, scores.device)
        scores[index] = scores[index].masked_fill(~allowed, -math.inf)


def accept(matcher, token_id: int) -> bool:
    """Advance ``matcher`` by the sampled ``token_id``; True once its grammar is complete (what
    follows can only be EOS)."""
    matcher.consume_token(token_id)
    return matcher.is_stopped()
