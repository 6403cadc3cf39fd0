"""Sampling parameters (as in vLLM's ``SamplingParams``) and the sampler (log-probabilities: ``logprobs.py``)."""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Collection, Sequence
from dataclasses import dataclass
from functools import cached_property
from typing import Any

import numpy as np
import torch

from sloserve.core.errors import ConfigError
from sloserve.engine.async_scheduling import fill_at, float_tensor, index_tensor, to_device

# The most top log-probabilities a request may ask for per token (vLLM's default max_logprobs; OpenAI's
# top_logprobs allows 20 too).
MAX_LOGPROBS = 20
# Prompt positions whose vocabulary scores are computed at once (prompt logprobs): 512 x a 150k
# vocabulary in float32 is 300 MB.
PROMPT_LOGITS_ROWS = 512
# vLLM accepts repetition penalties in (0, 2]
MAX_REPETITION_PENALTY = 2.0
# The most sequences one prompt may ask for (``n``; the server's ``best_of`` too): OpenAI's limit on ``n``.
MAX_CHOICES = 128


@dataclass(frozen=True)
class StructuredOutputsParams:
    """vLLM's ``StructuredOutputsParams``: one constraint on a request's output (structured_output.py).

    ``json``: a JSON schema (or its JSON text) the output validates against; ``json_object``: any JSON
    object; ``regex``: a regular expression the whole output matches; ``choice``: one of these
    strings; ``grammar``: a Lark grammar (as vLLM's guidance backend reads it)."""

    json: dict[str, Any] | str | None = None
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    json_object: bool | None = None

    def constraint(self) -> tuple[str, Any]:
        """(kind, value) of the one constraint set; a ConfigError unless exactly one is."""
        given = [(kind, value) for kind, value in (("json", self.json), ("regex", self.regex),
                 ("choice", self.choice), ("grammar", self.grammar)) if value is not None]  # fmt: skip
        if self.json_object:
            given.append(("json", None))
        if len(given) != 1:
            raise ConfigError(
                f"structured outputs take one of json, regex, choice, grammar or json_object; got {len(given)}"
            )
        return given[0]


