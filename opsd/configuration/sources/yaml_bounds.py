"""A YAML config's values, bounded before anything expands them, and its numbers checked as numbers.

PyYAML builds an alias (`*a`) as a second reference to the value its anchor names, so a 300-byte file of
nested aliases holds a list of 9^8 leaves in a few kilobytes of memory; whatever walks that value (TRL's
`str(value)` of a key it does not know or of `env`, a list of LoRA modules flattened) expands it until the
memory is gone. `check_bounded` counts the nodes of the whole document, every alias counted as the copy it
stands for, and stops at `MAX_NODES`: far above any real config (an open-r1 recipe has under a hundred), far
below what exhausts a machine. It runs on the file as loaded, before TRL reads it.

`check_yaml_numbers` refuses a YAML value that is not a number (`true`, a list, a mapping) for a numeric field, and
a fraction for an integer field, in words that say so ("learning_rate: true ... is not a number"), where the
range check would read it as out of range. Text is left to argparse, which parses it as the command line would.
"""

from __future__ import annotations

from collections.abc import Mapping

from opsd.errors import InvalidValue

MAX_NODES = 10_000


def node_count(value: object, cap: int = MAX_NODES) -> int:
    """The nodes of `value` (scalars, lists, mappings with their keys), each alias counted as a copy, up to
    `cap + 1`: the walk stops there, so a value of billions of leaves, or one that holds itself, costs `cap`
    steps."""
    count, stack = 0, [value]
    while stack and count <= cap:
        node = stack.pop()
        count += 1
        if isinstance(node, Mapping):
            stack.extend(node.keys())
            stack.extend(node.values())
        elif isinstance(node, (list, tuple, set)):
            stack.extend(node)
    return count


def check_bounded(document: object, source: str) -> None:
    """InvalidValue naming the key whose value takes the document past `MAX_NODES` nodes."""
    if not isinstance(document, Mapping):
        return  # TRL refuses a document that is not a mapping in its own words
    total = 0
    for key, value in document.items():
        total += node_count(value, MAX_NODES - total)
        if total > MAX_NODES:
            raise InvalidValue(
                f"{source}: the value of {str(key)[:80]!r} takes the config past {MAX_NODES:,} YAML nodes (an "
                "alias counts as the copy it stands for); a config is a few dozen plain values: write them out"
            )


def check_yaml_numbers(values: Mapping[str, object], kinds: Mapping[str, str], source: str) -> None:
    """InvalidValue for the first value of a numeric field (`kinds`: field -> "int" or "float") that is not
    a number: a boolean, a list, a mapping; or, for an integer field, a number with a fraction."""
    for key, value in values.items():
        kind = kinds.get(key)
        if kind not in ("int", "float") or value is None or isinstance(value, str):
            continue
        example = "8" if kind == "int" else "0.5"
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            # As YAML wrote it (`true`, not Python's True); a list or mapping by its type: its text may be huge.
            what = str(value).lower() if isinstance(value, bool) else f"a {type(value).__name__}"
            raise InvalidValue(f"{key}: {what} in {source} is not a number; write e.g. {key}: {example}")
        if kind == "int" and isinstance(value, float) and not value.is_integer():
            raise InvalidValue(
                f"{key}: {value!r} in {source} is not a whole number; write e.g. {key}: {example}"
            )
