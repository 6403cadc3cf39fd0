"""``sloserve serve`` for real: a uvicorn server on 127.0.0.1 and the official ``openai`` client.

The model is a tiny random Llama saved as a local HF directory with a trained BPE tokenizer and a
chat template, so text, chat templates and usage are exercised as with a real checkpoint.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import gc
import json
import logging
import os
import re
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")
openai = pytest.importorskip("openai")
httpx = pytest.importorskip("httpx")
uvicorn = pytest.importorskip("uvicorn")

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import sloserve
from chat_model import CORPUS
from helpers import llama7b_cost
from hf_models import VOCAB
from served_model import MODEL, Server, generate
from sloserve.bench.client import free_loopback_port, wait_until_ready
from sloserve.engine.chat_template import ChatTemplate, TemplateError
from sloserve.server.protocol import ChatCompletionRequest, CompletionRequest, DetokenizeRequest, TokenizeRequest
from sloserve.server.responses_api import ResponsesRequest
from sloserve.workload import workload_from_trace
from sloserve.workload.traces import load_trace


@pytest.fixture(scope="module")
def server(chat_model_dir, tmp_path_factory):
    s = Server(chat_model_dir, request_log=tmp_path_factory.mktemp("log") / "requests.jsonl")
    yield s
    s.stop()


def test_completions_streamed_or_not_equal_llm_generate(server, reference_llm):
    tokenizer = reference_llm.tokenizer
    for prompt in ("Hello world", "The quick brown fox", "latency and"):
        text, ids = generate(reference_llm, tokenizer.encode(prompt), 16)
        response = server.client.completions.create(model=MODEL, prompt=prompt, max_tokens=16, temperature=0)
        assert response.choices[0].text == text
        assert response.usage.prompt_tokens == len(tokenizer.encode(prompt))
        assert response.usage.completion_tokens == len(ids)
        assert response.choices[0].finish_reason == ("stop" if len(ids) < 16 else "length")
        chunks = list(
            server.client.completions.create(
                model=MODEL,
                prompt=prompt,
                max_tokens=16,
                temperature=0,
                stream=True,
                stream_options={"include_usage": True},
            )
        )
        assert "".join(c.choices[0].text for c in chunks if c.choices) == text
        assert chunks[-1].usage.completion_tokens == len(ids) and not chunks[-1].choices
    # vLLM's continuous_usage_stats: every chunk counts its choice's tokens so far, and from its first
    # token the prompt's cached tokens (sent twice: the second finds its prompt in the prefix cache)
    for _ in range(2):
        chunks = list(server.client.chat.completions.create(
            model=MODEL, messages=[{"role": "user", "content": "Hi " * 40}], max_tokens=6, temperature=0,
            stream=True, stream_options={"include_usage": True, "continuous_usage_stats": True},
            extra_body={"ignore_eos": True},
        ))  # fmt: skip
    counts = [c.usage.completion_tokens for c in chunks]
    assert counts[0] == 0 and counts[-2:] == [6, 6] and counts == sorted(counts)  # NOTE: deltas may merge
    assert len(set(counts)) == len(counts) - 1 and len({c.usage.prompt_tokens for c in chunks}) == 1
    cached = [c.usage.prompt_tokens_details and c.usage.prompt_tokens_details.cached_tokens for c in chunks]
    assert cached[0] is None and cached[1:] == [cached[-1]] * (len(chunks) - 1) and cached[-1] > 0
    ids = tokenizer.encode("Hello")
    by_ids = server.client.completions.create(model=MODEL, prompt=ids, max_tokens=8, temperature=0)
    assert by_ids.choices[0].text == generate(reference_llm, ids, 8)[0]


def test_a_stream_interval_sends_the_first_token_then_several_a_chunk_and_the_same_text(chat_model_dir, reference_llm):
    """``serve --stream-interval 4`` (vLLM's): a streamed completion's first token in a chunk of its own, then
    chunks of at least 4 tokens (the last of what is left), the text and tokens of the unstreamed answer."""
    ids = reference_llm.tokenizer.encode("Hello world")
    text, want = generate(reference_llm, ids, 11)  # (greedy: stops at EOS, where the server's requests go on)
    s = Server(chat_model_dir, stream_interval=4)
    try:
        common = dict(model=MODEL, prompt=ids, max_tokens=11, temperature=0)
        extra = {"return_token_ids": True, "ignore_eos": True}
        chunks = [c.model_dump() for c in s.client.completions.create(**common, stream=True, extra_body=extra)]
        whole = s.client.completions.create(**common, extra_body=extra).model_dump()["choices"][0]
    finally:
        s.stop()
    sizes = [len(c["choices"][0]["token_ids"]) for c in chunks]
    assert sizes[0] == 1 and all(n >= 4 for n in sizes[1:-1]) and sum(sizes) == 11, sizes
    assert "".join(c["choices"][0]["text"] for c in chunks) == whole["text"]
    assert [t for c in chunks for t in c["choices"][0]["token_ids"]] == whole["token_ids"]
    assert whole["token_ids"][: len(want)] == list(want) and whole["text"].startswith(text)


def test_chat_renders_the_model_template_as_transformers_does(server, reference_llm, chat_model_dir):
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hello world"}]
    hf = transformers.AutoTokenizer.from_pretrained(chat_model_dir)
    rendered = hf.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    assert ChatTemplate.for_model(chat_model_dir).render(messages) == rendered
    prompt_ids = reference_llm.tokenizer.encode(rendered, add_special_tokens=False)
    text, ids = generate(reference_llm, prompt_ids, 12)
    response = server.client.chat.completions.create(model=MODEL, messages=messages, max_tokens=12, temperature=0)
    assert response.choices[0].message.content == text and response.choices[0].message.role == "assistant"
    assert response.usage.prompt_tokens == len(prompt_ids) and response.usage.completion_tokens == len(ids)
    stream = server.client.chat.completions.create(
        model=MODEL, messages=messages, max_completion_tokens=12, temperature=0, stream=True
    )
    assert "".join(c.choices[0].delta.content or "" for c in stream) == text
    with pytest.raises(openai.BadRequestError, match="system message must come first"):
        server.client.chat.completions.create(model=MODEL, messages=messages[::-1] + messages[:1], max_tokens=4)


def test_vllms_chat_template_fields_render_as_transformers_does(server, reference_llm, chat_model_dir):
    """``continue_final_message`` (the model goes on with an assistant answer the client began),
    ``add_generation_prompt`` false and ``chat_template_kwargs`` (variables for the template), each
    rendered as transformers' ``apply_chat_template`` renders it and served from those tokens."""
    hf = transformers.AutoTokenizer.from_pretrained(chat_model_dir)
    template = ChatTemplate.for_model(chat_model_dir)
    begun = [{"role": "user", "content": "Hello world"}, {"role": "assistant", "content": "Hello to you"}]
    rendered = hf.apply_chat_template(begun, continue_final_message=True, tokenize=False)
    assert rendered.endswith("Hello to you")
    assert template.render(begun, add_generation_prompt=False, continue_final_message=True) == rendered
    prompt_ids = reference_llm.tokenizer.encode(rendered, add_special_tokens=False)
    text, _ = generate(reference_llm, prompt_ids, 8)
    extra = {"add_generation_prompt": False, "continue_final_message": True}
    response = server.client.chat.completions.create(
        model=MODEL, messages=begun, max_tokens=8, temperature=0, extra_body=extra
    )
    assert response.choices[0].message.content == text and response.usage.prompt_tokens == len(prompt_ids)
    # chat_template_kwargs reach the template, and may rename a special token, as in transformers
    variables = {"eos_token": "<|end|>"}
    rendered = hf.apply_chat_template(begun[:1], add_generation_prompt=False, tokenize=False, **variables)
    assert "<|end|>" in rendered
    assert template.render(begun[:1], add_generation_prompt=False, variables=variables) == rendered
    response = server.client.chat.completions.create(
        model=MODEL, messages=begun[:1], max_tokens=2, extra_body={"add_generation_prompt": False,
                                                                    "chat_template_kwargs": variables}
    )  # fmt: skip
    assert response.usage.prompt_tokens == len(reference_llm.tokenizer.encode(rendered, add_special_tokens=False))
    thinking = ChatTemplate("{% if enable_thinking is defined and not enable_thinking %}<no-think>{% endif %}x")
    assert thinking.render(begun, variables={"enable_thinking": False}) == "<no-think>x"
    assert thinking.render(begun) == "x"


@pytest.mark.parametrize(
    ("source", "raised"),
    [
        ("{{ messages[0].content + 1 }}", "TypeError"),
        ("{{ 1 / (messages | length - 1) }}", "ZeroDivisionError"),
        ("{% for i in range(10**9) %}{% endfor %}", "OverflowError: Range too big"),
        ("{% macro f() %}{{ f() }}{% endmacro %}{{ f() }}", "RecursionError"),
        ("{{ strftime_now(5) }}", "TypeError"),
    ],
)
def test_a_template_that_fails_on_the_messages_is_their_error(source, raised):
    """Whatever a template raises on a request's messages (or a trusted request's own template) is a
    TemplateError, a 400 on the server, not a 500."""
    with pytest.raises(TemplateError, match=f"chat template failed on these messages: {raised}"):
        ChatTemplate(source).render([{"role": "user", "content": "hi"}])


def test_tokenize_and_detokenize_as_vllm_serves_them(server, chat_model_dir):
    """vLLM's ``/tokenize`` (a prompt, or chat messages as a chat request reads them) and ``/detokenize``; a
    completion's and a chat's ``add_special_tokens`` read as /tokenize's."""
    hf = transformers.AutoTokenizer.from_pretrained(chat_model_dir)
    url = server.url
    answer = httpx.post(url + "/tokenize", json={"model": MODEL, "prompt": "Hello world"}).json()
    assert answer == {"count": len(hf.encode("Hello world")), "max_model_len": 256, "tokens": hf.encode("Hello world"),
                      "token_strs": None}  # fmt: skip
    bare = httpx.post(url + "/tokenize", json={"prompt": "Hello world", "add_special_tokens": False}).json()
    assert bare["tokens"] == hf.encode("Hello world", add_special_tokens=False)
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hello world"}]
    chat = httpx.post(url + "/tokenize", json={"messages": messages, "return_token_strs": True}).json()
    rendered = hf.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    assert chat["tokens"] == hf.encode(rendered, add_special_tokens=False)  # the template wrote BOS
    assert chat["token_strs"] == [hf.decode([t]) for t in chat["tokens"]]
    served = server.client.chat.completions.create(model=MODEL, messages=messages, max_tokens=1)
    assert served.usage.prompt_tokens == chat["count"]
    # vLLM's add_special_tokens on the requests that generate: a completion's BOS left out, a chat's added on top
    for special, tokens in ((None, answer["tokens"]), (True, answer["tokens"]), (False, bare["tokens"])):
        completion = server.client.completions.create(
            model=MODEL, prompt="Hello world", max_tokens=1, extra_body={"add_special_tokens": special}
        )
        assert completion.usage.prompt_tokens == len(tokens)
    on_top = server.client.chat.completions.create(
        model=MODEL, messages=messages, max_tokens=1, extra_body={"add_special_tokens": True}
    )
    assert on_top.usage.prompt_tokens == chat["count"] + len(answer["tokens"]) - len(bare["tokens"])
    tokenized = httpx.post(url + "/tokenize", json={"messages": messages, "add_special_tokens": True}).json()
    assert tokenized["count"] == on_top.usage.prompt_tokens
    text = httpx.post(url + "/detokenize", json={"model": MODEL, "tokens": answer["tokens"]}).json()
    assert text == {"prompt": hf.decode(answer["tokens"])} and text["prompt"].endswith("Hello world")
    text = httpx.post(url + "/detokenize", json={"tokens": chat["tokens"]}).json()
    assert text == {"prompt": rendered}  # special tokens included: what /tokenize read
    refused = [
        ("/tokenize", {"prompt": "a", "messages": messages}, 400, "prompt"),
        ("/tokenize", {}, 400, "prompt"),
        ("/tokenize", {"messages": messages, "continue_final_message": True, "add_generation_prompt": False}, 400,
         "continue_final_message"),
        ("/tokenize", {"model": "other", "prompt": "a"}, 404, "model"),
        ("/detokenize", {"tokens": [1, VOCAB]}, 400, "tokens"),
    ]  # fmt: skip
    for path, body, status, param in refused:
        response = httpx.post(url + path, json=body)
        assert response.status_code == status and response.json()["error"]["param"] == param, (body, response.text)


def test_32_concurrent_streams_are_all_correct(server, reference_llm):
    tokenizer = reference_llm.tokenizer
    prompts = [f"{CORPUS[i % 3][: 8 + i]} {i}" for i in range(32)]
    want = [generate(reference_llm, tokenizer.encode(p), 6 + i % 11)[0] for i, p in enumerate(prompts)]

    async def one(i: int, prompt: str) -> str:
        stream = await server.async_client.completions.create(
            model=MODEL, prompt=prompt, max_tokens=6 + i % 11, temperature=0, stream=True
        )
        return "".join([c.choices[0].text async for c in stream])

    async def main() -> list[str]:
        return await asyncio.gather(*(one(i, p) for i, p in enumerate(prompts)))

    assert asyncio.run(main()) == want


def test_a_client_that_disconnects_mid_stream_frees_its_kv(server):
    aborted_before = server.metric("sloserve_requests_total", request_class="rt", outcome="abort")
    body = {"model": MODEL, "prompt": "Hello", "max_tokens": 240, "ignore_eos": True, "stream": True}
    with httpx.stream("POST", server.url + "/v1/completions", json=body, timeout=30) as response:
        assert response.status_code == 200
        lines = response.iter_lines()
        events = []
        for line in lines:
            if line.startswith("data: "):
                events.append(line)
            if len(events) == 3:
                break
    deadline = time.monotonic() + 20
    while (
        server.metric("sloserve_kv_cache_used_tokens", replica="0") > 0
        or server.metric("sloserve_num_requests_running", replica="0") > 0
    ):
        assert time.monotonic() < deadline, "the KV of a disconnected client was not freed"
        time.sleep(0.05)
    assert server.metric("sloserve_requests_total", request_class="rt", outcome="abort") == aborted_before + 1
    assert server.engine.num_unfinished == 0


def test_a_client_that_leaves_before_its_answer_aborts_it_and_leaves_no_error_in_the_log(server, caplog):
    """A request answered whole (not streamed) whose client disconnects first: its choices are aborted, and
    the wait for them, cancelled, leaves nothing in the log (asyncio's "exception was never retrieved" and
    a traceback, for every such client, before). The engine process is paused meanwhile, so that the
    client surely leaves first; its choices are long (NOTE: the engine resumes when the client has left, maybe
    before the server has heard: 8 tokens could end before the abort came, seen once on a loaded machine)."""
    aborted_before = server.metric("sloserve_requests_total", request_class="rt", outcome="abort")
    body = {"model": MODEL, "prompt": "Hello", "max_tokens": 200, "ignore_eos": True, "n": 2}
    pid = server.engine._process.pid
    os.kill(pid, signal.SIGSTOP)
    try:
        with caplog.at_level(logging.ERROR, logger="asyncio"), pytest.raises(httpx.ReadTimeout):
            httpx.post(server.url + "/v1/completions", json=body, timeout=httpx.Timeout(30, read=1.0))
    finally:
        os.kill(pid, signal.SIGCONT)
    deadline = time.monotonic() + 20
    while server.metric("sloserve_requests_total", request_class="rt", outcome="abort") < aborted_before + 2:
        assert time.monotonic() < deadline, "the choices of a client that left were not aborted"
        time.sleep(0.05)
    gc.collect()  # NOTE: asyncio logs an unread exception when its future is collected
    assert server.engine.num_unfinished == 0
    assert not [r.getMessage() for r in caplog.records if "never retrieved" in r.getMessage()]


@pytest.mark.parametrize(
    ("route", "body", "param"),
    [
        ("completions", {"prompt": [5] * 256, "max_tokens": 2}, "prompt"),
        ("completions", {"prompt": [5] * 300}, "prompt"),
        ("completions", {"prompt": [5] * 200, "max_tokens": 100}, "max_tokens"),
        ("chat/completions", {"messages": [{"role": "user", "content": "hi " * 300}]}, "messages"),
        ("chat/completions", {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 300}, "max_tokens"),
        (
            "chat/completions",
            {"messages": [{"role": "user", "content": "hi"}], "max_completion_tokens": 300},
            "max_completion_tokens",
        ),
        ("responses", {"input": "hi " * 300}, "input"),
        ("responses", {"input": "hi", "max_output_tokens": 300}, "max_output_tokens"),
    ],
)
def test_a_request_beyond_the_context_is_context_length_exceeded_naming_its_field(server, route, body, param):
    """OpenAI's code, which clients look for to shorten a conversation; the field is the prompt's where
    the prompt alone fills the context, else the output cap's."""
    response = httpx.post(f"{server.url}/v1/{route}", json={"model": MODEL, **body})
    assert response.status_code == 400
    error = response.json()["error"]
    assert (error["code"], error["param"]) == ("context_length_exceeded", param), error
    assert "256" in error["message"]


def test_errors_are_openai_error_objects_with_the_right_status(server):
    client = server.client
    with pytest.raises(openai.NotFoundError) as e:
        client.completions.create(model="nope", prompt="hi", max_tokens=2)
    assert e.value.body["code"] == "model_not_found"
    with pytest.raises(openai.BadRequestError) as e:
        client.completions.create(model=MODEL, prompt="hi", max_tokens=2, suffix="!")
    assert e.value.body["param"] == "suffix"
    with pytest.raises(openai.BadRequestError) as e:
        client.completions.create(model=MODEL, prompt="hi", max_tokens=10**6)
    assert e.value.body["code"] == "context_length_exceeded" and "maximum context length is 256" in e.value.message
    with pytest.raises(openai.BadRequestError) as e:
        client.completions.create(model=MODEL, prompt="hi", max_tokens=0)  # without echo: a refusal, not a length
    assert (e.value.body["param"], e.value.body["code"]) == ("max_tokens", None)
    with pytest.raises(openai.BadRequestError) as e:
        client.completions.create(model=MODEL, prompt=[5, 99999], max_tokens=2)
    assert "outside the vocabulary" in e.value.message
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model=MODEL, messages=[], max_tokens=2)
    assert e.value.body["param"] == "messages"
    response = httpx.post(
        server.url + "/v1/completions", content=b"{not json", headers={"content-type": "application/json"}
    )
    assert response.status_code == 400 and "not valid JSON" in response.json()["error"]["message"]
    assert httpx.get(server.url + "/v1/nothing").json()["error"]["message"] == "Not Found"
    assert client.models.list().data[0].id == MODEL
    assert client.models.retrieve(MODEL).id == MODEL
    with pytest.raises(openai.NotFoundError) as e:
        client.models.retrieve("gpt-4o")
    assert e.value.body["code"] == "model_not_found" and "'gpt-4o' does not exist" in e.value.message
    assert httpx.get(server.url + "/version").json() == {"version": sloserve.__version__}


