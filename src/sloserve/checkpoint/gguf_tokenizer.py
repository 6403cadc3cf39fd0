"""A GGUF file's tokenizer as a ``tokenizers.Tokenizer`` (``gguf_tokenizer``): byte-level BPE (``gpt2``, its
pre-tokenizer's split pattern by ``tokenizer.ggml.pre``) or SentencePiece BPE (``llama``; Gemma's vocabulary),
its added and special tokens as llama.cpp's token types mark them."""

from __future__ import annotations

from sloserve.checkpoint.gguf import GGUFCheckpoint
from sloserve.core.errors import ConfigError

GEMMA_ARCHITECTURES = ("gemma", "gemma2", "gemma3")  # their SentencePiece vocabularies: see _gemma_vocabulary
# The split pattern of a byte-level BPE pre-tokenizer, by tokenizer.ggml.pre, as transformers' GGUF reader
# sets them: Qwen's; Llama 3's (digits in runs of at most three, as its tokenizer.json has it); Mistral's
# Tekken (Nemo). None: GPT-2's, the ByteLevel pre-tokenizer's own (a file without the key too). NOTE: a
# name not here is refused (``gguf_tokenizer``): split another way, the same text would read as other tokens.
QWEN_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|"
    r"\s+(?!\S)|\s+"
)
LLAMA3_SPLIT = QWEN_SPLIT.replace(r"|\p{N}|", r"|\p{N}{1,3}|")
# Qwen3.5's: Qwen's, a word's combining marks (\p{M}: accents written apart) kept with its letters
QWEN35_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?[\p{L}\p{M}]+|\p{N}| ?[^\s\p{L}\p{M}\p{N}]+[\r\n]*|\s*[\r\n]+|"
    r"\s+(?!\S)|\s+"
)
TEKKEN_SPLIT = (
    r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]*[\p{Ll}\p{Lm}\p{Lo}\p{M}]+"
    r"|[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]+[\p{Ll}\p{Lm}\p{Lo}\p{M}]*"
    r"|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
