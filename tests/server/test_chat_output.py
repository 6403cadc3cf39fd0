"""The parsers of a chat choice's output: the hermes blocks, vLLM's "required" array, a named call and
the <think> section of reasoning models read as the examples say, and a streamed output split anywhere
gives the same message as the whole output (hypothesis), so streamed and whole responses agree."""

from __future__ import annotations

import json

import pytest
from hypothesis import example, given, settings
from hypothesis import strategies as st

from sloserve.server.chat_output import ChatOutputParser
from sloserve.server.reasoning import AnswerTokens, ReasoningParser
from sloserve.server.tool_calls import (
    HermesParser,
    Llama3JsonParser,
    MistralParser,
    NamedCallParser,
    PythonicParser,
    RequiredCallsParser,
    ToolDelta,
    ToolUse,
    merge,
    mistral_call_id,
)

CALL_F = '{"name": "f", "arguments": {"a": 1}}'


def read(parser, pieces: list[str]) -> tuple[str | None, list[tuple[str, str]]]:
    """The message of ``pieces`` fed one by one: its content and (name, arguments) of its calls,
    after checking each call's first entry has an id of its own."""
    deltas = [parser.feed(piece) for piece in pieces] + [parser.finish()]
    heads = [entry for d in deltas for entry in d.calls if "id" in entry]
    assert [h["index"] for h in heads] == list(range(len(heads))) == list(range(parser.num_calls))
    assert len({h["id"] for h in heads}) == len(heads)
    if parser.new_id is mistral_call_id:  # what Mistral's templates accept
        assert all(len(h["id"]) == 9 and h["id"].isalnum() for h in heads)
    else:
        assert all(h["id"].startswith("call_") for h in heads)
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


LLAMA_CALL = '{"name": "f", "parameters": {"a": 1}}'


@pytest.mark.parametrize(
    ("text", "content", "calls"),
    [
        (LLAMA_CALL, None, [("f", '{"a": 1}')]),
        (f' {LLAMA_CALL}; {{"name": "g", "arguments": {{"x": "é"}}}}', None, [("f", '{"a": 1}'), ("g", '{"x": "é"}')]),
        (f"<|python_tag|>{LLAMA_CALL}", None, [("f", '{"a": 1}')]),
        (f"{LLAMA_CALL}; Hope this helps.", "Hope this helps.", [("f", '{"a": 1}')]),
        ('{"name": "f", "parameters": {"a": ', '{"name": "f", "parameters": {"a":', []),  # cut: content
        ('{"a": 1} is JSON', '{"a": 1} is JSON', []),  # not a call
        (f"The answer is 4. {LLAMA_CALL}", f"The answer is 4. {LLAMA_CALL}", []),  # calls open the answer only
        ("<|python", "<|python", []),
        ("  ", "  ", []),
    ],
)
def test_llama3_json_calls(text, content, calls):
    assert read(Llama3JsonParser(), [text]) == (content, calls)


LLAMA = [LLAMA_CALL, "; ", " ", "\n", "x", "{", "}", '"name"', "<|python_tag|>", "<|", "python", "é", '{"a": 1}']


@settings(max_examples=300, deadline=None)
@given(st.lists(st.sampled_from(LLAMA), max_size=10), st.lists(st.integers(0, 10_000), max_size=8))
def test_llama3_json_streamed_anywhere_equals_whole(fragments, cuts):
    read_streamed_anywhere(Llama3JsonParser, "".join(fragments), cuts)


@pytest.mark.parametrize(
    ("text", "content", "calls"),
    [
        (
            '[get_weather(city="Paris", days=2), now()]',
            None,
            [("get_weather", '{"city": "Paris", "days": 2}'), ("now", "{}")],
        ),
        ("\n[f(a={'x': [1, None, True]}, b=-1.5)]", None, [("f", '{"a": {"x": [1, null, true]}, "b": -1.5}')]),
        ("[f(x=1)] and some text", "[f(x=1)] and some text", []),  # not a list, whole
        ("[f(x=y)]", "[f(x=y)]", []),  # not a literal
        ("[f(1)]", "[f(1)]", []),  # a positional argument
        ("[f(x={1, 2})]", "[f(x={1, 2})]", []),  # no JSON for a set
        ("[]", "[]", []),
        ('[f(city="Par', '[f(city="Par', []),  # cut
        ("It is 4.", "It is 4.", []),
    ],
)
def test_pythonic_calls(text, content, calls):
    assert read(PythonicParser(), [text]) == (content, calls)
    assert read(PythonicParser(), list(text)) == (content, calls)


