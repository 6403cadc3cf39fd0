"""The detokenizer of streamed outputs: text held back while it could still be a stop string's start or
an incomplete character, and stop strings found the same whether the tokens come one at a time, in
chunks (a step's tokens with async scheduling, a fleet replica's coalesced deltas) or all at once, and
only past the text of the first ``min_tokens`` tokens."""

from __future__ import annotations

import pytest
from hypothesis import example, given
from hypothesis import strategies as st

pytest.importorskip("torch")

from sloserve.engine.detokenizer import Detokenizer  # noqa: E402
from sloserve.engine.tokenizer import ByteTokenizer  # noqa: E402

ALPHABET = "ab€\n"  # "€": three bytes, three tokens of the byte tokenizer


def test_detokenizer_holds_back_a_possible_stop_string_and_cuts_it():
    tok = ByteTokenizer()
    d = Detokenizer(tok, stop=("END",))
    assert d.push(list(b"abcE")) == "ab"  # "cE" could be the start of "END": held back
    assert d.push(list(b"N")) == "c"
    assert d.push(list(b"Dxyz")) == "" and d.stopped and d.text == "abc"
    d = Detokenizer(tok, stop=("xyz", "END", "EN"), include_stop_str_in_output=True)  # vLLM's option
    assert d.push(list(b"abcENDxyz")) == "abcEN" and d.stopped  # "EN" ends first
    d = Detokenizer(tok, stop=("END",), include_stop_str_in_output=True)
    assert d.push(list(b"abcE")) == "abcE"  # nothing held back: the text up to a stop string's end stays
    d = Detokenizer(tok)
    euro = list("€".encode())  # three bytes: nothing is final until the last one
    assert d.push(euro[:1]) == "" and d.push(euro[1:2]) == "" and d.push(euro[2:]) == "€"


def test_a_stop_string_counts_once_it_ends_past_the_first_min_tokens():
    """vLLM's example (its test_min_tokens_with_stop, here a token a byte): "e" in the first 8 tokens, " is Lee,",
    does not stop the text; the next does. A stop string may begin within them and end past them."""
    text = list(b" is Lee, and I'm a student")
    assert Detokenizer(ByteTokenizer(), ("e",)).push(text, finished=True) == " is L"
    assert Detokenizer(ByteTokenizer(), ("e",), min_tokens=8).push(text, finished=True) == " is Lee, and I'm a stud"
    assert Detokenizer(ByteTokenizer(), ("Lee",), min_tokens=6).push(text, finished=True) == " is "
    d = Detokenizer(ByteTokenizer(), ("Lee",), min_tokens=7)
    assert d.push(text, finished=True) == " is Lee, and I'm a student" and not d.stopped


def _stream(
    token_ids: list[int], sizes: list[int], stop: tuple[str, ...], include: bool, min_tokens: int
) -> tuple[str, str | None]:
    """The text sent and the stop string found, pushing ``token_ids`` in chunks of ``sizes`` (then the rest)."""
    detokenizer = Detokenizer(ByteTokenizer(), stop, include_stop_str_in_output=include, min_tokens=min_tokens)
    sent, start = "", 0
    for size in [*sizes, len(token_ids)]:
        end = min(start + size, len(token_ids))
        sent += detokenizer.push(token_ids[start:end], finished=end == len(token_ids))
        start = end
        if end == len(token_ids):
            break
    assert detokenizer.text == sent and detokenizer.stopped == (detokenizer.stop_reason is not None)
    return sent, detokenizer.stop_reason


@given(
    text=st.text(alphabet=ALPHABET, max_size=24),
    stop=st.lists(st.text(alphabet=ALPHABET, min_size=1, max_size=4), max_size=3).map(tuple),
    sizes=st.lists(st.integers(1, 5), max_size=12),
    include=st.booleans(),
    min_tokens=st.integers(0, 8),
)
@example(
    text="abcd", stop=("abc", "b"), sizes=[1], include=False, min_tokens=0
)  # "b" ends first: "a", however they come
@example(text="User:", stop=(":", "User:"), sizes=[], include=False, min_tokens=0)  # both end at ":": the longer
@example(text="abab", stop=("b",), sizes=[], include=False, min_tokens=2)  # the first "b" is in the first 2 tokens
def test_the_text_and_its_stop_string_do_not_depend_on_how_the_tokens_arrive(text, stop, sizes, include, min_tokens):
    token_ids = list(text.encode())
    sent, stop_reason = _stream(token_ids, sizes, stop, include, min_tokens)
    assert (sent, stop_reason) == _stream(token_ids, [1] * len(token_ids), stop, include, min_tokens)
    assert (sent, stop_reason) == _stream(token_ids, [], stop, include, min_tokens)  # all at once
    # The characters the first min_tokens tokens complete: no stop string may end within them
    free = len(bytes(token_ids[:min_tokens]).decode("utf-8", errors="ignore"))
    ends = [i + len(s) for s in stop for i in range(len(text)) if text.startswith(s, i) and i + len(s) > free]
    if stop_reason is None:
        assert sent == text and not ends
        return
    # The text ends before the first stop string to end past them (after it, with include_stop_str_in_output);
    # of two that end at one character, the text keeps neither.
    assert text.startswith(sent + ("" if include else stop_reason))
    kept = sent[: -len(stop_reason)] if include else sent
    end = len(kept) + len(stop_reason)
    assert end == min(ends)
    assert not any(text[:end].endswith(s) and len(s) > len(stop_reason) for s in stop)
