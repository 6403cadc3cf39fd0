"""Multi-turn conversations in a workload spec: sessions whose turn k resends the system prompt and
turns 1..k-1 with their answers, closed loop per session with a think time."""

from __future__ import annotations

import pytest

from helpers import llama7b_cost
from sloserve.core.errors import ConfigError
from sloserve.sched import make_scheduler
from sloserve.sim import simulate
from sloserve.workload import build_workload, load_workload_spec, parse_workload_spec
from sloserve.workload.build import synthetic_prompts


def _spec(**conversations):
    source = {"trace": "sharegpt", "turns": [2, 5], "think_time_s": 3.0, "system_prompt_tokens": 300}
    source.update(conversations)
    stream = {"name": "chat", "source": {"conversations": source}, "arrival": {"process": "poisson", "rate": 2}}
    return parse_workload_spec({"name": "chat", "streams": [{**stream, "num_requests": 120}]}, origin="chat.yaml")


def test_turns_resend_their_history_and_wait_for_the_turn_before():
    workload = build_workload(_spec(), seed=3, context_len=4096)
    assert len(workload.requests) == 120
    assert workload.chains and all(len(batch) == 1 for chain in workload.chains for batch in chain)
    for chain in workload.chains:
        turns = [batch[0] for batch in chain]
        first = turns[0]
        assert first.arrival_time < float("inf") and first.think_time_s == 0
        assert first.prompt_blocks.segment_ids[0] == 0 and first.prompt_blocks.segment_ends[0] == 300
        for before, turn in zip(turns, turns[1:]):
            assert turn.arrival_time == float("inf") and turn.think_time_s == 3.0  # released by the simulator
            # its prompt: the turn before's prompt and answer, then a new message
            assert turn.num_prompt_tokens > before.num_prompt_tokens + before.true_output_tokens
            history = before.prompt_blocks
            assert turn.prompt_blocks.segment_ids[: len(history.segment_ids)] == history.segment_ids
            assert turn.prompt_blocks.segment_ends[: len(history.segment_ends)] == history.segment_ends
            assert turn.num_prompt_tokens + turn.true_output_tokens <= 4096
    sessions = [chain[0][0].prompt_blocks.segment_ids[1] for chain in workload.chains]
    assert len(set(sessions)) == len(sessions)  # every session's messages are its own


def test_a_session_ends_at_the_first_turn_past_the_context():
    workload = build_workload(_spec(turns=[8, 8], system_prompt_tokens=1000), seed=0, context_len=2048)
    lengths = [len(chain) for chain in workload.chains]
    assert min(lengths) < 8  # some sessions stopped early
    assert all(r.num_prompt_tokens + r.true_output_tokens <= 2048 for r in workload.requests)


def test_the_next_turn_arrives_a_think_time_after_the_answer_and_finds_its_history_cached():
    workload = load_workload_spec("chat-sessions")
    built = build_workload(workload, seed=1, context_len=4096, num_requests=300)
    result = simulate(
        built.requests,
        lambda: make_scheduler("vllm", kv_capacity_tokens=400_000, max_model_len=4096, enable_prefix_caching=True),
        llama7b_cost(),
        chains=built.chains,
    )
    assert all(r.is_finished for r in result.requests)
    for chain in built.chains:
        for (before,), (turn,) in zip(chain, chain[1:]):
            assert turn.arrival_time == pytest.approx(before.finish_time + 5.0)
            # everything the turn before computed (its prompt and all but its last answer token), in whole blocks
            computed = before.num_prompt_tokens + before.true_output_tokens - 1
            assert turn.num_cached_tokens >= computed // 16 * 16
    hit = sum(r.num_cached_tokens for r in result.requests) / sum(r.num_prompt_tokens for r in result.requests)
    assert hit > 0.5


def test_a_turns_prompt_tokens_are_its_prompt_and_resend_the_turn_before():
    """The tokens the engine's ``run`` and ``bench-serve`` send: a turn's content reaches over the answer
    it gets (the next turn finds those blocks), but its prompt is the prompt alone (all of the content was
    sent: an engine got each answer as part of its prompt, and a context-long turn was refused)."""
    built = build_workload(_spec(), seed=3, context_len=4096)
    prompts = synthetic_prompts(built.requests, 512, seed=0)
    for r, tokens in zip(built.requests, prompts, strict=True):
        assert len(tokens) == r.num_prompt_tokens
    by_id = {r.request_id: tokens for r, tokens in zip(built.requests, prompts, strict=True)}
    for chain in built.chains:
        for (before,), (turn,) in zip(chain, chain[1:]):
            assert by_id[turn.request_id][: before.num_prompt_tokens] == by_id[before.request_id]


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"turns": [4, 2]}, r"source\.conversations\.turns must have lo <= hi, got \[4, 2\]"),
        ({"think_time_s": -1}, r"source\.conversations\.think_time_s must be >= 0, got -1"),
        ({"trace": "nope"}, r"unknown trace 'nope'"),
    ],
)
def test_bad_conversation_fields_are_one_error(change, message):
    with pytest.raises(ConfigError, match=message):
        _spec(**change)


def test_a_system_prompt_longer_than_the_context_is_an_error():
    with pytest.raises(ConfigError, match="system_prompt_tokens 5000 leaves no room in the model's context of 4096"):
        build_workload(_spec(system_prompt_tokens=5000), seed=0, context_len=4096)
