"""int64 arrays that follow the KV managers' Python lists (block tables, token -> slot lists), so the
engine can build a batch's context tables by copying arrays instead of converting every id from a
Python int, every step.

A mirror is kept per request and extended by what was appended to its list since it was last read.
NOTE: that is only right for lists that grow by appending. A manager that changes a list any other
way (an id replaced, tokens given back) calls ``drop`` for that request, and so does it when the
request leaves; a list that is replaced by a new one is caught by identity. ``check`` (from the
managers' ``check_integrity``) asserts every mirror still agrees with its list.
"""

from __future__ import annotations

from collections.abc import Hashable, Mapping

import numpy as np


class ArrayMirror:
    """Per-key int64 copies of lists of ints, refreshed on read by the appended tail."""

    def __init__(self) -> None:
        # key -> (the list mirrored, its array with room to grow, how much of it is the list's)
        self._held: dict[Hashable, tuple[list[int], np.ndarray, int]] = {}

    def __len__(self) -> int:
        return len(self._held)

    def array(self, key: Hashable, source: list[int]) -> np.ndarray:
        """``source`` as a ``(len(source),)`` int64 array (a view: valid until the next call)."""
        n = len(source)
        held = self._held.get(key)
        if held is None or held[0] is not source or held[2] > n:
            data = np.fromiter(source, dtype=np.int64, count=n)
        else:
            _, data, size = held
            if size == n:
                return data[:n]
            if n > len(data):  # room doubles, so a list growing one id a step costs O(1) a step
                grown = np.empty(max(n, 2 * len(data)), dtype=np.int64)
                grown[:size] = data[:size]
                data = grown
            data[size:n] = source[size:n]
        self._held[key] = (source, data, n)
        return data[:n]

    def adopt(self, key: Hashable, source: list[int], data: np.ndarray) -> None:
        """Mirror ``source`` by ``data``, an array equal to it that nobody changes (its owner's copy)."""
        self._held[key] = (source, data, len(source))

    def drop(self, key: Hashable) -> None:
        """Forget ``key``'s mirror (its list changed other than by appending, or is gone)."""
        self._held.pop(key, None)

    def check(self, sources: Mapping[Hashable, list[int]]) -> None:
        """Assert every mirror has a list in ``sources`` and, while it is the same list, equals it."""
        for key, (source, data, size) in self._held.items():
            assert key in sources, f"{key}: a mirror outlived its list"
            if sources[key] is source:
                assert data[:size].tolist() == source[:size], f"{key}: its list changed without a drop"
