"""The tiny chat model of the engine and server tests: a random Llama saved as an HF directory with a
trained byte-level BPE tokenizer and a chat template (``make_chat_model``; the ``chat_model_dir`` fixture of
conftest.py). Apart from ``served_model.py`` so that the engine's tests need no HTTP client (the GPU
machine's image has none)."""

from __future__ import annotations

import json
from pathlib import Path

from hf_models import VOCAB, hf_model

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
THINK_TOKENS = ("<think>", "</think>")


def train_tokenizer(think_tokens: bool = False):
    """The chat model's tokenizer (a ``tokenizers.Tokenizer``): a byte-level BPE trained on ``CORPUS``, BOS
    added; ``think_tokens``: ``<think>`` and ``</think>`` added to its vocabulary."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    added = ["<unk>", "<s>", "</s>", *(THINK_TOKENS if think_tokens else ())]
    trainer = trainers.BpeTrainer(
        vocab_size=VOCAB, special_tokens=added, initial_alphabet=pre_tokenizers.ByteLevel.alphabet()
    )
    tok.train_from_iterator(CORPUS, trainer)
    tok.post_processor = processors.TemplateProcessing(single="<s> $A", special_tokens=[("<s>", 1)])
    return tok


def make_chat_model(path: Path, think_tokens: bool = False) -> Path:
    """A tiny Llama with a byte-level BPE tokenizer (BOS added), tokenizer_config.json and a chat
    template, saved in ``path`` (the ``chat_model_dir`` fixture of conftest.py). ``think_tokens``: the
    vocabulary has ``<think>`` and ``</think>`` as added tokens that are not special (as Qwen3's and
    DeepSeek-R1's)."""
    hf_model("llama").save_pretrained(path)
    saved = json.loads(train_tokenizer(think_tokens).to_str())
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
