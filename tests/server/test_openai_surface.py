"""The OpenAI surface that evaluation, RL, agent and chat clients use, through the ``openai`` SDK against a
real server on loopback: logprobs against transformers' log-softmax, echo with ``max_tokens`` 0 over a
list of prompts (lm-eval's loglikelihood request), ``n`` and ``best_of``, penalties against a hand
computation, structured output validated with jsonschema."""

from __future__ import annotations

import asyncio
import json
import random
import re
import socket
import time

import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")
openai = pytest.importorskip("openai")

import httpx  # noqa: E402

from served_model import MODEL, Server, start_order_by_priority  # noqa: E402
from sloserve.bench.client import request_body  # noqa: E402
from sloserve.core.request import Request  # noqa: E402
from sloserve.engine.tokenizer import HFTokenizer  # noqa: E402

PROMPTS = ["Hello world", "The quick brown fox jumps over"]
HI = [{"role": "user", "content": "hi"}]


@pytest.fixture(scope="module")
def server(chat_model_dir):
    s = Server(chat_model_dir, max_queued_requests=16)
    yield s
    s.stop()


@pytest.fixture(scope="module")
def hf(chat_model_dir):
    model = transformers.AutoModelForCausalLM.from_pretrained(chat_model_dir, dtype=torch.float32).eval()
    tokenizer = transformers.AutoTokenizer.from_pretrained(chat_model_dir)
    return model, tokenizer


def hf_greedy(hf, prompt_ids: list[int], num_tokens: int) -> tuple[list[int], torch.Tensor]:
    """transformers' greedy tokens after ``prompt_ids`` (EOS ignored) and the log-softmax at every
    position of prompt + output: row p is the distribution of token p + 1."""
    model, _ = hf
    with torch.no_grad():
        out = model.generate(
            torch.tensor([prompt_ids]), max_new_tokens=num_tokens, min_new_tokens=num_tokens, do_sample=False
        )
        ids = out[0].tolist()
        logprobs = torch.log_softmax(model(out).logits[0].float(), dim=-1)
    return ids[len(prompt_ids) :], logprobs


def token_text(hf, token_id: int) -> str:
    return hf[1].decode([token_id])


def test_completion_logprobs_equal_transformers_streamed_or_not(server, hf):
    prompt_ids = hf[1].encode(PROMPTS[1])
    output_ids, expected = hf_greedy(hf, prompt_ids, 8)
    kwargs = dict(
        model=MODEL, prompt=PROMPTS[1], max_tokens=8, temperature=0, logprobs=3, extra_body={"ignore_eos": True}
    )
    whole = server.client.completions.create(**kwargs).choices[0].logprobs
    chunks = list(server.client.completions.create(**kwargs, stream=True))
    streamed = {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}
    for chunk in chunks:
        for key in streamed:
            streamed[key] += getattr(chunk.choices[0].logprobs, key)
    assert whole.tokens == streamed["tokens"] == [token_text(hf, t) for t in output_ids]
    assert whole.text_offset == streamed["text_offset"]
    assert whole.text_offset == [sum(len(t) for t in whole.tokens[:i]) for i in range(len(whole.tokens))]
    for i, token in enumerate(output_ids):
        row = expected[len(prompt_ids) - 1 + i]
        assert whole.token_logprobs[i] == pytest.approx(float(row[token]), abs=1e-4)
        assert streamed["token_logprobs"][i] == pytest.approx(whole.token_logprobs[i], abs=1e-4)
        values, ids = row.topk(3)
        top = whole.top_logprobs[i]
        # the 3 likeliest, and the sampled token (greedy: one of them)
        assert top == pytest.approx({token_text(hf, t): v for t, v in zip(ids.tolist(), values.tolist())}, abs=1e-4)


def test_chat_logprobs_in_openai_shape(server, hf):
    messages = [{"role": "user", "content": "Hello world"}]
    response = server.client.chat.completions.create(
        model=MODEL, messages=messages, max_tokens=6, temperature=0, logprobs=True, top_logprobs=2
    )
    rendered = hf[1].apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    prompt_ids = hf[1].encode(rendered, add_special_tokens=False)
    content = response.choices[0].logprobs.content
    output_ids, expected = hf_greedy(hf, prompt_ids, len(content))
    for i, (item, token) in enumerate(zip(content, output_ids, strict=True)):
        assert item.token == token_text(hf, token) and item.bytes == list(item.token.encode())
        row = expected[len(prompt_ids) - 1 + i]
        assert item.logprob == pytest.approx(float(row[token]), abs=1e-4)
        assert [t.logprob for t in item.top_logprobs] == pytest.approx(row.topk(2).values.tolist(), abs=1e-4)
    plain = server.client.chat.completions.create(model=MODEL, messages=messages, max_tokens=6, temperature=0)
    assert plain.choices[0].logprobs is None and plain.choices[0].message.content == response.choices[0].message.content


def test_echo_with_max_tokens_0_scores_each_prompt_as_lm_eval_asks(server, hf):
    """lm-eval's loglikelihood request: a list of prompts, echo, logprobs, max_tokens 0."""
    response = server.client.completions.create(model=MODEL, prompt=PROMPTS, max_tokens=0, echo=True, logprobs=1)
    assert [c.index for c in response.choices] == [0, 1]
    for choice, prompt in zip(response.choices, PROMPTS, strict=True):
        ids = hf[1].encode(prompt)
        _, expected = hf_greedy(hf, ids, 1)
        assert choice.text == prompt and choice.finish_reason == "length"
        logprobs = choice.logprobs
        assert logprobs.tokens == [token_text(hf, t) for t in ids]
        assert logprobs.token_logprobs[0] is None and logprobs.top_logprobs[0] is None
        for p in range(1, len(ids)):
            assert logprobs.token_logprobs[p] == pytest.approx(float(expected[p - 1, ids[p]]), abs=1e-4)
            assert len(logprobs.top_logprobs[p]) in (1, 2)  # the likeliest token, and the prompt's own
    assert response.usage.completion_tokens == 0
    assert response.usage.prompt_tokens == sum(len(hf[1].encode(p)) for p in PROMPTS)
    # echo with a completion: the prompt, then the completion, in the text and in the logprobs
    full = server.client.completions.create(
        model=MODEL, prompt=PROMPTS[0], max_tokens=4, echo=True, logprobs=0, temperature=0
    ).choices[0]
    alone = server.client.completions.create(model=MODEL, prompt=PROMPTS[0], max_tokens=4, temperature=0).choices[0]
    assert full.text == PROMPTS[0] + alone.text
    assert len(full.logprobs.tokens) == len(hf[1].encode(PROMPTS[0])) + 4 or full.finish_reason == "stop"
    streamed = server.client.completions.create(
        model=MODEL, prompt=PROMPTS[0], max_tokens=4, echo=True, temperature=0, stream=True
    )
    assert "".join(c.choices[0].text for c in streamed) == full.text


def test_vllms_prompt_logprobs_equal_transformers_with_their_ranks(server, hf):
    """vLLM's ``prompt_logprobs: k``: for each prompt token after the first, by token id, its logprob and
    rank in transformers' log-softmax and the k likeliest tokens' (completions: each choice; chat: the
    response); asked with echo's logprobs, each shows as many as it asked for. Not streamed (a 400)."""
    ids = hf[1].encode(PROMPTS[1])
    _, expected = hf_greedy(hf, ids, 1)
    response = server.client.completions.create(
        model=MODEL, prompt=ids, max_tokens=1, echo=True, logprobs=1, extra_body={"prompt_logprobs": 3}
    )
    choice = response.model_dump()["choices"][0]
    shown = choice["prompt_logprobs"]
    assert len(shown) == len(ids) and shown[0] is None
    for p in range(1, len(ids)):
        row = expected[p - 1]
        rank = int((row > row[ids[p]]).sum()) + 1
        assert shown[p][str(ids[p])]["rank"] == rank
        assert shown[p][str(ids[p])]["logprob"] == pytest.approx(float(row[ids[p]]), abs=1e-4)
        assert shown[p][str(ids[p])]["decoded_token"] == token_text(hf, ids[p])
        best = row.topk(3)
        top = {t: v for t, v in shown[p].items() if v["rank"] <= 3}
        assert sorted(int(t) for t in top) == sorted(best.indices.tolist())
        assert len(shown[p]) == 3 + (rank > 3)  # the prompt's own token, where it is not among them
        assert len(choice["logprobs"]["top_logprobs"][p]) in (1, 2)  # echo's logprobs: 1 asked
    chat = server.client.chat.completions.create(
        model=MODEL, messages=HI, max_tokens=1, extra_body={"prompt_logprobs": 0}
    ).model_dump()
    assert len(chat["prompt_logprobs"]) == chat["usage"]["prompt_tokens"] and chat["prompt_logprobs"][0] is None
    assert all(len(entry) == 1 for entry in chat["prompt_logprobs"][1:])
    with pytest.raises(openai.BadRequestError, match="prompt_logprobs cannot be streamed"):
        server.client.completions.create(
            model=MODEL, prompt="hi", max_tokens=1, stream=True, extra_body={"prompt_logprobs": 1}
        )


def test_vllms_truncate_prompt_tokens_and_tokens_as_token_ids(server, hf):
    """``truncate_prompt_tokens: k`` reads the prompt's last k tokens (echo shows their text), as if
    sent alone, or its first k with ``truncation_side: right``; ``return_tokens_as_token_ids`` names
    logprobs' tokens ``token_id:N``."""
    ids = hf[1].encode(PROMPTS[1])
    common = dict(model=MODEL, max_tokens=4, temperature=0, logprobs=1)
    cut = server.client.completions.create(
        **common, prompt=PROMPTS[1], echo=True, extra_body={"truncate_prompt_tokens": 3}
    ).choices[0]
    alone = server.client.completions.create(**common, prompt=ids[-3:]).choices[0]
    assert cut.text == hf[1].decode(ids[-3:]) + alone.text
    assert cut.logprobs.tokens[3:] == alone.logprobs.tokens
    first = server.client.completions.create(
        **common, prompt=PROMPTS[1], echo=True, extra_body={"truncate_prompt_tokens": 3, "truncation_side": "right"}
    ).choices[0]
    alone = server.client.completions.create(**common, prompt=ids[:3]).choices[0]
    assert first.text == hf[1].decode(ids[:3], skip_special_tokens=True) + alone.text  # (echo: the text, no <s>)
    chat = server.client.chat.completions.create(model=MODEL, messages=HI, max_tokens=1,
                                                 extra_body={"truncate_prompt_tokens": 2})  # fmt: skip
    assert chat.usage.prompt_tokens == 2
    as_ids = server.client.completions.create(
        **common, prompt=ids, extra_body={"return_tokens_as_token_ids": True, "prompt_logprobs": 1, "ignore_eos": True}
    ).model_dump()["choices"][0]
    assert as_ids["logprobs"]["tokens"] == [f"token_id:{t}" for t in hf_greedy(hf, ids, 4)[0]]
    assert all(set(top) <= {f"token_id:{t}" for t in range(300)} for top in as_ids["logprobs"]["top_logprobs"])
    assert as_ids["prompt_logprobs"][1][str(ids[1])]["decoded_token"] == f"token_id:{ids[1]}"
    chat = server.client.chat.completions.create(model=MODEL, messages=HI, max_tokens=2, logprobs=True,
                                                 extra_body={"return_tokens_as_token_ids": True})  # fmt: skip
    assert all(c.token.startswith("token_id:") for c in chat.choices[0].logprobs.content)
    for bad, message in ((0, "must be >= 1, or -1"), (300, r"\(300\) is above the model's context \(256 tokens\)")):
        with pytest.raises(openai.BadRequestError, match=message) as e:
            server.client.completions.create(**common, prompt=ids, extra_body={"truncate_prompt_tokens": bad})
        assert e.value.body["param"] == "truncate_prompt_tokens"


