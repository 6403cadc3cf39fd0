"""The real engine against HuggingFace transformers: the same greedy tokens whatever the policy, the
KV layout, the attention backend or the preemptions, on tiny random Llama (GQA) models and a few others in
float32; the offline API (stop strings and tokens, chat, beam search, n, structured outputs), the CLI's
engine commands and the simulator's steps on the engine. Each architecture against its transformers model:
test_architectures.py."""

from __future__ import annotations

import dataclasses
import json
import os
import re
import shutil

import numpy as np
import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from hf_models import MAX_TOKENS, PROMPTS, VOCAB, greedy_tokens, hf_cached, hf_greedy, reference  # noqa: E402
from sloserve import LLM, SamplingParams  # noqa: E402
from sloserve.core.errors import ConfigError  # noqa: E402
from sloserve.sched import scheduler_names  # noqa: E402


@pytest.mark.parametrize("scheduler", scheduler_names())
def test_every_scheduler_gives_hf_greedy_tokens(hf_dirs, scheduler):
    tokens, _ = greedy_tokens(hf_dirs["llama"], scheduler)
    assert tokens == reference("llama")


@pytest.mark.parametrize("kv_manager", ["paged", "max", "exact", "bidirectional"])
@pytest.mark.parametrize("block_size", [4, 16])
def test_every_kv_manager_gives_hf_greedy_tokens(hf_dirs, kv_manager, block_size):
    scheduler = "bros" if kv_manager == "bidirectional" else "vllm"
    tokens, _ = greedy_tokens(hf_dirs["llama"], scheduler, kv_manager=kv_manager, block_size=block_size)
    assert tokens == reference("llama")


def test_chunked_prefill_in_small_chunks(hf_dirs):
    """Sarathi with an 8-token prefill budget: prompts run as chunks over several steps, each
    attending to its earlier chunks through the slot table (bottom-right causal mask)."""
    tokens, llm = greedy_tokens(hf_dirs["opt"], "sarathi", prefill_token_budget=8, block_size=4)
    assert tokens == reference("opt")
    assert llm.engine.replica.timeline.as_dict()["num_prefill_tokens"].max() <= 8


def test_econoserve_offload_free_stops_keep_kv_in_place(hf_dirs):
    """Under-predicted GTs (predicted 2-5 tokens) outgrow their regions and the reserve: they stop
    with their KV where it is and resume in extended regions; every token still equals HF's."""
    from helpers import FixedPredictor

    llm = LLM(
        hf_dirs["llama"],
        "econoserve",
        kv_capacity_tokens=128,
        block_size=4,
        buffer=0.0,
        padding=0.0,
        reserve=0.25,
        target_forward_size=16,
    )
    llm.engine.scheduler.predictor = FixedPredictor({0: 5, 1: 2, 3: 3, 5: 4})
    params = [SamplingParams(max_tokens=n, temperature=0, ignore_eos=True) for n in MAX_TOKENS]
    outputs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], params)
    assert [o.outputs[0].token_ids for o in outputs] == reference("llama")
    assert llm.engine.scheduler.num_offload_free_stops > 0


@pytest.mark.parametrize("preemption", ["recompute", "swap"])
@pytest.mark.parametrize("scheduler", ["vllm", "sarathi"])
def test_forced_preemption_loses_nothing(hf_dirs, scheduler, preemption):
    """A KV cache of 64 slots cannot hold all six requests: some are evicted and come back (refilled
    from prompt + generated tokens, or swapped back in), and every token still equals HF's."""
    tokens, llm = greedy_tokens(
        hf_dirs["llama"], scheduler, kv_capacity_tokens=64, block_size=4, preemption_mode=preemption
    )
    assert tokens == reference("llama")
    assert llm.engine.scheduler.num_preemptions > 0
    if preemption == "swap":
        assert llm.engine.scheduler.kv.swapped_bytes > 0


@pytest.mark.parametrize(
    "options",
    [
        {},
        dict(kv_capacity_tokens=64, block_size=4, preemption_mode="recompute"),  # refilled, counts kept
        dict(async_scheduling=True),  # each row's last token counted on the device
    ],
)
def test_a_repetition_penalty_gives_hf_greedy_tokens_with_the_same_penalty(hf_dirs, options):
    """vLLM's repetition penalty is HF's (a score of a token in the prompt or the output so far divided by
    it, multiplied where negative): greedy tokens with it equal HF's ``generate(repetition_penalty=...)``,
    with the counts kept from step to step (``PenaltyCounts``) through preemptions and async scheduling."""
    penalty = 1.8
    want = []
    for prompt, n in zip(PROMPTS, MAX_TOKENS, strict=True):
        gen = hf_cached("llama").generate(torch.tensor([prompt]), max_new_tokens=n, min_new_tokens=n,
                                           do_sample=False, eos_token_id=None, pad_token_id=0,
                                           repetition_penalty=penalty)  # fmt: skip
        want.append(gen[0, len(prompt) :].tolist())
    assert want != reference("llama"), "the penalty changes no token: the test would not see it"
    llm = LLM(hf_dirs["llama"], "vllm", **options)
    params = [
        SamplingParams(max_tokens=n, temperature=0, ignore_eos=True, repetition_penalty=penalty) for n in MAX_TOKENS
    ]
    for _ in range(2):  # (the second time in the rows the first left: freed, and found clean)
        outputs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], params)
        assert [o.outputs[0].token_ids for o in outputs] == want
        assert not llm.engine.executor.penalties
    if "preemption_mode" in options:
        assert llm.engine.scheduler.num_preemptions > 0


@pytest.mark.parametrize(
    "arch,scheduler,options",
    [
        ("llama", "sarathi", dict(prefill_token_budget=8, block_size=4)),  # chunks attend to earlier chunks
        ("qwen2", "vllm", dict(kv_capacity_tokens=64, block_size=4, preemption_mode="recompute")),
        ("qwen3", "sarathi", dict(prefill_token_budget=8, block_size=4)),
        ("gemma3", "sarathi", dict(prefill_token_budget=8, block_size=4)),  # a sliding window of 8
        ("opt", "sarathi", dict(kv_capacity_tokens=64, block_size=4, preemption_mode="swap")),
        ("llama", "bros", {}),  # bidirectional KV blocks
        ("gpt_oss", "sarathi", dict(prefill_token_budget=8, block_size=4)),  # attention sinks, a window of 8
        ("ministral3", "vllm", {}),  # the queries' own rotary tables
        ("deepseek_v2", "sarathi", dict(prefill_token_budget=8, block_size=4)),  # MLA: one 40-wide latent head
        ("bloom", "vllm", {}),  # ALiBi (its kernels on 6 heads' slopes, chunks and splits: test_triton_attention.py)
    ],
)
def test_triton_backend_gives_hf_greedy_tokens(hf_dirs, arch, scheduler, options):
    """The Triton kernels (in Triton's interpreter without CUDA) drive the whole engine: the same
    greedy tokens as HF, through chunked prefill, preemption by recompute and swap, and BROS's layout."""
    pytest.importorskip("triton")
    # NOTE: on a GPU machine the kernels are compiled for CUDA (there is no interpreter to run them on
    # the CPU), still in float32: cuBLAS does not round float32 matmuls to tf32 unless asked to.
    device = "cuda" if torch.cuda.is_available() else "cpu"
    tokens, llm = greedy_tokens(hf_dirs[arch], scheduler, attention_backend="triton", device=device, **options)
    assert llm.loaded.attention_backend == "triton"
    assert tokens == reference(arch)
    if "preemption_mode" in options:
        assert llm.engine.scheduler.num_preemptions > 0


@pytest.mark.parametrize("in_kernel", ["0", "1"], ids=["combine_kernel", "combined_in_kernel"])
@pytest.mark.parametrize("arch", ["llama", "gemma3"])
def test_split_decodes_give_hf_greedy_tokens(hf_dirs, arch, in_kernel, monkeypatch):
    """Flash decoding (each decode's context in 3 splits, forced) through the whole engine, a sliding
    window too, the splits merged by a second kernel or by the decode kernel's last split
    (``SLOSERVE_COMBINE_SPLITS_IN_KERNEL``): HF's greedy tokens."""
    pytest.importorskip("triton")
    from sloserve.engine import triton_attention

    monkeypatch.setattr(triton_attention, "_SPLITS_SETTING", "3")
    monkeypatch.setenv("SLOSERVE_COMBINE_SPLITS_IN_KERNEL", in_kernel)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    tokens, llm = greedy_tokens(
        hf_dirs[arch], "sarathi", attention_backend="triton", device=device, prefill_token_budget=8, block_size=4
    )
    backend = next(m.backend for m in llm.loaded.model.modules() if hasattr(m, "backend"))
    assert backend.num_decode_splits == 3 and backend.combine_splits_in_kernel is (in_kernel == "1")
    assert tokens == reference(arch)


