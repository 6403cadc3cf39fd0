"""Closed-loop batches (a workload's ``chains``): each batch after a chain's first arrives when the batch
before it is done. The engine's replay (``run_requests``) and the load client (``bench-serve``) both
release batches with it; the simulator keeps its own per-batch counters on its event loop."""

from __future__ import annotations

from collections.abc import Sequence

from sloserve.core.request import Request


class ClosedLoopBatches:
    """Which requests arrive on their own, and which batch arrives when a request is done."""

    def __init__(self, chains: Sequence[Sequence[Sequence[Request]]]) -> None:
        self._chained = {id(r) for chain in chains for batch in chain[1:] for r in batch}
        self._left: dict[int, int] = {}  # id(batch) -> its requests not done yet
        # id(request) -> (id(its batch), the batch after it)
        self._batch: dict[int, tuple[int, Sequence[Request]]] = {}
        for chain in chains:
            for batch, following in zip(chain, chain[1:]):
                self._left[id(batch)] = len(batch)
                for r in batch:
                    self._batch[id(r)] = (id(batch), following)

    def arrives_on_its_own(self, request: Request) -> bool:
        """False for a request of a batch that waits for the batch before it."""
        return id(request) not in self._chained

    def done(self, request: Request) -> Sequence[Request]:
        """``request`` is done (finished, or failed for a load client): the batch that arrives now,
        when it was the last of its batch to be done; else nothing. Call once per request."""
        if id(request) not in self._batch:  # in a chain's last batch, or in none
            return ()
        key, following = self._batch[id(request)]
        self._left[key] -= 1
        return following if self._left[key] == 0 else ()
