"""``HFTokenizer``: the ids of the ``tokenizers`` library, and a long text encoded without holding the GIL
(the server tokenizes prompts in threads beside its event loop)."""

from __future__ import annotations

import sys
import threading
import time

import pytest

tokenizers = pytest.importorskip("tokenizers")
pytest.importorskip("transformers")  # chat_model.py builds its model with it

from chat_model import train_tokenizer
from sloserve.core.errors import ConfigError
from sloserve.engine.tokenizer import HFTokenizer


@pytest.fixture(scope="module")
def library_tokenizer():
    """The chat model's tokenizer, as the ``tokenizers`` library gives it."""
    return train_tokenizer()


@pytest.mark.parametrize("text", ["", "Hello world", "latency and throughput " * 50, "fox \u00e9\u4e16\U0001f600"])
@pytest.mark.parametrize("add_special_tokens", [True, False])
def test_encode_gives_the_librarys_ids(library_tokenizer, text, add_special_tokens):
    ours = HFTokenizer.from_tokenizer(library_tokenizer).encode(text, add_special_tokens=add_special_tokens)
    assert ours == library_tokenizer.encode(text, add_special_tokens=add_special_tokens).ids


def test_a_lone_surrogate_is_a_config_error_naming_it(library_tokenizer):
    with pytest.raises(ConfigError, match="lone UTF-16 surrogate at character 4"):
        HFTokenizer.from_tokenizer(library_tokenizer).encode("fox \ud800 jumps")


def test_a_tokenizer_path_that_holds_none_is_one_config_error_saying_what_it_is(tmp_path):
    """``bench-serve --tokenizer``'s reading: a path that does not exist, a file that is no tokenizer (once
    "no tokenizer.json in this directory" for a file) and a directory without one, each in its words."""
    from sloserve.engine.tokenizer import load_tokenizer_file

    with pytest.raises(ConfigError, match="nowhere: no such file or directory"):
        load_tokenizer_file(tmp_path / "nowhere")
    (tmp_path / "model.safetensors").write_bytes(b"weights")
    with pytest.raises(ConfigError, match="model.safetensors: not a tokenizer.json, a model directory or a .gguf file"):
        load_tokenizer_file(tmp_path / "model.safetensors")
    with pytest.raises(ConfigError, match=f"{tmp_path}: no tokenizer.json in this directory"):
        load_tokenizer_file(tmp_path)


def test_other_threads_run_while_a_long_text_is_encoded(library_tokenizer):
    """The main thread counts while a worker encodes 0.5 MB of text. NOTE: with a switch interval of 10 s,
    a thread that holds the GIL keeps it until it returns to Python (the library's ``encode`` does), and the
    count cannot move between the worker's two reads; it moves only where the encoding lets go of the GIL."""
    tokenizer = HFTokenizer.from_tokenizer(library_tokenizer)
    text = "The quick brown fox jumps over the lazy dog. " * 11_000
    count, done = [0], threading.Event()
    counts: dict[str, int] = {}

    def encode() -> None:
        counts["before"] = count[0]
        tokenizer.encode(text)
        counts["after"] = count[0]
        done.set()

    interval = sys.getswitchinterval()
    sys.setswitchinterval(10.0)
    try:
        worker = threading.Thread(target=encode)
        worker.start()
        while not done.is_set():
            count[0] += 1
            time.sleep(0)  # NOTE: lets go of the GIL, so the worker takes it back as soon as it needs it
        worker.join()
    finally:
        sys.setswitchinterval(interval)
    assert counts["after"] > counts["before"], "the main thread never ran while the text was encoded"