def test_vllms_return_token_ids_give_each_choices_tokens_and_its_prompts(server, hf):
    """``return_token_ids``: a completion choice's ``token_ids`` (the tokens its logprobs name) and its prompt's
    ``prompt_token_ids``; chat's prompt ids are the response's (what /tokenize reads); streamed, each chunk's
    tokens, the prompt's in a choice's first chunk (chat: the role chunk); beam search's beams too."""
    ids = hf[1].encode(PROMPTS[1])
    common = dict(model=MODEL, max_tokens=5, temperature=0)
    extra = {"return_token_ids": True, "ignore_eos": True}
    whole = server.client.completions.create(
        **common, prompt=[ids, ids[:4]], n=2, logprobs=0, extra_body={**extra, "return_tokens_as_token_ids": True}
    ).model_dump()
    for choice in whole["choices"]:
        assert choice["token_ids"] == [int(t.removeprefix("token_id:")) for t in choice["logprobs"]["tokens"]]
        assert choice["prompt_token_ids"] == (ids if choice["index"] < 2 else ids[:4])
    chunks = [
        c.model_dump() for c in server.client.completions.create(**common, prompt=ids, stream=True, extra_body=extra)
    ]
    assert [t for c in chunks for t in c["choices"][0]["token_ids"]] == whole["choices"][0]["token_ids"]
    assert [c["choices"][0].get("prompt_token_ids") for c in chunks] == [ids] + [None] * (len(chunks) - 1)
    chat = server.client.chat.completions.create(**common, messages=HI, extra_body=extra).model_dump()
    tokenized = httpx.post(server.url + "/tokenize", json={"messages": HI}).json()["tokens"]
    assert chat["prompt_token_ids"] == tokenized and len(chat["choices"][0]["token_ids"]) == 5
    streamed = [
        c.model_dump()
        for c in server.client.chat.completions.create(**common, messages=HI, stream=True, extra_body=extra)
    ]
    assert streamed[0]["prompt_token_ids"] == tokenized and all("prompt_token_ids" not in c for c in streamed[1:])
    assert [t for c in streamed[1:] for t in c["choices"][0]["token_ids"]] == chat["choices"][0]["token_ids"]
    beams = server.client.completions.create(**common, prompt=ids, n=2, extra_body={**extra, "use_beam_search": True})
    for choice in beams.model_dump()["choices"]:
        assert choice["prompt_token_ids"] == ids and len(choice["token_ids"]) == 5
    plain = server.client.completions.create(**common, prompt=ids).model_dump()["choices"][0]
    assert "token_ids" not in plain and "prompt_token_ids" not in plain


def test_vllms_request_id_names_the_response(server):
    """vLLM's ``request_id`` (the ``X-Request-Id`` header first): the response's id is ``cmpl-<it>`` (chat:
    ``chatcmpl-<it>``), every streamed chunk's too; without either, an id of its own each time."""
    common = dict(model=MODEL, max_tokens=2, temperature=0)
    assert (
        server.client.completions.create(**common, prompt="hi", extra_body={"request_id": "job-7"}).id == "cmpl-job-7"
    )
    header = {"X-Request-Id": "trace-1"}
    both = server.client.completions.create(
        **common, prompt="hi", extra_body={"request_id": "job-7"}, extra_headers=header
    )
    assert both.id == "cmpl-trace-1"
    chunks = list(server.client.chat.completions.create(**common, messages=HI, stream=True, extra_headers=header))
    assert {c.id for c in chunks} == {"chatcmpl-trace-1"}
    beams = server.client.completions.create(
        **common, prompt="hi", n=2, extra_body={"use_beam_search": True, "request_id": "b"}
    )
    assert beams.id == "cmpl-b"
    ids = {server.client.completions.create(**common, prompt="hi").id for _ in range(2)}
    assert len(ids) == 2 and all(i.startswith("cmpl-") for i in ids)


def test_n_choices_are_sequences_of_their_own(server):
    greedy = server.client.completions.create(
        model=MODEL, prompt=PROMPTS[1], max_tokens=8, temperature=0, n=3, logprobs=0
    )
    assert [c.index for c in greedy.choices] == [0, 1, 2]
    assert len({c.text for c in greedy.choices}) == 1
    prompt_tokens = greedy.usage.prompt_tokens
    assert greedy.usage.completion_tokens == sum(len(c.logprobs.tokens) for c in greedy.choices)  # each choice counts
    kwargs = dict(model=MODEL, prompt=PROMPTS[1], max_tokens=12, temperature=1.0, seed=7, n=3)
    first = server.client.completions.create(**kwargs)
    again = server.client.completions.create(**kwargs)
    assert [c.text for c in first.choices] == [c.text for c in again.choices]
    assert len({c.text for c in first.choices}) > 1  # each choice draws from its own seed
    assert first.usage.prompt_tokens == prompt_tokens  # counted once per prompt
    # two prompts x two choices, streamed: each chunk names its choice; the texts are the unstreamed ones
    kwargs = dict(model=MODEL, prompt=PROMPTS, max_tokens=6, temperature=1.0, seed=3, n=2)
    whole = server.client.completions.create(**kwargs)
    texts = ["", "", "", ""]
    for chunk in server.client.completions.create(**kwargs, stream=True):
        texts[chunk.choices[0].index] += chunk.choices[0].text
    assert texts == [c.text for c in whole.choices]
    chat = server.client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "Hi"}], max_tokens=5, temperature=0, n=2
    )
    assert [c.index for c in chat.choices] == [0, 1] and chat.choices[0].message.content == chat.choices[
        1
    ].message.content


def test_any_int64_seed_is_served_and_the_engine_goes_on(server):
    """OpenAI's seeds are int64: a negative one samples a stream of its own, the same each time (it
    stopped the engine process: numpy takes non-negative seeds), and one outside int64 is a 400."""
    kwargs = dict(model=MODEL, prompt=PROMPTS[1], max_tokens=8, temperature=1.0)
    texts = {seed: server.client.completions.create(**kwargs, seed=seed).choices[0].text for seed in (-1, -(2**63))}
    assert texts[-1] == server.client.completions.create(**kwargs, seed=-1).choices[0].text
    with pytest.raises(openai.BadRequestError, match="seed"):
        server.client.completions.create(**kwargs, seed=2**63)
    assert server.client.completions.create(**kwargs, seed=7).usage.completion_tokens == 8


def test_choices_of_one_prompt_share_its_cached_blocks(server):
    hits = server.metric("sloserve_prefix_cache_hits_total", replica="0")
    long_prompt = " ".join(["serving language models"] * 12)
    server.client.completions.create(model=MODEL, prompt=long_prompt, max_tokens=2, temperature=0, n=4)
    # the last three choices find the first one's full blocks (16 tokens each) in the cache
    assert server.metric("sloserve_prefix_cache_hits_total", replica="0") - hits >= 3 * 16


def test_best_of_returns_the_choices_with_the_highest_cumulative_logprob(server):
    common = dict(model=MODEL, prompt=PROMPTS[0], max_tokens=6, temperature=1.0, seed=11, logprobs=0)
    candidates = server.client.completions.create(**common, n=4).choices
    best = server.client.completions.create(**common, n=2, best_of=4)
    ranked = sorted(candidates, key=lambda c: sum(c.logprobs.token_logprobs), reverse=True)
    assert [c.text for c in best.choices] == [c.text for c in ranked[:2]]
    assert [c.index for c in best.choices] == [0, 1]
    assert best.usage.completion_tokens == sum(len(c.logprobs.tokens) for c in candidates)  # all 4 were computed


@pytest.mark.parametrize(
    ("route", "body", "param"),
    [
        ("completions", {"prompt": "hi", "n": 2, "best_of": 1}, "best_of"),
        ("completions", {"prompt": "hi", "best_of": 3, "stream": True}, "best_of"),
        ("completions", {"prompt": "hi", "max_tokens": 0}, "max_tokens"),
        ("completions", {"prompt": ["a", "b", "c"], "n": 8}, "n"),  # 24 sequences; the server queues 16
        # and beams: 20, never queued (it was a 429, "retry later", on an idle server)
        ("completions", {"prompt": ["a", "b"], "n": 10, "use_beam_search": True}, "n"),
        ("completions", {"prompt": ["a", ""]}, "prompt"),
        ("completions", {"prompt": "hi", "logprobs": 21}, "logprobs"),
        ("chat", {"messages": [{"role": "user", "content": "hi"}], "top_logprobs": 2}, "top_logprobs"),
        ("chat", {"messages": [{"role": "user", "content": "hi"}], "n": 129}, "n"),
        ("completions", {"prompt": "hi", "logit_bias": {"x": 1}}, "logit_bias"),
        ("completions", {"prompt": "hi", "logit_bias": {"100000": 1}}, "logit_bias"),
        ("completions", {"prompt": "hi", "presence_penalty": 3}, "presence_penalty"),
        ("completions", {"prompt": "hi", "max_tokens": 4, "min_tokens": 5}, "min_tokens"),
        ("completions", {"prompt": "hi", "stop_token_ids": [300]}, "stop_token_ids"),
        # a union's refusal names the field, not its first member ("prompt.str: Input should be a valid string")
        ("completions", {"prompt": [1.5]}, "prompt"),
        ("completions", {"prompt": [[1, 2], [-1]]}, "prompt"),
        ("completions", {"prompt": "hi", "stop": [1]}, "stop"),
        ("completions", {"prompt": "hi", "top_k": -2}, "top_k"),
        ("chat", {"messages": HI, "min_p": 1.5}, "min_p"),
        # add_generation_prompt is true by default
        ("chat", {"messages": [{"role": "assistant", "content": "hi"}], "continue_final_message": True},
         "continue_final_message"),
        ("chat", {"messages": HI, "continue_final_message": True, "add_generation_prompt": False},
         "continue_final_message"),
        ("chat", {"messages": HI, "chat_template_kwargs": {"messages": []}}, "chat_template_kwargs"),
        ("completions", {"prompt": "hi", "use_beam_search": True, "stop": "x"}, "stop"),
        ("completions", {"prompt": "hi", "allowed_token_ids": []}, "allowed_token_ids"),
        ("completions", {"prompt": "hi", "allowed_token_ids": [3, 300]}, "allowed_token_ids"),
        ("completions", {"prompt": "hi", "bad_words": ["w"] * 10_001}, "bad_words"),  # MAX_BAD_WORDS
        ("chat", {"messages": HI, "guided_whitespace_pattern": " "}, "guided_whitespace_pattern"),
        ("chat", {"messages": HI, "priority": 5}, "priority"),
        ("chat", {"messages": HI, "functions": [{"name": "f"}]}, "functions"),  # OpenAI's former tools
        # vLLM's newer extensions this server does not serve: refused, not ignored
        ("completions", {"prompt": "hi", "logprobs": 1, "logprob_token_ids": [3]}, "logprob_token_ids"),
        ("chat", {"messages": HI, "repetition_detection": {"max_pattern_size": 4}}, "repetition_detection"),
        ("chat", {"messages": HI, "thinking_token_budget": 64}, "thinking_token_budget"),
        ("completions", {"prompt": "hi", "truncation_side": "middle"}, "truncation_side"),
    ],
)  # fmt: skip
def test_choices_and_logprobs_out_of_range_are_400s_naming_the_field(server, route, body, param):
    client = server.client.chat.completions if route == "chat" else server.client.completions
    standard = {"prompt", "messages", "n", "best_of", "stream", "max_tokens", "logprobs", "top_logprobs",
                "logit_bias", "presence_penalty"}  # fmt: skip
    with pytest.raises(openai.BadRequestError) as e:
        client.create(
            model=MODEL,
            **{k: v for k, v in body.items() if k in standard},
            extra_body={k: v for k, v in body.items() if k not in standard},
        )
    assert e.value.body["param"] == param, e.value.body
    assert server.engine.num_unfinished == 0


