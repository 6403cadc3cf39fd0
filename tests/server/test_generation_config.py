"""The model's sampling defaults (its ``generation_config.json``, vLLM's ``--generation-config auto``): a
request that leaves ``temperature``, ``top_p``, ``top_k``, ``min_p`` or ``repetition_penalty`` unset (or
null) samples with the model's; one that sets them, with its own; ``--generation-config vllm``, with the
API's. Here the model's ``top_p`` (or ``top_k``) keeps one token: sampling gives its greedy tokens."""

from __future__ import annotations

import json
import shutil

import pytest

pytest.importorskip("torch")
openai = pytest.importorskip("openai")

from served_model import MODEL, Server  # noqa: E402
from sloserve import LLM, SamplingParams  # noqa: E402
from sloserve.core.errors import ConfigError  # noqa: E402
from sloserve.server.serve import generation_defaults  # noqa: E402

PROMPT = "The quick brown fox jumps over"
SEEDS = range(4)


def with_generation_config(source, directory, **sampling):
    """A copy of the model in ``source`` whose generation config sets ``sampling``."""
    shutil.copytree(source, directory)
    config = json.loads((directory / "generation_config.json").read_text())
    (directory / "generation_config.json").write_text(json.dumps({**config, "do_sample": True, **sampling}))
    return directory


@pytest.fixture(scope="module")
def model_dir(chat_model_dir, tmp_path_factory):
    # NOTE: top_p 0.01 keeps the likeliest token alone: sampling at any temperature gives the greedy tokens;
    # top_k 50 is transformers' default, not the model's choice, so not applied (as vLLM reads it)
    return with_generation_config(
        chat_model_dir, tmp_path_factory.mktemp("generation-config") / "model", temperature=0.7, top_p=0.01, top_k=50,
        max_new_tokens=6,
    )  # fmt: skip


@pytest.fixture(scope="module")
def server(model_dir):
    s = Server(model_dir)
    yield s
    s.stop()


def completion_text(server: Server, **fields) -> str:
    return server.client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=8, **fields).choices[0].text


def test_unset_sampling_fields_take_the_models_defaults_and_set_ones_win(server):
    greedy = completion_text(server, temperature=0)
    assert {completion_text(server, seed=seed) for seed in SEEDS} == {greedy}  # the model's top_p
    assert {completion_text(server, seed=seed, top_p=None) for seed in SEEDS} == {greedy}  # null: unset
    assert {completion_text(server, seed=seed, top_p=1.0) for seed in SEEDS} != {greedy}  # the request's wins
    chat = dict(model=MODEL, messages=[{"role": "user", "content": "hi"}], max_tokens=8)
    as_greedy = server.client.chat.completions.create(**chat, temperature=0).choices[0].message.content
    assert server.client.chat.completions.create(**chat, seed=1).choices[0].message.content == as_greedy
    response = server.client.responses.create(model=MODEL, input="hi", max_output_tokens=8, extra_body={"seed": 1})
    assert response.output_text == as_greedy
    assert (response.temperature, response.top_p) == (0.7, 0.01)  # echoed as sampled
    # the model's max_new_tokens is the max_tokens of a request that sets none (vLLM's fallback)
    unset = server.client.chat.completions.create(**{**chat, "max_tokens": None}, extra_body={"ignore_eos": True})
    asked = server.client.chat.completions.create(**{**chat, "max_tokens": 8}, extra_body={"ignore_eos": True})
    assert (unset.usage.completion_tokens, asked.usage.completion_tokens) == (6, 8)
    sampled = {server.client.responses.create(model=MODEL, input="hi", max_output_tokens=8, top_p=1.0,
                                              extra_body={"seed": seed}).output_text for seed in SEEDS}  # fmt: skip
    assert sampled != {as_greedy}
    echoed = server.client.responses.create(model=MODEL, input="hi", max_output_tokens=2, top_p=1.0, temperature=0)
    assert (echoed.temperature, echoed.top_p) == (0, 1.0)


@pytest.mark.parametrize(
    "sampling, flag, greedy_when_unset",
    [({"top_k": 1, "min_p": 0.0}, "auto", True), ({"top_p": 0.01}, "vllm", False)],
)
def test_the_models_top_k_and_generation_config_vllm(chat_model_dir, tmp_path, sampling, flag, greedy_when_unset):
    """The model's top_k 1 gives the greedy tokens too; ``--generation-config vllm`` samples with the
    API's defaults whatever the model's are."""
    server = Server(with_generation_config(chat_model_dir, tmp_path / "model", **sampling), generation_config=flag)
    try:
        greedy = completion_text(server, temperature=0)
        assert ({completion_text(server, seed=seed) for seed in SEEDS} == {greedy}) == greedy_when_unset
    finally:
        server.stop()


def test_llm_generate_without_params_samples_with_the_models_defaults(model_dir):
    """As vLLM's ``LLM``: ``generate`` given no sampling params uses ``get_default_sampling_params``."""
    llm = LLM(str(model_dir), kv_capacity_tokens=1024)
    defaults = llm.get_default_sampling_params()
    assert (defaults.temperature, defaults.top_p, defaults.max_tokens) == (0.7, 0.01, 6)
    greedy = llm.generate(PROMPT, SamplingParams(temperature=0, max_tokens=6))[0].outputs[0].text
    assert {llm.generate(PROMPT)[0].outputs[0].text for _ in SEEDS} == {greedy}
    assert LLM("random:tiny-llama").get_default_sampling_params() == SamplingParams()


def test_a_generation_config_that_cannot_be_served_is_one_clear_error(tmp_path, model_dir):
    assert generation_defaults(str(model_dir), "vllm") == {}
    assert generation_defaults(str(model_dir), "auto") == {"temperature": 0.7, "top_p": 0.01, "max_tokens": 6}
    assert generation_defaults("random:tiny-llama", "auto") == {}
    with pytest.raises(ConfigError, match="--generation-config must be auto, vllm or a directory, got 'nowhere'"):
        generation_defaults(str(model_dir), "nowhere")
    for value, message in (('"hot"', "temperature must be a number, got 'hot'"), ("-1", "temperature must be")):
        (tmp_path / "generation_config.json").write_text(f'{{"temperature": {value}}}')
        with pytest.raises(ConfigError, match=f"generation_config.json: .*{message}"):
            generation_defaults(str(model_dir), str(tmp_path))