def test_sampling_settings_at_their_extremes_are_served_or_refused_and_the_engine_lives_on(server):
    """top_p 1e-300 (0 in float32) once sampled a token past the vocabulary and the engine died with it:
    every later request was a 500. Controls that leave no token are a 400; a wrong type of tools too."""
    client = server.client
    tiny = client.completions.create(model=MODEL, prompt="hi", max_tokens=3, top_p=1e-300, seed=1)
    greedy = client.completions.create(model=MODEL, prompt="hi", max_tokens=3, temperature=0)
    assert tiny.choices[0].text == greedy.choices[0].text  # only the likeliest token is left
    with pytest.raises(openai.BadRequestError, match="none is left to generate"):
        client.completions.create(model=MODEL, prompt="hi", max_tokens=3,
                                  extra_body={"allowed_token_ids": [5], "stop_token_ids": [5], "min_tokens": 1})  # fmt: skip
    refused = httpx.post(f"{server.url}/v1/responses", json={"model": MODEL, "input": "hi", "tools": 3})
    assert refused.status_code == 400 and refused.json()["error"]["param"] == "tools"
    assert client.completions.create(model=MODEL, prompt="hi", max_tokens=1).choices[0].finish_reason == "length"


@pytest.mark.parametrize(
    ("route", "fields", "where"),
    [
        ("v1/completions", r'"prompt": "hi\ud800", "max_tokens": 2', "prompt"),
        ("v1/completions", r'"prompt": "hi", "max_tokens": 2, "logit_bias": {"\udc00": 1}', r"logit_bias.\udc00"),
        ("v1/chat/completions", r'"messages": [{"role": "user", "content": "\udfffhi"}]', "messages.0.content"),
        ("v1/responses", r'"input": "hi\ud83d", "max_output_tokens": 2', "input"),
        ("tokenize", r'"prompt": "\ud800"', "prompt"),
    ],
)
def test_a_lone_surrogate_is_a_400_naming_its_field(server, route, fields, where):
    """JSON may escape half of a UTF-16 pair (\\ud800); Python's parser keeps it and no tokenizer can
    encode it (it was a 500). The answer names the field, a bad key escaped."""
    raw = f'{{"model": {json.dumps(MODEL)}, {fields}}}'.encode()
    response = httpx.post(f"{server.url}/{route}", content=raw, headers={"content-type": "application/json"})
    assert response.status_code == 400, response.text
    assert (
        response.json()["error"]["message"] == rf"{where}: not valid Unicode (a lone UTF-16 surrogate such as \ud800)"
    )


