"""The papers' experiments as commands (`sloserve experiment NAME`): one module per paper
(``infermax``, ``econoserve``, ``bros``), their common CSV and plot writers in ``outputs``."""

from collections.abc import Callable

from sloserve.experiments import bros, econoserve, infermax

# name -> function(out_dir, quick, executor=..., ...) returning (rows, lines that compare ours with the
# paper); the executor (sloserve.parallel) runs its simulations one by one or on Ray.
EXPERIMENTS: dict[str, Callable[..., tuple[list[dict], list[str]]]] = {
    "infermax-fig4": infermax.fig4,
    "infermax-fig5": infermax.fig5,
    "infermax-fig8": infermax.fig8,
    "infermax-fig9": infermax.fig9,
    "infermax-fig10": infermax.fig10_12,
    "infermax-fig15": infermax.fig15,
    "infermax-sec6": infermax.sec6,
    "bros-fig10": bros.fig10,
    "bros-fig12": bros.fig12,
    "bros-fig13": bros.fig13,
    "bros-fig14": bros.fig14,
    "bros-token-groups": bros.token_groups,
    "econoserve-fig9": econoserve.fig9,
    "econoserve-fig13": econoserve.fig13,
    "econoserve-fig15": econoserve.fig15,
}

__all__ = ["EXPERIMENTS"]
