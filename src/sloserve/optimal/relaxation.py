"""A lower bound on the latency of any schedule, for any number of requests: a relaxation of the
constraint model (``model.py``) that keeps what every schedule must pay and drops the rest.

Per request (I prompt tokens, O output tokens), terms of the linear cost model no schedule avoids:

    tokens         every position 0 .. I+O-2 is processed at least once: a_o * (I + O - 1)
    the prompt     positions 0 .. I-2 in prefill chunks: a_p * (I-1)^2 (a chunk of c tokens after m
                   does c^2 + 2mc = sum of (2q + 1) over its positions q) and s_p for at least one
                   chunk; position I-1 in the last chunk, a_p * (2I - 1), or alone as a decode reading
                   I-1 tokens, a_d * (I-1) + s_d, whichever is less. (I = 1: one decode, s_d.)
    generated      each of the O-1 generated tokens that get KV is a decode reading the q tokens before
                   it (q = I .. I+O-2): a_d * q + s_d
    evictions      an eviction when s tokens are known processes positions 0 .. s-2 again, in
                   prefill (a_p * (s-1)^2 + a_o * (s-1) + s_p), and may process position s-1 in the
                   chunk instead of as a decode (a_p * (2s - 1) in place of a_d * (s-1) + s_d). An
                   eviction is counted only where that sum is negative (never with the bundled
                   presets, where a_o > a_d): the evictions that memory forces are what is relaxed.

Per batch: b_o for each of at least J_min batches, where J_min is the largest of max(O) (one token
of a request per batch), sum(I + O - 1) / C (tokens per batch) and the KV footprint over M: the
batch that samples the k-th token of a request holds I + k - 1 of its tokens after it, and every
batch's holdings sum to at most M. So the samplings, items of size I + k - 1, are packed into batches
of capacity M, and J_min is at least a lower bound of that bin packing: Martello and Toth's L2
(items above M/2 never share a batch; those above M - a not even with an item of a or more), which
is at least the footprint over M. Of those, at least P_min hold a prefill chunk (b_p each): one if
any prompt has 2 tokens or more, and the last prefill chunk of a prompt leaves at least I - 1 of its
tokens held, so P_min >= sum(I - 1) / M (and sum(I - 1) / P with a prefill budget P). And the
requests whose last prefill chunk (never evicted after it) shares a batch hold at least I - 1 tokens
each from then on, until each finishes; the first of them to finish holds I + O - 1 at its last
sampling, so sum(I - 1) + min O <= M over the group, and sum(I - 1) <= M - O_min with O_min the
least O of all. The groups are thus a bin packing of items I - 1 (prompts of 2 tokens or more) into
bins of M - O_min, one batch with a prefill chunk each: P_min is at least that packing's L2 bound
too. Every batch holds a prefill chunk or a decode, so the J_min - P_min others pay min(b_d, b_p) at
least.

Samplings that pairwise cannot share a batch need a batch each (a clique of the conflict graph):
those holding more than M/2, and the first samplings (I tokens held) of requests that conflict with
every one of those (I + the smallest > M) and with each other once neither is evicted again: after
sharing a batch both hold their prompts until the first finishes, so I_a + I_b + min(O_a, O_b) - 1
<= M. A batch holding k such first samplings has k - 1 of those requests evicted afterwards, so with
E evictions there are at least |clique| - E batches, and each eviction costs at least its recompute
(positions 0 .. s-2 again, s >= I + 1 tokens known; counted only where it costs something). The
bound takes the cheaper of a batch beyond J_min (b_o + min(b_d, b_p)) and an eviction, for each of
the |clique| - J_min samplings beyond J_min.

The terms left out (m_p, extra chunks, the other evictions memory forces, batches beyond these
counts) are what a schedule can lose against this bound.

The bin-packing terms need every item's size, so they are computed for the whole set of requests
(offline, and online for the suffix from the first arrival), not for each later suffix.

Online, the batches that serve requests arriving at or after t start at or after t, so the latency is
at least max over arrival times t of (t - first arrival) + the bound of the requests arriving from t.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING

import numpy as np

from sloserve.core.errors import ConfigError
from sloserve.cost.linear import LinearCostModel

if TYPE_CHECKING:  # model.py imports this module
    from sloserve.optimal.problem import BoundProblem


def request_work(k: Mapping[str, float], prompt: int, output: int) -> float:
    """The per-request terms above, in the units of the coefficients ``k`` (whole-model time per unit)."""
    I, O = prompt, output
    total = k["a_o"] * (I + O - 1)
    if I == 1:
        total += k["s_d"]  # the lone prompt token is a decode reading nothing
    else:
        total += k["a_p"] * (I - 1) ** 2 + k["s_p"] + min(k["a_p"] * (2 * I - 1), k["a_d"] * (I - 1) + k["s_d"])
    # Decodes of positions q = I .. I+O-2.
    num_decodes = O - 1
    total += k["a_d"] * num_decodes * (2 * I + num_decodes - 1) / 2 + k["s_d"] * num_decodes
    for s in range(I + 1, I + O):  # evictions that would pay for themselves (none with a_o >= a_d)
        redo = k["a_p"] * (s - 1) ** 2 + k["a_o"] * (s - 1) + k["s_p"]  # positions 0 .. s-2 again
        swap = k["a_p"] * (2 * s - 1) - k["a_d"] * (s - 1) - k["s_d"]  # position s-1: prefill, not decode
        if redo + min(swap, 0.0) < 0:
            total += redo + min(swap, 0.0)
        elif redo + swap >= 0 and 2 * k["a_p"] * s + k["a_o"] - k["a_d"] >= 0:
            break  # redo + swap is a convex quadratic below the extra, past its minimum: no more gains
    return total


def packing_lower_bound(prompts: Sequence[int], outputs: Sequence[int], kv_capacity_tokens: int) -> int:
    """Martello and Toth's L2 lower bound on the batches that hold every sampling: request i samples
    its k-th token (k = 1 .. O) in a batch that holds I + k - 1 of its tokens after it, and a batch
    holds at most M (``kv_capacity_tokens``). O(M + number of requests)."""
    M = kv_capacity_tokens
    if not prompts:
        return 0
    largest = max(i + o - 1 for i, o in zip(prompts, outputs, strict=True))
    assert largest <= M, "a request that never fits M"
    if 2 * largest <= M:
        # NOTE: with no item above M/2, L2 is the footprint over M (the caller's other term); the
        # arrays below are O(M), and M may be far larger than any request.
        return 0
    # (M + 2,) items of each size 0 .. M (+1 spare), from a difference array over each request's range.
    diff = np.zeros(M + 2, dtype=np.int64)
    np.add.at(diff, np.asarray(prompts), 1)
    np.add.at(diff, np.minimum(np.asarray(prompts) + np.asarray(outputs), M + 1), -1)
    count = np.cumsum(diff)[: M + 1]  # (M + 1,) items of size s
    assert not count[0], "a request holds at least one token when it samples"
    return _l2_bound(count, M)


def prefill_packing_lower_bound(prompts: Sequence[int], outputs: Sequence[int], kv_capacity_tokens: int) -> int:
    """L2 lower bound on the batches that hold a prefill chunk: the groups of requests whose last
    prefill chunk shares a batch pack items I - 1 into bins of M - min(O) (see the module docstring).
    O(M + number of requests)."""
    items = [i - 1 for i in prompts if i >= 2]
    if not items:
        return 0
    capacity = kv_capacity_tokens - min(outputs)
    assert max(items) <= capacity, "a request that never fits M"
    if 2 * max(items) <= capacity:
        return 0  # NOTE: no item above half a bin: L2 is the footprint, the caller's sum(I - 1) / M
    count = np.bincount(np.asarray(items), minlength=capacity + 1)  # (capacity + 1,) items of size s
    return _l2_bound(count, capacity)


def _l2_bound(count: np.ndarray, M: int) -> int:
    """Martello and Toth's L2: the fewest bins of capacity M that ``count`` (shape (M + 1,): the
    number of items of each size 0 .. M) needs, bounded below. O(M)."""
    num_le = np.cumsum(count)  # (M + 1,) items of size <= s
    size_le = np.cumsum(count * np.arange(M + 1))  # (M + 1,) their total size
    half = M // 2  # items of size <= half may share a batch
    alpha = np.arange(half + 1)  # (half + 1,) the threshold a of L2
    n_big = num_le[M] - num_le[M - alpha]  # J1: above M - a (no item of size >= a fits beside)
    n_mid = num_le[M - alpha] - num_le[half]  # J2: above M/2, at most M - a
    room = n_mid * M - (size_le[M - alpha] - size_le[half])  # what J2's batches leave free
    below = np.where(alpha > 0, size_le[np.maximum(alpha - 1, 0)], 0)
    small = size_le[half] - below  # J3: total size of the items from a to M/2
    extra = np.maximum(0, -(-(small - room) // M))  # batches J3 needs beyond J2's free room
    return int((n_big + n_mid + extra).max())


def eviction_cost(k: Mapping[str, float], prompt: int, output: int) -> float:
    """The least extra cost of evicting a request once it has sampled its first token (s >= I + 1
    tokens known, at most I + O - 1): positions 0 .. s-2 again in prefill, position s-1 in the chunk
    where that is cheaper than its decode (see the module docstring). inf when it cannot be evicted
    (O = 1: it finishes with its first token)."""
    if output < 2:
        return math.inf
    s = np.arange(prompt + 1, prompt + output, dtype=np.float64)  # (O - 1,) tokens known
    redo = k["a_p"] * (s - 1) ** 2 + k["a_o"] * (s - 1) + k["s_p"]
    swap = k["a_p"] * (2 * s - 1) - k["a_d"] * (s - 1) - k["s_d"]
    return float((redo + np.minimum(swap, 0.0)).min())


def sampling_clique(
    k: Mapping[str, float], prompts: Sequence[int], outputs: Sequence[int], kv_capacity_tokens: int
) -> tuple[int, float]:
    """(the size of a clique of samplings that cannot share a batch unless a request is evicted, the
    least cost of such an eviction) (see the module docstring). O(n log n + n x first samplings kept)."""
    M = kv_capacity_tokens
    # Samplings holding more than M/2: request i's k-th, I + k - 1 > M/2, for k = 1 .. O.
    big = [(i, o) for i, o in zip(prompts, outputs, strict=True) if i + o - 1 > M / 2]
    num_big = sum(i + o - 1 - max(i, M // 2 + 1) + 1 for i, o in big)
    smallest_big = min((max(i, M // 2 + 1) for i, _ in big), default=None)
    chosen: list[tuple[int, int]] = []  # first samplings (I, O) of the clique, longest first
    for prompt, output in sorted(zip(prompts, outputs, strict=True), reverse=True):
        if 2 * prompt > M or (smallest_big is not None and prompt + smallest_big <= M):
            continue  # counted among the big ones, or fits beside one of them
        if all(prompt + other + min(output, other_output) - 1 > M for other, other_output in chosen):
            chosen.append((prompt, output))
    cost = min((eviction_cost(k, i, o) for i, o in chosen), default=math.inf)
    return num_big + len(chosen), cost


class _Requests:
    """Running sums of a set of requests for J_min (see the module docstring)."""

    def __init__(self) -> None:
        self.max_output = 0
        self.tokens = 0  # sum of I + O - 1
        self.prompt_positions = 0  # sum of I - 1
        self.footprint = 0  # sum over requests and k = 1..O of I + k - 1
        self.work = 0.0

    def add(self, prompt: int, output: int, work: float = 0.0) -> None:
        """Count one request, whose ``request_work`` is ``work``."""
        self.max_output = max(self.max_output, output)
        self.tokens += prompt + output - 1
        self.prompt_positions += prompt - 1
        self.footprint += output * (prompt - 1) + output * (output + 1) // 2
        self.work += work

    def min_prefill_batches(
        self, kv_capacity_tokens: int, prefill_token_budget: int | None, prefill_packing: int = 0
    ) -> int:
        """P_min: the fewest batches with a prefill chunk (see the module docstring); ``prefill_packing``,
        the bin-packing bound where the caller computed it."""
        bounds = [
            1 if self.prompt_positions else 0,
            math.ceil(self.prompt_positions / kv_capacity_tokens),
            prefill_packing,
        ]
        if prefill_token_budget is not None:
            bounds.append(math.ceil(self.prompt_positions / prefill_token_budget))
        return max(bounds)

    def min_batches(
        self,
        kv_capacity_tokens: int,
        max_num_batched_tokens: int,
        prefill_token_budget: int | None,
        packing: int = 0,
        prefill_packing: int = 0,
    ) -> int:
        """J_min: the fewest batches (see the module docstring); ``packing`` and ``prefill_packing``,
        the bin-packing bounds where the caller computed them."""
        return max(
            self.max_output,
            math.ceil(self.tokens / max_num_batched_tokens),
            math.ceil(self.footprint / kv_capacity_tokens),
            packing,
            self.min_prefill_batches(kv_capacity_tokens, prefill_token_budget, prefill_packing),
        )

    def bound(
        self,
        k: Mapping[str, float],
        kv_capacity_tokens: int,
        max_num_batched_tokens: int,
        prefill_token_budget: int | None,
        packing: int = 0,
        prefill_packing: int = 0,
        clique: tuple[int, float] = (0, math.inf),
    ) -> float:
        """The least total batch time of these requests, in the units of ``k``; ``packing``,
        ``prefill_packing`` and ``clique`` (``sampling_clique``) where the caller computed them."""
        limits = (kv_capacity_tokens, max_num_batched_tokens, prefill_token_budget)
        batches = self.min_batches(*limits, packing, prefill_packing)
        prefill_batches = self.min_prefill_batches(kv_capacity_tokens, prefill_token_budget, prefill_packing)
        per_batch = k["b_o"] + min(k["b_d"], k["b_p"])  # what a batch beyond J_min adds at least
        fixed = (
            k["b_o"] * batches
            + k["b_p"] * prefill_batches
            + min(k["b_d"], k["b_p"]) * max(0, batches - prefill_batches)
        )
        clique_size, eviction = clique
        beyond = max(0, clique_size - batches) * max(0.0, min(per_batch, eviction))
        return fixed + beyond + self.work


def min_batches(
    prompts: Sequence[int],
    outputs: Sequence[int],
    kv_capacity_tokens: int,
    max_num_batched_tokens: int,
    prefill_token_budget: int | None,
) -> int:
    """J_min: the fewest batches any schedule of these requests runs (see the module docstring)."""
    requests = _Requests()
    for prompt, output in zip(prompts, outputs, strict=True):
        requests.add(prompt, output)
    packing = packing_lower_bound(prompts, outputs, kv_capacity_tokens)
    prefill_packing = prefill_packing_lower_bound(prompts, outputs, kv_capacity_tokens)
    return requests.min_batches(
        kv_capacity_tokens, max_num_batched_tokens, prefill_token_budget, packing, prefill_packing
    )


def offline_bound(
    k: Mapping[str, float],
    prompts: Sequence[int],
    outputs: Sequence[int],
    kv_capacity_tokens: int,
    max_num_batched_tokens: int,
    prefill_token_budget: int | None,
) -> float:
    """The least total batch time of the requests, in the units of ``k``."""
    requests = _Requests()
    for prompt, output in zip(prompts, outputs, strict=True):
        requests.add(prompt, output, request_work(k, prompt, output))
    packing = packing_lower_bound(prompts, outputs, kv_capacity_tokens)
    prefill_packing = prefill_packing_lower_bound(prompts, outputs, kv_capacity_tokens)
    clique = sampling_clique(k, prompts, outputs, kv_capacity_tokens)
    return requests.bound(
        k, kv_capacity_tokens, max_num_batched_tokens, prefill_token_budget, packing, prefill_packing, clique
    )


def whole_model_coefficients(cost: LinearCostModel) -> dict[str, float]:
    """The preset's per-layer ms coefficients as whole-model seconds per unit."""
    c = cost.coefficients
    scale = c.num_layers / 1000.0
    return {key: getattr(c, key) * scale for key in ("a_p", "b_p", "a_d", "b_d", "a_o", "b_o", "s_p", "s_d", "m_p")}