MISTRAL_ARRAY = '[{"name": "f", "arguments": {"a": 1}}, {"name": "g", "arguments": {"x": "é"}}]'


@pytest.mark.parametrize(
    ("text", "content", "calls"),
    [
        (f"[TOOL_CALLS] {MISTRAL_ARRAY}", None, [("f", '{"a": 1}'), ("g", '{"x": "é"}')]),  # Mistral 7B v0.3
        ('[TOOL_CALLS]f{"a": 1}[TOOL_CALLS]g[ARGS]{"x": "é"}', None, [("f", '{"a": 1}'), ("g", '{"x": "é"}')]),
        ('Let me check. [TOOL_CALLS]get.time{"zone": 2}', "Let me check.", [("get.time", '{"zone": 2}')]),
        ('[TOOL_CALLS]{"name": "f", "arguments": {}}', None, [("f", "{}")]),  # one object, no array
        ('[TOOL_CALLS]f{"a": 1} Hope this helps.', "Hope this helps.", [("f", '{"a": 1}')]),
        ('[TOOL_CALLS]f{"a": 1}[TOOL_CALLS]g{"b": ', '[TOOL_CALLS]g{"b":', [("f", '{"a": 1}')]),  # the second cut
        (f"[TOOL_CALLS]{MISTRAL_ARRAY} [oops", "[oops", [("f", '{"a": 1}'), ("g", '{"x": "é"}')]),
        ("no calls at all [TOOL", "no calls at all [TOOL", []),
        ("[TOOL_CALLS] not a call", "[TOOL_CALLS] not a call", []),  # as written
        ('x [TOOL_CALLS][{"name": 3}]', 'x [TOOL_CALLS][{"name": 3}]', []),
        ("[TOOL_CALLS]f[1, 2]", "[TOOL_CALLS]f[1, 2]", []),
    ],
)
def test_mistral_calls(text, content, calls):
    parser = ToolUse("auto", parser_name="mistral", call_ids="mistral").parser()
    assert isinstance(parser, MistralParser) and read(parser, [text]) == (content, calls)


MISTRAL = ["[TOOL_CALLS]", "[ARGS]", "[", "TOOL", "_CALLS]", "f", "g", '{"a": [1, "]"]}', "{", "}", ", ", " ", "\n",
           MISTRAL_ARRAY, "x", "é"]  # fmt: skip


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


def read_streamed_anywhere(make_parser, text: str, cuts: list[int]) -> tuple[str | None, list[tuple[str, str]]]:
    """The message of ``text`` read whole, after checking that split at ``cuts``, and a character at a
    time, a fresh parser reads the same."""
    whole = read(make_parser(), [text])
    assert read(make_parser(), split(text, cuts)) == read(make_parser(), list(text)) == whole
    return whole


@pytest.mark.parametrize(
    ("parser", "fragments", "max_size", "opener"),
    [(HermesParser, FRAGMENTS, 14, "<"), (MistralParser, MISTRAL, 12, "[TOOL_CALLS]")],
)
@settings(max_examples=300, deadline=None)
@given(data=st.data())
def test_text_parsers_streamed_anywhere_equal_whole(parser, fragments, max_size, opener, data):
    """Hermes' and Mistral's parsers: any split of the output reads as the whole; text with nothing
    that may open a call is all content."""
    text = "".join(data.draw(st.lists(st.sampled_from(fragments), max_size=max_size), label="fragments"))
    whole = read_streamed_anywhere(parser, text, data.draw(st.lists(st.integers(0, 10_000), max_size=8), label="cuts"))
    if opener not in text:
        assert whole == (text.rstrip() or None, [])


