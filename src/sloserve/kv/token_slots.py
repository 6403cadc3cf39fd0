"""Shared by managers that keep an explicit token -> slot list per request (BROS's bidirectional
blocks, EconoServe's pipelined regions): slot reads, and CPU slots for tokens moved to host memory
with the single-slot copies that move them."""

from __future__ import annotations

import numpy as np

from sloserve.core.outputs import SlotCopy
from sloserve.core.request import Request
from sloserve.kv.array_mirror import ArrayMirror

CHECKPOINTED = -1  # a token whose KV lives in CPU memory


class TokenSlotTable:
    """Mixin: ``token_slots[request][k]`` is token k's GPU slot, or CHECKPOINTED.

    NOTE: host memory is taken to be ample (both papers' assumption): CPU slots grow on demand;
    ``num_cpu_slots`` is the engine's host buffer size.
    """

    def _init_token_slots(self) -> None:
        self.token_slots: dict[Request, list[int]] = {}
        self.cpu_slots: dict[Request, dict[int, int]] = {}  # token -> CPU slot of each token in host memory
        self._cpu_free: list[int] = []
        self.num_cpu_slots = 0  # CPU slots ever handed out
        self.pending_copies: list[SlotCopy] = []  # copies to run before the next step, in order
        # NOTE: a token's slot is not a function of its block (slots move one by one), so the tables
        # the engine reads hold one slot per token.
        self.table_block_size = 1
        # NOTE: a manager that changes a slot list other than by appending (a token checkpointed,
        # restored or given back), or drops it, calls _slots_rewritten for that request.
        self._slot_arrays = ArrayMirror()

    def num_slots(self, request: Request) -> int:
        """Tokens of ``request`` with a GPU slot (those in CPU memory excluded)."""
        return len(self.token_slots.get(request, ())) - self.num_checkpointed(request)

    def num_checkpointed(self, request: Request) -> int:
        """Tokens of ``request`` whose KV is in CPU memory."""
        return len(self.cpu_slots.get(request, ()))

    def num_tracked_tokens(self, request: Request) -> int:
        """Tokens of ``request`` whose KV is kept (on the GPU or in CPU memory)."""
        return len(self.token_slots.get(request, ()))

    def slot_ids(self, request: Request, start: int, end: int) -> list[int]:
        slots = self.token_slots[request][start:end]
        if len(slots) != end - start or CHECKPOINTED in slots:
            raise IndexError(f"{request}: tokens {start}..{end - 1} are not all on the GPU")
        return slots

    def block_id_tables(self, requests: list[Request], num_tokens: np.ndarray) -> np.ndarray:
        """``(len(requests), max(num_tokens))`` slot ids, row i the first ``num_tokens[i]`` slots of
        ``requests[i]`` padded with slot 0: the compact tables of the block managers, with blocks of
        one token (``table_block_size`` is 1), so they are the slot tables themselves."""
        table = np.zeros((len(requests), int(num_tokens.max())), dtype=np.int64)
        for row, (request, n) in enumerate(zip(requests, num_tokens.tolist(), strict=True)):
            slots = self._slot_arrays.array(request, self.token_slots[request])
            if n > len(slots):
                raise IndexError(f"{request}: tokens {len(slots)}..{n - 1} have no slot")
            table[row, :n] = slots[:n]
        checkpointed = table == CHECKPOINTED  # (B, max tokens); entries past a row's length are 0
        if checkpointed.any():
            row = int(np.flatnonzero(checkpointed.any(axis=1))[0])
            raise IndexError(f"{requests[row]}: tokens 0..{num_tokens[row] - 1} are not all on the GPU")
        return table

    def _slots_rewritten(self, request: Request) -> None:
        """``request``'s slot list changed other than by appending, or is gone: the engine's array
        of it (``block_id_tables``) is rebuilt on its next read."""
        self._slot_arrays.drop(request)

    def take_copies(self) -> list[SlotCopy]:
        """The GPU <-> CPU slot copies decided since the last call, in the order they were decided."""
        copies, self.pending_copies = self.pending_copies, []
        return copies

    def _take_cpu_slot(self) -> int:
        if self._cpu_free:
            return self._cpu_free.pop()
        self.num_cpu_slots += 1
        return self.num_cpu_slots - 1

    def _check_token_slots(self) -> None:
        """Every CHECKPOINTED token has one CPU slot of its own; no CPU slot is lost; the slot lists'
        arrays agree with them."""
        self._slot_arrays.check(self.token_slots)
        for request, slots in self.token_slots.items():
            saved = self.cpu_slots.get(request, {})
            assert sorted(saved) == [i for i, x in enumerate(slots) if x == CHECKPOINTED], "CPU slots of checkpoints"
        held = [c for saved in self.cpu_slots.values() for c in saved.values()]
        assert len(set(held)) == len(held) and not set(held) & set(self._cpu_free), "a CPU slot is used twice"
        assert len(held) + len(self._cpu_free) == self.num_cpu_slots, "CPU slots lost"
