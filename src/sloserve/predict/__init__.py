"""Response-length predictors. A scheduler that needs output lengths asks one at arrival.

NOTE: only ``OraclePredictor`` reads ``Request.true_output_tokens``; schedulers read
``Request.predicted_output_tokens``, set by the predictor when the request arrives.
"""

from __future__ import annotations

import bisect
from abc import ABC, abstractmethod

from sloserve.core.errors import ConfigError, UnknownNameError
from sloserve.core.request import Request


class LengthPredictor(ABC):
    """Predicts a request's output length at arrival; may learn from finished requests."""

    name = "predictor"

    @abstractmethod
    def predict(self, request: Request) -> int:
        """Predicted number of output tokens (>= 1)."""

    def observe(self, request: Request) -> None:
        """A request finished with ``request.num_output_tokens`` tokens (online learners update)."""


class OraclePredictor(LengthPredictor):
    """The true output length: hypothetical schedulers (InferMax's eviction-free variants)."""

    name = "oracle"

    def predict(self, request: Request) -> int:
        return request.true_output_tokens


class OnlineHistogramPredictor(LengthPredictor):
    """Output lengths of finished requests, bucketed by prompt length (InferMax §6).

    A new request's prediction is the ``quantile`` of the outputs seen in its prompt-length bucket
    (power-of-two buckets), falling back to all outputs seen, then to ``default_tokens`` before any
    request has finished. Never above the request's ``max_tokens``.
    """

    name = "histogram"

    def __init__(self, quantile: float = 0.5, default_tokens: int = 256, min_samples: int = 8) -> None:
        if not 0 < quantile <= 1:
            raise ConfigError(f"histogram quantile must be in (0, 1], got {quantile}")
        if default_tokens < 1:
            raise ConfigError(f"histogram default_tokens must be >= 1, got {default_tokens}")
        self.quantile = quantile
        self.default_tokens = default_tokens
        self.min_samples = min_samples
        self._buckets: dict[int, list[int]] = {}  # prompt bucket -> sorted output lengths
        self._all: list[int] = []

    @staticmethod
    def bucket(num_prompt_tokens: int) -> int:
        """Power-of-two bucket of a prompt length: 1, 2-3, 4-7, ..."""
        return num_prompt_tokens.bit_length()

    def _quantile(self, values: list[int]) -> int:
        return values[min(len(values) - 1, int(self.quantile * len(values)))]

    def predict(self, request: Request) -> int:
        samples = self._buckets.get(self.bucket(request.num_prompt_tokens), [])
        if len(samples) >= self.min_samples:
            estimate = self._quantile(samples)
        elif self._all:
            estimate = self._quantile(self._all)
        else:
            estimate = self.default_tokens
        return max(1, min(estimate, request.max_tokens))

    def observe(self, request: Request) -> None:
        out = request.num_output_tokens
        bisect.insort(self._buckets.setdefault(self.bucket(request.num_prompt_tokens), []), out)
        bisect.insort(self._all, out)


PREDICTORS: dict[str, type[LengthPredictor]] = {
    "oracle": OraclePredictor,
    "histogram": OnlineHistogramPredictor,
}


def make_predictor(name: str, **options: float | int) -> LengthPredictor:
    if name not in PREDICTORS:
        raise UnknownNameError("predictor", name, list(PREDICTORS))
    return PREDICTORS[name](**options)