def _at(value, path: str):
    """The item of parsed JSON ``value`` at a dotted ``path`` (a list's index as a number)."""
    for key in path.split(".") if path else ():
        value = value[int(key)] if isinstance(value, list) else value[key]
    return value


@settings(max_examples=200, deadline=None)
@given(
    body=st.recursive(
        st.integers(-3, 10**6) | st.text(max_size=6) | st.none(),
        lambda inner: st.lists(inner, max_size=5) | st.dictionaries(st.text("abc", max_size=3), inner, max_size=3),
        max_leaves=30,
    ),
    data=st.data(),
)
def test_invalid_unicode_at_names_where_a_lone_surrogate_is(body, data):
    """``invalid_unicode_at`` finds a lone surrogate wherever it is, in a string or a key, and names its path;
    None for a body without one (a prompt's thousands of token ids checked without a path built for each)."""
    from sloserve.server.protocol import invalid_unicode_at

    assert invalid_unicode_at(body) is None
    assert invalid_unicode_at({"prompt": list(range(5000)), "n": [body]}) is None
    places = []  # (container, key) of every string and key in the body

    def walk(item):
        pairs = item.items() if isinstance(item, dict) else enumerate(item) if isinstance(item, list) else ()
        for key, child in pairs:
            places.append((item, key))
            walk(child)

    body = {"body": body}
    walk(body)
    container, key = data.draw(st.sampled_from(places))
    as_key = isinstance(container, dict) and data.draw(st.booleans())
    if as_key:  # the key itself made bad
        container["\ud800" + key] = container.pop(key)
    else:
        container[key] = "x\udfff"
    where = invalid_unicode_at(body)
    assert where is not None
    *parents, last = where.encode().decode("unicode_escape").split(".")
    parent = _at(body, ".".join(parents))
    if as_key:
        assert last == "\ud800" + key and last in parent
    else:
        assert parent[int(last) if isinstance(parent, list) else last] == "x\udfff"


JSON_VALUES = st.recursive(
    st.none()
    | st.booleans()
    | st.integers(-3, 40)
    | st.sampled_from([0, -1, 2**31, 10**12])
    | st.floats(-3, 3)
    | st.text(max_size=12),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner, max_size=3),
    max_leaves=8,
)
FIELDS = [
    "model",
    "prompt",
    "messages",
    "max_tokens",
    "max_completion_tokens",
    "temperature",
    "top_p",
    "seed",
    "stop",
    "stream",
    "stream_options",
    "n",
    "service_tier",
    "slo",
    "logprobs",
    "echo",
    "ignore_eos",
    "best_of",
    "top_logprobs",
    # vLLM's extensions
    "top_k",
    "min_p",
    "allowed_token_ids",
    "bad_words",
    "include_stop_str_in_output",
    "skip_special_tokens",
    "structured_outputs",
    "guided_json",
    "guided_regex",
    "guided_choice",
    "guided_grammar",
    "chat_template_kwargs",
    "add_generation_prompt",
    "continue_final_message",
    "use_beam_search",
    "priority",
    "tools",
    "tool_choice",
    "parallel_tool_calls",
    "functions",
]


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(
    body=st.fixed_dictionaries({"model": st.just(MODEL) | JSON_VALUES}, optional={f: JSON_VALUES for f in FIELDS[1:]})
    | JSON_VALUES,
    path=st.sampled_from(["/v1/completions", "/v1/chat/completions"]),
)
def test_fuzzed_bodies_never_get_a_5xx(server, body, path):
    response = httpx.post(server.url + path, json=body, timeout=60)
    assert response.status_code < 500, (body, response.text)
    if response.status_code >= 400:
        assert response.json()["error"]["message"], response.text
    assert server.engine.error is None