@dataclass(frozen=True)
class SamplingParams:
    """How to sample one request's output.

    ``temperature`` 0 is greedy (vLLM's default is 1.0, and so is ours). A sampled token is drawn
    from the softmax at ``temperature``, filtered as vLLM v1 filters it: ``min_p`` drops the tokens
    less likely than ``min_p`` times the likeliest one, ``top_k`` keeps the ``top_k`` likeliest (0
    or -1: all; ties with the k-th stay), then ``top_p`` keeps the smallest prefix of what is left,
    renormalised, whose mass reaches ``top_p``. ``seed`` makes a sampled request reproducible on its
    own, whatever it is batched with. ``ignore_eos`` keeps generating until ``max_tokens``
    (benchmarks force output lengths this way, as the papers do). ``stop``: strings that end the
    request ("stop") when its text holds one; the text ends before it (OpenAI's rule), or after it
    with ``include_stop_str_in_output``. ``skip_special_tokens``: leave special tokens out of the
    text (vLLM's default). ``n``: sequences to sample from the prompt (``LLM.generate``: each its own
    engine request; with a ``seed``, sequence ``j`` draws from ``seed + j``, vLLM's rule).

    ``logprobs``: report each sampled token's log-probability and the ``logprobs`` likeliest tokens'
    (None: none; 0: the sampled token's alone). ``prompt_logprobs``: the same for every prompt token
    after the first. Both are the model's own distribution: the log-softmax of its raw scores, before
    any control below and before temperature and top-p (vLLM v1's default,
    ``logprobs_mode="raw_logprobs"``).

    Controls of the scores, applied in this order before temperature and top-p (vLLM's order and
    formulas): ``allowed_token_ids`` (every other token's score is -inf, EOS's too), ``bad_words``
    (the last token of a word's tokens cannot follow the others: ``tokenize_bad_words``),
    ``min_tokens`` (EOS and ``stop_token_ids`` cannot be sampled before that many output tokens; a
    stop string ending in their text does not count: ``Detokenizer``),
    ``logit_bias`` (added to the named tokens' scores), ``repetition_penalty`` (a score of a
    token in the prompt or the output is divided by it when positive, multiplied when negative),
    ``frequency_penalty`` (times each token's count in the output, subtracted) and
    ``presence_penalty`` (subtracted once from each token the output holds). ``stop_token_ids`` end
    the request ("stop") when sampled, as EOS does.
    """

    max_tokens: int = 16
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    seed: int | None = None
    ignore_eos: bool = False
    logprobs: int | None = None
    prompt_logprobs: int | None = None
    min_tokens: int = 0
    logit_bias: dict[int, float] | None = None
    repetition_penalty: float = 1.0
    frequency_penalty: float = 0.0
    presence_penalty: float = 0.0
    stop_token_ids: tuple[int, ...] = ()
    allowed_token_ids: tuple[int, ...] | None = None  # a list is taken too
    bad_words: tuple[str, ...] = ()  # a list is taken too
    # The tokens of each bad word, as it starts a text and after a space (``tokenize_bad_words``)
    bad_words_token_ids: tuple[tuple[int, ...], ...] | None = None
    stop: tuple[str, ...] = ()  # a str or a list is taken too
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True
    n: int = 1
    structured_outputs: StructuredOutputsParams | None = None
    # The llguidance grammar every sampled token must follow (structured_output.py): compiled from
    # ``structured_outputs`` when it is None
    grammar: str | None = None

    def __post_init__(self) -> None:
        if self.structured_outputs is not None and self.grammar is None:
            from sloserve.engine.structured_output import compile_grammar

            object.__setattr__(self, "grammar", compile_grammar(*self.structured_outputs.constraint()))
        stop = (self.stop,) if isinstance(self.stop, str) else self.stop  # vLLM takes a str or a list
        if not isinstance(stop, (list, tuple)) or not all(isinstance(s, str) for s in stop):
            raise ConfigError(f"SamplingParams.stop must be a string or a list of strings, got {self.stop!r}")
        if "" in stop:  # NOTE: as vLLM's: every text would end at once
            raise ConfigError("SamplingParams.stop cannot hold an empty string")
        object.__setattr__(self, "stop", tuple(stop))  # NOTE: frozen (and hashable) from here
        if not isinstance(self.bad_words, (list, tuple)) or not all(isinstance(w, str) for w in self.bad_words):
            raise ConfigError(f"SamplingParams.bad_words must be a list of strings, got {self.bad_words!r}")
        object.__setattr__(self, "bad_words", tuple(self.bad_words))
        if isinstance(self.n, bool) or not isinstance(self.n, int) or not 1 <= self.n <= MAX_CHOICES:
            raise ConfigError(f"SamplingParams.n must be an integer in 1..{MAX_CHOICES}, got {self.n!r}")
        if isinstance(self.max_tokens, bool) or not isinstance(self.max_tokens, int) or self.max_tokens < 1:
            raise ConfigError(f"SamplingParams.max_tokens must be an integer >= 1, got {self.max_tokens!r}")
        if not 0 <= self.temperature < math.inf:  # NOTE: inf would sample uniformly, NaN nothing sensible
            raise ConfigError(f"SamplingParams.temperature must be a finite number >= 0, got {self.temperature!r}")
        if not 0 < self.top_p <= 1:
            raise ConfigError(f"SamplingParams.top_p must be in (0, 1], got {self.top_p!r}")
        if isinstance(self.top_k, bool) or not isinstance(self.top_k, int) or self.top_k < -1:
            raise ConfigError(
                f"SamplingParams.top_k must be an integer >= -1 (0 or -1: all tokens), got {self.top_k!r}"
            )
        if not 0 <= self.min_p <= 1:
            raise ConfigError(f"SamplingParams.min_p must be in [0, 1], got {self.min_p!r}")
        for name in ("logprobs", "prompt_logprobs"):
            value = getattr(self, name)
            if value is not None and (isinstance(value, bool) or not 0 <= value <= MAX_LOGPROBS):
                raise ConfigError(f"SamplingParams.{name} must be an integer in [0, {MAX_LOGPROBS}], got {value!r}")
        if isinstance(self.min_tokens, bool) or not 0 <= self.min_tokens <= self.max_tokens:
            raise ConfigError(
                f"SamplingParams.min_tokens must be in [0, max_tokens={self.max_tokens}], got {self.min_tokens!r}"
            )
        if not 0 < self.repetition_penalty <= MAX_REPETITION_PENALTY:
            raise ConfigError(
                f"SamplingParams.repetition_penalty must be in (0, {MAX_REPETITION_PENALTY}], got {self.repetition_penalty!r}"
            )
        for name in ("frequency_penalty", "presence_penalty"):
            if not -2 <= getattr(self, name) <= 2:
                raise ConfigError(f"SamplingParams.{name} must be in [-2, 2], got {getattr(self, name)!r}")
        for token_id, bias in (self.logit_bias or {}).items():
            if isinstance(token_id, bool) or not isinstance(token_id, int) or token_id < 0:
                raise ConfigError(f"SamplingParams.logit_bias: token id {token_id!r} is not an integer >= 0")
            if not -100 <= bias <= 100:
                raise ConfigError(f"SamplingParams.logit_bias[{token_id}] must be in [-100, 100], got {bias!r}")
        if any(isinstance(t, bool) or not isinstance(t, int) or t < 0 for t in self.stop_token_ids):
            raise ConfigError(f"SamplingParams.stop_token_ids must be integers >= 0, got {self.stop_token_ids!r}")
        allowed = self.allowed_token_ids
        if allowed is not None:
            if (
                not isinstance(allowed, (list, tuple))
                or not allowed
                or any(isinstance(t, bool) or not isinstance(t, int) or t < 0 for t in allowed)
            ):
                raise ConfigError(
                    f"SamplingParams.allowed_token_ids must be a non-empty list of integers >= 0, got {allowed!r}"
                )
            object.__setattr__(self, "allowed_token_ids", tuple(allowed))

    def ends_on(self, token_id: int, eos_token_ids: frozenset[int]) -> bool:
        """Whether sampling ``token_id`` ends the request ("stop"): a stop token, or EOS unless ignored.
        NOTE: as vLLM, such a token is in the output's tokens, not in its text (unless
        ``include_stop_str_in_output``)."""
        return token_id in self.stop_token_set or (token_id in eos_token_ids and not self.ignore_eos)

    def ended_on_stop_token(self, finish_reason: str | None, token_ids: list[int], eos: frozenset[int]) -> bool:
        """Whether an output that ended with ``token_ids`` (its last ones) ended on its last token,
        rather than on a stop string, a grammar's end or ``max_tokens``."""
        return finish_reason == "stop" and bool(token_ids) and self.ends_on(token_ids[-1], eos)

    def for_choice(self, index: int) -> SamplingParams:
        """The params of sequence ``index`` of the ``n``: with a ``seed``, sequence j draws from
        ``seed + j`` (vLLM's rule), so each is reproducible and differs from its siblings."""
        return self if self.seed is None or index == 0 else dataclasses.replace(self, seed=self.seed + index)

    def tokenize_bad_words(self, tokenizer) -> SamplingParams:
        """These params with ``bad_words_token_ids`` (vLLM's rule): each word's tokens as the text's
        start, and after a space where that makes a word token of its own (as many tokens, another
        first one); a word of no tokens is dropped. A ConfigError without a tokenizer (None)."""
        if self.bad_words_token_ids is not None or not self.bad_words:
            return self
        if tokenizer is None:
            raise ConfigError("bad_words need the model's tokenizer (tokenizer.json); this model has none")
        sequences: list[tuple[int, ...]] = []
        for word in self.bad_words:
            alone = tuple(tokenizer.encode(word.lstrip(), add_special_tokens=False))
            spaced = tuple(tokenizer.encode(" " + word.lstrip(), add_special_tokens=False))
            sequences += [ids for ids in (alone,) if ids]
            if spaced and alone and spaced[0] != alone[0] and len(spaced) == len(alone):
                sequences.append(spaced)
        return dataclasses.replace(self, bad_words_token_ids=tuple(sequences))

    def token_ids_named(self) -> list[int]:
        """The token ids these params name (logit_bias, stop_token_ids, allowed_token_ids): each must be
        in the vocabulary."""
        return [*(self.logit_bias or {}), *self.stop_token_ids, *(self.allowed_token_ids or ())]

    def leaves_no_token(self, eos_token_ids: Collection[int]) -> str | None:
        """Why these controls leave no token to sample, where that shows before the request runs, else
        None: every token of ``allowed_token_ids`` is a bad word of one token, or those left are EOS and
        ``stop_token_ids``, which ``min_tokens`` holds back. (A bad word of several tokens bars its last
        one only after the others: not seen here.) Tokenize the bad words first."""
        if not self.allowed_token_ids:
            return None
        left = set(self.allowed_token_ids) - {ids[0] for ids in self.bad_words_token_ids or () if len(ids) == 1}
        if not left:
            return "every token of allowed_token_ids is a bad word (bad_words): none is left to generate"
        if self.min_tokens and left <= {*eos_token_ids, *self.stop_token_ids}:
            return (
                f"min_tokens {self.min_tokens} holds back EOS and stop_token_ids, and they are every token "
                "allowed_token_ids leaves: none is left to generate"
            )
        return None

    # NOTE: cached (in the instance's __dict__, which the frozen dataclass leaves to them): the executor
    # reads these for every row of every step
    @cached_property
    def penalizes(self) -> bool:
        """Whether a repetition, frequency or presence penalty is set."""
        return self.repetition_penalty != 1 or bool(self.frequency_penalty or self.presence_penalty)

    @cached_property
    def controls_scores(self) -> bool:
        """Whether any control changes the scores (``apply_controls`` or the penalties have work for it)."""
        return bool(self.min_tokens or self.logit_bias or self.allowed_token_ids or self.bad_words_token_ids) or (
            self.penalizes
        )

    @cached_property
    def greedy(self) -> bool:
        return self.temperature == 0

    @cached_property
    def allowed_token_tensor(self) -> torch.Tensor:  # (K,) int64, on the CPU
        """``allowed_token_ids`` as a tensor, made once: a request may allow most of the vocabulary, and a
        list of 100,000 ids made into a tensor costs every step 25 ms."""
        return torch.tensor(self.allowed_token_ids or (), dtype=torch.int64)

    @cached_property
    def stop_token_set(self) -> frozenset[int]:
        """``stop_token_ids`` as a set, made once: every step asks whether each request's token is one."""
        return frozenset(self.stop_token_ids)

    @cached_property
    def stop_token_tensor(self) -> torch.Tensor:  # (S,) int64, on the CPU
        """``stop_token_ids`` as a tensor, made once (as ``allowed_token_tensor``): ``min_tokens`` bars them."""
        return torch.tensor(self.stop_token_ids, dtype=torch.int64)

    @cached_property
    def logit_bias_tensors(self) -> tuple[torch.Tensor, torch.Tensor]:  # (B,) int64 token ids, (B,) float32 biases
        """``logit_bias`` as tensors, made once (as ``allowed_token_tensor``)."""
        bias = self.logit_bias or {}
        return torch.tensor(list(bias), dtype=torch.int64), torch.tensor(list(bias.values()), dtype=torch.float32)

    @cached_property
    def bad_word_endings(self) -> dict[int, dict[tuple[int, ...], list[int]]]:
        """``bad_words_token_ids`` as a step looks them up: by the number of tokens before a word's last
        one, then by those tokens, the last tokens they bar. NOTE: a step looks up its output's ending once
        per length, not once per word (a request may bring thousands of words)."""
        endings: dict[int, dict[tuple[int, ...], list[int]]] = {}
        for ids in self.bad_words_token_ids or ():
            endings.setdefault(len(ids) - 1, {}).setdefault(ids[:-1], []).append(ids[-1])
        return endings

    @cached_property
    def bad_word_endings_but_last(self) -> dict[int, dict[tuple[int, ...], list[tuple[int, int]]]]:
        """The words of several tokens as ``bad_word_endings``, for an output whose last token is still on the
        device: by the tokens before the word's last two, (the token before its last, its last)."""
        endings: dict[int, dict[tuple[int, ...], list[tuple[int, int]]]] = {}
        for ids in self.bad_words_token_ids or ():
            if len(ids) > 1:
                endings.setdefault(len(ids) - 2, {}).setdefault(ids[:-2], []).append((ids[-2], ids[-1]))
        return endings

    @cached_property
    def filters(self) -> bool:
        """Whether a sampled token is drawn from part of the vocabulary (min_p, top_k or top_p set)."""
        return self.min_p > 0 or self.top_k > 0 or self.top_p < 1


