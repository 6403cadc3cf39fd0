"""The repetition, frequency and presence penalties, from token counts kept per request on the device.

A penalty reads two facts about each vocabulary token: whether the prompt holds it, and how many times
the output does. Counted afresh each step, they cost a step the whole context of every penalized
request (a 32K-token context is 32K tokens made into a tensor, every step). ``PenaltyCounts`` keeps
them instead, one row per penalized request in two (slots, vocab) tensors (vLLM's model runner v2
keeps its ``prompt_bin_mask`` and ``output_bin_counts`` so): the prompt is marked once, and a step adds
only the tokens a request gained since its last, in one scatter for the whole batch.
"""

from __future__ import annotations

from collections.abc import Hashable, Sequence

import torch

from sloserve.engine.async_scheduling import fill_at, float_tensor, index_tensor
from sloserve.engine.sampler import SamplingParams


class PenaltyCounts:
    """Each penalized request's prompt tokens and output token counts, on ``device``, kept from step
    to step under the request's key; ``release`` frees a finished request's row for another.

    NOTE: a request's output only grows (a preemption recomputes its KV, not its tokens), so its row
    counts its first ``_counted[key]`` output tokens, and a step adds the rest."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.in_prompt = torch.zeros(0, 0, dtype=torch.bool, device=device)  # (slots, vocab)
        self.output_counts = torch.zeros(0, 0, device=device)  # (slots, vocab) float32
        self._slot: dict[Hashable, int] = {}
        self._counted: dict[Hashable, int] = {}  # output tokens already in the request's row
        self._free: list[int] = []

    def __len__(self) -> int:
        """The requests that hold a row."""
        return len(self._slot)

    def release(self, key: Hashable) -> None:
        """Free ``key``'s row (nothing if it has none)."""
        slot = self._slot.pop(key, None)
        if slot is not None:
            del self._counted[key]
            self._free.append(slot)

    def apply(
        self,
        logits: torch.Tensor,  # (N, vocab) float32, one row per request that samples this step; changed in place
        keys: Sequence[Hashable],  # (N,) each row's request, the same key every step
        params: list[SamplingParams],
        token_ids: list[list[int]],  # (N,) each row's prompt and output tokens so far
        num_prompt_tokens: list[int],  # (N,)
        late: tuple[list[int], torch.Tensor] | None = None,  # rows with one more output token, on the device (L,)
    ) -> None:
        """Apply the penalties of the rows whose params set one (vLLM's formulas): a score of a token
        the prompt or output holds is divided by ``repetition_penalty`` (multiplied where negative),
        then ``frequency_penalty`` times the token's count in the output and ``presence_penalty`` once
        are subtracted. ``late`` (async scheduling): the rows whose last output token is not in
        ``token_ids`` yet, and those tokens; they are counted on the device."""
        penalized = [i for i, p in enumerate(params) if p.penalizes]
        if not penalized:
            return
        slots = [self._row(keys[i], token_ids[i], num_prompt_tokens[i], logits.shape[1]) for i in penalized]
        late_rows, late_tokens = late if late is not None else ([], None)
        late_entry = {i: at for at, i in enumerate(late_rows)}  # row -> its entry of ``late_tokens``
        gained = []  # (slot, token) of each output token on the host not counted yet
        for i, slot in zip(penalized, slots, strict=True):
            new = token_ids[i][num_prompt_tokens[i] + self._counted[keys[i]] :]
            gained += [(slot, token) for token in new]
            # NOTE: a late token is counted now, so not again when the host has it (in ``token_ids`` then)
            self._counted[keys[i]] += len(new) + (i in late_entry)
        if gained:
            where = index_tensor(gained, self.device).T  # (2, G)
            self._count(where[0], where[1])
        in_flight = [(slot, late_entry[i]) for i, slot in zip(penalized, slots, strict=True) if i in late_entry]
        if in_flight:
            at = index_tensor([at for _, at in in_flight], self.device)
            self._count(index_tensor([slot for slot, _ in in_flight], self.device), late_tokens[at])
        rows = index_tensor(slots, self.device)
        counts, in_prompt = self.output_counts[rows], self.in_prompt[rows]  # (R, vocab) each
        index = index_tensor(penalized, self.device)
        scores = logits[index]  # (R, vocab)
        repetition = float_tensor([params[i].repetition_penalty for i in penalized], self.device)[:, None]
        seen = in_prompt | (counts > 0)
        scores = torch.where(seen, torch.where(scores > 0, scores / repetition, scores * repetition), scores)
        frequency = float_tensor([params[i].frequency_penalty for i in penalized], self.device)[:, None]
        presence = float_tensor([params[i].presence_penalty for i in penalized], self.device)[:, None]
        logits[index] = scores - frequency * counts - presence * (counts > 0)

    def _count(self, slots: torch.Tensor, tokens: torch.Tensor) -> None:  # (C,) each
        """One more of ``tokens[c]`` in the output of ``slots[c]``'s request (a slot may repeat)."""
        self.output_counts.index_put_((slots, tokens), torch.ones(len(slots), device=self.device), accumulate=True)

    def _row(self, key: Hashable, token_ids: list[int], num_prompt_tokens: int, vocab: int) -> int:
        """``key``'s row; a new request gets a free one with its prompt marked and no output counted."""
        slot = self._slot.get(key)
        if slot is not None:
            return slot
        if not self._free:
            self._grow(vocab)
        slot = self._free.pop()
        self._slot[key], self._counted[key] = slot, 0
        self.output_counts[slot] = 0
        self.in_prompt[slot] = False
        if num_prompt_tokens:
            fill_at(self.in_prompt[slot], (index_tensor(token_ids[:num_prompt_tokens], self.device),), True)
        return slot

    def _grow(self, vocab: int) -> None:
        """Twice the rows (one at first), the rows in use kept."""
        used = self.output_counts.shape[0]
        size = max(1, 2 * used)
        in_prompt = torch.zeros(size, vocab, dtype=torch.bool, device=self.device)
        output_counts = torch.zeros(size, vocab, device=self.device)
        if used:
            in_prompt[:used], output_counts[:used] = self.in_prompt, self.output_counts
        self.in_prompt, self.output_counts = in_prompt, output_counts
        self._free.extend(range(size - 1, used - 1, -1))  # NOTE: popped from the end: the lowest first