HELD = "HOLD this prompt"


class HeldTokenizer:
    """The served tokenizer, but a text with ``HELD`` in it waits in ``encode`` until ``release`` is set."""

    def __init__(self, tokenizer) -> None:
        self.tokenizer = tokenizer
        self.entered, self.release = threading.Event(), threading.Event()

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        if HELD in text:
            self.entered.set()
            self.release.wait(timeout=30)
        return self.tokenizer.encode(text, add_special_tokens)

    def __getattr__(self, name: str):
        return getattr(self.tokenizer, name)


@pytest.mark.parametrize(
    ("path", "body"),
    [
        ("/v1/completions", {"prompt": HELD, "max_tokens": 2}),
        ("/v1/completions", {"prompt": ["Hello", HELD], "max_tokens": 2, "use_beam_search": True, "n": 2}),
        ("/v1/chat/completions", {"messages": [{"role": "user", "content": HELD}], "max_tokens": 2}),
        ("/v1/responses", {"input": HELD, "max_output_tokens": 2}),
        ("/tokenize", {"prompt": HELD}),
    ],
)
def test_a_prompt_is_tokenized_beside_the_event_loop(server, monkeypatch, path, body):
    """While one request's prompt is held in the tokenizer, the server answers others (a prompt of
    megabytes takes seconds there: every other request waited for it when it ran on the event loop)."""
    held = HeldTokenizer(server.engine.tokenizer)
    monkeypatch.setattr(server.engine, "tokenizer", held)
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        pending = pool.submit(httpx.post, server.url + path, json={"model": MODEL, **body}, timeout=60)
        assert held.entered.wait(timeout=30)
        meanwhile = httpx.post(
            server.url + "/v1/completions", json={"model": MODEL, "prompt": "Hello", "max_tokens": 2}, timeout=10
        )
        assert meanwhile.status_code == 200 and not pending.done()
        held.release.set()
        assert pending.result().status_code == 200, pending.result().text


@pytest.mark.parametrize(
    ("path", "model", "body", "bad"),
    [
        ("/v1/completions", CompletionRequest, {"prompt": "Hello", "max_tokens": 2}, {"temperature": "hot"}),
        ("/v1/chat/completions", ChatCompletionRequest, {"messages": [{"role": "user", "content": "Hi"}]},
         {"temperature": "hot"}),
        ("/v1/responses", ResponsesRequest, {"input": "Hi", "max_output_tokens": 2}, {"temperature": "hot"}),
        ("/tokenize", TokenizeRequest, {"messages": [{"role": "user", "content": "Hi"}]}, {"return_token_strs": "hot"}),
        ("/detokenize", DetokenizeRequest, {"tokens": [1, 2]}, {"tokens": "hot"}),
    ],
)  # fmt: skip
def test_a_body_is_validated_beside_the_event_loop(server, monkeypatch, path, model, body, bad):
    """While one request's body is held in its model's validation, the server answers others (200,000 chat
    messages took 1.4 s there: every other request waited for them when FastAPI validated on the event
    loop); then the held one is answered, and a body its model refuses is still a 400 naming the field."""
    entered, release = threading.Event(), threading.Event()
    validate = model.model_validate

    def held(payload, *args, **kwargs):
        if payload.get("user") == HELD:  # (an extra field: each model takes or ignores it)
            entered.set()
            release.wait(timeout=30)
        return validate(payload, *args, **kwargs)

    monkeypatch.setattr(model, "model_validate", held)
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        pending = pool.submit(httpx.post, server.url + path, json={"model": MODEL, "user": HELD, **body}, timeout=60)
        assert entered.wait(timeout=30)
        meanwhile = httpx.post(
            server.url + "/v1/completions", json={"model": MODEL, "prompt": "Hello", "max_tokens": 2}, timeout=10
        )
        assert meanwhile.status_code == 200 and not pending.done()
        release.set()
        assert pending.result().status_code == 200, pending.result().text
    refused = httpx.post(server.url + path, json={"model": MODEL, **body, **bad}, timeout=10)
    assert refused.status_code == 400 and refused.json()["error"]["param"] == next(iter(bad)), refused.text


def test_the_openapi_document_describes_the_bodies(server):
    """``/openapi.json`` (``/docs`` reads it) gives each route's body its model's schema, every
    reference in it found in the document (the bodies are validated by the routes, not by FastAPI)."""
    document = httpx.get(server.url + "/openapi.json", timeout=10).json()
    schemas = document["components"]["schemas"]
    for path, field in (("/v1/completions", "prompt"), ("/v1/chat/completions", "messages"), ("/v1/responses", "input"),
                        ("/tokenize", "messages"), ("/detokenize", "tokens")):  # fmt: skip
        body = document["paths"][path]["post"]["requestBody"]["content"]["application/json"]["schema"]
        assert field in body["properties"], path
    references = re.findall(r'"\$ref": "#/components/schemas/([^"]+)"', json.dumps(document))
    assert references and set(references) <= set(schemas)


def test_an_idle_connection_outlives_the_clients_pools(server):
    """A connection idle for longer than httpx (the openai SDK) keeps one in its pool, 5 s, still
    answers: uvicorn's default would have closed it then, and a client reusing it as it closed would
    have met a reset."""
    with socket.create_connection(("127.0.0.1", server.port), timeout=10) as conn:
        for attempt in range(2):
            conn.sendall(b"GET /health HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n")
            answer = conn.recv(4096)
            assert answer.startswith(b"HTTP/1.1 200"), (attempt, answer)
            if attempt == 0:
                time.sleep(5.5)


def test_the_request_log_reads_as_a_trace(server, tmp_path):
    server.client.completions.create(
        model=MODEL, prompt="Hello world", max_tokens=5, temperature=0, extra_body={"ignore_eos": True}
    )
    server.client.completions.create(model=MODEL, prompt="Hi", max_tokens=3, temperature=0,
                                     extra_body={"ignore_eos": True, "service_tier": "flex"})  # fmt: skip
    server.client.completions.create(model=MODEL, prompt="Hey", max_tokens=4, temperature=0,
                                     extra_body={"ignore_eos": True, "slo": {"ttft_ms": 800, "tpot_ms": 90}})  # fmt: skip
    # NOTE: one snapshot of the log: a request of an earlier test may still end and append a line
    # (the engine logs a request before its answer goes out, so ours is there)
    snapshot = tmp_path / "requests.jsonl"
    snapshot.write_text(Path(server.app.state.metrics._log.name).read_text())
    trace = load_trace(str(snapshot))
    lines = [json.loads(line) for line in snapshot.read_text().splitlines()]
    assert len(trace) == len(lines) > 0 and trace.arrival_s is not None
    ours = (len(server.engine.tokenizer.encode("Hello world")), 5, "length", "rt", 0)
    assert ours in [(line["prompt_tokens"], line["output_tokens"], line["finish_reason"], line["request_class"],
                     line["priority"]) for line in lines]  # fmt: skip
    by_arrival = sorted(lines, key=lambda line: line["arrival_s"])  # the log is in finishing order
    assert list(trace.output_tokens) == [line["output_tokens"] for line in by_arrival]
    assert list(trace.prompt_tokens) == [line["prompt_tokens"] for line in by_arrival]
    # the prompts' prefix structure: a replay of the log shares what the served requests shared
    assert list(trace.hash_ids) == [tuple(line["hash_ids"]) for line in by_arrival]
    # and each request is replayed with what it was served with
    replay = workload_from_trace(str(snapshot), num_requests=len(lines), seed=0, context_len=2048, trace_arrivals=True)
    logged = [(line["request_class"], line["priority"], line["slo_ttft_s"], line["slo_tpot_s"], line["max_tokens"])
              for line in by_arrival]  # fmt: skip
    assert [(r.request_class.value, r.priority, r.slo.ttft_s, r.slo.tpot_s, r.max_tokens) for r in replay.requests] == [
        (cls, priority, ttft, tpot, max_tokens or 2048 - line["prompt_tokens"])
        for (cls, priority, ttft, tpot, max_tokens), line in zip(logged, by_arrival)
    ]
    assert ("be", 0, None, None, 3) in logged and ("rt", 0, 0.8, 0.09, 4) in logged


