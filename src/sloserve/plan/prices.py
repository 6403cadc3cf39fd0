"""What a GPU costs per hour: the price table ``sloserve plan`` ranks deployments by.

The defaults are the midpoints of the on-demand ranges that specialty GPU clouds charged in May 2026
(Mercatus, "Cloud GPU pricing", see NOTICE): A100 80GB $1.10-1.50, H100 SXM $2.50-3.50, H200 SXM
$3.50-4.50 per GPU-hour. GPUs without a published range here (a100-40gb, a30) have no default: give
their price with ``--prices NAME=USD``, as for any price you pay that differs.
"""

from __future__ import annotations

from sloserve.core.errors import ConfigError
from sloserve.cost import get_gpu

# USD per GPU-hour, by the canonical GPU name of ``sloserve.cost.GPUS``.
DEFAULT_PRICES_PER_GPU_HOUR: dict[str, float] = {"a100-80gb": 1.30, "h100": 3.00, "h200": 4.00}


def parse_prices(text: str | None) -> dict[str, float]:
    """The default table with ``--prices a100=1.2,h100=2.5`` over it (GPU names or aliases)."""
    prices = dict(DEFAULT_PRICES_PER_GPU_HOUR)
    given: set[str] = set()
    for part in (text or "").split(","):
        if not part.strip():
            continue
        name, sep, value = part.partition("=")
        try:
            price = float(value)
        except ValueError:
            price = float("nan")
        if not sep or not price > 0 or price == float("inf"):
            raise ConfigError(f"--prices expects GPU=USD_PER_HOUR pairs with a price > 0, got {part.strip()!r}")
        gpu = get_gpu(name).name
        if gpu in given:
            raise ConfigError(f"--prices names {gpu} twice")
        given.add(gpu)
        prices[gpu] = price
    return prices


def price_per_gpu_hour(prices: dict[str, float], gpu: str) -> float:
    """The price of one ``gpu`` (canonical name) per hour; a ConfigError naming the flag if none."""
    if gpu not in prices:
        raise ConfigError(f"no price for GPU {gpu}: give it with --prices {gpu}=USD_PER_HOUR")
    return prices[gpu]
