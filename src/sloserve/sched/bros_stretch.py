"""The simulator's fast path for BROS (sim/stretch.py): when its step of decodes repeats as it is.

BROS names every request it runs each step, by deadline, under its iteration estimate (6), its batch
size (7) and the KV each needs (8); nothing in its step is a cohort. A step of decodes only (nothing
admitted, dropped or copied; nothing left out by (6) or (7)) is the same step again while:

- its order holds: the RT members' deadlines move by their TPOT per token and stay sorted (ties in
  running order);
- what left the others out still does: the RT request that found no room (``_refused``; the RT phase
  then skips every later one that needs KV) finds none, as its shortfall after evicting all it may
  (as ``_make_room`` counts it) exceeds what the members' growth can give back (bidirectional blocks:
  a slot per member among its victims per step, that evicting it would free; paged KV: none, a
  victim's new block was a free one), with the RT members whose deadlines pass its own (a waiting or
  dropped request's does not move) among its victims from then on; a BE request that found no room
  finds less (the members take free slots and nobody frees any); a prompt over the budget is still
  over it (the batch holds no prompt);
- the members' growth fits where it touches nobody: their own blocks, then free ones
  (``BidirectionalKVManager.decode_growth_steps``; the free KV with paged blocks);
- (6) binds nobody: at each step's start every RT member is past its deadline or has at least the
  whole batch's estimate left (with the refused request's part: it is estimated before it is refused),
  so no check of (6) fails, the batch size (7) grows from a step it did not bound, and the first RT
  member not past its deadline is the one whose residual bounds the batch.

Then only the clock and the members' lengths change, and the steps run as one stretch, with what BROS
keeps from step to step (B, the iteration average, the last estimate and residual) advanced as its
schedule would have. Each condition is checked, none assumed: a step that cannot be shown the same
runs alone. tests/sim/test_simulator.py runs BROS both ways and compares every timestamp.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import numpy as np

from sloserve.core.outputs import SchedulerOutput, StepResult
from sloserve.core.request import Request, RequestClass


class BrosStretches:
    """``decode_horizon``, ``clock_horizon`` and ``repeat`` of ``BrosScheduler`` (a mixin over
    ``SubsetScheduler``'s state); its ``schedule`` calls ``_note_step`` once a batch is packed."""

    named_decode_stretches = True

    _repeatable = False  # the last step may repeat, as far as the step itself could tell
    _refused: Request | None = None  # the RT request that found no room (8) in the last step
    # A planned stretch's later steps: the batch's estimate at each, and each RT member's time left then
    # (its deadline less the step's start; None without RT members)
    _clock_plan: tuple[list[float], np.ndarray | None] = ([], None)
    _slots_ahead = 0  # bidirectional blocks: slots a planned stretch allocated for tokens to come

    def _note_step(self, refused: Request | None, held_back: bool) -> None:
        """Record whether the step just packed may repeat: nothing in it was held back by (6), (7), the
        replacement rule or the liveness rule (``held_back``; then B grows from here, so (7) holds
        nobody back later either), its deadlines are per token, and the anti-thrash rule is on (a
        request that finds no room is refused, not given victims). ``refused``: the first RT request
        that found no room (one needing new KV: a running one refused room is held back). (With prefix
        caching the simulator runs named decodes one step at a time: sim/stretch.py.)"""
        cfg = self.config
        self._refused = refused
        self._repeatable = not held_back and cfg.deadlines == "per_token" and cfg.readmit_horizon_steps > 0

    # --- the hooks --------------------------------------------------------------------------------
    def decode_horizon(self, output: SchedulerOutput, limit: int) -> int:
        if not self._repeatable:
            return 1
        members = [r for r, _ in output.chunks]
        rt = [r for r in members if r.request_class is RequestClass.RT]  # (the batch's first ones)
        deadlines = self._deadlines(rt, 0, limit)  # (rt, limit): each one's at each step from now
        limit = self._order_horizon(rt, deadlines)
        if limit > 1 and self._refused is not None:
            limit = min(limit, self._refused_horizon(members, rt, deadlines[:, :limit]))
        if limit > 1:
            if self._bicache:
                limit = 1 + self.kv.decode_growth_steps(members, limit - 1)
            else:
                limit = self._named_decode_memory_horizon(output, limit)
        return limit

    def clock_horizon(self, output: SchedulerOutput, end_times: Sequence[float]) -> int:
        """The steps through which (6) binds nobody (see the module docstring), from the first; keeps
        their estimates and the RT members' times left for ``repeat``."""
        members = [r for r, _ in output.chunks]
        num_later = len(end_times) - 1  # steps after the scheduled one: j = 1..num_later
        n = len(members)
        decode_kv = 0
        for r in members:
            decode_kv += r.num_computed_tokens
        # The batch's estimate at each later step j (its sums as _add makes them: n decodes reading
        # decode_kv + j * n tokens), and with the refused request's part (it is estimated before it is refused).
        num_decode = np.full(num_later, n, dtype=np.int64)
        later_kv = decode_kv + n * np.arange(1, num_later + 1, dtype=np.int64)
        estimates = self._batch_times((0,) * 7, num_decode, later_kv)
        bounds = estimates
        if self._refused is not None:
            refused = self._contribution(self._refused)
            bounds = self._batch_times(refused, num_decode + refused[0], later_kv + refused[1])
        rt = [r for r in members if r.request_class is RequestClass.RT]
        own, valid = None, num_later
        if rt:
            own = self._deadlines(rt, 1, num_later + 1) - np.asarray(end_times[:-1], dtype=np.float64)  # (rt, later)
            met = own >= 0
            bad = np.flatnonzero((met & (own < np.asarray(bounds))).any(axis=0))
            valid = int(bad[0]) if len(bad) else num_later
        self._clock_plan = (estimates.tolist(), own)
        return 1 + valid

    def repeat(self, output: SchedulerOutput, num_steps: int) -> SchedulerOutput:
        """``output`` standing for ``num_steps`` steps (within both horizons): the members' slots for
        the later steps allocated in the order the steps would take them, and B, the iteration average,
        the last estimate and residual as the later steps' ``schedule`` would leave them."""
        cfg = self.config
        estimates, own = self._clock_plan
        for estimate in estimates[: num_steps - 1]:
            self.iteration_ema_s += self.ITERATION_EMA_WEIGHT * (estimate - self.iteration_ema_s)
        last = num_steps - 2
        self.last_estimate_s, self.last_residual_s = estimates[last], math.inf
        met = np.flatnonzero(own[:, last] >= 0) if own is not None else ()
        if len(met):  # the residual of the last step: the first RT member, in order, not past its deadline
            self.last_residual_s = float(own[met[0], last])
        self.batch_size = min(self.batch_size + (num_steps - 1) * cfg.batch_size_step, cfg.max_batch_size)
        if not self._bicache:
            return self._named_decode_repeat(output, num_steps)
        members = [r for r, _ in output.chunks]
        self.kv.allocate_decode_steps(members, num_steps - 1)
        self._slots_ahead = len(members) * num_steps
        return output.repeated(num_steps, [0, *[len(members)] * (num_steps - 1)])

    def update(self, output: SchedulerOutput, result: StepResult, now: float) -> list[Request]:
        self._slots_ahead = 0
        return super().update(output, result, now)

    def kv_used_tokens(self) -> int:
        """Bidirectional blocks count slots: those a stretch took for its later tokens are not used yet."""
        return super().kv_used_tokens() - self._slots_ahead

    # --- the conditions -----------------------------------------------------------------------------
    def _deadlines(self, rt: list[Request], first: int, stop: int) -> np.ndarray:
        """Per-token deadlines (as ``deadline``) of the running ``rt`` requests at steps ``first`` to
        ``stop - 1`` from now, one token a step: shape (len(rt), stop - first)."""
        num = len(rt)
        first_token = np.fromiter((r.first_token_time for r in rt), np.float64, num)
        produced = np.fromiter((r.num_output_tokens for r in rt), np.int64, num)
        default = self.config.default_tpot_s
        tpot = np.fromiter((r.slo.tpot_s or default for r in rt), np.float64, num)
        return first_token[:, None] + (produced[:, None] + np.arange(first, stop)) * tpot[:, None]

    def _order_horizon(self, rt: list[Request], deadlines: np.ndarray) -> int:
        """Steps (>= 1, <= the columns of ``deadlines``, the ``rt`` members' at each step) through which
        the RT members stay in deadline order, ties in running order as the sort keeps them. (Where they
        stand against the refused request is ``_refused_horizon``'s.)"""
        limit = deadlines.shape[1]
        if len(rt) < 2:
            return limit
        position = {r: i for i, r in enumerate(self._running(RequestClass.RT))}  # (running order)
        rank = np.fromiter((position[r] for r in rt), np.int64, len(rt))
        a, b = deadlines[:-1], deadlines[1:]
        ok = ((a < b) | ((a == b) & (rank[:-1] < rank[1:])[:, None])).all(axis=0)
        bad = np.flatnonzero(~ok)
        return int(bad[0]) if len(bad) else limit

    def _refused_horizon(self, members: list[Request], rt: list[Request], deadlines: np.ndarray) -> int:
        """Steps (>= 1, <= the columns of ``deadlines``, the ``rt`` members' at each step) through which
        the refused RT request still finds no room, as ``_make_room``
        counts it: its victims are the running BE requests on the GPU and, unless it was dropped, the
        RT ones after it in the order, which an RT member joins at the step its deadline passes the
        refused one's (a waiting or dropped request's deadline does not move). Where the members stand
        against it changes nothing else: it never joins the batch, sets no residual, and (6) on its
        estimate is ``clock_horizon``'s. Its shortfall is counted with the victims' KV of now: with paged
        KV a victim's new block came from the free ones; with bidirectional blocks each step of a member
        among its victims can lower the shortfall by one slot (one the victim holds more, in a block
        already counted or taken from the free ones), and no other member's can (its slot is a free one,
        its own block's, or over a victim's BE tokens)."""
        # At its turn the batch holds the RT members before it: none is a victim, none protects a block,
        # and with paged KV the new blocks they take only add to its shortfall.
        refused, limit = self._refused, deadlines.shape[1]
        be, after = self._eviction_candidates(refused, ())
        joins: list[tuple[int, Request]] = []  # (the step from which it is a victim, an RT member before it)
        if not (self._was_dropped(refused) and self.config.readmit_horizon_steps):  # (else it drops BE only)
            passed = deadlines > self.deadline(refused)  # (rt, limit)
            victim = set(after)
            joins = [(int(row.argmax()), r) for row, r in zip(passed, rt, strict=True) if r not in victim and row.any()]
            joins.sort(key=lambda join: join[0])
        victims, start = be + after, 1
        in_batch = set(members)
        growing = sum(1 for r in victims if r in in_batch)  # victims that grow a slot a step
        for end, joining in [*joins, (limit, None)]:  # steps start..end-1 have these victims
            if end > start:
                shortfall = self._shortfall_after_evicting(refused, victims, (), 0)
                if shortfall <= 0:
                    return start
                # bidirectional blocks: at step j from now each growing victim holds j slots more at most
                if self._bicache and growing and -(-shortfall // growing) < end:
                    return max(start, -(-shortfall // growing))
                start = end
            if joining is not None:
                victims.append(joining)
                growing += 1
        return limit
