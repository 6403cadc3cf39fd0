"""A state layer (Mamba-2's mixer, a short convolution: engine/state_cache.py) against a reference's outputs for
one prompt, run three ways (engine/test_mamba.py, engine/test_short_conv.py)."""

from __future__ import annotations

import torch

from sloserve.engine.state_cache import StateCache, StateMetadata


def assert_steps_give_the_references_outputs(ours, config, x: torch.Tensor, want: torch.Tensor) -> torch.Tensor:
    """``ours`` (a layer taking (T, H) and a ``StateMetadata``) on the prompt ``x`` (21, H), against ``want`` (21, H),
    the reference's outputs for it whole: the prompt whole (slot 1); as chunks of 5 and 9 that carry their states,
    then 7 decodes (slot 2); and beside other requests in one step: a 7-token prompt (slot 3), a decode of the
    request in slot 0 (which holds the states after 10 tokens), a 3-token prompt in slot 1 (whose stale states, the
    whole prompt's, it must not read), then a padding row of no request. Returns that step's outputs (12, H)."""
    none = torch.zeros(0, dtype=torch.int64)

    def close(got: torch.Tensor, expected: torch.Tensor) -> None:
        torch.testing.assert_close(got, expected, rtol=1e-4, atol=1e-5)

    cache = StateCache(config, 4, torch.float32, torch.device("cpu"))  # (one for all: slot 1's states go stale)
    close(ours(x, StateMetadata([(0, 21, 1, False)], none, none, cache)), want)
    parts = [ours(x[:5], StateMetadata([(0, 5, 2, False)], none, none, cache))]
    parts.append(ours(x[5:14], StateMetadata([(0, 9, 2, True)], none, none, cache)))
    for t in range(14, 21):
        parts.append(ours(x[t : t + 1], StateMetadata([], torch.tensor([0]), torch.tensor([2]), cache)))
    close(torch.cat(parts), want)
    ours(x[:10], StateMetadata([(0, 10, 0, False)], none, none, cache))
    step = torch.cat((x[:7], x[10:11], x[:3], x[:1]))
    out = ours(step, StateMetadata([(0, 7, 3, False), (8, 3, 1, False)], torch.tensor([7]), torch.tensor([0]), cache))
    close(out[:11], torch.cat((want[:7], want[10:11], want[:3])))
    return out