@settings(max_examples=200, deadline=None)
@given(st.lists(st.sampled_from(ARRAY), max_size=10), st.lists(st.integers(0, 10_000), max_size=8))
def test_required_streamed_anywhere_equals_whole(fragments, cuts):
    whole = read_streamed_anywhere(RequiredCallsParser, "".join(fragments), cuts)
    for _, arguments in whole[1]:
        json.loads(arguments)


def split_reasoning(name: str, pieces: list[str]) -> tuple[str, str]:
    parser = ReasoningParser(name)
    parts = [parser.feed(piece) for piece in pieces] + [parser.finish()]
    return "".join(r for r, _ in parts), "".join(c for _, c in parts)


@pytest.mark.parametrize(
    ("name", "text", "reasoning", "content"),
    [
        ("deepseek_r1", "Let me see.</think>\n\nIt is 4.", "Let me see.", "\n\nIt is 4."),
        ("deepseek_r1", "<think>\nhm</think>4", "\nhm", "4"),  # the model opened it itself
        ("deepseek_r1", "still thinking", "still thinking", ""),  # never closed: all reasoning (vLLM's)
        ("qwen3", "<think>\nhm\n</think>\n\n4", "\nhm\n", "\n\n4"),
        ("qwen3", "  <think>unclosed", "unclosed", ""),
        ("qwen3", "4, no thinking", "", "4, no thinking"),  # enable_thinking off
        ("qwen3", "<thinking> is a word", "", "<thinking> is a word"),
        ("qwen3", "<thi", "", "<thi"),
        ("qwen3", "a </think> b", "", "a </think> b"),  # not opened: content
    ],
)
def test_reasoning_sections(name, text, reasoning, content):
    assert split_reasoning(name, [text]) == (reasoning, content)


THINKING = ["<think>", "</think>", "<", "think", ">", "/", " ", "\n", "x", "é", "<tool_call>", "</tool_call>", CALL_F]


@settings(max_examples=300, deadline=None)
@given(
    st.sampled_from(["deepseek_r1", "qwen3"]),
    st.lists(st.sampled_from(THINKING), max_size=12),
    st.lists(st.integers(0, 10_000), max_size=8),
)
def test_reasoning_then_tool_calls_streamed_anywhere_equal_whole(name, fragments, cuts):
    """The reasoning parser alone, and with hermes tool calls after it (as --reasoning-parser and
    --tool-call-parser run together): any split gives the whole output's message."""
    text = "".join(fragments)
    whole = split_reasoning(name, [text])
    assert split_reasoning(name, split(text, cuts)) == split_reasoning(name, list(text)) == whole
    opened = text.lstrip().removeprefix("<think>")
    kept = {text, opened, text.replace("</think>", "", 1), opened.replace("</think>", "", 1)}
    assert "".join(whole) in kept  # nothing lost but the tags (and the blanks before an opening one)

    def message(pieces: list[str]) -> tuple:
        parser = ChatOutputParser(name, ToolUse("auto", parser_name="hermes"))
        deltas = [parser.feed(p) for p in pieces] + [parser.feed("", finished=True)]
        content, calls = merge([ToolDelta(d.content, d.calls) for d in deltas])
        return (
            "".join(d.reasoning for d in deltas),
            content,
            [(c["function"]["name"], c["function"]["arguments"]) for c in calls],
        )

    assert message(split(text, cuts)) == message([text])