@pytest.mark.parametrize("arch", ["llama", "gemma3"])
def test_dense_prefills_give_hf_greedy_tokens(hf_dirs, arch, monkeypatch):
    """Prompts with nothing cached attend densely (SDPA, ``SLOSERVE_DENSE_PREFILL=1``, the threshold
    lowered to reach the test's prompts) through the whole engine; a sliding-window layer keeps the
    kernel: HF's greedy tokens."""
    pytest.importorskip("triton")
    from sloserve.engine import triton_attention

    monkeypatch.setenv("SLOSERVE_DENSE_PREFILL", "1")
    monkeypatch.setattr(triton_attention, "DENSE_PREFILL_MIN_TOKENS", 2)
    dense_calls = []
    real_dense = triton_attention._dense_causal
    monkeypatch.setattr(triton_attention, "_dense_causal", lambda *args: dense_calls.append(1) or real_dense(*args))
    device = "cuda" if torch.cuda.is_available() else "cpu"
    tokens, _ = greedy_tokens(hf_dirs[arch], "vllm", attention_backend="triton", device=device, block_size=4)
    assert dense_calls and tokens == reference(arch)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="a second CUDA stream")
def test_on_cuda_prefills_attending_beside_decodes_give_hf_greedy_tokens(hf_dirs, monkeypatch):
    """Sarathi's mixed steps (8-token chunks beside the decodes) with each chunk's attention on a second stream
    (``SLOSERVE_OVERLAP_ATTENTION=1``): HF's greedy tokens."""
    pytest.importorskip("triton")
    from sloserve.engine import triton_attention

    monkeypatch.setenv("SLOSERVE_OVERLAP_ATTENTION", "1")
    forks = []
    real_beside = triton_attention.SideStream.beside
    monkeypatch.setattr(triton_attention.SideStream, "beside", lambda *args: forks.append(1) or real_beside(*args))
    tokens, _ = greedy_tokens(
        hf_dirs["llama"], "sarathi", attention_backend="triton", device="cuda", prefill_token_budget=8, block_size=4
    )
    assert forks and tokens == reference("llama")


@pytest.mark.skipif(not torch.cuda.is_available(), reason="the default KV cache on CUDA")
def test_on_cuda_the_default_kv_cache_fits_in_the_processs_memory_share(hf_dirs):
    """A process held to a share of the GPU (``torch.cuda.set_per_process_memory_fraction``, as engines
    sharing one GPU are): an engine given no KV capacity takes 90% of what the share leaves, and runs."""
    from sloserve.engine.llm_engine import kv_bytes_per_token

    before = torch.cuda.get_per_process_memory_fraction()
    torch.cuda.empty_cache()
    held = torch.cuda.memory_reserved()  # engines of earlier tests not yet collected
    share_bytes = held + (1 << 30)
    torch.cuda.set_per_process_memory_fraction(share_bytes / torch.cuda.mem_get_info()[1])
    try:
        tokens, llm = greedy_tokens(hf_dirs["llama"], "vllm", device="cuda")
        kv_bytes = llm.engine.scheduler.kv.capacity_tokens * kv_bytes_per_token(llm.loaded)
        others = torch.cuda.memory_reserved() - kv_bytes  # those, the weights, the steps' activations
        assert 0.8 * (share_bytes - others) <= kv_bytes <= 0.9 * (share_bytes - held)
        assert tokens == reference("llama")
    finally:
        torch.cuda.set_per_process_memory_fraction(before)


def test_eos_stops_a_request(hf_dirs, tmp_path):
    """With EOS = the 4th greedy token of prompt 0, that request stops there ('stop'); others run on."""
    ref = reference("llama")
    eos = ref[0][3]
    path = tmp_path / "model"
    shutil.copytree(hf_dirs["llama"], path)
    config = json.loads((path / "config.json").read_text())
    config["eos_token_id"] = eos
    (path / "config.json").write_text(json.dumps(config))
    llm = LLM(str(path))
    out = llm.generate([{"prompt_token_ids": PROMPTS[0]}], SamplingParams(max_tokens=12, temperature=0))[0].outputs[0]
    assert out.token_ids == ref[0][: ref[0].index(eos) + 1]
    assert out.finish_reason == "stop"
    forced = llm.generate(
        [{"prompt_token_ids": PROMPTS[0]}], SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)
    )
    assert forced[0].outputs[0].token_ids == ref[0] and forced[0].outputs[0].finish_reason == "length"


def test_stop_strings_end_a_sequence_in_the_step_that_completes_one(reference_llm):
    """``SamplingParams.stop`` offline, as the server's ``stop``: the text ends before the first stop
    string, the tokens end with the one that completed it, and the engine drops the sequence there."""
    llm, prompt = reference_llm, "The quick brown fox"
    greedy = SamplingParams(max_tokens=24, temperature=0, ignore_eos=True)
    full = llm.generate(prompt, greedy)[0].outputs[0]
    middle = len(full.text) // 2
    stop = full.text[middle : middle + 3]
    assert stop.strip() and full.text.index(stop) > 0, full.text
    out = llm.generate(prompt, dataclasses.replace(greedy, stop=["never in the text", stop], n=2))[0].outputs
    assert [o.index for o in out] == [0, 1] and out[0].token_ids == out[1].token_ids
    assert out[0].finish_reason == "stop" and out[0].text == full.text[: full.text.index(stop)]
    assert out[0].stop_reason == stop  # vLLM's: what it stopped on
    cut = out[0].token_ids
    assert cut == full.token_ids[: len(cut)] and len(cut) < len(full.token_ids)
    decode = llm.tokenizer.decode
    assert stop in decode(cut) and stop not in decode(cut[:-1])
    assert not llm.engine.has_unfinished()
    # min_tokens: a stop string ending in the text of the first min_tokens tokens does not count (vLLM's rule)
    held = llm.generate(prompt, dataclasses.replace(greedy, stop=[stop], min_tokens=len(cut)))[0].outputs[0]
    assert held.token_ids[: len(cut)] == cut and len(held.token_ids) > len(cut)
    assert held.text.startswith(out[0].text + stop)
    never = llm.generate(prompt, dataclasses.replace(greedy, stop="never in the text"))[0].outputs[0]
    assert (never.text, never.token_ids, never.finish_reason) == (full.text, full.token_ids, "length")
    assert never.stop_reason is None
    token = full.token_ids[3]
    on_token = llm.generate(prompt, dataclasses.replace(greedy, stop_token_ids=(token,)))[0].outputs[0]
    assert on_token.token_ids == full.token_ids[: full.token_ids.index(token) + 1] and on_token.stop_reason == token
    assert on_token.text == decode(on_token.token_ids[:-1])  # the stop token's text left out, as vLLM
    kept = llm.generate(prompt, dataclasses.replace(greedy, stop_token_ids=(token,), include_stop_str_in_output=True))
    assert kept[0].outputs[0].text == decode(on_token.token_ids)


def test_bad_words_offline_are_tokenized_with_the_models_tokenizer(reference_llm):
    """A word of one token, pushed by a logit bias: greedy takes it, and never with it barred."""
    encode = reference_llm.tokenizer.encode
    word = next(w for w in ("how", "world", "the", "you") if len(encode(w, add_special_tokens=False)) == 1)
    (token,) = encode(word, add_special_tokens=False)
    pushed = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True, logit_bias={token: 30.0})
    assert reference_llm.generate("The quick brown fox", pushed)[0].outputs[0].token_ids[0] == token
    barred = reference_llm.generate("The quick brown fox", dataclasses.replace(pushed, bad_words=[word]))[0]
    assert token not in barred.outputs[0].token_ids
    with pytest.raises(ConfigError, match="prompt 0: every token of allowed_token_ids is a bad word"):
        reference_llm.generate("The quick brown fox", SamplingParams(allowed_token_ids=[token], bad_words=[word]))
    with pytest.raises(
        ConfigError, match=r"text 'fox\\ud800' is not valid Unicode: a lone UTF-16 surrogate at character 3"
    ):
        reference_llm.generate("fox\ud800")  # the tokenizers library's TypeError before
    with pytest.raises(ConfigError, match=r"conversation 1, message 0: content must be a string or text parts, got 5"):
        reference_llm.chat([[{"role": "user", "content": "hi"}], [{"role": "user", "content": 5}]])
    with pytest.raises(ConfigError, match="chat needs a conversation"):
        reference_llm.chat([])  # an IndexError before
    parts = reference_llm.chat(
        [{"role": "user", "content": [{"type": "text", "text": "h"}, {"type": "text", "text": "i"}]}]
    )
    assert parts[0].prompt == reference_llm.chat([{"role": "user", "content": "hi"}])[0].prompt  # joined, as served
    no_tokenizer = LLM("random:tiny-llama")
    with pytest.raises(ConfigError, match="is not valid Unicode"):
        no_tokenizer.generate("fox\udfff")  # bytes: a UnicodeEncodeError before
    no_tokenizer.loaded.tokenizer = None
    with pytest.raises(ConfigError, match="prompt 0: bad_words need the model's tokenizer"):
        no_tokenizer.generate({"prompt_token_ids": [1, 2]}, SamplingParams(bad_words=["x"]))


