"""BROS's token-group latency metric (papers/bros.md §3-4, Table 1), beside per-token deadlines.

BROS defines "token group based latency metrics to balance quick response and high context rate"; its
formulas were lost in the text, and Table 1 keeps only their inputs: the time since an RT request's
last token was returned and the tokens left in its current token group, checked against "either the
TTFT or TPOT target depending on whether the token is the first or a later one". Our reading (a
careful reproducer's choice; the constants are unstated):

- An RT request's output is returned in groups: the first token alone, then groups of ``group_size``
  tokens (the last may be shorter).
- The first group is due TTFT after arrival. Each later group of g tokens is due g x TPOT after the
  previous group was returned (its last token's time), which is the context rate TPOT asks for.
- A request meets the token-group SLO when every one of its groups does.

Unlike per-token deadlines (token k due at first token + (k - 1) x TPOT, what the BROS scheduler
packs against and the TPOT attainment of Figure 10 averages), a late group moves the clock: the next
group is due from when the late one came, so one stall costs one group, not every token after it.
The default group of 5 tokens is one second of reading at BROS's 0.2 s TPOT (our choice).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import NamedTuple

from sloserve.core.request import Request

DEFAULT_GROUP_SIZE = 5


class TokenGroupAttainment(NamedTuple):
    """Shares of requests whose every group was on time, and of groups on time."""

    requests: float
    groups: float
    num_groups: int


def group_deadlines_met(
    arrival: float,
    token_times: Sequence[float],
    ttft_s: float,
    tpot_s: float,
    group_size: int = DEFAULT_GROUP_SIZE,
    tolerance_s: float = 0.0,
) -> list[bool]:
    """For each token group of one request (see the module docstring): was it returned by its due time?"""
    if group_size < 1:
        raise ValueError(f"group_size must be >= 1, got {group_size}")
    met = [token_times[0] <= arrival + ttft_s + tolerance_s]
    returned = token_times[0]
    for start in range(1, len(token_times), group_size):
        group = token_times[start : start + group_size]
        met.append(group[-1] <= returned + len(group) * tpot_s + tolerance_s)
        returned = group[-1]
    return met


def token_group_attainment(
    requests: Sequence[Request],
    default_ttft_s: float,
    default_tpot_s: float,
    group_size: int = DEFAULT_GROUP_SIZE,
    tolerance_s: float = 0.0,
) -> TokenGroupAttainment:
    """Token-group attainment of finished ``requests`` that kept ``token_times``; a request's own SLO
    overrides the defaults. An unfinished request misses."""
    met_requests, met_groups, num_groups = 0, 0, 0
    for r in requests:
        if r.token_times is None:
            raise ValueError(f"request {r.request_id} kept no token times (set token_times = [] before the run)")
        if not r.is_finished or not r.token_times:
            num_groups += 1
            continue
        ttft = r.slo.ttft_s if r.slo.ttft_s is not None else default_ttft_s
        tpot = r.slo.tpot_s if r.slo.tpot_s is not None else default_tpot_s
        met = group_deadlines_met(r.arrival_time, r.token_times, ttft, tpot, group_size, tolerance_s)
        met_requests += all(met)
        met_groups += sum(met)
        num_groups += len(met)
    n = len(requests)
    return TokenGroupAttainment(
        met_requests / n if n else math.nan, met_groups / num_groups if num_groups else math.nan, num_groups
    )
