"""The Responses API's store: a conversation read back oldest first across its chain, each response its
owner's, kept across restarts in a data dir and bounded in memory."""

from __future__ import annotations

import pytest

from sloserve.server.response_store import MAX_IN_MEMORY, PreviousResponseNotFound, ResponseStore


def turn(store: ResponseStore, number: int, previous: str | None, owner: str = "") -> str:
    """Store turn ``number``: input "q{number}", output "a{number}"; its id."""
    response = {"id": f"resp_{number}", "object": "response",
                "output": [{"type": "message", "role": "assistant", "content": [{"type": "output_text", "text": f"a{number}"}]}]}  # fmt: skip
    store.put(response, [{"type": "message", "role": "user", "content": f"q{number}"}], previous, owner)
    return response["id"]


def texts(items: list[dict]) -> list[str]:
    return [i["content"] if isinstance(i["content"], str) else i["content"][0]["text"] for i in items]


def test_a_conversation_is_every_turns_input_then_output_oldest_first_and_kept_in_a_data_dir(tmp_path):
    store = ResponseStore(tmp_path)
    first = turn(store, 1, None)
    second = turn(store, 2, first)
    turn(store, 3, None)  # another conversation
    assert texts(store.conversation(second, "")) == ["q1", "a1", "q2", "a2"]
    store.close()
    store = ResponseStore(tmp_path)  # a restarted server
    assert texts(store.conversation(second, "")) == ["q1", "a1", "q2", "a2"]
    assert store.get(first, "")["id"] == first and texts(store.input_items(second, "")) == ["q2"]
    assert store.delete(first, "") and not store.delete(first, "")
    with pytest.raises(PreviousResponseNotFound) as e:
        store.conversation(second, "")
    assert e.value.response_id == first
    store.close()


def test_a_response_is_its_owners_only():
    store = ResponseStore()
    mine = turn(store, 1, None, owner="alice")
    assert store.get(mine, "bob") is None and store.input_items(mine, "bob") is None
    assert not store.delete(mine, "bob") and store.get(mine, "alice") is not None
    with pytest.raises(PreviousResponseNotFound):
        store.conversation(mine, "bob")


def test_in_memory_the_newest_responses_are_kept():
    store = ResponseStore()
    previous = None
    for number in range(MAX_IN_MEMORY + 2):
        previous = turn(store, number, previous)
    assert store.get("resp_0", "") is None and store.get("resp_1", "") is None and store.get("resp_2", "") is not None
    with pytest.raises(PreviousResponseNotFound) as e:
        store.conversation(previous, "")
    assert e.value.response_id == "resp_1"
