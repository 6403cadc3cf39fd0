"""The ``sloserve`` command: a module per command group, as vLLM's ``entrypoints/cli``.

    simulate.py    simulate, compare, sweep         plan.py        plan
    bound.py       bound                            experiment.py  experiment
    engine.py      run, profile, fit-cost           serve.py       serve, bench-serve
    listings.py    traces, schedulers, hardware, workloads

``app.py`` holds the command group and its error handling; ``options.py`` what the commands share.
NOTE: each command imports what it runs inside its body, so ``sloserve --help`` loads no simulator.
"""

from sloserve.cli import bound, engine, experiment, listings, plan, serve, simulate  # noqa: F401  (register)
from sloserve.cli.app import main
from sloserve.cli.options import DEFAULT_FIT_FORM, FIT_FORMS

__all__ = ["DEFAULT_FIT_FORM", "FIT_FORMS", "main"]
