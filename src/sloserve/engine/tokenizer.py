"""Tokenizers: a local HF ``tokenizer.json`` (the ``tokenizers`` library) or, for random models,
bytes (ids 0..255 are the UTF-8 bytes; BOS and EOS follow)."""

from __future__ import annotations

import functools
import json
from pathlib import Path
from typing import Any, Protocol

from sloserve.checkpoint.config import BYTE_BOS_ID, BYTE_EOS_ID
from sloserve.core.errors import ConfigError


class Tokenizer(Protocol):
    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]: ...

    def decode(self, token_ids: list[int], skip_special_tokens: bool = True) -> str: ...


def not_unicode(text: str, at: int) -> ConfigError:
    """The error for a text no tokenizer can encode: a lone UTF-16 surrogate (Python keeps one from a JSON
    ``\\ud800`` escape), at character ``at``."""
    return ConfigError(
        f"text {text[max(0, at - 20) : at + 20]!r} is not valid Unicode: a lone UTF-16 surrogate at character {at}"
    )


class ByteTokenizer:
    """UTF-8 bytes as token ids, BOS prepended; ids that are not bytes decode to nothing."""

    bos_token_id, eos_token_id = BYTE_BOS_ID, BYTE_EOS_ID

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        try:
            data = text.encode("utf-8")
        except UnicodeEncodeError as e:
            raise not_unicode(text, e.start) from None
        return [BYTE_BOS_ID, *data] if add_special_tokens else list(data)

    def decode(self, token_ids: list[int], skip_special_tokens: bool = True) -> str:
        """BOS and EOS have no text, special or not."""
        return bytes(t for t in token_ids if t < 256).decode("utf-8", errors="replace")


class HFTokenizer:
    """A ``tokenizers`` tokenizer: a ``tokenizer.json`` (special tokens as it defines them), or one
    built in memory (``from_tokenizer``: a GGUF file's)."""

    # transformers' ``eos_token_id``: tokenizer_config.json's ``eos_token``, a GGUF file's
    # ``tokenizer.ggml.eos_token_id`` (None: it names none). NOTE: the one EOS whose end vLLM reports with
    # ``stop_reason`` None; the model's other EOS ids (its generation config's) are stop tokens to it.
    eos_token_id: int | None = None

    def __init__(self, path: Path) -> None:
        from tokenizers import Tokenizer as _Tokenizer

        try:
            self._tok = _Tokenizer.from_file(str(path))
        except Exception as e:  # the library raises a bare Exception on a bad file
            raise ConfigError(f"{path}: cannot load tokenizer ({e})") from None

    @classmethod
    def from_tokenizer(cls, tokenizer) -> HFTokenizer:
        self = cls.__new__(cls)
        self._tok = tokenizer
        return self

    @property
    def vocab_size(self) -> int:
        return self._tok.get_vocab_size()

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """``text``'s token ids. NOTE: through ``encode_batch``, which lets go of the GIL while it works
        (``encode`` holds it throughout): a server thread tokenizing a long prompt (seconds for megabytes)
        leaves the event loop serving everyone else."""
        try:
            [encoding] = self._tok.encode_batch([text], add_special_tokens=add_special_tokens)
            return encoding.ids
        except TypeError:  # the Rust side's word for a str it cannot take as UTF-8
            try:
                text.encode("utf-8")
            except UnicodeEncodeError as e:
                raise not_unicode(text, e.start) from None
            raise

    def decode(self, token_ids: list[int], skip_special_tokens: bool = True) -> str:
        return self._tok.decode(token_ids, skip_special_tokens=skip_special_tokens)

    def added_token_id(self, text: str) -> int | None:
        """The id of the token added to the vocabulary as ``text`` whole (a special token, or one such
        as ``</think>``); None where ``text`` has none."""
        return self._added_token_ids.get(text)

    @functools.cached_property
    def _added_token_ids(self) -> dict[str, int]:
        """The added tokens by their text, read once: requests ask for the thinking tags' ids, and the
        library builds its whole table of added tokens on each call (a text added twice: its lowest id)."""
        ids: dict[str, int] = {}
        for token_id, token in sorted(self._tok.get_added_tokens_decoder().items()):
            ids.setdefault(token.content, token_id)
        return ids

    def to_json(self) -> str:
        """The tokenizer as a ``tokenizer.json`` text (what a grammar library reads)."""
        return self._tok.to_str()


def load_tokenizer_file(path: Path) -> HFTokenizer:
    """A tokenizer from a ``tokenizer.json``, a model directory holding one, or a ``.gguf`` file."""
    if path.is_file() and path.suffix == ".json":
        return HFTokenizer(path)
    if not path.exists():
        raise ConfigError(f"{path}: no such file or directory (a tokenizer.json, a model directory or a .gguf file)")
    tokenizer = load_tokenizer(path)
    if tokenizer is None:
        if path.is_file():  # (a model's weights or config given for its tokenizer)
            raise ConfigError(f"{path}: not a tokenizer.json, a model directory or a .gguf file")
        raise ConfigError(f"{path}: no tokenizer.json in this directory")
    return tokenizer


def load_tokenizer(model_dir: Path) -> HFTokenizer | None:
    """The directory's tokenizer, or None when it has no tokenizer.json (prompts must be token ids);
    for a ``.gguf`` file, the tokenizer in its metadata."""
    from sloserve.checkpoint.gguf import is_gguf, read_gguf
    from sloserve.checkpoint.gguf_tokenizer import gguf_tokenizer

    if is_gguf(str(model_dir)):
        checkpoint = read_gguf(model_dir)
        tokenizer = HFTokenizer.from_tokenizer(gguf_tokenizer(checkpoint))
        tokenizer.eos_token_id = checkpoint.metadata.get("tokenizer.ggml.eos_token_id")
        return tokenizer
    path = model_dir / "tokenizer.json"
    if not path.is_file():
        return None
    tokenizer = HFTokenizer(path)
    eos = special_token_text(read_tokenizer_config(model_dir).get("eos_token"))
    if eos:
        tokenizer.eos_token_id = tokenizer._tok.token_to_id(eos)  # (added tokens too)
    return tokenizer


def read_tokenizer_config(model_dir: Path) -> dict[str, Any]:
    """A model directory's ``tokenizer_config.json`` ({} where it has none); one that cannot be read
    is a ConfigError naming it."""
    path = model_dir / "tokenizer_config.json"
    if not path.is_file():
        return {}
    try:
        config = json.loads(path.read_text())
    except (OSError, json.JSONDecodeError) as e:
        raise ConfigError(f"{path}: cannot read ({e})") from None
    if not isinstance(config, dict):
        raise ConfigError(f"{path}: must be a JSON object, got {type(config).__name__}")
    return config


def special_token_text(value: Any) -> str:
    """A special token in tokenizer_config.json: a string or ``{"content": ...}``."""
    if isinstance(value, dict):
        return str(value.get("content", ""))
    return "" if value is None else str(value)