def test_chat_content_as_text_parts_is_the_same_text_and_other_parts_are_400s_naming_them(server):
    def chat(content):
        return server.client.chat.completions.create(
            model=MODEL, messages=[{"role": "user", "content": content}], max_tokens=4, temperature=0
        )

    parts = [{"type": "text", "text": "Hello "}, {"type": "text", "text": "world"}]
    assert chat(parts).choices[0].message.content == chat("Hello world").choices[0].message.content
    image = {"type": "image_url", "image_url": {"url": "https://example.com/cat.png"}}
    for content, message in (
        ([parts[0], image], "content part 1 is of type 'image_url': this server takes text parts only"),
        (["Hello"], 'content part 0 must be an object {"type": "text", "text": "..."}'),
        ([{"type": "text"}], 'content part 0 needs its "text" as a string'),
    ):
        with pytest.raises(openai.BadRequestError) as e:
            chat(content)
        assert e.value.body["param"] == "messages.0.content", e.value.body
        assert e.value.body["message"] == f"messages.0.content: {message}"


def test_penalties_and_logit_bias_change_tokens_as_computed_by_hand(server, hf):
    """Greedy under frequency, presence and repetition penalties and a logit bias, against the same
    formulas applied by hand to transformers' scores at each step (vLLM's definitions)."""
    model, tokenizer = hf
    prompt_ids = tokenizer.encode(PROMPTS[1])
    frequency, presence, repetition, bias = 0.8, 0.5, 1.3, {5: 3.0, 7: -100.0}
    ids = list(prompt_ids)
    with torch.no_grad():
        for _ in range(10):
            scores = model(torch.tensor([ids])).logits[0, -1].float()
            for token, b in bias.items():
                scores[token] += b
            output = ids[len(prompt_ids) :]
            for token in set(ids):
                scores[token] = scores[token] / repetition if scores[token] > 0 else scores[token] * repetition
            for token in set(output):
                scores[token] -= frequency * output.count(token) + presence
            ids.append(int(scores.argmax()))
    by_hand = ids[len(prompt_ids) :]
    response = server.client.completions.create(
        model=MODEL, prompt=prompt_ids, max_tokens=10, temperature=0, logprobs=0, frequency_penalty=frequency,
        presence_penalty=presence, logit_bias={str(t): b for t, b in bias.items()},
        extra_body={"repetition_penalty": repetition, "ignore_eos": True},
    )  # fmt: skip
    assert response.choices[0].logprobs.tokens == [token_text(hf, t) for t in by_hand]
    plain, _ = hf_greedy(hf, prompt_ids, 10)
    assert plain != by_hand  # the controls did change the tokens


def test_allowed_token_ids_restrict_greedy_and_sampled_tokens(server, hf):
    """vLLM's ``allowed_token_ids``: greedy takes the likeliest allowed token at each step (by hand on
    transformers' scores), and sampled choices draw allowed tokens only."""
    model, tokenizer = hf
    prompt_ids = tokenizer.encode(PROMPTS[1])
    plain, _ = hf_greedy(hf, prompt_ids, 1)
    allowed = [t for t in (40, 41, 42, 60, 61, plain[0] + 1) if t != plain[0]]
    ids = list(prompt_ids)
    with torch.no_grad():
        for _ in range(6):
            scores = model(torch.tensor([ids])).logits[0, -1].float()
            ids.append(allowed[int(scores[allowed].argmax())])
    common = dict(model=MODEL, prompt=prompt_ids, max_tokens=6, logprobs=0)
    greedy = server.client.completions.create(**common, temperature=0, extra_body={"allowed_token_ids": allowed})
    assert greedy.choices[0].logprobs.tokens == [token_text(hf, t) for t in ids[len(prompt_ids) :]]
    sampled = server.client.completions.create(
        **common, temperature=1.5, n=4, seed=1, extra_body={"allowed_token_ids": allowed}
    )
    texts = {token_text(hf, t) for t in allowed}
    assert all(set(c.logprobs.tokens) <= texts for c in sampled.choices)


def test_bad_words_as_computed_by_hand(server, hf):
    """vLLM's ``bad_words``: greedy where each word's last token is barred after its other tokens
    (the words tokenized alone and after a space), by hand on transformers' scores."""
    model, tokenizer = hf
    prompt_ids = tokenizer.encode(PROMPTS[1])
    plain, _ = hf_greedy(hf, prompt_ids, 10)
    words = [tokenizer.decode(plain[:2]).strip(), tokenizer.decode(plain[4:5]).strip()]
    sequences = []
    for word in words:
        alone = tokenizer.encode(word, add_special_tokens=False)
        spaced = tokenizer.encode(" " + word, add_special_tokens=False)
        sequences += [alone] + ([spaced] if spaced[0] != alone[0] and len(spaced) == len(alone) else [])
    ids = list(prompt_ids)
    with torch.no_grad():
        for _ in range(10):
            scores = model(torch.tensor([ids])).logits[0, -1].float()
            output = ids[len(prompt_ids) :]
            for seq in sequences:
                if len(seq) == 1 or output[len(output) - len(seq) + 1 :] == seq[:-1]:
                    scores[seq[-1]] = -torch.inf
            ids.append(int(scores.argmax()))
    by_hand = ids[len(prompt_ids) :]
    assert by_hand != plain
    response = server.client.completions.create(
        model=MODEL, prompt=prompt_ids, max_tokens=10, temperature=0, logprobs=0,
        extra_body={"bad_words": words, "ignore_eos": True},
    )  # fmt: skip
    assert response.choices[0].logprobs.tokens == [token_text(hf, t) for t in by_hand]


def test_top_k_and_min_p_sample_only_the_tokens_they_keep(server):
    """vLLM's ``top_k`` and ``min_p`` (sent as ``extra_body``, as vLLM's clients do): every sampled
    token is among the ``top_k`` likeliest at its position (the raw logprobs rank them: temperature
    keeps the order), where the same seeds without ``top_k`` draw others; ``top_k`` 1 or ``min_p`` 1
    is greedy at any temperature."""
    common = dict(model=MODEL, messages=[{"role": "user", "content": PROMPTS[1]}], max_tokens=8, temperature=1.5,
                  seed=5, n=4, logprobs=True, top_logprobs=3)  # fmt: skip

    def outside_top3(extra: dict) -> int:
        """Sampled tokens less likely than the third likeliest."""
        choices = server.client.chat.completions.create(**common, extra_body=extra).choices
        return sum(t.logprob < t.top_logprobs[2].logprob for c in choices for t in c.logprobs.content)

    assert outside_top3({}) > 0 and outside_top3({"top_k": 3}) == 0
    greedy = server.client.chat.completions.create(**{**common, "temperature": 0, "n": 1}).choices[0]
    for extra in ({"top_k": 1}, {"min_p": 1.0}):
        sampled = server.client.chat.completions.create(**common, extra_body=extra).choices
        assert [c.message.content for c in sampled] == [greedy.message.content] * 4, extra


def test_min_tokens_and_stop_token_ids(server, hf):
    """``stop_token_ids`` ends a request on that token; ``min_tokens`` keeps it (and EOS) from being
    sampled before, as computed by hand on transformers' scores."""
    model, tokenizer = hf
    prompt_ids = tokenizer.encode(PROMPTS[0])
    plain, _ = hf_greedy(hf, prompt_ids, 8)
    stop = plain[2]
    common = dict(model=MODEL, prompt=prompt_ids, max_tokens=8, temperature=0, logprobs=0)
    stopped = server.client.completions.create(**common, extra_body={"stop_token_ids": [stop]}).choices[0]
    assert stopped.finish_reason == "stop" and len(stopped.logprobs.tokens) == plain.index(stop) + 1
    assert stopped.stop_reason == stop  # vLLM's: the token it stopped on
    assert stopped.text == "".join(stopped.logprobs.tokens[:-1])  # its text left out (vLLM's rule)
    kept = server.client.completions.create(
        **common, extra_body={"stop_token_ids": [stop], "include_stop_str_in_output": True}
    ).choices[0]
    assert kept.text == "".join(kept.logprobs.tokens) and kept.text.endswith(token_text(hf, stop))
    last = list(server.client.completions.create(**common, stream=True, extra_body={"stop_token_ids": [stop]}))[-1]
    assert (last.choices[0].finish_reason, last.choices[0].stop_reason) == ("stop", stop)
    eos = tokenizer.eos_token_id
    forced = server.client.completions.create(
        **common, logit_bias={str(eos): 100}, extra_body={"stop_token_ids": [eos]}
    )
    assert forced.choices[0].finish_reason == "stop" and forced.choices[0].stop_reason is None  # EOS is no stop token
    assert server.client.completions.create(**common).choices[0].stop_reason is None
    ids = list(prompt_ids)
    with torch.no_grad():
        while len(ids) - len(prompt_ids) < 8 and (len(ids) == len(prompt_ids) or ids[-1] != stop):
            scores = model(torch.tensor([ids])).logits[0, -1].float()
            if len(ids) - len(prompt_ids) < 6:
                scores[[stop, tokenizer.eos_token_id]] = -torch.inf
            ids.append(int(scores.argmax()))
    held = server.client.completions.create(**common, extra_body={"stop_token_ids": [stop], "min_tokens": 6}).choices[0]
    assert held.logprobs.tokens == [token_text(hf, t) for t in ids[len(prompt_ids) :]]
    assert len(held.logprobs.tokens) >= 6


def test_vllms_unserved_fields_at_their_unused_values_are_served(server):
    """A client that sends vLLM's extensions at their defaults (some always do) is served; another
    value is a 400 naming the field (above)."""
    unused = {"use_beam_search": False, "length_penalty": 1.0, "bad_words": [], "guided_json": None, "priority": 0,
              "spaces_between_special_tokens": True, "some_field_of_another_server": 3}  # fmt: skip
    response = server.client.completions.create(model=MODEL, prompt="hi", max_tokens=2, extra_body=unused)
    assert response.usage.completion_tokens == 2