def apply_controls(
    logits: torch.Tensor,  # (N, vocab) float32, one row per request that samples this step; changed in place
    params: list[SamplingParams],
    token_ids: list[list[int]],  # (N,) each row's prompt and output tokens so far
    num_prompt_tokens: list[int],  # (N,)
    eos_token_ids: frozenset[int],
    late: tuple[list[int], torch.Tensor] | None = None,  # rows with one more output token, on the device (L,)
) -> None:
    """Apply each row's score controls (``SamplingParams``) but the penalties, which read counts kept
    from step to step (``penalties.PenaltyCounts``, applied after these), batched over the rows that
    have them. ``late`` (async scheduling): the rows whose last output token is not in ``token_ids``
    yet, and those tokens on the device; ``min_tokens`` counts them, a bad word is matched there."""
    device, vocab = logits.device, logits.shape[1]
    rows = [i for i, p in enumerate(params) if p.controls_scores]
    if not rows:
        return
    late_rows, late_tokens = late if late is not None else ([], None)
    late_entry = {i: at for at, i in enumerate(late_rows)}  # row -> its entry of ``late_tokens`` (its last token)
    allowing = [i for i in rows if params[i].allowed_token_ids]
    if allowing:  # every score but the allowed tokens' to -inf
        barred = torch.ones(len(allowing), vocab, dtype=torch.bool, device=device)  # (A, vocab)
        fill_at(
            barred, _scattered(range(len(allowing)), [params[i].allowed_token_tensor for i in allowing], device), False
        )
        index = index_tensor(allowing, device)
        logits[index] = logits[index].masked_fill(barred, -math.inf)
    # bad words: a word's last token is barred where the output ends with the tokens before it. Where the
    # output's last token is still on the device, the host matches the tokens before that one and the
    # device the last: (row, entry of late, the token it must be, the token barred if it is)
    banned, banned_if_last = [], []
    for i in rows:
        p = params[i]
        if not p.bad_words_token_ids:
            continue
        if i not in late_entry:
            for length, words in p.bad_word_endings.items():
                banned += [
                    (i, last) for last in words.get(_output_ending(token_ids[i], num_prompt_tokens[i], length), ())
                ]
            continue
        banned += [(i, last) for last in p.bad_word_endings.get(0, {}).get((), ())]  # the words of one token
        for length, words in p.bad_word_endings_but_last.items():
            for token, last in words.get(_output_ending(token_ids[i], num_prompt_tokens[i], length), ()):
                banned_if_last.append((i, late_entry[i], token, last))
    if banned:
        fill_at(logits, tuple(index_tensor(banned, device).T), -math.inf)
    if banned_if_last:  # NOTE: added, not set: a row may bar one token by two words, one of them not in force
        last_is = late_tokens[index_tensor([at for _, at, _, _ in banned_if_last], device)] == index_tensor(
            [token for _, _, token, _ in banned_if_last], device
        )  # (C,)
        where = index_tensor([(i, barred) for i, _, _, barred in banned_if_last], device).T
        bar = torch.zeros(len(banned_if_last), device=device).masked_fill(last_is, -math.inf)  # (C,)
        logits.index_put_(tuple(where), bar, accumulate=True)
    # min_tokens (EOS and the stop tokens barred while the output is shorter), then logit_bias: each set or
    # added at once
    holding = [i for i in rows if len(token_ids[i]) + (i in late_entry) - num_prompt_tokens[i] < params[i].min_tokens]
    if holding:
        fill_at(
            logits, (index_tensor(holding, device)[:, None], index_tensor(sorted(eos_token_ids), device)), -math.inf
        )
        stopping = [i for i in holding if params[i].stop_token_ids]
        if stopping:
            fill_at(logits, _scattered(stopping, [params[i].stop_token_tensor for i in stopping], device), -math.inf)
    biasing = [i for i in rows if params[i].logit_bias]
    if biasing:
        tokens, biases = zip(*(params[i].logit_bias_tensors for i in biasing), strict=True)
        logits.index_put_(_scattered(biasing, tokens, device), to_device(torch.cat(biases), device), accumulate=True)


