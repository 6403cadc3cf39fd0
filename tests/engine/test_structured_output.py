"""The grammar of a reasoning model's structured output (``thinking_first``): free thinking up to
``</think>``, then the answer's grammar from the next token, whether the tags are tokens of the
vocabulary (Qwen3's, DeepSeek-R1's) or text (any other model's)."""

from __future__ import annotations

import json

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

pytest.importorskip("llguidance")

from sloserve.core.errors import ConfigError  # noqa: E402
from sloserve.engine.structured_output import (  # noqa: E402
    GRAMMARS_CACHED,
    GrammarMatchers,
    accept,
    json_grammar,
    regex_grammar,
    thinking_first,
)
from sloserve.engine.tokenizer import HFTokenizer  # noqa: E402

SCORE = {"type": "object", "properties": {"score": {"type": "integer", "minimum": 0, "maximum": 99}},
         "required": ["score"], "additionalProperties": False}  # fmt: skip
EOS = 2  # "</s>" of served_model.make_chat_model


@pytest.fixture(scope="module", params=["text tags", "tag tokens"])
def vocabulary(request, chat_model_dir, thinking_model_dir):
    """(tokenizer, matchers, close tag, opener tag) as the server passes them: ``</think>`` is text in
    chat_model_dir's vocabulary, a token of its own in thinking_model_dir's."""
    tokenizer = HFTokenizer((chat_model_dir if request.param == "text tags" else thinking_model_dir) / "tokenizer.json")
    tag = {t: tokenizer.added_token_id(t) or t for t in ("<think>", "</think>")}
    assert isinstance(tag["</think>"], int) == (request.param == "tag tokens")
    return tokenizer, GrammarMatchers(tokenizer.to_json(), 300, (EOS,)), tag["<think>"], tag["</think>"]


def run(vocabulary, grammar: str, text: str) -> tuple[bool, bool, bool]:
    """Feed ``text``'s tokens to a fresh matcher of ``grammar``: (all were allowed, the grammar is
    complete (the request ends), the output may end here (complete, or EOS allowed next))."""
    tokenizer, matchers, _, _ = vocabulary
    matcher = matchers.matcher(grammar)
    complete = False
    for token_id in tokenizer.encode(text, add_special_tokens=False):
        if not matcher.validate_tokens([token_id]):
            return False, False, False
        complete = accept(matcher, token_id)
    return True, complete, complete or bool(matcher.validate_tokens([EOS]))


# thoughts without a tag (a tag token inside the thinking is barred, as every special token is)
THOUGHT = (
    st.lists(st.sampled_from([*'ab <>/\n{}"é', "think", "</thi", "nk>"]), max_size=12)
    .map("".join)
    .filter(lambda t: "<think>" not in t and "</think>" not in t)
)


@settings(max_examples=60, deadline=None)
@given(thought=THOUGHT, score=st.integers(0, 99))
def test_deepseek_r1_thinks_anything_then_answers_in_the_grammar(vocabulary, thought, score):
    """The output starts thinking (a ``<think>`` it writes first is thought too): any text, a JSON object
    too, is thought, cannot end the output and does not complete the answer; after the first
    ``</think>`` the answer is held to the schema and ends the output once whole."""
    _, _, opener, close = vocabulary
    grammar = thinking_first(json_grammar(SCORE), opener, close, starts_thinking=True)
    answer = json.dumps({"score": score})
    assert run(vocabulary, grammar, thought) == (True, False, False)
    assert run(vocabulary, grammar, f"<think>{thought}</think>{answer}") == (True, True, True)
    assert run(vocabulary, grammar, answer) == (True, False, False)  # still thinking
    assert run(vocabulary, grammar, f"{thought}</think>{answer}") == (True, True, True)
    assert run(vocabulary, grammar, f"{thought}</think>{answer[:-1]}") == (True, False, False)
    for wrong in (" " + answer, "sure", json.dumps({"score": 100}), '{"other": 1}'):
        assert not run(vocabulary, grammar, f"{thought}</think>{wrong}")[0]


@settings(max_examples=60, deadline=None)
@given(thought=THOUGHT, score=st.integers(0, 99))
def test_qwen3_thinks_only_after_think_and_else_answers_from_the_first_token(vocabulary, thought, score):
    """The output thinks only if it opens with ``<think>``; else it is the answer from its first token."""
    _, _, opener, close = vocabulary
    grammar = thinking_first(json_grammar(SCORE), opener, close, starts_thinking=False)
    answer = json.dumps({"score": score})
    assert run(vocabulary, grammar, answer) == (True, True, True)
    assert run(vocabulary, grammar, f"<think>{thought}</think>{answer}") == (True, True, True)
    assert run(vocabulary, grammar, f"<think>{thought}") == (True, False, False)
    assert not run(vocabulary, grammar, f"{thought}</think>{answer}")[0]


def test_a_grammar_is_compiled_once_and_each_request_gets_a_matcher_of_its_own(vocabulary, monkeypatch):
    """The last ``GRAMMARS_CACHED`` grammars stay compiled: each request gets a copy, at its start whatever
    another consumed."""
    tokenizer, _, _, _ = vocabulary
    matchers = GrammarMatchers(tokenizer.to_json(), 300, (EOS,))
    compiled: list[str] = []
    compile_grammar = matchers._compile
    monkeypatch.setattr(matchers, "_compile", lambda grammar: compiled.append(grammar) or compile_grammar(grammar))
    grammar = json_grammar(SCORE)
    assert not matchers.has_compiled(grammar)
    first, second = matchers.matcher(grammar), matchers.matcher(grammar)
    assert matchers.has_compiled(grammar) and compiled == [grammar]
    tokens = tokenizer.encode('{"score": 7}', add_special_tokens=False)
    assert first.validate_tokens(tokens) == len(tokens) and [accept(first, t) for t in tokens][-1]
    for other in (second, matchers.matcher(grammar)):
        assert not other.is_stopped() and other.validate_tokens(tokens) == len(tokens)
    others = [regex_grammar(f"a{{{i}}}") for i in range(1, GRAMMARS_CACHED + 1)]
    for other in others:
        matchers.matcher(other)
    assert not matchers.has_compiled(grammar) and all(matchers.has_compiled(g) for g in others)
    assert len(compiled) == 1 + GRAMMARS_CACHED


def test_a_grammar_llguidance_cannot_build_over_the_tokenizer_is_a_config_error_of_one_line(vocabulary):
    _, matchers, _, _ = vocabulary
    from llguidance import LLMatcher

    with pytest.raises(ConfigError, match=r"cannot be used with this model's tokenizer: .*too large: 5000$"):
        matchers.matcher(LLMatcher.grammar_from_lark("start: <[5000]>"))