def test_fields_sent_as_null_take_their_defaults_and_an_empty_stop_string_is_a_400(server):
    """OpenAI's API lets ``temperature``, ``top_p``, ``n``, ``stream`` and the penalties (and completions'
    ``echo``) be null, and clients send it (the SDK sends a None it is handed): each is its default, as
    vLLM reads it. An empty stop string is a 400 naming ``stop``, as vLLM's (it ended nothing here)."""
    nulls = dict(temperature=None, top_p=None, n=None, stream=None, presence_penalty=None, frequency_penalty=None)
    kwargs = dict(model=MODEL, max_tokens=6, seed=3)

    def texts(response) -> list[str]:
        return [c.text if hasattr(c, "text") else c.message.content for c in response.choices]

    plain = server.client.completions.create(**kwargs, prompt=PROMPTS[1])
    nulled = server.client.completions.create(**kwargs, prompt=PROMPTS[1], **nulls, echo=None,
                                              extra_body={"repetition_penalty": None})  # fmt: skip
    assert texts(nulled) == texts(plain)
    plain = server.client.chat.completions.create(**kwargs, messages=HI)
    assert texts(server.client.chat.completions.create(**kwargs, messages=HI, **nulls)) == texts(plain)
    common = dict(model=MODEL, input="hi", max_output_tokens=6, extra_body={"seed": 3})
    nulled = server.client.responses.create(**common, temperature=None, top_p=None, stream=None)
    assert nulled.output_text == server.client.responses.create(**common).output_text
    for stop in ("", ["\n", ""]):
        with pytest.raises(openai.BadRequestError) as e:
            server.client.completions.create(**kwargs, prompt=PROMPTS[1], stop=stop)
        assert e.value.body["param"] == "stop" and "empty" in e.value.message


def test_vllms_stop_string_and_special_token_options(server, hf):
    """``include_stop_str_in_output`` keeps the stop string at the end of the text; ``skip_special_tokens``
    false shows special tokens in it (here EOS, forced by a logit bias past ``ignore_eos``)."""
    common = dict(model=MODEL, prompt=PROMPTS[1], max_tokens=16, temperature=0)
    full = server.client.completions.create(**common, extra_body={"ignore_eos": True}).choices[0].text
    stop = full[len(full) // 2 : len(full) // 2 + 2]
    assert stop.strip(), full
    for stream in (False, True):
        extra = {"ignore_eos": True, "include_stop_str_in_output": True}
        response = server.client.completions.create(**common, stop=["never", stop], stream=stream, extra_body=extra)
        chunks = list(response) if stream else [response]
        text = "".join(c.choices[0].text for c in chunks)
        assert text == full[: full.index(stop) + len(stop)], stream
        assert chunks[-1].choices[0].stop_reason == stop  # vLLM's: the stop string it stopped on
        chat = server.client.chat.completions.create(
            model=MODEL,
            messages=HI,
            max_tokens=16,
            temperature=0,
            stop=[stop],
            stream=stream,
            extra_body={"ignore_eos": True},
        )
        chunks = list(chat) if stream else [chat]
        assert chunks[-1].choices[0].stop_reason == (stop if chunks[-1].choices[0].finish_reason == "stop" else None)
    eos = hf[1].eos_token_id
    forced = dict(model=MODEL, prompt=PROMPTS[0], max_tokens=3, temperature=0, logit_bias={str(eos): 100})
    shown = server.client.completions.create(**forced, extra_body={"ignore_eos": True, "skip_special_tokens": False})
    assert shown.choices[0].text == hf[1].eos_token * 3
    assert server.client.completions.create(**forced, extra_body={"ignore_eos": True}).choices[0].text == ""
    # the token that stops a request (EOS, a stop token) is in its tokens, not in its text (vLLM's rule),
    # unless include_stop_str_in_output; skip_special_tokens false shows no EOS that ended it
    ended = dict(model=MODEL, prompt=PROMPTS[0], max_tokens=8, temperature=0, logprobs=0, logit_bias={str(eos): 100})
    for stream in (False, True):
        for keep in (False, True):
            extra = {"min_tokens": 2, "skip_special_tokens": False, "include_stop_str_in_output": keep}
            response = server.client.completions.create(**ended, stream=stream, extra_body=extra)
            chunks = list(response) if stream else [response]
            tokens = [t for c in chunks for t in (c.choices[0].logprobs.tokens if c.choices[0].logprobs else [])]
            assert len(tokens) == 3 and tokens[-1] == hf[1].eos_token and chunks[-1].choices[0].finish_reason == "stop"
            assert "".join(c.choices[0].text for c in chunks) == "".join(tokens[: 3 if keep else 2])


PERSON = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 8},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "tags": {"type": "array", "items": {"enum": ["a", "b", "c"]}, "maxItems": 3},
        "ok": {"type": "boolean"},
    },
    "required": ["name", "age", "ok"],
    "additionalProperties": False,
}


def test_json_schema_outputs_always_validate(server):
    """50 random prompts, sampled at temperature 1 (a random model: no text it would write by itself is
    JSON): every output parses and validates against the schema."""
    jsonschema = pytest.importorskip("jsonschema")
    words = " ".join(PROMPTS).split()
    rng = random.Random(0)
    response_format = {"type": "json_schema", "json_schema": {"name": "person", "schema": PERSON}}

    async def one(i: int):
        prompt = " ".join(rng.choice(words) for _ in range(rng.randint(1, 8)))
        return await server.async_client.chat.completions.create(
            model=MODEL, messages=[{"role": "user", "content": prompt}], max_tokens=96, temperature=1.0, seed=i,
            response_format=response_format,
        )  # fmt: skip

    async def all_of_them():
        # NOTE: 8 at a time: the server queues 16 requests
        limit = asyncio.Semaphore(8)

        async def limited(i: int):
            async with limit:
                return await one(i)

        return await asyncio.gather(*(limited(i) for i in range(50)))

    for response in asyncio.run(all_of_them()):
        choice = response.choices[0]
        assert choice.finish_reason == "stop", choice.message.content
        jsonschema.validate(json.loads(choice.message.content), PERSON)
    # any JSON object: those that close within max_tokens parse as objects
    closed = 0
    for seed in range(6):
        choice = server.client.completions.create(
            model=MODEL, prompt="Hello", max_tokens=48, temperature=1.0, seed=seed,
            extra_body={"response_format": {"type": "json_object"}},
        ).choices[0]  # fmt: skip
        if choice.finish_reason == "stop":
            closed += 1
            assert isinstance(json.loads(choice.text), dict)
        else:
            assert choice.text.startswith("{")
    assert closed > 0


def test_vllms_structured_outputs_choice_regex_grammar_and_json(server):
    """vLLM's ``structured_outputs`` (and its older ``guided_*`` fields): every sampled output, at
    temperature 1 from a random model, is one of the choices, matches the regex whole, is a sentence
    of the Lark grammar, or validates against the schema."""
    jsonschema = pytest.importorskip("jsonschema")
    choices = ["positive", "negative", 'a "quoted"\nanswer', "ünïcode"]
    common = dict(model=MODEL, prompt=PROMPTS[0], max_tokens=24, temperature=1.0, seed=3, n=6)

    def outputs(extra: dict) -> list[str]:
        answer = server.client.completions.create(**common, extra_body=extra).choices
        assert all(c.finish_reason == "stop" for c in answer), [c.text for c in answer]
        return [c.text for c in answer]

    for extra in ({"structured_outputs": {"choice": choices}}, {"guided_choice": choices}):
        assert set(outputs(extra)) <= set(choices)
    regex = r"[0-9]{2,4}-[a-z]{1,3}"
    for extra in ({"structured_outputs": {"regex": regex}}, {"guided_regex": regex}):
        assert all(re.fullmatch(regex, text) for text in outputs(extra))
    grammar = 'start: item ("," item)*\nitem: "x" | "yy"'
    assert all(re.fullmatch(r"(x|yy)(,(x|yy))*", text) for text in outputs({"guided_grammar": grammar}))
    for extra in ({"structured_outputs": {"json": PERSON}}, {"guided_json": json.dumps(PERSON)}):
        common["max_tokens"] = 96
        for text in outputs(extra):
            jsonschema.validate(json.loads(text), PERSON)


@pytest.mark.parametrize(
    ("extra", "param", "message"),
    [
        ({"guided_regex": "("}, "guided_regex", "the regular expression cannot be compiled: .*unclosed group"),
        ({"structured_outputs": {"grammar": "start: foo"}}, "structured_outputs", 'unknown name: "foo"'),
        ({"guided_regex": "a\\"}, "guided_regex", "ends with a backslash that escapes nothing"),  # llguidance: "a"
        ({"structured_outputs": {}}, "structured_outputs",
         "take one of json, regex, choice, grammar or json_object; got 0"),
        ({"structured_outputs": {"json_object": False}}, "structured_outputs", "take one of .*; got 0"),
        ({"guided_choice": []}, "guided_choice", "at least one string"),
        ({"guided_json": "{not json"}, "guided_json", "the JSON schema is not valid JSON"),
        ({"response_format": {"type": "json_object"}, "guided_regex": "a"}, "guided_regex",
         "one structured output per request: response_format and guided_regex"),
        ({"structured_outputs": {"choice": ["a"], "regex": "a"}}, "structured_outputs", "take one of .*; got 2"),
        ({"structured_outputs": {"choices": ["a"]}}, "structured_outputs.choices", "Extra inputs are not permitted"),
        # valid grammars that llguidance cannot build over this tokenizer (the engine failed on them: a 500)
        ({"guided_grammar": "start: <[5000]>"}, "guided_grammar",
         "cannot be used with this model's tokenizer: .*Token range end too large: 5000"),
        ({"guided_grammar": "start: <|nope|>"}, "guided_grammar", 'unknown special token: "<\\|nope\\|>"'),
    ],
)  # fmt: skip
def test_structured_outputs_that_cannot_be_served_are_400s_naming_the_field(server, extra, param, message):
    with pytest.raises(openai.BadRequestError) as e:
        server.client.completions.create(model=MODEL, prompt="hi", max_tokens=4, extra_body=extra)
    assert e.value.body["param"] == param and re.search(message, e.value.message), e.value.body
    assert "\n" not in e.value.message