def relaxed_bound(problem: BoundProblem, cost: LinearCostModel) -> float:
    """A lower bound (seconds) on the latency of any schedule of ``problem``:
    offline, the least total batch time; online, the largest over arrival times t of the time to t
    plus the bound of the requests arriving from t. O(n log n + M) time."""
    if beyond := cost.coefficients.beyond_infermax():
        raise ConfigError(
            f"bound: the relaxation prices tokens by InferMax's linear form; cost model {cost.name!r} has "
            f"{', '.join(beyond)} (use a preset, or a fit with --form infermax)"
        )
    k = whole_model_coefficients(cost)
    limits = (problem.kv_capacity_tokens, problem.max_num_batched_tokens, problem.prefill_token_budget)
    if not problem.online:
        return offline_bound(k, problem.prompts, problem.outputs, *limits)
    order = sorted(range(len(problem.prompts)), key=lambda i: problem.arrivals[i])
    first = problem.arrivals[order[0]]
    best = offline_bound(k, problem.prompts, problem.outputs, *limits)  # the suffix from the first arrival
    later = _Requests()  # the requests arriving at or after the current one
    for pos in range(len(order) - 1, -1, -1):
        i = order[pos]
        later.add(problem.prompts[i], problem.outputs[i], request_work(k, problem.prompts[i], problem.outputs[i]))
        if pos and problem.arrivals[order[pos - 1]] == problem.arrivals[i]:
            continue  # not the first request at this arrival time
        best = max(best, problem.arrivals[i] - first + later.bound(k, *limits))
    return best
