"""Log-probabilities: of one position (``Logprobs``, as vLLM reports them), computed for many rows on
the device (``logprobs_on_device``) and, with async scheduling, brought to the host with the step's tokens
(``PendingLogprobs``)."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any, NamedTuple

import torch


class Logprobs(NamedTuple):
    """Log-probabilities at one position: of the token there, and of the likeliest tokens, best first."""

    token_id: int
    logprob: float
    top_token_ids: tuple[int, ...]
    top_logprobs: tuple[float, ...]
    rank: int  # the token's among the vocabulary: 1 + the tokens likelier than it (vLLM's)

    def with_top(self, num_top: int) -> Logprobs:
        """These log-probabilities with the ``num_top`` likeliest tokens only."""
        return self._replace(top_token_ids=self.top_token_ids[:num_top], top_logprobs=self.top_logprobs[:num_top])


def cumulative_logprob(entries: Iterable[Logprobs]) -> float:
    """A sequence's log-probability: the sum of its tokens' (vLLM's ``cumulative_logprob``)."""
    return sum(entry.logprob for entry in entries)


class LogprobsOnDevice(NamedTuple):
    """Log-probabilities of N rows as tensors, where they were computed (``logprobs_on_device``); a step
    launched early (async scheduling) brings them to the host with its tokens."""

    chosen: torch.Tensor  # (N,) float32 the log-probability of each row's token
    ranks: torch.Tensor  # (N,) int64
    top_ids: torch.Tensor  # (N, k) int64, k the rows' most top tokens asked for
    top_values: torch.Tensor  # (N, k) float32

    def to_host(self, num_top: list[int], token_ids: list[int]) -> list[Logprobs]:
        """Each row's ``Logprobs`` with its ``num_top`` best tokens (the tensors on the host already, or
        brought there now)."""
        return [
            Logprobs(t, lp, tuple(ids[:n]), tuple(values[:n]), rank)
            for t, lp, rank, n, ids, values in zip(
                token_ids,
                self.chosen.tolist(),
                self.ranks.tolist(),
                num_top,
                self.top_ids.tolist(),
                self.top_values.tolist(),
                strict=True,
            )
        ]


def logprobs_on_device(
    logits: torch.Tensor,  # (N, vocab) float32
    token_ids: torch.Tensor,  # (N,) int64, on the logits' device: the token at each row's position
    num_top: int,  # the most top tokens any row asks for
) -> LogprobsOnDevice:
    """The log-softmax of each row's raw scores at ``token_ids``, its rank and the ``num_top`` best tokens
    (ties in the order of ``torch.topk``), left on the device."""
    logprobs = torch.log_softmax(logits, dim=-1)  # (N, vocab)
    chosen = logprobs.gather(1, token_ids[:, None])  # (N, 1)
    ranks = (logprobs > chosen).sum(dim=-1) + 1  # (N,)
    top_values, top_ids = logprobs.topk(num_top, dim=-1) if num_top else (logprobs[:, :0], logprobs[:, :0])  # (N, k)
    return LogprobsOnDevice(chosen[:, 0], ranks, top_ids.long(), top_values)


class PendingLogprobs:
    """Log-probabilities computed on the device (``logprobs_on_device``) for ``rows``, each with
    how many top tokens it asked for and its token (None for the sampled tokens: they come back with
    them); ``found`` is brought to the host with the tokens."""

    __slots__ = ("rows", "num_top", "found", "token_ids")

    def __init__(
        self, rows: list[Any], num_top: list[int], found: LogprobsOnDevice, token_ids: list[int] | None = None
    ) -> None:
        self.rows, self.num_top, self.found, self.token_ids = rows, num_top, found, token_ids

    def to_host(self, token_ids: list[int] | None = None) -> list[Logprobs]:
        """Each row's ``Logprobs``, of ``token_ids`` or of the tokens given at construction (after
        ``SampledOnDevice.token_ids``: ``found`` is on the host then)."""
        return self.found.to_host(self.num_top, self.token_ids if token_ids is None else token_ids)