def test_the_request_log_keeps_the_prompts_sharing(tmp_path):
    """Two requests whose prompts share their first 512 tokens log the same first hash id; replayed
    as a trace with caching, the second finds the first's blocks as the server did. A third of the same
    tokens under vLLM's ``cache_salt`` finds none, and logs hash ids of its own."""
    from sloserve.sched import make_scheduler
    from sloserve.sim import simulate
    from sloserve.workload import workload_from_trace

    log = tmp_path / "requests.jsonl"
    server = Server("random:tiny-llama", request_log=log)  # a context of 1024: room for 512-token segments
    try:
        shared = [7, 8, 9, 10] * 150  # 600 tokens
        for tail, salt in (([1, 2, 3], None), ([4, 5, 6, 11, 12], None), ([4, 5, 6, 11, 12], "tenant-b")):
            server.client.completions.create(
                model=MODEL, prompt=shared + tail, max_tokens=2, temperature=0, extra_body={"cache_salt": salt}
            )
        with pytest.raises(openai.BadRequestError) as e:
            server.client.completions.create(model=MODEL, prompt="hi", max_tokens=2, extra_body={"cache_salt": ""})
        assert e.value.body["param"] == "cache_salt"
    finally:
        server.stop()
    lines = [json.loads(line) for line in log.read_text().splitlines()]
    assert lines[0]["hash_ids"][0] == lines[1]["hash_ids"][0] and lines[0]["hash_ids"] != lines[1]["hash_ids"]
    assert lines[1]["cached_tokens"] == 592  # the server found the shared 600 tokens' full blocks
    assert lines[2]["cached_tokens"] == 0 and not set(lines[2]["hash_ids"]) & set(lines[1]["hash_ids"])
    workload = workload_from_trace(str(log), num_requests=3, seed=0, context_len=1024, trace_arrivals=True)
    simulate(
        workload.requests,
        lambda: make_scheduler("vllm", kv_capacity_tokens=10_000, max_model_len=1024, enable_prefix_caching=True),
        llama7b_cost(),
    )
    # the log's granularity is Mooncake's 512-token segment: the replay finds the first one
    assert [r.num_cached_tokens for r in workload.requests] == [0, 512, 0]


def test_a_full_queue_answers_429_and_every_accepted_request_completes(chat_model_dir):
    """ORCA reserves prompt + max_tokens, so the KV holds one request: one runs, two wait, the rest get 429."""
    server = Server(chat_model_dir, "orca", kv_capacity_tokens=160, max_queued_requests=2)
    try:
        body = {"model": MODEL, "prompt": "Hello", "max_tokens": 120, "ignore_eos": True, "temperature": 0}

        async def main():
            async with httpx.AsyncClient(base_url=server.url, timeout=60) as http:
                async with http.stream("POST", "/v1/completions", json={**body, "stream": True}) as first:
                    lines = first.aiter_lines()
                    async for line in lines:
                        if line.startswith("data: "):
                            break  # running: it holds the KV
                    others = await asyncio.gather(
                        *(http.post("/v1/completions", json={**body, "seed": i}) for i in range(6))
                    )
                    async for _ in lines:
                        pass
                return others

        others = asyncio.run(main())
        codes = sorted(r.status_code for r in others)
        assert codes == [200, 200, 429, 429, 429, 429]
        for r in others:
            if r.status_code == 429:
                assert r.headers["retry-after"] == "1" and r.json()["error"]["type"] == "rate_limit_error"
            else:
                assert r.json()["usage"]["completion_tokens"] == 120
        assert server.metric("sloserve_requests_rejected_total", reason="queue_full") == 4
    finally:
        server.stop()


