"""The tool-call parsers of chat completions: the hermes blocks, vLLM's "required" array and a named
call read as the examples say, and a streamed output split anywhere gives the same message as the whole
output (hypothesis), so streamed and whole responses agree."""

from __future__ import annotations

import json

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from sloserve.server.tool_calls import HermesParser, NamedCallParser, RequiredCallsParser, merge

CALL_F = '{"name": "f", "arguments": {"a": 1}}'


def read(parser, pieces: list[str]) -> tuple[str | None, list[tuple[str, str]]]:
    """The message of ``pieces`` fed one by one: its content and (name, arguments) of its calls,
    after checking each call's first entry has an id of its own."""
    deltas = [parser.feed(piece) for piece in pieces] + [parser.finish()]
    heads = [entry for d in deltas for entry in d.calls if "id" in entry]
    assert [h["index"] for h in heads] == list(range(len(heads))) == list(range(parser.num_calls))
    assert len({h["id"] for h in heads}) == len(heads) and all(h["id"].startswith("call_") for h in heads)
    content, calls = merge(deltas)
    return content, [(c["function"]["name"], c["function"]["arguments"]) for c in calls]


@pytest.mark.parametrize(
    ("text", "content", "calls"),
    [
        (f"<tool_call>\n{CALL_F}\n</tool_call>", None, [("f", '{"a": 1}')]),
        (
            f'Let me look.\n<tool_call>{CALL_F}</tool_call>\n<tool_call>{{"name": "g", "arguments": {{"x": "é"}}}}'
            "</tool_call>\n",
            "Let me look.",
            [("f", '{"a": 1}'), ("g", '{"x": "é"}')],
        ),
        ("no calls at all\n", "no calls at all", []),
        ('<tool_call>{"name": "f", "arguments": {"a": 1}}', None, [("f", '{"a": 1}')]),  # the output ended first
        ('<tool_call>{"name": "f", "argu', '<tool_call>{"name": "f", "argu', []),  # cut: not JSON
        ("x <tool_call>not json</tool_call> y", "x <tool_call>not json</tool_call> y", []),  # as written
        ('<tool_call>{"arguments": {}}</tool_call>', '<tool_call>{"arguments": {}}</tool_call>', []),  # no name
        ("a < b, then <tool_cal", "a < b, then <tool_cal", []),
        ('<tool_call>{"name": "f", "arguments": "{\\"a\\": 1}"}</tool_call>', None, [("f", '{"a": 1}')]),  # as text
        ('<tool_call>{"name": "ping"}</tool_call>', None, [("ping", "{}")]),
        (f"<tool_call>{CALL_F}</tool_call> and then some", "and then some", [("f", '{"a": 1}')]),
    ],
)
def test_hermes_blocks(text, content, calls):
    assert read(HermesParser(), [text]) == (content, calls)


def test_required_array_and_a_cut_one():
    text = '[{"name": "f", "parameters": {"a": 1}}, {"name": "g", "parameters": {}}]'
    assert read(RequiredCallsParser(), [text]) == (None, [("f", '{"a": 1}'), ("g", "{}")])
    cut = '[{"name": "f", "parameters": {"a": "é"}}, {"name": "g", "para'
    assert read(RequiredCallsParser(), [cut]) == (cut, [("f", '{"a": "é"}')])


def test_named_call_is_the_whole_output():
    assert read(NamedCallParser("f"), ['{"a": ', "1}"]) == (None, [("f", '{"a": 1}')])
    assert read(NamedCallParser("f"), []) == (None, [("f", "")])  # nothing written: still the call


FRAGMENTS = ["<tool_call>", "</tool_call>", CALL_F, '{"name": "g"}', " ", "\n", "x", "<", "tool", "_call>", "{", "é"]
ARRAY = ["[", "]", ",", " ", '{"name": "f", "parameters": {"a": [1, "]"]}}', '{"name": "g", "parameters": {}}', "{"]


def split(text: str, cuts: list[int]) -> list[str]:
    positions = sorted({0, len(text), *(c % (len(text) + 1) for c in cuts)})
    return [text[a:b] for a, b in zip(positions, positions[1:], strict=False)]


@settings(max_examples=300, deadline=None)
@given(st.lists(st.sampled_from(FRAGMENTS), max_size=14), st.lists(st.integers(0, 10_000), max_size=8))
def test_hermes_streamed_anywhere_equals_whole(fragments, cuts):
    text = "".join(fragments)
    whole = read(HermesParser(), [text])
    assert read(HermesParser(), split(text, cuts)) == whole
    assert read(HermesParser(), list(text)) == whole  # a character at a time
    if "<" not in text:
        assert whole == (text.rstrip() or None, [])


@settings(max_examples=200, deadline=None)
@given(st.lists(st.sampled_from(ARRAY), max_size=10), st.lists(st.integers(0, 10_000), max_size=8))
def test_required_streamed_anywhere_equals_whole(fragments, cuts):
    text = "".join(fragments)
    whole = read(RequiredCallsParser(), [text])
    assert read(RequiredCallsParser(), split(text, cuts)) == whole
    assert read(RequiredCallsParser(), list(text)) == whole
    for _, arguments in whole[1]:
        json.loads(arguments)