def _scattered(
    rows: Sequence[int], columns: Sequence[torch.Tensor], device: torch.device
) -> tuple[torch.Tensor, torch.Tensor]:  # (C,) int64 rows, (C,) int64 columns
    """The index of each row's ``columns`` (CPU tensors, one per row) in a (rows, vocab) tensor on ``device``."""
    counts = torch.tensor([len(c) for c in columns], dtype=torch.int64)
    repeated = torch.repeat_interleave(torch.tensor(rows, dtype=torch.int64), counts)
    return to_device(repeated, device), to_device(torch.cat(columns), device)


def _output_ending(token_ids: list[int], num_prompt_tokens: int, length: int) -> tuple[int, ...] | None:
    """The output's (``token_ids`` after the prompt) last ``length`` tokens; None where it has fewer."""
    if len(token_ids) - num_prompt_tokens < length:
        return None
    return tuple(token_ids[len(token_ids) - length :])


def sample(
    logits: torch.Tensor,  # (N, vocab) float32, one row per request that samples this step
    params: list[SamplingParams],
    generators: list[np.random.Generator | None],
) -> list[int]:
    """``sample_on_device``'s tokens on the host."""
    return sample_on_device(logits, params, generators).tolist()


def sample_on_device(
    logits: torch.Tensor,  # (N, vocab) float32, one row per request that samples this step
    params: list[SamplingParams],
    generators: list[np.random.Generator | None],
) -> torch.Tensor:  # (N,) int64 on the logits' device
    """One token per row: argmax for greedy rows; the others at temperature, filtered (min-p, top-k,
    top-p: ``SamplingParams``), drawn by inverse CDF with one uniform number per row from the row's
    own host generator (drawn before the logits are known: nothing here waits for the device).

    NOTE: rows are sampled in two batches (without and with filters), whatever their number: a loop
    over rows would launch about ten kernels a row, thousands a step at batch 256, longer than the
    forward pass. A row's token depends only on its logits, its params and its generator, so a
    seeded request samples the same tokens in any batch.
    """
    tokens = logits.argmax(dim=-1)  # (N,)
    plain = [i for i, p in enumerate(params) if not p.greedy and not p.filters]
    filtered = [i for i, p in enumerate(params) if not p.greedy and p.filters]
    for rows, filters in ((plain, False), (filtered, True)):
        if rows:
            index = index_tensor(rows, logits.device)  # (R,)
            tokens[index] = _draw(logits[index], [params[i] for i in rows], [generators[i] for i in rows], filters)
    return tokens