def test_a_schema_the_grammar_library_refuses_is_a_400_naming_it(server):
    with pytest.raises(openai.BadRequestError) as e:
        server.client.chat.completions.create(
            model=MODEL, messages=[{"role": "user", "content": "hi"}], max_tokens=4,
            response_format={"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "strange"}}},
        )  # fmt: skip
    assert e.value.body["param"] == "response_format" and "strange" in e.value.message
    assert server.engine.num_unfinished == 0


WEATHER = {
    "type": "object",
    "properties": {"city": {"type": "string", "maxLength": 12}, "unit": {"type": "string", "enum": ["c", "f"]}},
    "required": ["city", "unit"],
    "additionalProperties": False,
}
ZONE = {"type": "object", "properties": {"zone": {"type": "integer", "minimum": -12, "maximum": 14}},
        "required": ["zone"], "additionalProperties": False}  # fmt: skip
TOOLS = [
    {"type": "function", "function": {"name": "get_weather", "description": "The weather", "parameters": WEATHER}},
    {"type": "function", "function": {"name": "get_time", "parameters": ZONE}},
    {"type": "function", "function": {"name": "ping"}},  # no parameters: {}
]
SCHEMAS = {"get_weather": WEATHER, "get_time": ZONE, "ping": {"type": "object", "maxProperties": 0}}  # no arguments


def streamed_message(server, **request) -> tuple[str | None, list[tuple[str, str]], str]:
    """A streamed chat answer put together as a client does: content, (name, arguments) of each call,
    finish reason; every call's first chunk has its id, type and name."""
    content, calls, reason = [], {}, None
    for chunk in server.client.chat.completions.create(**request, stream=True):
        delta = chunk.choices[0].delta
        content.append(delta.content or "")
        for entry in delta.tool_calls or ():
            if entry.index not in calls:
                mistral = len(entry.id) == 9 and entry.id.isalnum()  # under --tool-call-parser mistral
                assert (entry.id.startswith("call_") or mistral) and entry.type == "function" and entry.function.name
                calls[entry.index] = [entry.function.name, ""]
            calls[entry.index][1] += entry.function.arguments or ""
        reason = chunk.choices[0].finish_reason or reason
    return "".join(content) or None, [tuple(calls[i]) for i in sorted(calls)], reason


def message_calls(message) -> list[tuple[str, str]]:
    return [(c.function.name, c.function.arguments) for c in message.tool_calls or ()]


def test_named_and_required_tool_calls_always_validate_streamed_or_not(server):
    """tool_choice naming a function, or "required": at temperature 1 from a random model, every call
    is one of the tools with arguments that validate against its parameters (vLLM's guided schemas);
    ``parallel_tool_calls: false`` makes one. Greedy, the streamed message is the whole one."""
    jsonschema = pytest.importorskip("jsonschema")
    common = dict(model=MODEL, messages=HI, tools=TOOLS, max_tokens=160)
    named = {"type": "function", "function": {"name": "get_time"}}
    answer = server.client.chat.completions.create(**common, tool_choice=named, temperature=1.0, seed=1, n=6)
    for choice in answer.choices:
        assert choice.finish_reason == "stop" and choice.message.content is None  # called as asked: "stop"
        [(name, arguments)] = message_calls(choice.message)
        assert name == "get_time"
        jsonschema.validate(json.loads(arguments), ZONE)
    names, most = set(), 0
    for parallel, seed in ((None, 2), (False, 3)):
        answer = server.client.chat.completions.create(
            **common, tool_choice="required", temperature=1.0, seed=seed, n=6,
            **({} if parallel is None else {"parallel_tool_calls": parallel}),
        )  # fmt: skip
        for choice in answer.choices:
            calls = message_calls(choice.message)
            assert len(calls) >= 1 and (parallel is None or len(calls) == 1)
            assert len({c.id for c in choice.message.tool_calls}) == len(calls)
            if choice.finish_reason == "length":  # the array did not close: its closed calls, and the text
                assert parallel is None and choice.message.content.startswith('[{"name": ')
            else:
                assert choice.finish_reason == "tool_calls" and choice.message.content is None
            for name, arguments in calls:
                names.add(name)
                jsonschema.validate(json.loads(arguments), SCHEMAS[name])
            most = max(most, len(calls))
    assert len(names) > 1 and most > 1  # the model's choice, not always the first tool; parallel calls
    for choice in (named, "required"):
        whole = server.client.chat.completions.create(**common, tool_choice=choice, temperature=0).choices[0]
        streamed = streamed_message(server, **common, tool_choice=choice, temperature=0)
        assert streamed == (whole.message.content, message_calls(whole.message), whole.finish_reason)


def test_tools_and_earlier_calls_reach_the_chat_template_as_transformers_renders_them(server, hf):
    """The tools, an assistant's calls (arguments sent as JSON text, given to the template as an object,
    as vLLM does) and a tool's answer: the tokens /tokenize reads and a chat request's prompt_tokens
    are transformers' ``apply_chat_template`` of the same conversation; tool_choice "none" answers text."""
    call = {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Oslo"}'}}
    messages = [*HI, {"role": "assistant", "content": None, "tool_calls": [call]},
                {"role": "tool", "tool_call_id": "call_1", "content": "-3 C"}]  # fmt: skip
    as_transformers = [*HI, {"role": "assistant", "content": "", "tool_calls": [
        {**call, "function": {"name": "get_weather", "arguments": {"city": "Oslo"}}}]}, messages[2]]  # fmt: skip
    expected = hf[1].apply_chat_template(as_transformers, tools=TOOLS, add_generation_prompt=True, tokenize=False)
    assert '"arguments": {"city": "Oslo"}' in expected and '["get_weather","get_time","ping"]' in expected
    expected_ids = hf[1].encode(expected, add_special_tokens=False)
    tokens = httpx.post(server.url + "/tokenize", json={"messages": messages, "tools": TOOLS}).json()["tokens"]
    assert tokens == expected_ids
    answer = server.client.chat.completions.create(
        model=MODEL, messages=messages, tools=TOOLS, tool_choice="none", max_tokens=4, temperature=0
    )
    assert answer.usage.prompt_tokens == len(expected_ids)
    assert answer.choices[0].message.tool_calls is None and isinstance(answer.choices[0].message.content, str)


HERMES_BLOCK = (
    r'<tool_call>\n\{"name": "get_weather", "arguments": \{"city": "[a-z]{1,6}", "unit": "c"\}\}\n</tool_call>'
)


def test_vllms_priority_needs_a_scheduler_that_orders_by_it_and_then_goes_first(server, chat_model_dir):
    """``priority`` other than 0 is a 400 naming it on an FCFS server (vLLM's rule); under
    ``--set waiting_order=priority`` (one request at a time here) the requests that queue behind a
    running one start by priority, the lower first, then arrival; bench-serve sends a workload's."""
    with pytest.raises(openai.BadRequestError) as e:
        server.client.completions.create(model=MODEL, prompt="hi", max_tokens=2, extra_body={"priority": 1})
    assert e.value.body["param"] == "priority" and "waiting_order=priority" in e.value.message
    with pytest.raises(openai.BadRequestError) as e:  # once served, then logged where no replay could read it
        server.client.completions.create(model=MODEL, prompt="hi", max_tokens=2, extra_body={"priority": 10**30})
    assert e.value.body["param"] == "priority" and "less than or equal to 1000000000" in e.value.message
    ordered = Server(chat_model_dir, scheduler_options={"waiting_order": "priority", "max_num_seqs": 1})
    try:
        assert start_order_by_priority(ordered) == ["high", "mid", "low-a", "low-b"]
    finally:
        ordered.stop()
    # bench-serve sends a workload request's priority (vLLM's field), none at 0
    assert request_body(MODEL, Request(0, 0.0, 4, 2, 2, priority=-1), "hi")["priority"] == -1
    assert "priority" not in request_body(MODEL, Request(0, 0.0, 4, 2, 2), "hi")


def test_chat_echo_puts_the_last_message_before_the_answer_when_it_is_in_the_answers_role(server):
    """vLLM's chat ``echo``: an assistant message the model goes on with (``continue_final_message``)
    comes back before what it wrote, streamed or not; a user's last message is not echoed."""
    begun = [*HI, {"role": "assistant", "content": "Well,"}]
    going_on = {"add_generation_prompt": False, "continue_final_message": True}
    common = dict(model=MODEL, messages=begun, max_tokens=4, temperature=0, n=2)
    plain = server.client.chat.completions.create(**common, extra_body=going_on)
    echoed = server.client.chat.completions.create(**common, extra_body={**going_on, "echo": True})
    assert [c.message.content for c in echoed.choices] == ["Well," + c.message.content for c in plain.choices]
    assert (echoed.usage.prompt_tokens, echoed.usage.completion_tokens) == (plain.usage.prompt_tokens,
                                                                            plain.usage.completion_tokens)  # fmt: skip
    streamed = ["", ""]
    for chunk in server.client.chat.completions.create(**common, stream=True, extra_body={**going_on, "echo": True}):
        for choice in chunk.choices:
            streamed[choice.index] += choice.delta.content or ""
    assert streamed == [c.message.content for c in echoed.choices]
    asked = dict(model=MODEL, messages=HI, max_tokens=4, temperature=0)
    assert (server.client.chat.completions.create(**asked, extra_body={"echo": True}).choices[0].message.content
            == server.client.chat.completions.create(**asked).choices[0].message.content)  # fmt: skip


DOCUMENTS_TEMPLATE = """{% for d in documents or [] %}[{{ d.title }}] {{ d.text }}
{% endfor %}{% for m in messages %}<|{{ m.role }}|>{{ m.content }}{% endfor %}
{% if add_generation_prompt %}<|assistant|>{% endif %}"""


def test_documents_and_a_requests_own_chat_template_render_as_transformers_renders_them(server, chat_model_dir, hf):
    """``documents`` reach the template (transformers' ``documents``); a request's ``chat_template`` is a
    400 unless the server trusts its clients with one (``--trust-request-chat-template``, vLLM's rule),
    and then renders the chat: /tokenize and a chat request's prompt_tokens read transformers' tokens."""
    documents = [{"title": "Oslo", "text": "-3 C"}, {"title": "Rome", "text": "18 C"}]
    body = {"messages": HI, "documents": documents, "chat_template": DOCUMENTS_TEMPLATE}
    refused = httpx.post(server.url + "/tokenize", json=body)
    assert refused.status_code == 400 and refused.json()["error"]["param"] == "chat_template"
    assert "--trust-request-chat-template" in refused.json()["error"]["message"]
    trusting = Server(chat_model_dir, trust_request_chat_template=True)
    try:
        expected = hf[1].apply_chat_template(HI, documents=documents, chat_template=DOCUMENTS_TEMPLATE,
                                             add_generation_prompt=True, tokenize=False)  # fmt: skip
        assert expected.startswith("[Oslo] -3 C\n[Rome] 18 C\n<|user|>hi")
        expected_ids = hf[1].encode(expected, add_special_tokens=False)
        assert httpx.post(trusting.url + "/tokenize", json=body).json()["tokens"] == expected_ids
        answer = trusting.client.chat.completions.create(
            model=MODEL, messages=HI, max_tokens=2, extra_body={"documents": documents, "chat_template": DOCUMENTS_TEMPLATE}
        )  # fmt: skip
        assert answer.usage.prompt_tokens == len(expected_ids)
        broken = httpx.post(trusting.url + "/tokenize", json={**body, "chat_template": "{% if %}"})
        assert broken.status_code == 400 and broken.json()["error"]["param"] == "chat_template"
        failing = httpx.post(
            trusting.url + "/v1/chat/completions", json={**body, "model": MODEL, "chat_template": "{{ 1 / 0 }}"}
        )
        assert failing.status_code == 400 and "ZeroDivisionError" in failing.json()["error"]["message"]
    finally:
        trusting.stop()


EFFORT_TEMPLATE = """{% for m in messages %}<|{{ m.role }}|>{{ m.content }}{% endfor %}
Reasoning: {{ reasoning_effort | default("medium") }}
{% if add_generation_prompt %}<|assistant|>{% endif %}"""


def test_reasoning_effort_is_the_chat_templates_variable(chat_model_dir, hf):
    """OpenAI's ``reasoning_effort`` (a Responses request's ``reasoning.effort``) is the chat template's variable
    of that name, as gpt-oss's template reads it (here the server's ``--chat-template``); ``chat_template_kwargs``
    naming it win; another value is a 400 naming it."""
    server = Server(chat_model_dir, chat_template=EFFORT_TEMPLATE)
    try:
        for level in ("low", "high"):
            expected = hf[1].apply_chat_template(HI, chat_template=EFFORT_TEMPLATE, reasoning_effort=level,
                                                 add_generation_prompt=True, tokenize=False)  # fmt: skip
            assert expected.endswith(f"Reasoning: {level}\n<|assistant|>")
            expected_ids = hf[1].encode(expected, add_special_tokens=False)
            tokenized = httpx.post(server.url + "/tokenize", json={"messages": HI, "reasoning_effort": level}).json()
            assert tokenized["tokens"] == expected_ids
            answer = server.client.chat.completions.create(
                model=MODEL, messages=HI, max_tokens=2, reasoning_effort=level
            )
            assert answer.usage.prompt_tokens == len(expected_ids)
            response = server.client.responses.create(
                model=MODEL, input=HI, max_output_tokens=2, reasoning={"effort": level}
            )
            assert response.usage.input_tokens == len(expected_ids) and response.reasoning.effort == level
        kwargs_win = {"messages": HI, "reasoning_effort": "low", "chat_template_kwargs": {"reasoning_effort": "high"}}
        assert httpx.post(server.url + "/tokenize", json=kwargs_win).json()["tokens"] == expected_ids
        wrong = httpx.post(server.url + "/tokenize", json={"messages": HI, "reasoning_effort": "extreme"})
        assert wrong.status_code == 400 and wrong.json()["error"]["param"] == "reasoning_effort"
    finally:
        server.stop()


TOOL_TEMPLATE = """{% for m in messages %}<|{{ m.role }}|>{{ m.content }}{{ eos_token }}{% endfor %}
{% if tools %}<|tools|>{% for t in tools %}{{ t.function.name }};{% endfor %}{% endif %}
{% if add_generation_prompt %}<|assistant|>{% endif %}"""


def test_auto_tool_choice_parses_hermes_blocks_streamed_or_not(chat_model_dir, hf, tmp_path):
    """With --tool-call-parser hermes, tool_choice "auto" finds the <tool_call> blocks the model writes
    (forced here by a regex: a random model writes none): the text before them is the content, the
    finish reason "tool_calls"; streamed or not alike. Without a block, or with tool_choice "none",
    the answer is the text. The server's --chat-template (a file) renders the chat, as transformers
    renders that template."""
    (tmp_path / "tools.jinja").write_text(TOOL_TEMPLATE)
    server = Server(chat_model_dir, tool_call_parser="hermes", chat_template=str(tmp_path / "tools.jinja"))
    try:
        rendered = hf[1].apply_chat_template(HI, tools=TOOLS, chat_template=TOOL_TEMPLATE, tokenize=False,
                                             add_generation_prompt=True)  # fmt: skip
        assert rendered.endswith("<|tools|>get_weather;get_time;ping;<|assistant|>")
        tokens = httpx.post(server.url + "/tokenize", json={"messages": HI, "tools": TOOLS}).json()["tokens"]
        assert tokens == hf[1].encode(rendered, add_special_tokens=False)
        block = HERMES_BLOCK
        common = dict(model=MODEL, messages=HI, tools=TOOLS, max_tokens=160, temperature=0)
        regex = {"structured_outputs": {"regex": r"Checking\.\n" + block}}
        whole = server.client.chat.completions.create(**common, extra_body=regex).choices[0]
        assert whole.finish_reason == "tool_calls" and whole.message.content == "Checking."
        [(name, arguments)] = message_calls(whole.message)
        assert name == "get_weather" and json.loads(arguments)["unit"] == "c"
        assert streamed_message(server, **common, extra_body=regex) == ("Checking.", [(name, arguments)], "tool_calls")
        plain = {"structured_outputs": {"regex": r"No call: <tool"}}  # what may begin a tag comes at the end
        for extra in (plain, {"tool_choice": "none", **regex}):
            choice = server.client.chat.completions.create(**common, extra_body=extra).choices[0]
            assert choice.finish_reason == "stop" and choice.message.tool_calls is None
            text = choice.message.content
            assert text == "No call: <tool" if extra is plain else text.startswith("Checking.\n<tool_call>")
            assert streamed_message(server, **common, extra_body=extra) == (text, [], "stop")
        # "auto" with hermes keeps special tokens in the text, where some vocabularies have the tags (vLLM's)
        bos = hf[1].bos_token_id
        forced = dict(model=MODEL, messages=HI, tools=TOOLS, max_tokens=2, logit_bias={str(bos): 100},
                      extra_body={"ignore_eos": True})  # fmt: skip
        assert server.client.chat.completions.create(**forced).choices[0].message.content == hf[1].bos_token * 2
        assert not server.client.chat.completions.create(**forced, tool_choice="none").choices[0].message.content
    finally:
        server.stop()


SCORE = {"type": "object", "properties": {"score": {"type": "integer", "minimum": 0, "maximum": 99}},
         "required": ["score"], "additionalProperties": False}  # fmt: skip


@pytest.mark.parametrize(("parser", "thought"), [("deepseek_r1", ["Ser", "The"]), ("qwen3", ["<think>", "Ser"])])
def test_a_reasoning_models_structured_output_holds_from_the_token_after_its_thinking(
    thinking_model_dir, parser, thought
):
    """Under --reasoning-parser, a JSON schema holds from the token after ``</think>`` (vLLM's rule): the
    thinking before it is free. Forced here by logit_bias and repetition_penalty (the biased tokens in
    turn, then ``</think>``, a token of this vocabulary as of DeepSeek-R1's and Qwen3's); the answer
    is whatever the random model writes within the schema. Streamed or not alike; the same request
    to /v1/completions (no reasoning) is JSON from its first token, which none of those tokens is. Tool
    calls (``--tool-call-parser hermes``) are looked for in the answer. ``include_reasoning: false`` leaves
    the thinking out."""
    jsonschema = pytest.importorskip("jsonschema")
    tokenizer = HFTokenizer(thinking_model_dir / "tokenizer.json")
    [close] = tokenizer.encode("</think>", add_special_tokens=False)
    forced = [*(tokenizer.encode(t, add_special_tokens=False) for t in thought), [close]]
    assert all(len(ids) == 1 for ids in forced)
    # 100, 95, 90: each sampled token is divided by 1.5 (to at most 67) and the next biased one wins
    bias = {str(ids[0]): 100 - 5 * i for i, ids in enumerate(forced)}
    common = dict(model=MODEL, max_tokens=40, temperature=0, logit_bias=bias,
                  extra_body={"repetition_penalty": 1.5, "structured_outputs": {"json": SCORE}})  # fmt: skip
    server = Server(thinking_model_dir, reasoning_parser=parser, tool_call_parser="hermes")
    try:
        whole = server.client.chat.completions.create(messages=HI, **common).choices[0]
        reasoning = "".join(t for t in thought if t != "<think>")
        assert whole.finish_reason == "stop" and whole.message.reasoning_content == reasoning
        jsonschema.validate(json.loads(whole.message.content), SCORE)
        deltas = [c.choices[0].delta for c in server.client.chat.completions.create(messages=HI, stream=True, **common)
                  if c.choices]  # fmt: skip
        assert "".join(getattr(d, "reasoning_content", None) or "" for d in deltas) == reasoning
        assert "".join(d.content or "" for d in deltas) == whole.message.content
        # vLLM's include_reasoning: false leaves the thinking out, streamed or not; the answer is the same
        hidden = {**common, "extra_body": {**common["extra_body"], "include_reasoning": False}}
        unshown = server.client.chat.completions.create(messages=HI, **hidden).choices[0].message
        assert getattr(unshown, "reasoning_content", None) is None and unshown.content == whole.message.content
        deltas = [c.choices[0].delta for c in server.client.chat.completions.create(messages=HI, stream=True, **hidden)
                  if c.choices]  # fmt: skip
        assert not any(getattr(d, "reasoning_content", None) for d in deltas)
        assert "".join(d.content or "" for d in deltas) == whole.message.content
        plain = server.client.completions.create(prompt="hi", **common).choices[0]
        assert plain.finish_reason == "stop" and plain.text.startswith("{")
        jsonschema.validate(json.loads(plain.text), SCORE)
        # tool_choice "auto": the calls are looked for in the answer (a regex forces one here)
        regex = {"structured_outputs": {"regex": r"Ok\.\n" + HERMES_BLOCK}}
        calling = {**common, "max_tokens": 120, "extra_body": {**common["extra_body"], **regex}}
        choice = server.client.chat.completions.create(messages=HI, tools=TOOLS, **calling).choices[0]
        assert choice.message.reasoning_content == reasoning and choice.message.content == "Ok."
        [(called, _)] = message_calls(choice.message)
        assert called == "get_weather" and choice.finish_reason == "tool_calls"
        # the Responses API's logprobs: the answer's tokens, after the thinking's, streamed or not
        asked = dict(model=MODEL, input="hi", max_output_tokens=10, temperature=0, top_logprobs=1,
                     include=["message.output_text.logprobs"],
                     extra_body={"logit_bias": bias, "repetition_penalty": 1.5, "ignore_eos": True})  # fmt: skip
        response = server.client.responses.create(**asked)
        thinking, message = response.output
        assert thinking.type == "reasoning" and thinking.content[0].text == reasoning
        tokens = [lp.token for lp in message.content[0].logprobs]
        assert "".join(tokens) == response.output_text and len(tokens) == 10 - len(forced)
        with server.client.responses.stream(**asked) as stream:
            final = list(stream)[-1].response
        assert [lp.token for lp in final.output[1].content[0].logprobs] == tokens
    finally:
        server.stop()


@pytest.mark.parametrize(
    ("parser", "call", "two_calls"),
    [
        ("llama3_json", r'\{"name": "get_time", "parameters": \{"zone": [0-9]\}\}', "{call}; {call}"),
        ("pythonic", r"get_time\(zone=[0-9]\)", r"\[{call}, {call}\]"),
        ("mistral", r'get_time\{"zone": [0-9]\}', r"\[TOOL_CALLS\]{call}\[TOOL_CALLS\]{call}"),
    ],
)
def test_auto_tool_choice_parses_llama3_json_pythonic_and_mistral_calls(chat_model_dir, parser, call, two_calls):
    """``--tool-call-parser llama3_json``, ``pythonic`` and ``mistral``: an answer of two calls (forced by a
    regex) is the calls, streamed or not; one that opens with text is text."""
    server = Server(chat_model_dir, tool_call_parser=parser)
    try:
        common = dict(model=MODEL, messages=HI, tools=TOOLS, max_tokens=120, temperature=0)
        two = {"structured_outputs": {"regex": two_calls.format(call=call)}}
        whole = server.client.chat.completions.create(**common, extra_body=two).choices[0]
        calls = message_calls(whole.message)
        assert whole.finish_reason == "tool_calls" and whole.message.content is None and len(calls) == 2
        assert all(name == "get_time" and 0 <= json.loads(arguments)["zone"] <= 9 for name, arguments in calls)
        assert streamed_message(server, **common, extra_body=two) == (None, calls, "tool_calls")
        text = {"structured_outputs": {"regex": "It is " + call}}
        choice = server.client.chat.completions.create(**common, extra_body=text).choices[0]
        assert choice.finish_reason == "stop" and choice.message.content.startswith("It is ")
        assert choice.message.tool_calls is None
    finally:
        server.stop()


# As Mistral's templates do: an earlier call's id must be 9 letters and digits
MISTRAL_IDS_TEMPLATE = """{% for m in messages %}{% for c in m.tool_calls or [] %}{% if not (c.id|length == 9 and
c.id.isalnum()) %}{{ raise_exception('Tool call IDs should be alphanumeric strings with length 9!') }}{% endif %}
[TOOL_CALLS]{{ c.function.name }}{% endfor %}{{ m.content }}{% endfor %}"""


def test_mistral_call_ids_are_the_ones_its_templates_take_back(chat_model_dir, tmp_path):
    """Under ``--tool-call-parser mistral`` every call's id (auto, required, named) is 9 letters and
    digits, so a conversation that sends the calls back renders through a template that checks them."""
    (tmp_path / "mistral.jinja").write_text(MISTRAL_IDS_TEMPLATE)
    server = Server(chat_model_dir, tool_call_parser="mistral", chat_template=str(tmp_path / "mistral.jinja"))
    try:
        common = dict(model=MODEL, messages=HI, tools=TOOLS, max_tokens=64, temperature=0)
        forced = {"structured_outputs": {"regex": r'\[TOOL_CALLS\]get_time\{"zone": [0-9]\}'}}
        named = {"type": "function", "function": {"name": "get_time"}}
        answers = [server.client.chat.completions.create(**common, extra_body=forced),
                   server.client.chat.completions.create(**common, tool_choice="required", parallel_tool_calls=False),
                   server.client.chat.completions.create(**common, tool_choice=named)]  # fmt: skip
        for answer in answers:
            [call] = answer.choices[0].message.tool_calls
            assert len(call.id) == 9 and call.id.isalnum() and call.function.name == "get_time"
            back = [*HI, answer.choices[0].message.model_dump(exclude_none=True),
                    {"role": "tool", "tool_call_id": call.id, "content": "noon"}]  # fmt: skip
            assert server.client.chat.completions.create(model=MODEL, messages=back, max_tokens=2).choices
        with pytest.raises(openai.BadRequestError, match="alphanumeric strings with length 9"):
            bad = {"id": "call_1", "type": "function", "function": {"name": "get_time", "arguments": "{}"}}
            server.client.chat.completions.create(model=MODEL, max_tokens=2, messages=[
                *HI, {"role": "assistant", "tool_calls": [bad]}, {"role": "tool", "tool_call_id": "call_1", "content": "x"}])  # fmt: skip
    finally:
        server.stop()


@pytest.mark.parametrize(
    ("extra", "param", "message"),
    [
        ({"tools": TOOLS}, "tool_choice", 'tool_choice "auto" .* needs the server started with --enable-auto-tool-choice'),
        ({"tool_choice": "required"}, "tool_choice", "tool_choice needs tools"),
        ({"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "nope"}}}, "tool_choice",
         "'nope', which is not one of the tools"),
        ({"tools": TOOLS, "tool_choice": "sometimes"}, "tool_choice", 'must be "none", "auto", "required" or'),
        ({"tools": [*TOOLS, TOOLS[0]], "tool_choice": "required"}, "tools", "'get_weather' is repeated"),
        ({"tools": TOOLS, "tool_choice": "required", "response_format": {"type": "json_object"}}, "tool_choice",
         "one structured output per request: response_format and tool_choice"),
        ({"tools": [{"type": "retrieval"}], "tool_choice": "none"}, "tools.0.type", "'function'"),
        ({"tools": [{"type": "function", "function": {"name": "no spaces"}}], "tool_choice": "none"},
         "tools.0.function.name", "should match pattern"),
        ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "strange"}}}],
          "tool_choice": "required"}, "tools", "cannot be compiled: .*strange"),
        ({"messages": [*HI, {"role": "assistant", "tool_calls": [{"id": "c"}]}], "tool_choice": "none"},
         "messages.1.tool_calls.0.function", "Field required"),
    ],
)  # fmt: skip
def test_tool_requests_that_cannot_be_served_are_400s_naming_the_field(server, extra, param, message):
    with pytest.raises(openai.BadRequestError) as e:
        server.client.chat.completions.create(**{"model": MODEL, "messages": HI, "max_tokens": 4, **extra})
    assert e.value.body["param"] == param and re.search(message, e.value.message), e.value.body
    assert "\n" not in e.value.message
    assert server.engine.num_unfinished == 0