def test_chat_renders_as_transformers_and_generates_asgreedy_tokens(reference_llm, chat_model_dir):
    """vLLM's ``LLM.chat``: the model's template rendered as transformers' ``apply_chat_template``, the
    same tokens as ``generate`` on that text; a list of conversations; its options (tools too) as the server's."""
    hf = transformers.AutoTokenizer.from_pretrained(chat_model_dir)
    conversations = [[{"role": "user", "content": "Hello world"}],
                     [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello to"}]]  # fmt: skip
    greedy = SamplingParams(max_tokens=6, temperature=0)
    out = reference_llm.chat(conversations[0], greedy)
    rendered = hf.apply_chat_template(conversations[0], add_generation_prompt=True, tokenize=False)
    ids = hf.encode(rendered, add_special_tokens=False)  # the template wrote BOS
    assert out[0].prompt == rendered and out[0].prompt_token_ids == ids
    assert (
        out[0].outputs[0].token_ids == reference_llm.generate({"prompt_token_ids": ids}, greedy)[0].outputs[0].token_ids
    )
    begun = [conversations[1], [*conversations[0], {"role": "assistant", "content": "Hi"}]]
    both = reference_llm.chat(begun, greedy, add_generation_prompt=False, continue_final_message=True)
    assert [o.prompt for o in both] == [hf.apply_chat_template(c, continue_final_message=True, tokenize=False)
                                        for c in begun]  # fmt: skip
    tools = [{"type": "function", "function": {"name": "lookup", "parameters": {"type": "object"}}}]
    with_tools = reference_llm.chat(conversations[0], greedy, tools=tools)[0].prompt
    assert with_tools == hf.apply_chat_template(
        conversations[0], tools=tools, add_generation_prompt=True, tokenize=False
    )
    assert '["lookup"]' in with_tools
    own = "{% for m in messages %}[{{ m.role }}] {{ m.content }}{{ eos_token }}{% endfor %}"
    assert reference_llm.chat(conversations[1], greedy, chat_template=own)[0].prompt == hf.apply_chat_template(
        conversations[1], chat_template=own, tokenize=False
    )
    with pytest.raises(ConfigError, match="continue_final_message continues an assistant message; the last .* 'user'"):
        reference_llm.chat(conversations[0], greedy, add_generation_prompt=False, continue_final_message=True)
    with pytest.raises(ConfigError, match="cannot both be true"):
        reference_llm.chat(conversations[1], greedy, continue_final_message=True)


def test_a_generation_configs_eos_ids_end_a_generation_too(hf_dirs, tmp_path):
    """vLLM adds a generation config's ``eos_token_id`` to every request's stop ids (Qwen2.5 Instruct's
    config.json names <|im_end|>, its generation config <|endoftext|> too); ``ignore_eos`` ignores them
    all. A malformed one is refused by name."""
    model = tmp_path / "model"
    shutil.copytree(hf_dirs["llama"], model)
    eos = json.loads((model / "config.json").read_text())["eos_token_id"]
    (model / "generation_config.json").write_text(json.dumps({"eos_token_id": [eos, 7]}))
    llm = LLM(str(model))
    assert llm.engine.executor.eos_token_ids == {eos, 7}
    forced = {"prompt_token_ids": PROMPTS[0]}
    [out] = llm.generate(forced, SamplingParams(max_tokens=6, temperature=0, logit_bias={7: 100}))
    assert (out.outputs[0].finish_reason, out.outputs[0].token_ids) == ("stop", [7])
    [out] = llm.generate(forced, SamplingParams(max_tokens=6, temperature=0, logit_bias={7: 100}, ignore_eos=True))
    assert (out.outputs[0].finish_reason, out.outputs[0].token_ids) == ("length", [7] * 6)
    for bad in ('{"eos_token_id": "7"}', "{not json"):
        (model / "generation_config.json").write_text(bad)
        with pytest.raises(
            ConfigError, match="generation_config.json: (eos_token_id must be a token id|not valid JSON)"
        ):
            LLM(str(model))


def test_stop_reason_is_none_for_the_tokenizers_eos_and_the_id_for_a_generation_configs_other(chat_model_dir, tmp_path):
    """vLLM's ``stop_reason``: None for the tokenizer's EOS (tokenizer_config.json's ``eos_token``), the
    token id for the generation config's other EOS ids (Llama 3.1 Instruct's <|eom_id|> beside its
    <|eot_id|>), which it adds to each request's ``stop_token_ids``."""
    model = tmp_path / "model"
    shutil.copytree(chat_model_dir, model)
    eos = transformers.AutoTokenizer.from_pretrained(chat_model_dir).eos_token_id
    (model / "generation_config.json").write_text(json.dumps({"eos_token_id": [7, eos]}))
    llm = LLM(str(model))
    assert llm.tokenizer.eos_token_id == eos
    for token, stop_reason in ((eos, None), (7, 7)):
        [out] = llm.generate("Hello", SamplingParams(max_tokens=6, temperature=0, logit_bias={token: 100}))
        ended = out.outputs[0]
        assert (ended.finish_reason, ended.token_ids, ended.stop_reason) == ("stop", [token], stop_reason)
    for bad in ("{not json", "[]"):
        (model / "tokenizer_config.json").write_text(bad)
        with pytest.raises(ConfigError, match="tokenizer_config.json: (cannot read|must be a JSON object)"):
            LLM(str(model))


def test_beam_search_keeps_the_best_beams_as_computed_on_transformers_scores(reference_llm, chat_model_dir):
    """vLLM's ``LLM.beam_search``: the beams equal a beam search written out here on transformers'
    log-softmax (each step: every beam by each of its 2 * width likeliest tokens, the width best kept;
    EOS ends a beam; vLLM's length-penalised score), and width 1 is greedy decoding."""
    from sloserve.engine.beam_search import BeamSearchParams

    model = transformers.AutoModelForCausalLM.from_pretrained(chat_model_dir, dtype=torch.float32).eval()
    tokenizer = reference_llm.tokenizer
    eos = transformers.AutoTokenizer.from_pretrained(chat_model_dir).eos_token_id
    assert reference_llm.engine.executor.eos_token_ids == {eos}
    prompts = ["The quick brown fox", "Hello world"]
    width, steps, penalty = 3, 4, 0.5

    def score(tokens: list[int], total: float) -> float:
        return total / (len(tokens) - (tokens[-1] == eos)) ** penalty

    def by_hand(prompt_ids: list[int]) -> list[tuple[list[int], float]]:
        live, done = [(prompt_ids, 0.0)], []
        for _ in range(steps):
            children = []
            with torch.no_grad():
                for tokens, total in live:
                    row = torch.log_softmax(model(torch.tensor([tokens])).logits[0, -1].float(), dim=-1)
                    values, ids = row.topk(2 * width)
                    for v, t in zip(values.tolist(), ids.tolist(), strict=True):
                        (done if t == eos else children).append((tokens + [t], total + v))
            live = sorted(children, key=lambda b: score(*b), reverse=True)[:width]
        return sorted(done + live, key=lambda b: score(*b), reverse=True)[:width]

    outputs = reference_llm.beam_search(prompts, BeamSearchParams(width, steps, length_penalty=penalty))
    for prompt, output in zip(prompts, outputs, strict=True):
        expected = by_hand(tokenizer.encode(prompt))
        assert [s.tokens for s in output.sequences] == [tokens for tokens, _ in expected]
        assert [s.cum_logprob for s in output.sequences] == pytest.approx([t for _, t in expected], abs=1e-4)
        best = output.sequences[0]
        assert best.text == tokenizer.decode(best.tokens) and len(best.logprobs) == len(best.tokens) - len(
            tokenizer.encode(prompt)
        )
        assert sum(e.logprob for e in best.logprobs) == pytest.approx(best.cum_logprob)
    greedy = SamplingParams(max_tokens=steps, temperature=0, ignore_eos=True)
    one = reference_llm.beam_search(prompts[0], BeamSearchParams(1, steps, ignore_eos=True))[0].sequences
    assert (
        len(one) == 1 and one[0].tokens[-steps:] == reference_llm.generate(prompts[0], greedy)[0].outputs[0].token_ids
    )
    with pytest.raises(ConfigError, match="beam_width must be in 1..10, got 11"):
        BeamSearchParams(11, 4)


def test_n_sequences_are_the_requests_of_seeds_seed_plus_j(reference_llm):
    """``SamplingParams.n``: each prompt's sequence j is what the prompt alone gives with seed + j
    (vLLM's rule, as the server's ``n``)."""
    prompts = ["Hello world", "Hi"]
    sampled = dict(max_tokens=8, temperature=1.0, ignore_eos=True)
    outputs = reference_llm.generate(prompts, SamplingParams(**sampled, seed=11, n=3))
    assert [[c.index for c in o.outputs] for o in outputs] == [[0, 1, 2], [0, 1, 2]]
    for prompt, output in zip(prompts, outputs, strict=True):
        for j, sequence in enumerate(output.outputs):
            alone = reference_llm.generate(prompt, SamplingParams(**sampled, seed=11 + j))[0].outputs[0]
            assert sequence.token_ids == alone.token_ids and sequence.text == alone.text
    assert len({tuple(c.token_ids) for c in outputs[0].outputs}) == 3


def test_structured_outputs_offline_as_vllms_params(reference_llm):
    """``SamplingParams(structured_outputs=StructuredOutputsParams(...))``, vLLM's offline form: every
    sampled sequence is one of the choices or matches the regex whole; a bad constraint is one error."""
    from sloserve import StructuredOutputsParams

    sampled = dict(max_tokens=16, temperature=1.0, seed=0, n=6)
    choices = ["yes", "no", "maybe not"]
    params = SamplingParams(**sampled, structured_outputs=StructuredOutputsParams(choice=choices))
    assert {c.text for c in reference_llm.generate("Hello", params)[0].outputs} <= set(choices)
    regex = r"[a-c]{2,5}-[0-9]{2}"
    params = SamplingParams(**sampled, structured_outputs=StructuredOutputsParams(regex=regex))
    for c in reference_llm.generate("Hello", params)[0].outputs:
        assert c.finish_reason == "stop" and re.fullmatch(regex, c.text), c.text
    with pytest.raises(ConfigError, match="the regular expression cannot be compiled"):
        SamplingParams(structured_outputs=StructuredOutputsParams(regex="("))
    with pytest.raises(ConfigError, match="take one of json, regex, choice, grammar or json_object; got 2"):
        SamplingParams(structured_outputs=StructuredOutputsParams(regex="a", choice=["a"]))


def test_use_tqdm_shows_the_finished_sequences_and_changes_nothing(capsys):
    """vLLM's ``use_tqdm`` (code copied from vLLM passes it): a bar of every sequence, ``n`` included."""
    llm = LLM("random:tiny-llama")
    params = SamplingParams(max_tokens=6, temperature=0, n=2, ignore_eos=True)
    quiet = llm.generate(["hi", "hello there", "a"], params)
    assert capsys.readouterr().err == ""
    shown = llm.generate(["hi", "hello there", "a"], params, use_tqdm=True)
    assert "6/6" in capsys.readouterr().err
    assert [[c.token_ids for c in o.outputs] for o in shown] == [[c.token_ids for c in o.outputs] for o in quiet]


def test_seeded_sampling_does_not_depend_on_the_batch():
    llm = LLM("random:tiny-llama")
    params = SamplingParams(max_tokens=10, temperature=0.8, top_p=0.9, seed=7, ignore_eos=True)
    alone = llm.generate(["sampling"], params)[0].outputs[0].token_ids
    batch = llm.generate(
        ["other", "sampling", "prompts here"],
        [SamplingParams(max_tokens=6, temperature=1.0), params, SamplingParams(max_tokens=3, temperature=0)],
    )
    assert batch[1].outputs[0].token_ids == alone
    other_seed = llm.generate(
        ["sampling"], SamplingParams(max_tokens=10, temperature=0.8, top_p=0.9, seed=8, ignore_eos=True)
    )
    assert other_seed[0].outputs[0].token_ids != alone


def test_outputs_in_input_order_with_text():
    llm = LLM("random:tiny-llama", "sarathi")
    prompts = ["a much longer prompt than the others, to finish later", "hi", {"prompt_token_ids": [256, 104, 105]}]
    outputs = llm.generate(prompts, SamplingParams(max_tokens=4, temperature=0, ignore_eos=True))
    assert [o.prompt for o in outputs] == [prompts[0], prompts[1], None]
    assert outputs[1].prompt_token_ids == llm.tokenizer.encode("hi")
    # "hi" is the same tokens as {"prompt_token_ids": [BOS, h, i]}: the same greedy output.
    assert outputs[1].outputs[0].token_ids == outputs[2].outputs[0].token_ids
    assert all(len(o.outputs[0].token_ids) == 4 for o in outputs)
    assert outputs[0].outputs[0].text == llm.tokenizer.decode(outputs[0].outputs[0].token_ids)


def test_bad_input_is_one_clear_error(tmp_path, hf_dirs):
    with pytest.raises(ConfigError, match="does not exist"):
        LLM(str(tmp_path / "nowhere"))
    (tmp_path / "empty").mkdir()
    with pytest.raises(ConfigError, match="no config.json"):
        LLM(str(tmp_path / "empty"))
    no_weights = tmp_path / "no-weights"
    no_weights.mkdir()
    shutil.copy(f"{hf_dirs['llama']}/config.json", no_weights)
    with pytest.raises(ConfigError, match=r"no \*.safetensors"):
        LLM(str(no_weights))
    cut_off = tmp_path / "cut-off"  # a download that stopped half-way
    shutil.copytree(hf_dirs["llama"], cut_off)
    weights = cut_off / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[: weights.stat().st_size // 2])
    with pytest.raises(ConfigError, match="model.safetensors: not a readable safetensors file .*not fully covered"):
        LLM(str(cut_off))
    deeper = tmp_path / "deeper"  # a config that asks for more layers than the weights hold: refused before
    shutil.copytree(hf_dirs["llama"], deeper)  # the model is built (once all 1000 layers, then "weights missing")
    config = json.loads((deeper / "config.json").read_text())
    (deeper / "config.json").write_text(json.dumps({**config, "num_hidden_layers": 1000}))
    with pytest.raises(
        ConfigError, match="deeper: the config has 1000 layers .num_hidden_layers., but the weights are those of 2$"
    ):
        LLM(str(deeper))
    wider = tmp_path / "wider"  # a vocabulary of 10**9: once a raw allocation error (or the memory filled)
    shutil.copytree(hf_dirs["llama"], wider)
    (wider / "config.json").write_text(json.dumps({**config, "vocab_size": 10**9}))
    with pytest.raises(
        ConfigError, match="wider: the config describes a model of 128,000,.* parameters, but the weights hold"
    ):
        LLM(str(wider))
    (tmp_path / "listed").mkdir()
    (tmp_path / "listed" / "config.json").write_text("[]")
    with pytest.raises(ConfigError, match=r"listed/config.json: must be a JSON object, got list"):
        LLM(str(tmp_path / "listed"))  # (once "'list' object has no attribute 'get'")
    (tmp_path / "rwkv").mkdir()
    (tmp_path / "rwkv" / "config.json").write_text(json.dumps({"model_type": "rwkv"}))
    with pytest.raises(
        ConfigError,
        match="unsupported architecture 'rwkv'.*supported: afmoe, apertus, arcee, bamba, bloom, cohere, cohere2, cohere2_moe, cwm, deepseek_v2, deepseek_v3, dots1, ernie4_5, ernie4_5_moe, exaone, exaone4, exaone4_5, exaone_moe, falcon, falcon_h1, falcon_mamba, flex_olmo, gemma, gemma2, gemma3, gemma3_text, glm, glm4, glm46v, glm4_moe, glm4_moe_lite, glm4v, glm4v_moe, gpt2, gpt_bigcode, gpt_neox, gpt_oss, granite, granite_swa, granitemoe, granitemoe_swa, granitemoehybrid, granitemoeshared, helium, hunyuan_v1_dense, hunyuan_v1_moe, hy_v3, hyperclovax, internlm3, iquestcoder, jais2, jamba, kimi_linear, lfm2, lfm2_moe, lfm2_vl, lfm3, lfm3_vl, llama, llama4, llama4_text, mamba, mamba2, minicpm3, minimax_m2, ministral, ministral3, mistral, mistral3, mistral4, mixtral, mpt, nanochat, nemotron, nemotron_h, olmo, olmo2, olmo3, olmo_hybrid, olmoe, opt, phi, phi3, phimoe, qwen2, qwen2_5_vl, qwen2_moe, qwen2_vl, qwen3, qwen3_5, qwen3_5_moe, qwen3_5_moe_text, qwen3_5_text, qwen3_moe, qwen3_next, qwen3_vl, qwen3_vl_moe, sarvam_moe, seed_oss, smollm3, solar_open, stablelm, starcoder2, vaultgemma, youtu",
    ):
        LLM(str(tmp_path / "rwkv"))
    fp8 = tmp_path / "fp8"  # an FP8 checkpoint's weights would load as plain ones, their scales ignored
    shutil.copytree(hf_dirs["llama"], fp8)
    config = json.loads((fp8 / "config.json").read_text())
    (fp8 / "config.json").write_text(json.dumps({**config, "quantization_config": {"quant_method": "fp8"}}))
    with pytest.raises(ConfigError, match="quantized checkpoints are not supported .*quant_method 'fp8'"):
        LLM(str(fp8))
    with pytest.raises(ConfigError, match="unknown random model shape 'nope'"):
        LLM("random:nope")
    with pytest.raises(ConfigError, match="max_model_len 5000 is above the model's context of 1024"):
        LLM("random:tiny-llama", max_model_len=5000)  # once capped silently
    llm = LLM("random:tiny-llama", max_model_len=32)
    with pytest.raises(ConfigError, match="prompt 1: 40 prompt tokens .* context of 32"):
        llm.generate([{"prompt_token_ids": [1, 2]}, {"prompt_token_ids": [1] * 40}])
    assert not llm.engine.has_unfinished()  # the valid prompt was not started either
    small = LLM("random:tiny-llama", kv_capacity_tokens=16, block_size=4)
    with pytest.raises(ConfigError, match="KV capacity 16 tokens cannot hold one request"):
        small.generate([{"prompt_token_ids": [1] * 10}], SamplingParams(max_tokens=10))
    with pytest.raises(ConfigError, match="outside the vocabulary"):
        llm.generate([{"prompt_token_ids": [1, 99999]}])
    # once filled in until the OS killed the process (24 GB in)
    with pytest.raises(ConfigError, match=r"kv_capacity_tokens 10,000,000,000,000 and .* of the host's memory"):
        LLM("random:tiny-llama", kv_capacity_tokens=10**13)
    with pytest.raises(ConfigError, match="swap_space_tokens must be >= 0, got -1"):
        LLM("random:tiny-llama", swap_space_tokens=-1)
    with pytest.raises(ConfigError, match=r"seed must be in -2\*\*63..2\*\*64-1, torch's range, got 1" + "0" * 30):
        LLM("random:tiny-llama", seed=10**30)  # once torch's "Overflow when unpacking long long"
    with pytest.raises(ConfigError, match="unknown cost model 'nope'; valid: llama-2-7b-a100, .*; or a path"):
        LLM("random:tiny-llama", cost_model="nope")  # once "cost model file nope: not found"
    if not torch.cuda.is_available():
        with pytest.raises(ConfigError, match="CUDA is not available"):
            LLM("random:tiny-llama", device="cuda")


def _bros_be_then_rt(hf_dirs, capacity: int, be_prompt_tokens: int, on_step=None, rt_share_tokens: int = 0):
    """BROS on the engine, block size 8: three BE requests run 4 steps, then three RT requests arrive,
    each starting with the first ``rt_share_tokens`` tokens of a BE prompt; runs to the end
    (``on_step(output, kv)`` sees every scheduler output) and checks every request gets HF's greedy tokens.
    Returns the engine."""
    from sloserve.core.request import Request, RequestClass
    from sloserve.engine.llm_engine import LLMEngine
    from sloserve.engine.loader import load_model

    engine = LLMEngine(
        load_model(hf_dirs["llama"]), "bros", kv_capacity_tokens=capacity, scheduler_options={"block_size": 8}
    )
    params = SamplingParams(max_tokens=10, temperature=0, ignore_eos=True)
    prompts, requests = {}, []

    def add(i: int, cls: RequestClass, prompt: list[int]) -> None:
        request = Request(i, engine.replica.now, len(prompt), 10, 10, request_class=cls)
        requests.append(engine.add_request(prompt, params, engine.replica.now, request=request))
        prompts[request] = prompt

    for i in range(3):
        add(i, RequestClass.BE, [(7 * i + j) % VOCAB for j in range(1, be_prompt_tokens + 1)])
    for _ in range(4):
        engine.step()
    for i in range(3, 6):
        shared = list(prompts.values())[i - 3][:rt_share_tokens]
        add(i, RequestClass.RT, shared + [(11 * i + j) % VOCAB for j in range(1, 13)])
    if on_step is not None:
        schedule = engine.scheduler.schedule

        def recording(now):
            out = schedule(now)
            on_step(out, engine.scheduler.kv)
            return out

        engine.scheduler.schedule = recording
    while engine.has_unfinished():
        engine.step()
        engine.scheduler.check_integrity()
    for request in requests:
        assert engine.output_token_ids(request) == hf_greedy("llama", tuple(prompts[request]), 10), request
    return engine


def test_bros_checkpoints_and_restores_real_kv(hf_dirs):
    """BROS with bidirectional blocks in a 64-slot cache: BE requests fill it, RT requests arriving
    later overwrite BE slots (lazy checkpointing copies exactly those slots to CPU memory), and the
    BE requests restore them when they run again. Every request still gets HF's tokens."""
    kv = _bros_be_then_rt(hf_dirs, 64, 18).scheduler.kv
    assert kv.checkpointed_bytes > 0 and kv.restored_bytes > 0


def test_bros_rt_requests_read_the_cached_prompt_blocks_of_be_requests(hf_dirs):
    """Prefix caching under bidirectional blocks: RT requests whose prompts start with a BE prompt's two
    full blocks find them cached (written right to left by the BE request) and compute only the
    rest, while RT growth still checkpoints BE slots. Every request still gets HF's tokens."""
    from sloserve.core.request import RequestClass

    found = []  # per RT admission that found blocks: whether they were written right to left

    def on_step(out, kv):
        for request, _ in out.chunks:
            if request.request_class is RequestClass.RT and request.num_cached_tokens and request not in found:
                found.append(request)
                assert kv._right_to_left[kv.prefix_blocks[request][:2]].all()  # a BE request's blocks

    kv = _bros_be_then_rt(hf_dirs, 64, 18, on_step, rt_share_tokens=16).scheduler.kv
    assert found and kv.checkpointed_bytes > 0


def test_bros_swaps_dropped_requests_out_and_back_in_real_kv(hf_dirs):
    """Progressive dropping by swap-out (§5) on the engine: in a 40-slot cache RT requests drop
    whole requests, whose every token is copied to CPU memory and back when they run again. Every
    drop is a swap, and every request still gets HF's tokens."""
    from sloserve.core.outputs import PreemptionMode

    modes = []
    _bros_be_then_rt(hf_dirs, 40, 14, on_step=lambda out, kv: modes.extend(p.mode for p in out.preempted))
    assert modes and set(modes) == {PreemptionMode.SWAP}


@pytest.mark.parametrize(
    "variant,predictions,outputs,evictions",
    [
        ("econoserve-oracle", None, (33, 17), 0),  # Figure 7a: the hosted GT is done in time
        ("econoserve", {1: 17}, (33, 40), 1),  # under-predicted: evicted to CPU, restored later
    ],
)
def test_econoserve_pipelining_hosts_in_real_kv(hf_dirs, variant, predictions, outputs, evictions):
    """KV-cache pipelining on the engine (the simulator's Figure 7a case): the hosted GT writes its
    KV into the second half of its host's region, the real cache slots. When it overruns, its written
    tokens are copied to CPU memory before the host overwrites them and copied back when it resumes.
    Both requests still get HF's tokens."""
    from helpers import FixedPredictor
    from sloserve.core.request import Request
    from sloserve.engine.llm_engine import LLMEngine
    from sloserve.engine.loader import load_model

    engine = LLMEngine(
        load_model(hf_dirs["llama"]),
        variant,
        kv_capacity_tokens=64,
        scheduler_options={"buffer": 0.0, "padding": 0.0, "reserve": 0.25, "target_forward_size": 64},
    )
    scheduler = engine.scheduler
    if predictions is not None:
        scheduler.predictor = FixedPredictor(predictions)
    prompts = ([3 * j % VOCAB for j in range(1, 9)], [(5 * j + 1) % VOCAB for j in range(1, 9)])
    requests = []
    for i, (prompt, n) in enumerate(zip(prompts, outputs, strict=True)):
        params = SamplingParams(max_tokens=n, temperature=0, ignore_eos=True)
        requests.append(engine.add_request(prompt, params, 0.0, request=Request(i, 0.0, len(prompt), n, n)))
    host, hosted = requests
    hosted_slots = None
    while engine.has_unfinished():
        engine.step()
        scheduler.check_integrity()
        regions = scheduler.kv.regions
        if hosted in regions and regions[hosted].parent is not None and hosted_slots is None:
            hosted_slots = list(regions[hosted].slots)
            assert set(hosted_slots) <= set(regions[host].slots[16:32])
    assert hosted_slots is not None and scheduler.num_hosted >= 1
    assert scheduler.num_hosted_evictions == evictions
    for request, prompt, n in zip(requests, prompts, outputs, strict=True):
        assert engine.output_token_ids(request) == hf_greedy("llama", tuple(prompt), n), request


def test_the_simulator_never_imports_torch():
    """The core install has no torch: simulating, the CLI and ``import sloserve`` must not load it."""
    import subprocess
    import sys

    code = (
        "import sys, sloserve, sloserve.cli, sloserve.sim, sloserve.sched, sloserve.metrics, sloserve.optimal\n"
        "from sloserve.workload import synthetic_workload\n"
        "from sloserve.checkpoint import model_spec\n"
        "model_spec('llama-2-7b'), model_spec('random:tiny-llama')  # an engine model's shape too\n"
        "assert 'torch' not in sys.modules, 'torch imported'\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True)


def test_an_engine_on_the_cpu_starts_without_torch_dynamo():
    """Building a model leaves its weights unset (they are loaded after): a meta tensor's ``normal_`` would import
    ``torch._dynamo``, 2-3.6 s of every engine's start where nothing else needs it."""
    import subprocess
    import sys

    code = (
        "import sys\nfrom sloserve import LLM\n"
        "LLM('random:tiny-llama', 'vllm').generate([{'prompt_token_ids': [1, 2, 3]}])\n"
        "assert 'torch._dynamo' not in sys.modules, 'torch._dynamo imported'\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True, env={**os.environ, "CUDA_VISIBLE_DEVICES": ""})


def _cli(*args: str):
    import subprocess
    import sys

    return subprocess.run([sys.executable, "-m", "sloserve.cli", *args], capture_output=True, text=True, timeout=300)


def test_run_replays_a_workload_through_the_engine(tmp_path):
    """`sloserve run` writes what `simulate` writes, and its steps as a profile CSV; every request gets
    exactly its trace's output length."""
    import csv

    from sloserve.cost.fit import read_profile_csv

    out = tmp_path / "run"
    proc = _cli(
        "run",
        "--model",
        "random:tiny-llama",
        "--trace",
        "sharegpt",
        "--num-requests",
        "12",
        "--rate",
        "50",
        "--max-model-len",
        "512",
        "--scheduler",
        "sarathi",
        "--virtual-clock",
        "--out",
        str(out),
        "--json",
    )
    assert proc.returncode == 0, proc.stderr
    summary = json.loads(proc.stdout)
    assert summary["completed"] == 12 and summary["engine"] is True and summary["clock"] == "virtual"
    assert summary["attention_backend"] == "torch" and summary["cuda_graphs"] is False
    assert summary["throughput_tps"] > 0 and summary["num_steps"] > 0
    assert {p.name for p in out.iterdir()} >= {"summary.json", "requests.csv", "timeline.csv", "timeline.png"}
    with open(out / "requests.csv") as f:
        rows = list(csv.DictReader(f))
    assert len(rows) == 12 and all(r["ttft_s"] for r in rows)
    # steps.csv: each step's shape as the cost model sees it and its measured time, the timeline's steps.
    shapes, times = read_profile_csv(out / "steps.csv")
    with open(out / "timeline.csv") as f:
        timeline = list(csv.DictReader(f))
    assert len(shapes) == len(timeline) == summary["num_steps"]
    assert times == [float(t["duration_s"]) for t in timeline]  # the virtual clock is the measured time
    # NOTE: a prompt's last chunk of one token is a decode to the cost model, a prefill to the timeline.
    assert [s.num_tokens for s in shapes] == [int(t["num_tokens"]) for t in timeline]
    assert [s.num_decode + s.num_prefill for s in shapes] == [int(t["num_requests"]) for t in timeline]
    assert all(s.decode_max_kv_tokens * s.num_decode >= s.decode_kv_tokens > 0 for s in shapes if s.num_decode)
    # Without preemptions, every token but each request's last is processed once.
    assert sum(int(r["num_preemptions"]) for r in rows) == 0
    assert sum(s.num_tokens for s in shapes) == sum(int(r["prompt_tokens"]) + int(r["output_tokens"]) - 1 for r in rows)
    # The same workload simulated: the engine produced exactly the trace's output lengths.
    sim = tmp_path / "sim"
    proc = _cli(
        "simulate",
        "--trace",
        "sharegpt",
        "--num-requests",
        "12",
        "--rate",
        "50",
        "--max-model-len",
        "512",
        "--out",
        str(sim),
    )
    assert proc.returncode == 0, proc.stderr
    with open(sim / "requests.csv") as f:
        simulated = {r["request_id"]: r["output_tokens"] for r in csv.DictReader(f)}
    assert {r["request_id"]: r["output_tokens"] for r in rows} == simulated


@pytest.mark.parametrize(
    "scheduler,capacity,options",
    [
        ("vllm", 100, "infermax"),  # InferMax's M = 100: evictions and refills
        ("vllm_ef", 100, "infermax"),
        ("sarathi", 100, "infermax"),
        ("vllm", 1024, None),  # ShareGPT lengths in blocks of 16: preemptions
        ("sarathi", 4096, None),
    ],
)
@pytest.mark.parametrize("caching", [False, True])
def test_the_engine_takes_the_simulators_steps(scheduler, capacity, options, caching):
    """Offline, no decision depends on how long a step takes: the engine and the simulator take the same
    steps (forward size, prefill tokens, decodes, preemptions), with prefix caching too (a request
    recomputed after a preemption finds the blocks of its prompt and of what it generated; the
    simulated requests are given the engine's tokens). What fidelity compares is then only the steps'
    times."""
    from sloserve.core.prefix import TokenPrompt
    from sloserve.cost import LinearCostModel, get_preset
    from sloserve.engine.llm_engine import LLMEngine, run_requests, synthetic_prompt
    from sloserve.engine.loader import load_model
    from sloserve.experiments.infermax import OPTIONS
    from sloserve.sched import make_scheduler
    from sloserve.sim import simulate
    from sloserve.workload import synthetic_workload, workload_from_trace

    set_options = OPTIONS if options == "infermax" else None

    def workload():
        if options == "infermax":
            return synthetic_workload(4, 24, 16, context_len=512).requests
        return workload_from_trace("sharegpt", num_requests=24, seed=1, context_len=512, offline=True).requests

    loaded = load_model("random:tiny-llama")
    engine = LLMEngine(
        loaded,
        scheduler,
        kv_capacity_tokens=capacity,
        max_model_len=512,
        scheduler_options=set_options,
        enable_prefix_caching=caching,
    )
    requests = workload()
    rng = np.random.default_rng(0)
    prompts = [synthetic_prompt(r.num_prompt_tokens, loaded.config.vocab_size, rng) for r in requests]
    params = [SamplingParams(max_tokens=r.true_output_tokens, temperature=0, ignore_eos=True) for r in requests]
    run_requests(engine, requests, prompts, params, wall_clock=False)
    simulated = workload()
    for r, served in zip(simulated, requests, strict=True):  # the tokens: prompt and greedy output
        r.prompt_blocks = TokenPrompt(list(served.prompt_blocks.token_ids))
    result = simulate(
        simulated,
        lambda: make_scheduler(
            scheduler,
            kv_capacity_tokens=capacity,
            max_model_len=512,
            options=set_options,
            enable_prefix_caching=caching,
        ),
        LinearCostModel(get_preset("llama-2-7b-a100")),
    )
    columns = ("num_tokens", "num_prefill_tokens", "num_decode", "num_requests", "num_preempted")
    for column in columns:
        assert engine.replica.timeline.column(column).tolist() == result.timeline.column(column).tolist(), column
    preemptions = sum(r.num_preemptions for r in requests)
    assert preemptions == sum(r.num_preemptions for r in simulated)
    assert (preemptions > 0) == (scheduler != "vllm_ef")  # every case preempts but the eviction-free one
    assert [r.num_cached_tokens for r in requests] == [r.num_cached_tokens for r in simulated]


def test_a_cache_salt_shares_cached_blocks_only_under_the_same_salt():
    """vLLM's ``cache_salt`` offline: a prompt finds the blocks an earlier one of the same tokens left only under
    the same salt (none: its own namespace); the tokens are the same either way."""
    llm = LLM("random:tiny-llama", block_size=4)
    ids, greedy = list(range(3, 23)), SamplingParams(max_tokens=3, temperature=0)

    def run(salt: str | None):
        return llm.generate({"prompt_token_ids": ids} | ({} if salt is None else {"cache_salt": salt}), greedy)[0]

    first, *others = [run(salt) for salt in ("tenant-a", "tenant-b", None, "tenant-a")]
    assert [o.num_cached_tokens for o in [first, *others]] == [0, 0, 0, 16]  # 20 tokens: the last is computed
    assert all(o.outputs[0].token_ids == first.outputs[0].token_ids for o in others)
    with pytest.raises(ConfigError, match="prompt 0: cache_salt must be a non-empty string, got ''"):
        llm.generate({"prompt_token_ids": ids, "cache_salt": ""}, greedy)


def test_a_reset_prefix_cache_makes_the_next_prompts_compute_afresh():
    """vLLM's ``LLM.reset_prefix_cache``: a prompt sent again finds its blocks, and after a reset finds none, as on a
    cold engine (the same tokens); an engine's reset waits for no request but is refused while one holds KV."""
    llm = LLM("random:tiny-llama", block_size=4)
    ids, greedy = list(range(3, 23)), SamplingParams(max_tokens=3, temperature=0)
    first = llm.generate({"prompt_token_ids": ids}, greedy)[0]
    again = llm.generate({"prompt_token_ids": ids}, greedy)[0]
    assert llm.reset_prefix_cache()
    reset = llm.generate({"prompt_token_ids": ids}, greedy)[0]
    assert [o.num_cached_tokens for o in (first, again, reset)] == [0, 16, 0]
    assert again.outputs[0].token_ids == reset.outputs[0].token_ids == first.outputs[0].token_ids
    engine = llm.engine
    running = engine.add_request(ids, greedy)
    engine.step()  # (its prompt computed, its blocks held)
    assert not engine.reset_prefix_cache() and running.num_cached_tokens == 16
    while engine.has_unfinished():
        engine.step()
    assert engine.reset_prefix_cache()


def test_run_with_a_closed_loop_workload_on_the_wall_clock(tmp_path):
    """BROS on its own workload (RT Poisson + BE batches resubmitted when done), arrivals in real time."""
    proc = _cli(
        "run",
        "--model",
        "random:tiny-opt",
        "--workload",
        "bros-sharegpt",
        "--num-requests",
        "10",
        "--rt-rate",
        "20",
        "--max-model-len",
        "1024",
        "--scheduler",
        "bros",
        "--json",
    )
    assert proc.returncode == 0, proc.stderr
    summary = json.loads(proc.stdout)
    assert summary["clock"] == "wall" and summary["completed"] == summary["num_requests"]
    assert set(summary["classes"]) == {"rt", "be"}


def test_profile_fits_a_preset_that_simulate_can_use(tmp_path):
    preset, measured = tmp_path / "tiny.json", tmp_path / "tiny.csv"
    proc = _cli(
        "profile",
        "--model",
        "random:tiny-llama",
        "--out",
        str(preset),
        "--prefill-chunks",
        "16,64,128,256,5000",
        "--context-lens",
        "0,128",
        "--batch-sizes",
        "1,4,8,16",
        "--decode-kv-lens",
        "32,128",
        "--repeats",
        "1",
        "--csv",
        str(measured),
    )
    assert proc.returncode == 0, proc.stderr
    assert "held out" in proc.stdout and "host share" in proc.stdout and "pin down" not in proc.stdout
    # A length the context cannot hold is named, not dropped without a word
    assert proc.stderr.strip() == "note: --prefill-chunks 5000 not measured: longer than the context of 1024 tokens"
    # The measurements it wrote are what `fit-cost` reads; fitted on all of them, not 3 in 4.
    refit = tmp_path / "refit.json"
    proc = _cli("fit-cost", "--csv", str(measured), "--layers", "2", "--out", str(refit))
    assert proc.returncode == 0, proc.stderr
    assert json.loads(refit.read_text())["info"]["fit"]["n_rows"] == len(measured.read_text().splitlines()) - 1
    # Decode batches alone say nothing of prefills: the fit says so
    header, *rows = measured.read_text().splitlines()
    decodes_only = tmp_path / "decodes.csv"
    decodes_only.write_text("\n".join([header, *(row for row in rows if row.split(",")[2] == "0")]) + "\n")
    proc = _cli("fit-cost", "--csv", str(decodes_only), "--layers", "2", "--out", str(tmp_path / "decodes.json"))
    assert proc.returncode == 0, proc.stderr
    assert "note: the data does not pin down a_p, b_p, s_p, m_p, floor_p (left at 0)" in proc.stdout
    doc = json.loads(preset.read_text())
    assert doc["num_layers"] == 2 and doc["info"]["held_out"]["points"] >= 3
    assert doc["info"]["attention_backend"] == "torch" and doc["info"]["cuda_graphs"] is False
    # The engine loop's host share, measured over served steps and priced per layer (2 layers)
    host = doc["info"]["host"]
    assert host["num_steps"] >= 32
    assert doc["h_s"] == pytest.approx(host["per_step_s"] * 1000 / 2) and host["per_step_s"] > 0
    assert doc["host_overlapped"] is False  # added to each step: the CPU's engine overlaps nothing
    assert doc["info"]["fit"]["n_rows"] >= 9
    from sloserve.cost import LinearCostModel, load_preset
    from sloserve.cost.base import BatchShape

    # The fitted model predicts positive times, a 256-token prompt slower than one decode (not a fixed
    # figure: the machine decides; on a CPU a tiny model's decode batches may all take the same time).
    model = LinearCostModel(load_preset(preset))
    prompt = BatchShape(num_prefill=1, prefill_tokens=256, prefill_attention_work=256 * 256)
    assert 0 < model.batch_time(BatchShape(1, 32)).total_s < model.batch_time(prompt).total_s
    # The profiled model itself is simulated with its preset (its shape read without torch).
    proc = _cli(
        "simulate",
        "--model",
        "random:tiny-llama",
        "--cost-model",
        str(preset),
        "--trace",
        "sharegpt",
        "--rate",
        "5",
        "--num-requests",
        "20",
        "--kv-capacity-tokens",
        "4096",
        "--json",
    )
    assert proc.returncode == 0, proc.stderr
    assert json.loads(proc.stdout)["completed"] == 20


def test_a_profile_step_is_an_engine_step_and_leaves_nothing_behind():
    """The profiler times ``EngineExecutor.execute`` (what the engine's clock counts) on requests it
    places in a paged KV manager, and frees them after; decode lengths spread around the grid's mean."""
    from sloserve.cost.profile_grid import ProfileGrid, spread_decode_lens
    from sloserve.engine.loader import load_model
    from sloserve.engine.profile import StepTimer

    decodes = spread_decode_lens(9, 100, 150)
    assert decodes == sorted(decodes) and decodes[0] == 20 and max(decodes) == 150 and len(decodes) == 9
    assert sum(spread_decode_lens(8, 50, 1000)) == 8 * 50 and spread_decode_lens(1, 70, 1000) == [70]
    loaded = load_model("random:tiny-llama")
    batch = ([(40, 24), (9, 0)], decodes)
    timer = StepTimer(loaded, StepTimer.blocks_needed(*batch), max_context=256)
    calls = []
    real_execute = timer.executor.execute
    timer.executor.execute = lambda output, now: calls.append(output) or real_execute(output, now)
    assert timer.time(*batch, repeats=2) > 0
    assert len(calls) == 3  # a warm-up and two timed runs
    assert [c.num_tokens for c in calls[0].chunks] == [40, 9] + [1] * 9
    assert [c.request.num_computed_tokens for c in calls[0].chunks] == [24, 0, *decodes]
    assert timer.kv.num_free_blocks == timer.kv.gpu.num_blocks and not timer.executor.sequences
    timer.kv.check_integrity()
    # Every grid batch fits the slots it was given.
    for prefills, decode_lens in ProfileGrid().shapes(max_model_len=1024, max_slots=20_000):
        assert sum(c + m for c, m in prefills) + sum(m + 1 for m in decode_lens) <= 20_000
        assert all(c + m <= 1024 for c, m in prefills) and all(m + 1 <= 1024 for m in decode_lens)


def test_a_profile_times_each_batchs_second_step_unless_timed_as_an_asynchronous_engine(monkeypatch):
    """A request's first step computes what it keeps for its later ones (once in its life in a run; for every
    request at once in a freshly built batch), so a profile times each batch's second step: one untimed before
    it. Timed as an asynchronous engine runs them, the first step is already untimed: no more warm-up."""
    from sloserve.cost.profile_grid import ProfileGrid
    from sloserve.engine.loader import load_model
    from sloserve.engine.profile import StepTimer, profile

    warmups = []
    real_time = StepTimer.time
    monkeypatch.setattr(
        StepTimer, "time", lambda self, *a, **kw: warmups.append(kw["warmup"]) or real_time(self, *a, **kw)
    )
    grid = ProfileGrid(
        prefill_chunks=(16, 32, 64), context_lens=(0, 32), batch_sizes=(1, 2, 4), decode_kv_lens=(16, 32)
    )
    loaded = load_model("random:tiny-llama")
    num_points = len(grid.shapes(256, 4096))
    profile(loaded, grid, max_model_len=256, max_slots=4096, name="t", repeats=1, host_share=False)
    assert warmups == [1] * 2 * num_points  # (a warm-up pass, then one timed)
    warmups.clear()
    profile(
        loaded, grid, max_model_len=256, max_slots=4096, name="t", repeats=1, host_share=False, host_overlapped=True
    )
    assert warmups == [0] * 2 * num_points


def test_the_host_share_fit_is_not_bent_by_descheduled_steps():
    """``measure_host``'s line: 0.15 ms a step + 5 us a request, 3% noise, and one step in 16 taken 20-40x
    longer (the OS ran something else meanwhile): found within 5%, where least squares is off by 2x or
    more; never below 0."""
    from sloserve.engine.profile import fit_host_share

    rng = np.random.default_rng(0)
    sizes = np.repeat(np.arange(32, 0, -1), 4).astype(np.float64)  # (128,) as 32 requests finishing
    host = (150e-6 + 5e-6 * sizes) * rng.normal(1.0, 0.03, len(sizes))
    slow = rng.choice(len(sizes), len(sizes) // 16, replace=False)
    host[slow] *= rng.uniform(20, 40, len(slow))
    per_step, per_request = fit_host_share(sizes, host)
    assert per_step == pytest.approx(150e-6, rel=0.05) and per_request == pytest.approx(5e-6, rel=0.05)
    plain = np.linalg.lstsq(np.column_stack([np.ones(len(sizes)), sizes]), host, rcond=None)[0]
    assert not 0.5 < plain[0] / 150e-6 < 2  # the premise: the spikes bend a least-squares line
    # Steps that shrink as the batch grows (noise that says less than nothing): 0, not a negative cost
    per_step, per_request = fit_host_share(sizes, 400e-6 - 10e-6 * sizes)
    assert per_request == pytest.approx(0, abs=1e-12) and per_step > 0


@pytest.mark.skipif(
    not hasattr(os, "sched_setaffinity") or len(os.sched_getaffinity(0)) < 2, reason="two cores to pin apart"
)
def test_the_host_calibrations_reader_runs_off_the_cores_a_pinned_profile_holds():
    """Pinned to one core (as a profile for a pinned server's engine is), ``measure_host``'s reader of the
    pipe goes to the other cores, where the server's process would read; unpinned, it stays where it is."""
    import subprocess
    import sys

    from sloserve.engine.profile import _beside_this_process

    mine = os.sched_getaffinity(0)
    first = min(mine)
    reader = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        if mine == set(range(os.cpu_count())):  # (not held to some of the machine's cores already)
            _beside_this_process(reader.pid)
            assert os.sched_getaffinity(reader.pid) == mine
        os.sched_setaffinity(0, {first})
        _beside_this_process(reader.pid)
        assert os.sched_getaffinity(reader.pid) and first not in os.sched_getaffinity(reader.pid)
    finally:
        os.sched_setaffinity(0, mine)
        reader.kill()
        reader.wait()


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (("run", "--model", "/nonexistent/model", "--trace", "sharegpt"), "does not exist"),
        (("run", "--model", "random:tiny-llama", "--trace", "sharegpt", "--device", "cuda"), "CUDA is not available"),
        (("run", "--model", "random:huge", "--trace", "sharegpt"), "unknown random model shape"),
        (
            (
                "run",
                "--model",
                "random:tiny-llama",
                "--trace",
                "sharegpt",
                "--num-requests",
                "3",
                "--offline",
                "--kv-capacity-tokens",
                "64",
            ),
            "KV capacity 64 tokens cannot hold one request",
        ),
        (
            ("profile", "--model", "random:tiny-llama", "--out", "x.json", "--batch-sizes", "a,b"),
            "--batch-sizes expects",
        ),
        (
            ("profile", "--model", "random:tiny-llama", "--out", "x.json", "--batch-sizes", "0,2"),
            "--batch-sizes expects integers >= 1, got '0,2'",
        ),
        (  # once hung building a list of 10^12 decode lengths
            ("profile", "--model", "random:tiny-llama", "--out", "x.json", "--batch-sizes", str(10**12)),
            "profile: the grid has 11 points within a context of 1024 and 65536 KV slots; need at least 18",
        ),
        (
            ("profile", "--model", "random:tiny-llama", "--out", "x.json", "--repeats", str(10**12)),
            "--repeats must be in 1..100, got 1,000,000,000,000",
        ),
        (  # once filled memory until the OS killed the process
            ("run", "--model", "random:tiny-llama", "--trace", "sharegpt", "--kv-capacity-tokens", str(10**13)),
            "kv_capacity_tokens 10,000,000,000,000 and",
        ),
        (
            ("run", "--model", "random:tiny-llama", "--trace", "sharegpt", "--attention-backend", "flash"),
            "unknown attention backend 'flash'; valid: auto, torch, triton",
        ),
        (
            ("run", "--model", "random:tiny-llama", "--trace", "sharegpt", "--cuda-graphs"),
            "CUDA graphs need device cuda and the triton attention backend",
        ),
    ],
)
def test_engine_commands_bad_input_exit_2(args, message, tmp_path, monkeypatch):
    from click.testing import CliRunner

    from sloserve.cli import main

    if "cuda" in args and torch.cuda.is_available():
        pytest.skip("this machine has CUDA")
    monkeypatch.chdir(tmp_path)  # `--out x.json`, were it written
    result = CliRunner().invoke(main, args)  # in process: 11 cases, each a subprocess would import torch anew
    assert result.exit_code == 2, result.output
    assert message in result.stderr and result.stderr.count("\n") == 1, result.stderr


def test_the_engine_finds_the_cached_prefixes_the_simulator_finds(tmp_path):
    """Mooncake's prefix structure replayed: the engine caches by real tokens (the same tokens for the
    same hash ids), the simulator by the ids; request for request, they find the same cached tokens,
    and switching caching off finds none."""
    import csv

    from click.testing import CliRunner

    from sloserve.cli import main

    common = ("--trace", "mooncake-conv", "--trace-arrivals", "--num-requests", "30", "--max-model-len", "1024")
    model = ("--model", "random:tiny-llama")
    cached = {}
    for name, args in {
        "engine": ("run", *model, *common, "--virtual-clock"),
        "sim": ("simulate", *model, *common),
        "off": ("run", *model, *common, "--virtual-clock", "--no-enable-prefix-caching"),
    }.items():
        result = CliRunner().invoke(main, [*args, "--out", str(tmp_path / name)])  # in process: torch imported once
        assert result.exit_code == 0, result.output
        with open(tmp_path / name / "requests.csv") as f:
            cached[name] = [int(row["cached_tokens"]) for row in csv.DictReader(f)]
    assert cached["engine"] == cached["sim"] and sum(cached["sim"]) > 0
    assert not any(cached["off"])
