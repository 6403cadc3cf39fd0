"""YAML as people write it: PyYAML's safe loader, with exponent notation read as a number.

PyYAML follows YAML 1.1, where a float needs a dot: ``rate: 5e-1`` is the string ``'5e-1'``, which a
spec's strict number fields then refuse ("must be a number, got '5e-1'"). YAML 1.2 (and JSON) reads
it as 0.5; so does this loader. Nothing else changes.
"""

from __future__ import annotations

import re
from typing import Any

import yaml


class SafeLoader(yaml.SafeLoader):
    """``yaml.SafeLoader`` that also reads ``1e3``, ``5E-1``, ``1.5e3`` and ``.5e3`` as floats."""


# NOTE: PyYAML's own float pattern is tried first; this one adds what YAML 1.2 reads as a float with an
# exponent and YAML 1.1 does not (a mantissa without a dot, an exponent without a sign).
SafeLoader.add_implicit_resolver(
    "tag:yaml.org,2002:float",
    re.compile(r"^[-+]?(?:[0-9][0-9_]*(?:\.[0-9_]*)?|\.[0-9_]+)[eE][-+]?[0-9]+$"),
    list("-+.0123456789"),
)


def load_yaml(text: str) -> Any:
    """``text`` decoded as ``yaml.safe_load`` does, with exponents as numbers (see the module)."""
    return yaml.load(text, Loader=SafeLoader)