def test_vllms_beam_search_returns_the_beams_of_llm_beam_search(server, reference_llm, hf):
    """``use_beam_search`` with ``n`` beams and ``length_penalty``: the choices are the beams
    ``LLM.beam_search`` finds on the same model, best first (completions over a list of prompts, and
    chat); what beam search would not honour is a 400 naming it."""
    from sloserve import BeamSearchParams

    beams = dict(n=3, max_tokens=5, extra_body={"use_beam_search": True, "length_penalty": 0.5})
    response = server.client.completions.create(model=MODEL, prompt=PROMPTS, logprobs=2, temperature=0, **beams)
    expected = reference_llm.beam_search(PROMPTS, BeamSearchParams(3, 5, length_penalty=0.5))
    assert [c.index for c in response.choices] == list(range(6))
    for choice, sequence in zip(response.choices, [s for out in expected for s in out.sequences], strict=True):
        output = sequence.tokens[len(sequence.tokens) - len(sequence.logprobs) :]
        assert choice.text == hf[1].decode(output, skip_special_tokens=True)
        assert choice.finish_reason == sequence.finish_reason
        assert sum(choice.logprobs.token_logprobs) == pytest.approx(sequence.cum_logprob, abs=1e-4)
        assert all(len(top) <= 3 for top in choice.logprobs.top_logprobs)  # 2 asked, and the token's own
    assert response.usage.completion_tokens == sum(len(s.logprobs) for out in expected for s in out.sequences)
    chat = server.client.chat.completions.create(model=MODEL, messages=HI, **beams)
    rendered = hf[1].apply_chat_template(HI, add_generation_prompt=True, tokenize=False)
    [best] = reference_llm.beam_search({"prompt_token_ids": hf[1].encode(rendered, add_special_tokens=False)},
                                       BeamSearchParams(3, 5, length_penalty=0.5))  # fmt: skip
    assert [c.message.content for c in chat.choices] == [
        hf[1].decode(s.tokens[len(s.tokens) - len(s.logprobs) :], skip_special_tokens=True) for s in best.sequences
    ]
    refused = [({"stop": ["x"]}, "stop"), ({"n": 11}, "n"),
               ({"logit_bias": {"3": 1}}, "logit_bias"), ({"response_format": {"type": "json_object"}}, "use_beam_search"),
               ({"tools": TOOLS}, "tool_choice"), ({"stop": "none"}, "stop")]  # fmt: skip
    for extra, param in refused:
        with pytest.raises(openai.BadRequestError) as e:
            server.client.chat.completions.create(
                model=MODEL, messages=HI, max_tokens=2, extra_body={"use_beam_search": True, **extra}
            )
        assert e.value.body["param"] == param, e.value.body
    with pytest.raises(openai.BadRequestError, match="length_penalty applies to beam search"):
        server.client.completions.create(model=MODEL, prompt="hi", max_tokens=2, extra_body={"length_penalty": 2})
    assert server.engine.num_unfinished == 0