def _draw(
    logits: torch.Tensor,  # (R, vocab)
    params: list[SamplingParams],
    generators: list[np.random.Generator | None],
    filters: bool,
) -> torch.Tensor:  # (R,) token ids
    device = logits.device
    temperature = float_tensor([p.temperature for p in params], device)[:, None]  # (R, 1)
    uniform = float_tensor([g.random() for g in generators], device)[:, None]  # (R, 1) in [0, 1)
    probs = torch.softmax(logits / temperature, dim=-1)  # (R, vocab)
    if filters:
        probs, order = probs.sort(dim=-1, descending=True)  # (R, vocab)
        probs = _filter_sorted(probs, params)
    cdf = probs.cumsum(dim=-1)  # (R, vocab)
    # The first token whose CDF passes u x mass. Held below the mass (u can round to 1.0 in
    # float32), the target is always passed where the CDF rises: at a token of probability > 0.
    mass = cdf[:, -1:]
    target = torch.minimum(uniform * mass, torch.nextafter(mass, torch.zeros_like(mass)))  # (R, 1)
    pick = torch.searchsorted(cdf, target, right=True).clamp(max=logits.shape[1] - 1)  # (R, 1)
    drawn = order.gather(1, pick) if filters else pick  # (R, 1)
    # NOTE: a row with no mass takes its argmax, as a greedy row: its controls barred every token (all scores
    # -inf, as allowed_token_ids that are all bad words), or its temperature is below float32's (1e-320 is 0)
    return torch.where(mass > 0, drawn, logits.argmax(dim=-1, keepdim=True))[:, 0]


