"""YAML as people write it: PyYAML's safe loader, with exponent notation read as a number and a key
given twice refused.

PyYAML follows YAML 1.1, where a float needs a dot: ``rate: 5e-1`` is the string ``'5e-1'``, which a
spec's strict number fields then refuse ("must be a number, got '5e-1'"). YAML 1.2 (and JSON) reads
it as 0.5; so does this loader. YAML forbids a key twice in one mapping, but PyYAML keeps the last
silently (``name: a`` then ``name: b`` is ``b``); this loader names it, with its line. Keys a merge
(``<<: *base``) brings in may still be overridden, as YAML says.
"""

from __future__ import annotations

import re
from typing import Any

import yaml


class SafeLoader(yaml.SafeLoader):
    """``yaml.SafeLoader`` that also reads ``1e3``, ``5E-1``, ``1.5e3`` and ``.5e3`` as floats, and refuses
    a key written twice in one mapping."""

    def construct_mapping(self, node: yaml.MappingNode, deep: bool = False) -> dict[Any, Any]:
        seen: dict[str, yaml.Node] = {}
        for key_node, _ in node.value:  # NOTE: before the merges are flattened in: those keys may be overridden
            if isinstance(key_node, yaml.ScalarNode) and key_node.tag != "tag:yaml.org,2002:merge":
                if key_node.value in seen:
                    first = seen[key_node.value].start_mark.line + 1
                    raise yaml.constructor.ConstructorError(
                        None,
                        None,
                        f"key {key_node.value!r} is given twice (first on line {first})",
                        key_node.start_mark,
                    )
                seen[key_node.value] = key_node
        return super().construct_mapping(node, deep=deep)


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