def test_a_streamed_beam_search_sends_each_beam_whole_once_found(server):
    """``stream: true`` with ``use_beam_search`` (vLLM streams it so): nothing until the beams are
    found, then each choice whole in one chunk (its text, finish reason and logprobs, those of the
    non-streamed answer), the usage, ``[DONE]``; chat's choices after their role chunks."""
    beams = dict(n=2, max_tokens=4, stream_options={"include_usage": True}, extra_body={"use_beam_search": True})
    whole = server.client.completions.create(
        model=MODEL, prompt=PROMPTS, logprobs=1, **{**beams, "stream_options": None}
    )
    chunks = list(server.client.completions.create(model=MODEL, prompt=PROMPTS, logprobs=1, stream=True, **beams))
    *choices, last = chunks
    assert [c.choices[0].index for c in choices] == [c.index for c in whole.choices] == [0, 1, 2, 3]
    for chunk, choice in zip(choices, whole.choices, strict=True):
        [streamed] = chunk.choices
        assert (streamed.text, streamed.finish_reason) == (choice.text, choice.finish_reason)
        assert streamed.logprobs.tokens == choice.logprobs.tokens
    assert last.choices == [] and last.usage == whole.usage
    chat = server.client.chat.completions.create(model=MODEL, messages=HI, **{**beams, "stream_options": None})
    streamed = list(server.client.chat.completions.create(model=MODEL, messages=HI, stream=True, **beams))
    assert [c.choices[0].delta.role for c in streamed[:-1]] == ["assistant", None] * 2
    assert [c.choices[0].delta.content for c in streamed[1:-1:2]] == [c.message.content for c in chat.choices]
    assert streamed[-1].usage == chat.usage
    assert server.engine.num_unfinished == 0


@pytest.mark.parametrize("stream", [False, True])
def test_a_beam_search_whose_client_leaves_ends_there(server, stream):
    """A client that closes its connection mid-search (streamed or not, the answer comes at the end)
    ends the search: no step after it, nothing left running or holding KV."""

    def steps_done() -> float:  # one-token requests, each ended by its length
        return server.metric("sloserve_requests_total", request_class="rt", outcome="length")

    before = steps_done()
    body = json.dumps({"model": MODEL, "prompt": "Hello", "n": 10, "max_tokens": 240, "ignore_eos": True,
                       "use_beam_search": True, "stream": stream}).encode()  # fmt: skip
    head = f"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\nContent-Length: {len(body)}\r\n\r\n"
    with socket.create_connection(("127.0.0.1", server.port)) as connection:
        connection.sendall(head.encode() + body)
        deadline = time.monotonic() + 20
        while server.engine.num_unfinished == 0:  # the search has begun (240 steps of 10 requests)
            assert time.monotonic() < deadline, "the search did not start"
            time.sleep(0.01)
    # NOTE: between two steps nothing runs: the search is over once no step has ended for a second
    # (a step takes milliseconds)
    last, still_since = steps_done(), time.monotonic()
    while time.monotonic() - still_since < 1.0 or server.engine.num_unfinished > 0:
        time.sleep(0.1)
        if steps_done() != last:
            last, still_since = steps_done(), time.monotonic()
    assert server.metric("sloserve_kv_cache_used_tokens", replica="0") == 0
    assert last - before < 240 * 10 / 2  # the whole search: 2400 (1.7 s here, the client left at once)


def test_the_responses_api_answers_as_the_chat_completion_it_maps_to(server):
    """``POST /v1/responses`` (the ``openai`` SDK's ``responses.create``, ``responses.stream``): text,
    instructions and a length cut answer as the same chat completion does; streamed, the SDK's
    accumulator builds the same response from our events."""
    chat = server.client.chat.completions.create(
        model=MODEL, messages=[{"role": "system", "content": "Be brief."}, *HI], max_tokens=6, temperature=0,
        extra_body={"ignore_eos": True},
    ).choices[0]  # fmt: skip
    common = dict(model=MODEL, instructions="Be brief.", input="hi", max_output_tokens=6, temperature=0)
    response = server.client.responses.create(**common, extra_body={"ignore_eos": True})
    assert response.output_text == chat.message.content and response.usage.output_tokens == 6
    assert response.status == "incomplete" and response.incomplete_details.reason == "max_output_tokens"
    [message] = response.output
    assert message.type == "message" and message.status == "incomplete"
    with server.client.responses.stream(**common) as stream:
        events = list(stream)
    assert [e.sequence_number for e in events] == list(range(len(events)))
    assert events[0].type == "response.created" and events[-1].type in ("response.completed", "response.incomplete")
    whole = server.client.responses.create(**common)
    final = events[-1].response  # NOTE: the SDK's get_final_response() wants response.completed
    assert final.output_text == whole.output_text and final.status == whole.status


