"""A served tiny model for the server tests: a random Llama saved as an HF directory with a trained
BPE tokenizer and a chat template (``make_chat_model``), and ``make_app`` under a real uvicorn on a
free loopback port (``Server``)."""

from __future__ import annotations

import json
import re
import threading
import time
from pathlib import Path

import httpx
import openai
import uvicorn

from hf_models import VOCAB, hf_model
from sloserve import LLM, SamplingParams
from sloserve.bench.client import free_loopback_port
from sloserve.engine.engine_core import EngineSpec
from sloserve.server.serve import ServeOptions, make_app, uvicorn_config

CHAT_TEMPLATE = """{{ bos_token }}
{% if tools %}
<|tools|>
{{ tools | map(attribute='function') | map(attribute='name') | list | tojson(separators=(',', ':')) }}{{ eos_token }}
{% endif %}
{% for message in messages %}
    {% if message['role'] == 'system' and not loop.first %}
        {{ raise_exception('the system message must come first') }}
    {% endif %}
<|{{ message['role'] }}|>
{{ message['content'] }}
{%- for call in message.tool_calls or [] %}<tool_call>{{ call.function | tojson }}</tool_call>{% endfor %}
{%- if message.tool_call_id %} ({{ message.tool_call_id }}){% endif %}{{ eos_token }}
{% endfor %}
{% if add_generation_prompt %}
<|assistant|>
{% endif %}"""
CORPUS = [
    "Hello world, how are you today?",
    "The quick brown fox jumps over the lazy dog.",
    "Serving language models is about latency and throughput.",
] * 20
MODEL = "tiny"
THINK_TOKENS = ("<think>", "</think>")


def make_chat_model(path: Path, think_tokens: bool = False) -> Path:
    """A tiny Llama with a byte-level BPE tokenizer (BOS added), tokenizer_config.json and a chat
    template, saved in ``path`` (the ``chat_model_dir`` fixture of conftest.py). ``think_tokens``: the
    vocabulary has ``<think>`` and ``</think>`` as added tokens that are not special (as Qwen3's and
    DeepSeek-R1's)."""
    from tokenizers import (
        Tokenizer,
        decoders,
        models,
        pre_tokenizers,
        processors,
        trainers,
    )

    hf_model("llama").save_pretrained(path)
    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    added = ["<unk>", "<s>", "</s>", *(THINK_TOKENS if think_tokens else ())]
    trainer = trainers.BpeTrainer(
        vocab_size=VOCAB, special_tokens=added, initial_alphabet=pre_tokenizers.ByteLevel.alphabet()
    )
    tok.train_from_iterator(CORPUS, trainer)
    tok.post_processor = processors.TemplateProcessing(single="<s> $A", special_tokens=[("<s>", 1)])
    saved = json.loads(tok.to_str())
    for token in saved["added_tokens"]:
        token["special"] = token["content"] not in THINK_TOKENS
    (path / "tokenizer.json").write_text(json.dumps(saved))
    (path / "tokenizer_config.json").write_text(
        json.dumps(
            {
                "tokenizer_class": "PreTrainedTokenizerFast",
                "bos_token": "<s>",
                "eos_token": "</s>",
                "unk_token": "<unk>",
                "chat_template": CHAT_TEMPLATE,
            }
        )
    )
    return path


class Server:
    """``make_app`` under a real uvicorn in a thread, on a free loopback port."""

    def __init__(
        self,
        model_dir: Path,
        scheduler: str = "vllm",
        kv_capacity_tokens: int | None = 4096,
        scheduler_options: dict | None = None,
        **options,
    ) -> None:
        spec = EngineSpec(
            str(model_dir), scheduler, kv_capacity_tokens=kv_capacity_tokens, scheduler_options=scheduler_options or {}
        )
        self.port = free_loopback_port()
        serve_options = ServeOptions(port=self.port, served_model_name=MODEL, **{"log_level": "warning", **options})
        self.app = make_app(spec, serve_options)
        self.server = uvicorn.Server(uvicorn_config(self.app, serve_options))
        self.thread = threading.Thread(target=self.server.run, daemon=True)
        self.thread.start()
        deadline = time.monotonic() + 30
        while not self.server.started:
            assert time.monotonic() < deadline, "the server did not start"
            time.sleep(0.02)
        self.url = f"http://127.0.0.1:{self.port}"
        self.client = openai.OpenAI(base_url=self.url + "/v1", api_key="none", max_retries=0)
        self.async_client = openai.AsyncOpenAI(base_url=self.url + "/v1", api_key="none", max_retries=0)

    @property
    def engine(self):
        return self.app.state.engine

    def metric(self, name: str, **labels: str) -> float:
        text = httpx.get(self.url + "/metrics").text
        wanted = ",".join(f'{k}="{v}"' for k, v in sorted(labels.items()))
        for line in text.splitlines():
            m = re.fullmatch(rf"{name}(?:{{(.*)}})? (\S+)", line)
            if m and ",".join(sorted((m.group(1) or "").split(","))) == wanted:
                return float(m.group(2))
        return 0.0

    def stop(self) -> None:
        self.server.should_exit = True
        self.thread.join(timeout=30)


def generate(llm: LLM, prompt_ids: list[int], max_tokens: int) -> tuple[str, list[int]]:
    out = llm.generate({"prompt_token_ids": prompt_ids}, SamplingParams(max_tokens=max_tokens, temperature=0))[0]
    return out.outputs[0].text, out.outputs[0].token_ids