def response_items(pieces: list[str]) -> tuple[list[tuple], list[str]]:
    """The Responses API items of an output fed in ``pieces`` (qwen3 reasoning, hermes calls): each
    item's (type, text or name + arguments, status), and the event types."""
    from sloserve.server.responses_api import ResponseBuilder, ResponsesRequest

    parser = ChatOutputParser("qwen3", ToolUse("auto", parser_name="hermes"))
    builder = ResponseBuilder(ResponsesRequest(model="m", input="x"), "m", "default")
    events = builder.start()
    for piece in pieces:
        for delta in parser.feed_in_order(piece):
            events += builder.feed(delta)
    events += builder.feed(parser.feed("", finished=True))
    events += builder.finish(parser.finish_reason("stop"), {"prompt_tokens": 1, "completion_tokens": 2,
                                                            "total_tokens": 3, "prompt_tokens_details": {}})  # fmt: skip
    assert [e["sequence_number"] for e in events] == list(range(len(events)))
    final = events[-1]["response"]
    added = [e["item"]["id"] for e in events if e["type"] == "response.output_item.added"]
    done = [e["item"] for e in events if e["type"] == "response.output_item.done"]
    assert added == [d["id"] for d in done] == [item["id"] for item in final["output"]]  # each opened, closed
    items = []
    for item in final["output"]:
        if item["type"] == "function_call":
            items.append((item["type"], item["name"], item["arguments"], item["status"]))
        else:
            items.append((item["type"], item["content"][0]["text"], item.get("status")))
    return items, [e["type"] for e in events]


def test_a_responses_stream_has_the_items_of_the_whole_output():
    text = f"<think>hm</think>Let me look.<tool_call>{CALL_F}</tool_call> Done."
    items, kinds = response_items([text])
    assert items == [("reasoning", "hm", None), ("message", "Let me look.", "completed"),
                     ("function_call", "f", '{"a": 1}', "completed"), ("message", "Done.", "completed")]  # fmt: skip
    assert response_items(list(text))[0] == items
    assert kinds[:2] == ["response.created", "response.in_progress"] and kinds[-1] == "response.completed"


@settings(max_examples=300, deadline=None)
@given(
    st.lists(st.sampled_from([*THINKING, f"<tool_call>{CALL_F}</tool_call>"]), max_size=12),
    st.lists(st.integers(0, 10_000), max_size=8),
)
def test_responses_items_streamed_anywhere_equal_whole(fragments, cuts):
    text = "".join(fragments)
    assert response_items(split(text, cuts))[0] == response_items([text])[0]


# The tokens of a vocabulary with the tags as tokens of their own (ids 3 and 4, as Qwen3's and
# DeepSeek-R1's), none of which spells a tag in pieces
TOKENS = {3: "<think>", 4: "</think>", 10: " ", 11: "\n", 12: "a", 13: "b c", 14: "<", 15: "é"}


@settings(max_examples=300, deadline=None)
@given(
    st.sampled_from(["deepseek_r1", "qwen3"]),
    st.lists(st.sampled_from(sorted(TOKENS)), max_size=12),
    st.lists(st.integers(0, 12), max_size=4),
)
@example("qwen3", [10, 3, 4], [])  # whitespace, then the thinking: the parser drops the whitespace (found by exploring)
def test_the_answers_tokens_are_those_whose_text_the_reasoning_parser_calls_content(name, token_ids, cuts):
    """``AnswerTokens`` (the Responses API's logprobs of a reasoning model's answer) reads the parser's
    rules on token ids: the text of the tokens it keeps is the parser's content, fed in any chunks."""
    answer = AnswerTokens(name, 3, 4)
    kept: list[int] = []
    for start, end in zip([0, *sorted(cuts)], [*sorted(cuts), len(token_ids)]):
        chunk = token_ids[start:end]
        kept += answer.answer(chunk, [TOKENS[t] for t in chunk], chunk)
    kept += answer.finish()
    _, content = split_reasoning(name, ["".join(TOKENS[t] for t in token_ids)])
    assert "".join(TOKENS[t] for t in kept) == content


def test_answer_tokens_need_the_tags_as_tokens(chat_model_dir, thinking_model_dir):
    from sloserve.engine.tokenizer import HFTokenizer

    assert AnswerTokens.of("qwen3", HFTokenizer(chat_model_dir / "tokenizer.json")) is None
    found = AnswerTokens.of("qwen3", HFTokenizer(thinking_model_dir / "tokenizer.json"))
    assert (found.open_id, found.close_id, found.starts_thinking) == (3, 4, False)