def test_responses_api_function_calls_round_trip(server):
    """Function tools (flat, the Responses shape): a required call's item validates against its
    parameters, streamed or not; sent back with its output (``function_call`` and
    ``function_call_output`` items) the conversation is the chat one with the call and the tool's answer."""
    jsonschema = pytest.importorskip("jsonschema")
    tools = [{"type": "function", "name": "get_time", "parameters": ZONE, "strict": True}]
    common = dict(model=MODEL, input="hi", tools=tools, tool_choice="required", max_output_tokens=64, temperature=0,
                  parallel_tool_calls=False)  # fmt: skip
    response = server.client.responses.create(**common)
    calls = response.output
    assert response.status == "completed" and len(calls) == 1
    assert all(c.type == "function_call" and c.name == "get_time" and c.status == "completed" for c in calls)
    for call in calls:
        jsonschema.validate(json.loads(call.arguments), ZONE)
    with server.client.responses.stream(**common) as stream:
        final = stream.get_final_response()
    assert [(o.name, o.arguments) for o in final.output] == [(c.name, c.arguments) for c in calls]
    call = calls[0]
    answered = server.client.responses.create(
        model=MODEL, tools=tools, tool_choice="none", max_output_tokens=4, temperature=0,
        input=[{"role": "user", "content": "hi"}, call.model_dump(exclude_none=True),
               {"type": "function_call_output", "call_id": call.call_id, "output": "noon"}],
    )  # fmt: skip
    as_chat = server.client.chat.completions.create(
        model=MODEL, max_tokens=4, temperature=0, tool_choice="none",
        tools=[{"type": "function", "function": {"name": "get_time", "parameters": ZONE, "strict": True}}],
        messages=[*HI, {"role": "assistant", "content": None, "tool_calls": [
            {"id": call.call_id, "type": "function", "function": {"name": "get_time", "arguments": call.arguments}}]},
            {"role": "tool", "tool_call_id": call.call_id, "content": "noon"}],
    )  # fmt: skip
    assert answered.output_text == as_chat.choices[0].message.content
    assert answered.usage.input_tokens == as_chat.usage.prompt_tokens


def test_a_function_call_output_answers_a_call_made_before_it_or_is_a_400_naming_its_call_id(server):
    """As OpenAI's Responses API: a ``function_call_output`` whose ``call_id`` no earlier ``function_call``
    made (in the input, or in the conversation of ``previous_response_id``) is refused, naming the item."""
    call = {"type": "function_call", "call_id": "call_a", "name": "get_time", "arguments": "{}"}
    tools = [{"type": "function", "name": "get_time", "parameters": ZONE}]
    common = dict(model=MODEL, tools=tools, tool_choice="none", max_output_tokens=2, temperature=0)
    answered = server.client.responses.create(
        **common, input=[{"role": "user", "content": "hi"}, call,
                         {"type": "function_call_output", "call_id": "call_a", "output": "noon"}],
    )  # fmt: skip
    assert answered.status in ("completed", "incomplete")
    plain = server.client.responses.create(model=MODEL, input="hi", max_output_tokens=2)
    for previous, input_items, field in (
        (None, [{"role": "user", "content": "hi"}, call, {"type": "function_call_output", "call_id": "call_b",
                                                          "output": "noon"}], "input.2.call_id"),
        (None, [{"type": "function_call_output", "call_id": "call_a", "output": "noon"}], "input.0.call_id"),
        (plain.id, [{"type": "function_call_output", "call_id": "call_a", "output": "noon"}], "input.0.call_id"),
    ):  # fmt: skip
        with pytest.raises(openai.BadRequestError) as e:
            server.client.responses.create(**common, input=input_items, previous_response_id=previous)
        assert e.value.body["param"] == field and "call_" in e.value.message


def test_previous_response_id_continues_a_stored_conversation_as_the_chat_that_holds_it(server):
    """An agent's loop: a response with a required call, then its output sent with only
    ``previous_response_id`` (``function_call_output``), then a text turn: each answers as the chat
    completion of the whole conversation (earlier instructions do not carry over). Streamed responses
    are stored too; ``input_items`` lists a response's own input; ``store: false`` and deleted
    responses are not found, and a chain that needs one is a 400 naming it."""
    tools = [{"type": "function", "name": "get_time", "parameters": ZONE, "strict": True}]
    chat_tools = [{"type": "function", "function": {"name": "get_time", "parameters": ZONE, "strict": True}}]
    first = server.client.responses.create(model=MODEL, input="hi", instructions="Be brief.", tools=tools,
                                           tool_choice="required", parallel_tool_calls=False, max_output_tokens=64,
                                           temperature=0)  # fmt: skip
    [call] = first.output
    assert first.store and server.client.responses.retrieve(first.id) == first
    answered = server.client.responses.create(
        model=MODEL, previous_response_id=first.id, tools=tools, tool_choice="none", max_output_tokens=4,
        temperature=0, input=[{"type": "function_call_output", "call_id": call.call_id, "output": "noon"}],
    )  # fmt: skip
    messages = [*HI, {"role": "assistant", "content": None, "tool_calls": [
        {"id": call.call_id, "type": "function", "function": {"name": "get_time", "arguments": call.arguments}}]},
        {"role": "tool", "tool_call_id": call.call_id, "content": "noon"}]  # fmt: skip
    as_chat = server.client.chat.completions.create(model=MODEL, max_tokens=4, temperature=0, tool_choice="none",
                                                    tools=chat_tools, messages=messages)  # fmt: skip
    assert answered.output_text == as_chat.choices[0].message.content
    assert answered.usage.input_tokens == as_chat.usage.prompt_tokens and answered.previous_response_id == first.id
    with server.client.responses.stream(model=MODEL, previous_response_id=answered.id, input="and now?",
                                        max_output_tokens=4, temperature=0) as stream:  # fmt: skip
        third = list(stream)[-1].response  # completed, or incomplete (cut by max_output_tokens)
    messages += [{"role": "assistant", "content": answered.output_text}, {"role": "user", "content": "and now?"}]
    as_chat = server.client.chat.completions.create(model=MODEL, max_tokens=4, temperature=0, messages=messages)
    assert third.output_text == as_chat.choices[0].message.content
    assert third.usage.input_tokens == as_chat.usage.prompt_tokens
    assert server.client.responses.retrieve(third.id).output_text == third.output_text
    [item] = server.client.responses.input_items.list(third.id).data
    assert item.type == "message" and item.role == "user" and item.content[0].text == "and now?"
    items = server.client.responses.input_items.list(first.id, order="asc").data
    assert [(i.type, i.role, i.content[0].text) for i in items] == [("message", "user", "hi")]
    # not stored, deleted: not found; a chain that needs them: a 400 naming the missing one
    unstored = server.client.responses.create(model=MODEL, input="hi", max_output_tokens=2, store=False)
    assert not unstored.store
    server.client.responses.delete(first.id)
    for gone in (unstored.id, first.id):
        with pytest.raises(openai.NotFoundError):
            server.client.responses.retrieve(gone)
    for previous, missing in ((unstored.id, unstored.id), (third.id, first.id)):
        with pytest.raises(openai.BadRequestError) as e:
            server.client.responses.create(model=MODEL, input="x", max_output_tokens=2, previous_response_id=previous)
        assert e.value.body["code"] == "previous_response_not_found" and missing in e.value.message
    assert server.client.responses.retrieve(third.id).id == third.id  # the rest of the chain is kept


def test_responses_api_logprobs_are_the_chat_logprobs_of_the_same_answer_streamed_or_not(server, hf):
    """``include: ["message.output_text.logprobs"]`` and ``top_logprobs``: the message's text holds each
    sampled token's logprob and its alternatives, as the same chat completion's ``logprobs.content`` (and
    transformers' log-softmax); streamed, the text deltas bring them token by token, and the EOS that
    ended the answer (forced here by vLLM's ``logit_bias`` and ``min_tokens``, which a Responses request
    takes as a chat one does; it has no text) comes in the text's last snapshot, and in the last delta
    only when it reached the server with the token before it (one message of the engine's, or two the
    stream read at once)."""
    asked = dict(include=["message.output_text.logprobs"], top_logprobs=2)
    common = dict(model=MODEL, input="Hello world", max_output_tokens=6, temperature=0)
    chat = server.client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "Hello world"}], max_tokens=6, temperature=0,
        logprobs=True, top_logprobs=2, extra_body={"ignore_eos": True},
    ).choices[0].logprobs.content  # fmt: skip
    whole = server.client.responses.create(**common, **asked, extra_body={"ignore_eos": True})
    [text] = whole.output[0].content
    assert [t.token for t in text.logprobs] == [t.token for t in chat] and len(chat) == 6
    for ours, theirs in zip(text.logprobs, chat, strict=True):
        assert ours.bytes == list(ours.token.encode()) and ours.logprob == pytest.approx(theirs.logprob, abs=1e-4)
        assert [(t.token, t.logprob) for t in ours.top_logprobs] == [
            (t.token, pytest.approx(t.logprob, abs=1e-4)) for t in theirs.top_logprobs
        ]
    assert whole.top_logprobs == 2
    plain = server.client.responses.create(**common, extra_body={"ignore_eos": True})
    assert plain.output[0].content[0].logprobs == [] and plain.output_text == whole.output_text
    # three tokens, then the EOS: streamed, the deltas bring the three, the last snapshot all four
    eos = hf[1].eos_token_id
    ended = {"min_tokens": 3, "logit_bias": {str(eos): 100}}
    with server.client.responses.stream(**common, **asked, extra_body=ended) as stream:
        events = list(stream)
    streamed = [lp.token for e in events if e.type == "response.output_text.delta" for lp in e.logprobs]
    [done] = [e for e in events if e.type == "response.output_text.done"]
    final = [lp.token for lp in events[-1].response.output[0].content[0].logprobs]
    assert events[-1].type == "response.completed"
    assert [lp.token for lp in done.logprobs] == final and len(final) == 4 and final[-1] == token_text(hf, eos)
    assert streamed in (final[:3], final)
    again = server.client.responses.create(**common, **asked, extra_body=ended)
    assert [lp.token for lp in again.output[0].content[0].logprobs] == final and again.usage.output_tokens == 4


@pytest.mark.parametrize(
    ("extra", "param", "message"),
    [
        ({"conversation": "conv_1"}, "conversation", "send the conversation in input, or continue a response with"),
        ({"background": True}, "background", "background is not supported"),
        ({"tools": [{"type": "web_search"}]}, "tools", "tool 0 is of type 'web_search': this server runs function"),
        ({"input": []}, "input", "input is empty"),
        ({"input": [{"type": "reasoning", "summary": []}]}, "input", "input holds no message"),
        # the field in the item that is wrong, not the first branch of input's union ("input.str")
        (
            {"input": [{"role": "user", "content": [{"type": "input_text", "text": 5}]}]},
            "input.0.content.0.text",
            "- input.0.content.0.text: Input should be a valid string$",
        ),
        (
            {"input": [{"role": "user", "content": "hi"}, {"type": "message", "content": "x"}]},
            "input.1.role",
            "Field required",
        ),
        ({"tool_choice": "required"}, "tool_choice", "tool_choice needs tools"),
        (
            {"text": {"format": {"type": "json_schema", "name": "x"}}},
            "text.format",
            "text.format of type json_schema needs schema",
        ),  # (not the chat request's response_format it becomes)
        ({"max_output_tokens": 300}, "max_output_tokens", "maximum context length is 256"),
        (
            {
                "include": ["message.output_text.logprobs"],
                "tool_choice": "required",
                "tools": [{"type": "function", "name": "f", "parameters": ZONE}],
            },
            "include",
            "all text, not with tools",
        ),
        ({"include": ["message.output_text.logprob"]}, "include.0", "message.output_text.logprobs"),
        ({"top_logprobs": 21}, "top_logprobs", "20"),
        ({"extra_body": {"top_k": -2}}, "top_k", "top_k: Input should be greater than or equal to -1, got -2"),
    ],
)
def test_responses_api_requests_that_cannot_be_served_are_400s_naming_the_field(server, extra, param, message):
    with pytest.raises(openai.BadRequestError) as e:
        server.client.responses.create(**{"model": MODEL, "input": "hi", "max_output_tokens": 4, **extra})
    assert e.value.body["param"] == param and re.search(message, e.value.message), e.value.body
