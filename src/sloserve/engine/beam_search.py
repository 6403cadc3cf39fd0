"""Beam search, as vLLM v1 runs it: above the engine, one token at a time.

Each step asks the engine for the next token of every live beam (a request of ``max_tokens`` 1 with the
``2 * beam_width`` likeliest tokens' log-probabilities; the beams share their prefix's KV through the
prefix cache), extends each beam by each of those tokens, and keeps the ``beam_width`` best by
cumulative log-probability. A beam that ends in EOS is complete and set aside. After ``max_tokens``
steps (or when no beam is live) the best ``beam_width`` of the complete and live beams are returned,
ranked by vLLM's score: the cumulative log-probability over the sequence length (prompt included, EOS
not) to the power ``length_penalty``.

``search`` is a generator, so that the offline ``LLM`` (its engine stepped in a loop) and a server
(its engine behind ``await``) can drive the same search: it yields the token lists to extend and is
sent back each one's next-token ``Logprobs``.
"""

from __future__ import annotations

from collections.abc import Generator
from dataclasses import dataclass, field

from sloserve.core.errors import ConfigError
from sloserve.engine.logprobs import Logprobs
from sloserve.engine.sampler import MAX_LOGPROBS, SamplingParams

# The widest beam: each step asks for 2 * beam_width log-probabilities, at most MAX_LOGPROBS.
MAX_BEAM_WIDTH = MAX_LOGPROBS // 2


@dataclass(frozen=True)
class BeamSearchParams:
    """vLLM's ``BeamSearchParams``."""

    beam_width: int
    max_tokens: int
    ignore_eos: bool = False
    length_penalty: float = 1.0

    def __post_init__(self) -> None:
        if not 1 <= self.beam_width <= MAX_BEAM_WIDTH:
            raise ConfigError(f"beam_width must be in 1..{MAX_BEAM_WIDTH}, got {self.beam_width}")
        if self.max_tokens < 1:
            raise ConfigError(f"beam search needs max_tokens >= 1, got {self.max_tokens}")

    def step_params(self) -> SamplingParams:
        """The engine request of one beam's step: one greedy token, with the ``2 * beam_width``
        likeliest tokens' log-probabilities."""
        return SamplingParams(max_tokens=1, temperature=0, logprobs=2 * self.beam_width)


@dataclass
class Beam:
    """A sequence the search holds: the prompt and its tokens so far, with their log-probabilities."""

    token_ids: list[int]  # prompt + output
    num_prompt_tokens: int
    cumulative_logprob: float = 0.0
    logprobs: list[Logprobs] = field(default_factory=list)  # each output token's
    finished: bool = False  # ended in EOS

    @property
    def output_token_ids(self) -> list[int]:
        return self.token_ids[self.num_prompt_tokens :]

    def score(self, length_penalty: float, eos_token_ids: frozenset[int]) -> float:
        """vLLM's ``get_beam_search_score``."""
        length = len(self.token_ids) - (self.token_ids[-1] in eos_token_ids)
        return self.cumulative_logprob / length**length_penalty


def search(
    prompt_token_ids: list[int], params: BeamSearchParams, eos_token_ids: frozenset[int]
) -> Generator[list[list[int]], list[Logprobs], list[Beam]]:
    """The best ``params.beam_width`` beams after ``prompt_token_ids``, best first (see the module)."""
    width = params.beam_width
    live = [Beam(list(prompt_token_ids), len(prompt_token_ids))]
    complete: list[Beam] = []
    for _ in range(params.max_tokens):
        nexts = yield [beam.token_ids for beam in live]
        extended = []
        for beam, nxt in zip(live, nexts, strict=True):
            for rank, (token, logprob) in enumerate(zip(nxt.top_token_ids, nxt.top_logprobs, strict=True), 1):
                entry = Logprobs(token, logprob, nxt.top_token_ids, nxt.top_logprobs, rank)
                child = Beam(beam.token_ids + [token], beam.num_prompt_tokens, beam.cumulative_logprob + logprob,
                             beam.logprobs + [entry])  # fmt: skip
                if token in eos_token_ids and not params.ignore_eos:
                    child.finished = True
                    complete.append(child)
                else:
                    extended.append(child)
        # NOTE: as vLLM, the live beams are ranked by the same score as the final ones
        extended.sort(key=lambda b: b.score(params.length_penalty, eos_token_ids), reverse=True)
        live = extended[:width]
        if not live:
            break
    ranked = sorted(complete + live, key=lambda b: b.score(params.length_penalty, eos_token_ids), reverse=True)
    return ranked[:width]