def test_bros_gives_rt_requests_a_lower_ttft_than_be_ones(chat_model_dir):
    """BROS co-serving: BE requests (service_tier flex, long prompts and answers) arrive first and fill
    the KV (room for one), then RT ones (short, with a TTFT SLO): RT requests go ahead of the queued BE
    ones, taking BE blocks where they must. Checked by order (the RT requests' first tokens come before
    most BE ones'), not by a ratio of seconds that a loaded machine moves."""
    server = Server(chat_model_dir, "bros", kv_capacity_tokens=400)
    try:
        long_prompt = " ".join(CORPUS[:6])

        async def one(prompt: str, tier: str | None, max_tokens: int) -> float:
            """When the request's first token came (seconds on the test's clock)."""
            # NOTE: the SDK's completions.create has no service_tier argument (chat's has): send it as JSON.
            extra = {"slo": {"ttft_ms": 200, "tpot_ms": 100}} if tier is None else {"service_tier": tier}
            stream = await server.async_client.completions.create(
                model=MODEL,
                prompt=prompt,
                max_tokens=max_tokens,
                temperature=0,
                stream=True,
                extra_body={"ignore_eos": True, **extra},
            )
            first = None
            async for _ in stream:
                first = first if first is not None else time.perf_counter()
            return first

        async def main():
            # NOTE: ~150 prompt tokens + 96 each, of the model's 256 positions: one runs at a time, and the
            # queued ones take seconds, so RT requests a loaded machine sends late still find them queued
            # (with 24 tokens each, two at a time, they had all started within ~0.3 s: 0 of 12 after the
            # median RT once in a full `make test`)
            be = [asyncio.ensure_future(one(long_prompt[i:], "flex", 96)) for i in range(12)]
            # NOTE: the BE requests reached the engine: in it, or (a slow client) already answered. Counting
            # those in it alone waited forever once, when the first ended before the last arrived.
            deadline = time.monotonic() + 60
            while server.engine.num_unfinished + sum(f.done() for f in be) < 12:
                assert time.monotonic() < deadline, "the BE requests did not reach the engine"
                await asyncio.sleep(0.005)
            rt = await asyncio.gather(*(one(f"Hello {i}", None, 24) for i in range(12)))
            return await asyncio.gather(*be), rt

        be, rt = asyncio.run(main())
        # NOTE: against the median RT request's first token, so that one RT request the client sent late
        # does not decide it. FCFS vLLM, on the same load: 0 BE requests after it.
        median_rt = sorted(rt)[len(rt) // 2]
        assert sum(first > median_rt for first in be) >= 6
        assert server.metric("sloserve_requests_total", request_class="be", outcome="length") == 12
    finally:
        server.stop()


def test_a_killed_engine_process_is_an_error_to_its_requests_and_health_says_why(chat_model_dir):
    """The engine process SIGKILLed (the OOM killer) mid-stream: the stream gets an error event naming the
    signal, ``/health`` answers 503 with it (a supervisor's probe restarts the server), a new request 500."""
    server = Server(chat_model_dir)
    try:
        # NOTE: the model's whole context (256 tokens), so that it is still running when killed
        body = {"model": MODEL, "prompt": "Hello", "max_tokens": 250, "ignore_eos": True, "stream": True}
        with httpx.stream("POST", server.url + "/v1/completions", json=body, timeout=60) as response:
            lines = response.iter_lines()
            next(line for line in lines if line.startswith("data: "))
            server.engine._process.kill()
            events = [json.loads(line[6:]) for line in lines if line.startswith("data: {")]
        health = httpx.get(server.url + "/health")
        after = httpx.post(server.url + "/v1/completions", json={**body, "stream": False})
    finally:
        server.stop()
    reason = "the engine process was killed by SIGKILL"
    assert events[-1]["error"]["code"] == "engine_failed" and reason in events[-1]["error"]["message"]
    assert health.status_code == 503 and health.json()["error"]["message"] == f"the engine failed: {reason}"
    assert after.status_code == 500 and after.json()["error"]["code"] == "engine_failed"


def test_serve_refuses_bad_settings_with_one_line_and_exit_2():
    from click.testing import CliRunner

    from sloserve.cli import main

    def serve(*args: str) -> str:
        result = CliRunner().invoke(main, ["serve", "--model", "random:tiny-llama", *args])
        assert result.exit_code == 2, result.output
        return result.output

    assert "--set predictor=histogram" in serve("--scheduler", "econoserve")  # an oracle predictor
    assert "--rt-ttft-ms must be > 0" in serve("--rt-ttft-ms", "-3")
    assert "--stream-interval must be >= 1, got 0" in serve("--stream-interval", "0")
    assert "disagree: give one" in serve("--scheduling-policy", "priority", "--set", "waiting_order=lpm")
    assert "scheduler bros has no option 'waiting_order'" in serve(
        "--scheduler", "bros", "--scheduling-policy", "priority"
    )
    for flag in (["--enable-auto-tool-choice"], ["--tool-call-parser", "hermes"]):
        assert "--enable-auto-tool-choice and --tool-call-parser go together" in serve(*flag)
    assert "'--tool-call-parser': 'granite' is not one of 'hermes', 'llama3_json', 'pythonic', 'mistral'" in serve(
        "--tool-call-parser", "granite"
    )
    assert "--chat-template 'no/such.jinja': no such file" in serve("--chat-template", "no/such.jinja")
    assert "chat template: " in serve("--chat-template", "{% if %}")
    assert "'--reasoning-parser': 'o1' is not one of 'deepseek_r1', 'qwen3'" in serve("--reasoning-parser", "o1")
    assert "--timeout-keep-alive must be a finite number of seconds > 0, got 0.0" in serve("--timeout-keep-alive", "0")
    # each once accepted (nan, inf) or a traceback (--max-batch-file-mb inf converted to an integer)
    assert "--drain-timeout must be a finite number of seconds >= 0, got nan" in serve("--drain-timeout", "nan")
    assert "--timeout-keep-alive must be a finite number of seconds > 0, got inf" in serve(
        "--timeout-keep-alive", "inf"
    )
    assert "--max-batch-file-mb must be a finite number > 0, got inf" in serve("--max-batch-file-mb", "inf")
    assert "--step-log no/such/dir/steps.csv: cannot open for writing (No such file or directory)" in serve(
        "--step-log", "no/such/dir/steps.csv"
    )
    assert "--step-log is one engine's steps: it cannot be given with --replicas 2" in serve(
        "--step-log", "steps.csv", "--replicas", "2"
    )
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        assert "Address already in use" in serve("--port", str(taken.getsockname()[1]))
    result = CliRunner().invoke(main, ["serve", "--model", "random:no-such-shape"])
    assert result.exit_code == 2 and "unknown random model shape" in result.output


def test_serve_refuses_an_unsupported_architecture_in_one_line(tmp_path):
    """Before the engine starts: config.json is read first."""
    from click.testing import CliRunner

    from sloserve.cli import main

    (tmp_path / "config.json").write_text(json.dumps({"model_type": "rwkv", "hidden_size": 64}))
    result = CliRunner().invoke(main, ["serve", "--model", str(tmp_path), "--port", str(free_loopback_port())])
    assert result.exit_code == 2 and result.output.count("\n") == 1, result.output
    assert "unsupported architecture 'rwkv'" in result.output
    assert (
        "supported: afmoe, apertus, arcee, bamba, bloom, cohere, cohere2, cohere2_moe, cwm, deepseek_v2, deepseek_v3, dots1, ernie4_5, ernie4_5_moe, exaone, exaone4, exaone4_5, exaone_moe, falcon, falcon_h1, falcon_mamba, flex_olmo, gemma, gemma2, gemma3, gemma3_text, glm, glm4, glm46v, glm4_moe, glm4_moe_lite, glm4v, glm4v_moe, gpt2, gpt_bigcode, gpt_neox, gpt_oss, granite, granite_swa, granitemoe, granitemoe_swa, granitemoehybrid, granitemoeshared, helium, hunyuan_v1_dense, hunyuan_v1_moe, hy_v3, hyperclovax, internlm3, iquestcoder, jais2, jamba, kimi_linear, lfm2, lfm2_moe, lfm2_vl, lfm3, lfm3_vl, llama, llama4, llama4_text, mamba, mamba2, minicpm3, minimax_m2, ministral, ministral3, mistral, mistral3, mistral4, mixtral, mpt, nanochat, nemotron, nemotron_h, olmo, olmo2, olmo3, olmo_hybrid, olmoe, opt, phi, phi3, phimoe, qwen2, qwen2_5_vl, qwen2_moe, qwen2_vl, qwen3, qwen3_5, qwen3_5_moe, qwen3_5_moe_text, qwen3_5_text, qwen3_moe, qwen3_next, qwen3_vl, qwen3_vl_moe, sarvam_moe, seed_oss, smollm3, solar_open, stablelm, starcoder2, vaultgemma, youtu"
        in result.output
    )


def test_a_port_for_a_server_is_one_no_connection_takes_meanwhile():
    """The tests' servers bind their port seconds after it is picked (a fleet's after its replicas start):
    one from the ephemeral range could meanwhile be the source port of one of Ray's connections (seen:
    "address already in use"), one among Ray's worker ports a worker's."""
    from sloserve.bench.client import RAY_WORKER_PORTS, first_ephemeral_port

    ports = {free_loopback_port() for _ in range(20)}
    assert all(RAY_WORKER_PORTS.stop <= p < first_ephemeral_port() for p in ports), sorted(ports)
    assert len(ports) > 1  # picked at random: two test processes do not pick the same one
    with socket.socket() as s:
        s.bind(("127.0.0.1", ports.pop()))


def test_bench_serve_replays_a_trace_against_the_server(server, tmp_path):
    from click.testing import CliRunner

    from sloserve.cli import main

    out = tmp_path / "bench"
    result = CliRunner().invoke(
        main,
        [
            "bench-serve",
            "--base-url",
            server.url + "/v1",
            "--model",
            MODEL,
            "--trace",
            "sharegpt",
            "--rate",
            "20",
            "--num-requests",
            "12",
            "--max-tokens",
            "6",
            "--vocab-size",
            str(VOCAB),
            "--out",
            str(out),
            "--json",
        ],
    )
    assert result.exit_code == 0, result.output
    summary = json.loads((out / "summary.json").read_text())
    assert summary["completed"] == 12 and summary["num_failed"] == 0
    assert summary["ttft_s"]["mean"] > 0 and summary["inter_token_latency_s"]["mean"] > 0
    assert (out / "latency_cdf.png").is_file() and len((out / "requests.csv").read_text().splitlines()) == 13
    bad = CliRunner().invoke(
        main, ["bench-serve", "--base-url", server.url + "/v1", "--model", "nope", "--trace", "sharegpt", "--rate", "1"]
    )
    assert bad.exit_code == 2 and "not served" in bad.output
    # each once a traceback (int64 overflow, or an infinite timeout converted to an integer)
    for flag, value, message in (
        ("--vocab-size", str(10**30), "--vocab-size must be in 1..10,000,000"),
        ("--max-model-len", str(10**30), "--max-model-len must be in 2..1,000,000,000"),
        ("--max-model-len", "1", "--max-model-len must be in 2..1,000,000,000, got 1"),
        ("--timeout", "inf", "--timeout must be a finite number of seconds > 0, got inf"),
    ):
        args = ["bench-serve", "--base-url", server.url + "/v1", "--model", MODEL, "--trace", "sharegpt", "--rate", "1"]
        bad = CliRunner().invoke(main, [*args, flag, value])
        assert bad.exit_code == 2 and message in bad.output, bad.output


def test_sigterm_drains_running_requests_and_refuses_new_ones(tmp_path):
    port = free_loopback_port()
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "sloserve.cli",
            "serve",
            "--model",
            "random:tiny-llama",
            "--port",
            str(port),
            "--drain-timeout",
            "60",
        ],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        env=env,
    )
    url = f"http://127.0.0.1:{port}"
    try:
        wait_until_ready(url, process=proc, timeout_s=60)
        body = {"model": "random:tiny-llama", "prompt": "Hi", "max_tokens": 300, "ignore_eos": True, "stream": True}
        with httpx.stream("POST", url + "/v1/completions", json=body, timeout=60) as response:
            lines = response.iter_lines()
            next(line for line in lines if line.startswith("data: "))
            proc.send_signal(signal.SIGTERM)
            time.sleep(0.3)
            refused = httpx.post(url + "/v1/completions", json={**body, "stream": False})
            rest = [line for line in lines if line.startswith("data: ")]
        assert refused.status_code == 503 and refused.json()["error"]["code"] == "shutting_down"
        assert rest[-1] == "data: [DONE]" and json.loads(rest[-2][6:])["choices"][0]["finish_reason"] == "length"
        assert proc.wait(timeout=60) == 0
    finally:
        if proc.poll() is None:
            proc.kill()