def _filter_sorted(
    probs: torch.Tensor,  # (R, vocab) each row's probabilities at its temperature, in descending order
    params: list[SamplingParams],
) -> torch.Tensor:  # (R, vocab) the same with the filtered-out tokens at 0 (not renormalised)
    """min-p, then top-k, then top-p over what is left (vLLM v1's order); a filter no row sets is
    skipped (a top-p row alone costs no more kernels than before the others). The likeliest token
    always stays: it passes min-p (min_p <= 1), is the first of any top-k and starts every top-p prefix."""
    # NOTE: each row's setting goes to the device from pinned memory (``float_tensor``): a tensor made on a
    # GPU from a list is copied from pageable memory, which waits for every kernel queued before it (the
    # step's forward pass, and with async scheduling the host's work on the next step with it)
    device, vocab = probs.device, probs.shape[1]
    if any(p.min_p > 0 for p in params):
        min_p = float_tensor([p.min_p for p in params], device)[:, None]  # (R, 1)
        probs = probs.masked_fill(probs < min_p * probs[:, :1], 0)
    if any(p.top_k > 0 for p in params):  # by threshold: a token as likely as the k-th stays too (vLLM's rule)
        kth = index_tensor([min(p.top_k, vocab) - 1 if p.top_k > 0 else vocab - 1 for p in params], device)  # (R,)
        probs = probs.masked_fill(probs < probs.gather(1, kth[:, None]), 0)
    if any(p.top_p < 1 for p in params):  # the smallest prefix whose mass reaches top_p of the mass left
        top_p = float_tensor([p.top_p if p.top_p < 1 else math.inf for p in params], device)[:, None]
        dropped = probs.cumsum(dim=-1) - probs >= top_p * probs.sum(dim=-1, keepdim=True)  # (R, vocab)
        dropped[:, 0] = False  # NOTE: where top_p is below float32's (1e-300 is 0), the likeliest token stays
        probs = probs.masked_fill(dropped, 0)
    return probs