GPT4O_SPLIT = (  # (tiktoken's o200k: Tekken's letters with the contractions attached, digits in threes)
    r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]*[\p{Ll}\p{Lm}\p{Lo}\p{M}]+(?i:'s|'t|'re|'ve|'m|'ll|'d)?"
    r"|[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]+[\p{Ll}\p{Lm}\p{Lo}\p{M}]*(?i:'s|'t|'re|'ve|'m|'ll|'d)?"
    r"|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
PRE_TOKENIZER_SPLITS: dict[str | None, str | None] = {
    None: None,
    "default": None,
    "gpt-2": None,
    # (llama.cpp's other names of GPT-2's pattern: OLMo's GPT-NeoX vocabulary, MPT's, Phi-2's, Jais's)
    **dict.fromkeys(("olmo", "mpt", "phi-2", "jais")),
    "smollm": None,  # NOTE: llama.cpp splits its digits one by one first; its vocabulary has no runs of them
    "starcoder": None,  # (StarCoder2's: as SmolLM's, llama.cpp's case)
    "stablelm2": QWEN_SPLIT,  # (StableLM 2's: Qwen's pattern, llama.cpp's case)
    "qwen2": QWEN_SPLIT,
    "qwen35": QWEN35_SPLIT,  # (Qwen3.5's; llama.cpp's case)
    "deepseek-r1-qwen": QWEN_SPLIT,
    "llama-bpe": LLAMA3_SPLIT,
    "llama3": LLAMA3_SPLIT,
    "llama-v3": LLAMA3_SPLIT,
    "falcon3": LLAMA3_SPLIT,
    "falcon-h1": LLAMA3_SPLIT,  # (Falcon-H1's, llama.cpp's and transformers' case)
    "midm-2.0": LLAMA3_SPLIT,
    "smaug-bpe": LLAMA3_SPLIT,
    "dbrx": LLAMA3_SPLIT,  # (Phi-4's: GPT-4's cl100k split, Llama 3's pattern)
    "pixtral": LLAMA3_SPLIT,
    "tekken": TEKKEN_SPLIT,
    "lfm2": LLAMA3_SPLIT,  # (llama.cpp's: LFM2's pattern is Llama 3's)
    "gpt-4o": GPT4O_SPLIT,  # (Phi-4 mini's)
}
# The pre-tokenizers after whose split llama.cpp takes a piece that is a token whole, merges or not (its
# ``ignore_merges``: Llama 3's and Mistral Nemo's tokenizer.json say so, as tiktoken encodes). NOTE: transformers'
# GGUF reader does not; on a vocabulary whose merges reach every token (a trained one) the two agree.
WHOLE_PIECE_PRE_TOKENIZERS = frozenset(
    {"llama-bpe", "llama3", "llama-v3", "falcon3", "falcon-h1", "pixtral", "midm-2.0", "lfm2", "tekken"}
)
TOKEN_TYPE_CONTROL = 3  # llama.cpp's token types: 1 normal, 3 control (special), 4 user-defined
TOKEN_TYPE_USER_DEFINED = 4  # an added token that is not special (Qwen3's <think>, <tool_call>)


def gguf_tokenizer(checkpoint: GGUFCheckpoint):
    """The file's tokenizer as a ``tokenizers.Tokenizer``, as transformers' GGUF reader builds it: a
    byte-level BPE (``tokenizer.ggml.model = gpt2``) or a SentencePiece BPE (``llama``: Llama 2, Mistral,
    TinyLlama); control tokens as special tokens, user-defined ones as added tokens, BOS added when the
    file says so (a SentencePiece file that does not say: added, as llama.cpp does)."""
    from tokenizers import AddedToken, processors

    meta = checkpoint.metadata
    kind = meta.get("tokenizer.ggml.model")
    if not meta.get("tokenizer.ggml.tokens"):
        raise ConfigError(f"{checkpoint.path}: GGUF metadata has no tokenizer.ggml.tokens (the vocabulary)")
    tokens = list(meta["tokenizer.ggml.tokens"])
    if kind == "gpt2":
        tok = _byte_level_bpe(checkpoint, tokens)
    elif kind == "llama":
        scores = list(meta.get("tokenizer.ggml.scores") or [])
        if len(scores) != len(tokens):
            raise ConfigError(
                f"{checkpoint.path}: a GGUF SentencePiece tokenizer needs tokenizer.ggml.scores, one a token "
                f"({len(tokens)}); the file has {len(scores)}"
            )
        arch = meta.get("general.architecture")
        if arch in GEMMA_ARCHITECTURES:
            tokens, scores = _gemma_vocabulary(tokens)
        prefix_space = meta.get("tokenizer.ggml.add_space_prefix", True)
        # NOTE: Phi-3's tokenizer puts a space before any text (one that starts with spaces too), as
        # transformers' GGUF reader builds it; Llama 2's only before text that does not start with one
        tok = _sentencepiece_bpe(
            tokens, scores, prefix_space="always" if prefix_space and arch == "phi3" else prefix_space
        )
    else:
        raise ConfigError(
            f"{checkpoint.path}: GGUF tokenizer {kind!r} is not supported (gpt2: byte-level BPE; llama: SentencePiece)"
        )
    types = meta.get("tokenizer.ggml.token_type") or []
    tok.add_special_tokens(
        [
            AddedToken(t, special=True, normalized=False)
            for t, token_type in zip(tokens, types, strict=False)
            if token_type == TOKEN_TYPE_CONTROL
        ]
    )
    # NOTE: read whole in any text, as llama.cpp and transformers do (else cut into pieces: a chat
    # template's <tool_call> would read as other tokens than the model wrote); kept when decoding. (Not
    # Gemma's runs of spaces: transformers reads them as the vocabulary's pieces, respelled as "▁"s.)
    respelled = set(tokens)
    tok.add_tokens(
        [
            AddedToken(t, special=False, normalized=False)
            for t, token_type in zip(meta["tokenizer.ggml.tokens"], types, strict=False)
            if token_type == TOKEN_TYPE_USER_DEFINED and t in respelled
        ]
    )
    bos = meta.get("tokenizer.ggml.bos_token_id")
    if bos is not None and not 0 <= bos < len(tokens):
        raise ConfigError(
            f"{checkpoint.path}: GGUF tokenizer.ggml.bos_token_id {bos} is outside the vocabulary [0, {len(tokens)})"
        )
    if meta.get("tokenizer.ggml.add_bos_token", kind == "llama") and bos is not None:
        tok.post_processor = processors.TemplateProcessing(
            single=f"{tokens[bos]} $A", special_tokens=[(tokens[bos], bos)]
        )
    elif kind == "gpt2":
        tok.post_processor = processors.ByteLevel(trim_offsets=False)
    return tok


def _byte_level_bpe(checkpoint: GGUFCheckpoint, tokens: list[str]):
    """GPT-2's byte-level BPE, split first as ``tokenizer.ggml.pre`` names."""
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers

    meta = checkpoint.metadata
    merges = [tuple(m.split(" ", 1)) for m in meta.get("tokenizer.ggml.merges") or []]
    vocab = {t: i for i, t in enumerate(tokens)}
    # NOTE: the tokenizers package panics (a BaseException) on a merge whose result is not a token
    bad = next((i for i, m in enumerate(merges) if len(m) != 2 or not {*m, "".join(m)} <= vocab.keys()), None)
    if bad is not None:
        raise ConfigError(
            f"{checkpoint.path}: GGUF merge {bad} of tokenizer.ggml.merges is {meta['tokenizer.ggml.merges'][bad]!r}, "
            "not two tokens separated by a space that make a third (tokenizer.ggml.tokens)"
        )
    pre = meta.get("tokenizer.ggml.pre")
    tok = Tokenizer(models.BPE(vocab, merges, fuse_unk=False, ignore_merges=pre in WHOLE_PIECE_PRE_TOKENIZERS))
    if pre not in PRE_TOKENIZER_SPLITS:
        known = ", ".join(name for name in PRE_TOKENIZER_SPLITS if name is not None)
        raise ConfigError(
            f"{checkpoint.path}: GGUF pre-tokenizer {pre!r} (tokenizer.ggml.pre) is not supported ({known})"
        )
    split = PRE_TOKENIZER_SPLITS[pre]
    if split is None:
        tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    else:
        tok.pre_tokenizer = pre_tokenizers.Sequence(
            [
                pre_tokenizers.Split(Regex(split), behavior="isolated", invert=False),
                pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
            ]
        )
    tok.decoder = decoders.ByteLevel()
    return tok


def _sentencepiece_bpe(tokens: list[str], scores: list[float], prefix_space: bool | str = True):
    """SentencePiece's BPE as Llama 2's tokenizer runs it: spaces as "▁", one before the text unless it
    starts with one (``prefix_space`` "always": before any text, Phi-3's; False: none, Gemma's), characters
    outside the vocabulary as their UTF-8 bytes (the ``<0xNN>`` tokens), merges from the scores."""
    from tokenizers import Tokenizer, decoders, models, normalizers, pre_tokenizers

    vocab = {t: i for i, t in enumerate(tokens)}  # NOTE: a token listed twice: its last id, as llama.cpp's
    tok = Tokenizer(models.BPE(vocab, merges_from_scores(tokens, scores), fuse_unk=True, byte_fallback=True))
    if prefix_space == "always":
        tok.normalizer = normalizers.Sequence([normalizers.Prepend("\u2581"), normalizers.Replace(" ", "\u2581")])
    else:
        prepend = "first" if prefix_space else "never"
        tok.pre_tokenizer = pre_tokenizers.Metaspace(replacement="\u2581", prepend_scheme=prepend, split=False)
    strip = [decoders.Strip(" ", 1, 0)] if prefix_space else []  # the space put before the text
    tok.decoder = decoders.Sequence([decoders.Replace("\u2581", " "), decoders.ByteFallback(), decoders.Fuse(), *strip])
    return tok


def _gemma_vocabulary(tokens: list[str]) -> tuple[list[str], list[float]]:
    """A Gemma GGUF vocabulary as transformers' GGUF reader reads it: the tokens that are runs of spaces
    (the converter writes "  ") spelled as the "▁"s the text becomes, and ranked by their place in the
    file (Gemma's scores do not follow its merges' order; the file's order does)."""
    respelled = ["\u2581" * len(t) if " " in t and not t.strip() else t for t in tokens]  # (transformers' test)
    return respelled, [-float(i) for i in range(len(tokens))]


def merges_from_scores(tokens: list[str], scores: list[float]) -> list[tuple[str, str]]:
    """The merges a SentencePiece vocabulary implies (its file stores none): every two tokens that make a
    third, ranked by the score of the token they make, best first (llama.cpp merges the best-scored pair
    first); ties by the longer left part, then the longer right part, then the token's place (as
    transformers' ``generate_merges`` ranks them)."""
    ids = {t: i for i, t in enumerate(tokens)}
    score_of = dict(zip(tokens, scores, strict=True))  # NOTE: a token listed twice: its last score
    ranked = []
    for token, score in score_of.items():
        pairs = [(token[:cut], token[cut:]) for cut in range(1, len(token))]
        pairs = sorted((p for p in pairs if p[0] in ids and p[1] in ids), key=lambda p: (ids[p[0]], ids[p[1]]))
        ranked.extend((score, len(left), len(right), left, right) for left, right in pairs)
    ranked.sort(key=lambda m: m[:3], reverse=True)  # NOTE: stable: equal keys keep the order above
    return [(left, right) for _, _, _, left, right in ranked]