def test_the_bench_client_records_when_it_wrote_each_request(server):
    """``BenchResult.sent_s``: each request's headers written (the client's clock), after its send began and
    before its first token came back; the check of the model list before the load is not among them."""
    from sloserve.bench.client import run_benchmark, synthetic_prompts

    requests = workload_from_trace(
        "sharegpt", num_requests=6, seed=0, context_len=256, offline=True, max_tokens=4
    ).requests
    result = run_benchmark(server.url + "/v1", MODEL, requests, synthetic_prompts(requests, VOCAB, seed=0))
    assert not result.errors and len(result.sent_s) == 6
    assert result.sent_s == sorted(result.sent_s)
    assert min(r.arrival_time for r in requests) <= result.sent_s[0]
    assert result.sent_s[-1] <= max(r.first_token_time for r in requests)


def test_bench_serve_sends_a_workloads_classes_and_closed_loop_batches(server, tmp_path):
    """An RT stream with an SLO and BE batches each sent when the one before it completes: every
    request completes, the BE ones as best-effort (service_tier flex) and the RT ones with their SLO."""
    from click.testing import CliRunner

    from sloserve.cli import main

    spec = tmp_path / "mix.yaml"
    spec.write_text("""name: mix
streams:
  - name: rt
    class: rt
    source: {uniform: {prompt: [8, 24], output: [4, 8]}}
    arrival: {process: poisson, rate: 20}
    num_requests: 10
    slo: {ttft_s: 5.0, tpot_s: 1.0}
  - name: be
    class: be
    source: {uniform: {prompt: [16, 32], output: [4, 8]}}
    arrival: {process: closed-batches, batch_size: 4}
    num_requests: 12
""")
    be_before = server.metric("sloserve_requests_total", request_class="be", outcome="length")
    slo_before = server.metric("sloserve_slo_requests_total", request_class="rt", met="true")
    result = CliRunner().invoke(
        main,
        [
            "bench-serve",
            "--base-url",
            server.url + "/v1",
            "--model",
            MODEL,
            "--workload",
            str(spec),
            "--vocab-size",
            str(VOCAB),
            "--json",
        ],
    )
    assert result.exit_code == 0, result.output
    summary = json.loads(result.output)
    assert summary["completed"] == 22 and summary["classes"]["be"]["completed"] == 12
    assert summary["classes"]["rt"]["slo_attainment"] == 1.0
    assert server.metric("sloserve_requests_total", request_class="be", outcome="length") == be_before + 12
    assert server.metric("sloserve_slo_requests_total", request_class="rt", met="true") == slo_before + 10


def test_a_resent_conversation_reports_its_cached_tokens(server):
    """Prefix caching is on by default (vLLM v1): the second time a long prompt comes, its full blocks
    are found; the OpenAI SDK reads them in usage.prompt_tokens_details.cached_tokens, and /metrics
    counts the tokens looked up and found."""
    before = server.metric("sloserve_prefix_cache_hits_total", replica="0")
    history = "User: tell me about latency and throughput. " * 6
    first = server.client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": history}], max_tokens=4, temperature=0
    )
    assert first.usage.prompt_tokens_details.cached_tokens == 0
    second = server.client.chat.completions.create(
        model=MODEL,
        messages=[
            {"role": "user", "content": history},
            {"role": "assistant", "content": first.choices[0].message.content},
            {"role": "user", "content": "And why?"},
        ],
        max_tokens=4,
        temperature=0,
    )
    cached = second.usage.prompt_tokens_details.cached_tokens
    assert 0 < cached < second.usage.prompt_tokens and cached % 16 == 0
    for _ in range(2):  # a completion prompt sent again (not a prefix of the chat's: the template wraps it)
        completion = server.client.completions.create(model=MODEL, prompt=history, max_tokens=2, temperature=0)
    assert completion.usage.prompt_tokens_details.cached_tokens > 0
    assert server.metric("sloserve_prefix_cache_hits_total", replica="0") - before >= cached
    assert server.metric("sloserve_prefix_cache_queries_total", replica="0") > server.metric(
        "sloserve_prefix_cache_hits_total", replica="0"
    )


def _reset_while_a_request_runs(server) -> httpx.Response:
    """``POST /reset_prefix_cache`` sent while a streamed request is running: the engine process is paused once
    the stream has begun, until the reset is in its pipe (a try where the tiny model finished the request
    first is made again)."""
    body = {"model": MODEL, "prompt": "Hello", "max_tokens": 240, "ignore_eos": True, "stream": True}
    pid = server.engine._process.pid
    for _ in range(5):
        with (
            httpx.stream("POST", server.url + "/v1/completions", json=body, timeout=30) as response,
            concurrent.futures.ThreadPoolExecutor(1) as pool,
        ):
            lines = response.iter_lines()  # NOTE: held: a collected iterator would close the stream (an abort)
            next(line for line in lines if line.startswith("data: "))
            os.kill(pid, signal.SIGSTOP)
            try:
                time.sleep(0.2)  # (what the engine sent before it stopped is read)
                if server.engine.num_unfinished:
                    asked = pool.submit(httpx.post, server.url + "/reset_prefix_cache", timeout=30)
                    deadline = time.monotonic() + 10
                    while not server.engine._answers:  # (until the question is in the engine's pipe)
                        assert time.monotonic() < deadline, "the reset never reached the engine's pipe"
                        time.sleep(0.01)
            finally:
                os.kill(pid, signal.SIGCONT)
            if server.engine.num_unfinished:
                return asked.result()
    raise AssertionError("the request finished before the engine was paused, five times")


def test_reset_prefix_cache_makes_a_resent_prompt_compute_afresh(server):
    """vLLM's ``POST /reset_prefix_cache``: 200 with an empty body, then a prompt sent again finds nothing cached
    (and gets the same answer); 409 naming why while a request is served, 200 once its client left; 400 for
    ``reset_running_requests``."""
    prompt = "Tell me about latency and throughput once more. " * 6

    def sent() -> tuple[int, str]:
        answer = server.client.completions.create(model=MODEL, prompt=prompt, max_tokens=2, temperature=0)
        return answer.usage.prompt_tokens_details.cached_tokens, answer.choices[0].text

    first = sent()
    assert sent()[0] > 0
    reset = httpx.post(server.url + "/reset_prefix_cache")
    assert reset.status_code == 200 and reset.content == b""
    assert sent() == (0, first[1])
    busy = _reset_while_a_request_runs(server)
    assert busy.status_code == 409 and busy.json()["error"]["code"] == "requests_running"
    assert "while requests hold KV (1 unfinished)" in busy.json()["error"]["message"]
    # (its client left: the server aborts its request)
    deadline = time.monotonic() + 30
    while (reset := httpx.post(server.url + "/reset_prefix_cache")).status_code == 409:
        assert time.monotonic() < deadline, "the aborted request still holds its KV"
        time.sleep(0.05)
    assert reset.status_code == 200 and sent() == (0, first[1])
    refused = httpx.post(server.url + "/reset_prefix_cache", params={"reset_running_requests": "true"})
    assert refused.status_code == 400 and refused.json()["error"]["param"] == "reset_running_requests"


def test_bench_serve_resets_the_servers_prefix_cache_so_each_run_starts_cold(server, tmp_path):
    """``bench-serve --reset-prefix-cache``: a trace with prefix structure replayed twice finds the same cached
    tokens each time (what its own turns share); replayed again without the reset it finds more (the run
    before left them). A server without the route: exit 2 naming it."""
    from click.testing import CliRunner

    from sloserve.cli import main

    args = ["bench-serve", "--base-url", server.url + "/v1", "--model", MODEL, "--trace", "mooncake-conv"]
    args += ["--rate", "50", "--num-requests", "12", "--max-tokens", "2", "--vocab-size", str(VOCAB), "--json"]
    cached = []
    for reset in (True, True, False):
        result = CliRunner().invoke(main, args + (["--reset-prefix-cache"] if reset else []))
        assert result.exit_code == 0, result.output
        summary = json.loads(result.output)
        assert summary["completed"] == 12 and summary["prefix_cache_reset"] is reset
        cached.append(summary["cached_tokens"])
    assert cached[0] == cached[1] < cached[2], cached
    elsewhere = ["--base-url", server.url + "/elsewhere/v1", "--reset-prefix-cache", "--max-model-len", "256"]
    bad = CliRunner().invoke(main, args[:1] + elsewhere + args[3:])
    assert bad.exit_code == 2 and "POST " + server.url + "/elsewhere/reset_prefix_cache answered 404" in bad.output


def test_bench_serve_sends_the_same_tokens_for_the_same_hash_ids():
    """bench-serve's prompts for a trace with prefix structure: a server caching by tokens finds what
    the simulation finds by ids (the engine's ``run`` uses the same tokens)."""
    from sloserve.bench.client import synthetic_prompts
    from sloserve.workload import workload_from_trace

    requests = workload_from_trace(
        "mooncake-conv", num_requests=20, seed=0, context_len=4096, trace_arrivals=True
    ).requests
    prompts = synthetic_prompts(requests, 32000, seed=0)
    for r, prompt in zip(requests, prompts, strict=True):
        assert prompt == r.prompt_blocks.token_ids(32000) and len(prompt) == r.num_prompt_tokens
    from sloserve.core.prefix import TokenPrompt

    first, second = (TokenPrompt(p).block_keys(16) for p in prompts[:2])
    shared_ids = sum(x == y for x, y in zip(*(r.prompt_blocks.block_keys(16) for r in requests[:2])))
    assert sum(x == y for x, y in zip(first, second)) == shared_ids


def test_serve_config_serves_the_planned_deployment(tmp_path):
    """`serve --config deploy.yaml` (as `sloserve plan` writes it): its scheduler, options and SLO, flags given
    on the command line winning; what only the simulator has (tensor parallelism, P:D) refused in one line."""
    from click.testing import CliRunner

    from sloserve.cli import main
    from sloserve.plan.deploy import Deployment, PlannedSlo, write_deployment

    planned = Deployment(
        model="llama-2-7b",
        gpu="h100",
        scheduler="sarathi",
        scheduler_options={"prefill_token_budget": 64},
        router="least-outstanding",
        slo=PlannedSlo(ttft_s=0.5, tpot_s=0.05),
    )
    config = write_deployment(planned, tmp_path / "deploy.yaml", "a test")
    log = tmp_path / "requests.jsonl"
    port = free_loopback_port()
    command = [sys.executable, "-m", "sloserve.cli", "serve", "--config", str(config), "--model", "random:tiny-llama",
               "--port", str(port), "--request-log", str(log), "--rt-tpot-ms", "80"]  # fmt: skip
    proc = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        wait_until_ready(f"http://127.0.0.1:{port}", process=proc, timeout_s=60)
        body = {"model": "random:tiny-llama", "prompt": [1, 2, 3], "max_tokens": 4, "ignore_eos": True}
        assert httpx.post(f"http://127.0.0.1:{port}/v1/completions", json=body, timeout=30).status_code == 200
    finally:
        proc.terminate()
        output = proc.communicate(timeout=60)[0]
    assert "with sarathi" in output
    line = json.loads(log.read_text().splitlines()[0])
    assert (line["slo_ttft_s"], line["slo_tpot_s"]) == (0.5, 0.08)  # the plan's TTFT; --rt-tpot-ms given here

    def refused(deployment: Deployment | str) -> str:
        path = tmp_path / "bad.yaml"
        if isinstance(deployment, str):
            path.write_text(deployment)
        else:
            write_deployment(deployment, path, "bad")
        result = CliRunner().invoke(main, ["serve", "--config", str(path), "--model", "random:tiny-llama"])
        assert result.exit_code == 2 and len(result.output.strip().splitlines()) == 1, result.output
        return result.output

    assert "tensor_parallel 2" in refused(Deployment(tensor_parallel=2))
    assert "disaggregate 1:2" in refused(Deployment(disaggregate="1:2"))
    assert "replicas: Input should be greater than or equal to 1" in refused("replicas: 0\n")
    assert "gpus: Extra inputs are not permitted" in refused("gpus: h100\n")
    assert "not YAML: line 2, column 1: while parsing a flow node" in refused("model: [\n")
    assert "prefill_token_budget must be >= 1, got -5" in refused("scheduler_options: {prefill_token_budget: -5}\n")


def test_the_device_idle_counter_is_per_engine_and_counts_nothing_on_the_cpu(server):
    """``sloserve_device_idle_seconds_total`` (a GPU's waits for the host between steps) comes with each
    engine's stats; on the CPU the host is the device and nothing is counted."""
    server.client.completions.create(model=MODEL, prompt="Hello", max_tokens=5, temperature=0)
    text = httpx.get(server.url + "/metrics").text
    assert re.search(r'^sloserve_device_idle_seconds_total\{replica="0"\} 0\.0$', text, re.MULTILINE)


def test_full_garbage_collections_are_counted_for_the_server_and_each_engine(server):
    """``sloserve_gc_full_collections_total{process}`` and their seconds: the server's own process (here, the
    test's: a full collection of it counts) and its engine's (``engine-0``, from the engine's stats)."""

    def counted(process: str) -> tuple[float, float]:
        text = httpx.get(server.url + "/metrics").text
        count, seconds = (
            re.search(rf'^sloserve_gc_full_collection{name}_total\{{process="{process}"\}} (\S+)$', text, re.MULTILINE)
            for name in ("s", "_seconds")
        )
        assert count is not None and seconds is not None, f"no counts for {process}"
        return float(count.group(1)), float(seconds.group(1))

    server.client.completions.create(model=MODEL, prompt="Hello", max_tokens=5, temperature=0)
    before = counted("server")
    gc.collect()
    after = counted("server")
    assert after[0] >= before[0] + 1
    assert after[1] > before[1]
    assert counted("engine-0")[0] >= 0


def test_an_engines_full_collections_count_once_and_from_zero_after_a_restart():
    """The engine reports totals since its process started serving; the server's counters take what they grew
    by, and a replica's new process (Ray Serve restarts it) starts again from 0."""
    from prometheus_client import generate_latest

    from sloserve.engine.engine_core import EngineStats
    from sloserve.server.metrics import ServerMetrics

    metrics = ServerMetrics(MODEL)
    try:
        for count, seconds in ((3, 0.3), (5, 0.5), (1, 0.1)):  # (the third: a restarted process)
            metrics.on_step(EngineStats(0, 0, 0, 0, 0, 1, 0, gc_full_collections=count, gc_full_collection_s=seconds))
        text = generate_latest(metrics.registry).decode()
    finally:
        metrics.close()
    assert re.search(r'^sloserve_gc_full_collections_total\{process="engine-0"\} 6\.0$', text, re.MULTILINE)
    found = re.search(r'^sloserve_gc_full_collection_seconds_total\{process="engine-0"\} (\S+)$', text, re.MULTILINE)
    assert found is not None and float(found.group(1)) == pytest.approx(0.6)


def test_metrics_answer_under_vllms_names_too(server):
    """vLLM's dashboard reads vllm:* families with a model_name label; each is ours, renamed; the
    request phases (queue, prefill, decode) and lengths are histograms under both names."""
    server.client.completions.create(model=MODEL, prompt="Hello world", max_tokens=5, temperature=0)
    text = httpx.get(server.url + "/metrics").text
    for name in ("vllm:num_requests_running", "vllm:kv_cache_usage_perc", "vllm:gpu_cache_usage_perc",
                 "vllm:time_to_first_token_seconds_bucket", "vllm:request_queue_time_seconds_count",
                 "vllm:request_prefill_time_seconds_count", "vllm:request_decode_time_seconds_count",
                 "vllm:request_prompt_tokens_bucket", "vllm:request_generation_tokens_sum"):  # fmt: skip
        assert re.search(rf'^{re.escape(name)}{{[^}}]*model_name="{MODEL}"', text, re.MULTILINE), name
    for ours, theirs in (("sloserve_prompt_tokens_total", "vllm:prompt_tokens_total"),
                         ("sloserve_generation_tokens_total", "vllm:generation_tokens_total")):  # fmt: skip
        assert server.metric(theirs, model_name=MODEL) == server.metric(ours) > 0
    assert server.metric("vllm:request_success_total", model_name=MODEL, finished_reason="length",
                         request_class="rt") == server.metric("sloserve_requests_total", outcome="length",
                                                              request_class="rt")  # fmt: skip
    count = server.metric("sloserve_request_queue_time_seconds_count", request_class="rt")
    assert count == server.metric("sloserve_time_to_first_token_seconds_count", request_class="rt") > 0
