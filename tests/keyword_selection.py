"""A ``-k`` expression for an inner conformance session of a reference and its controls.

Why: a control is asserted only on the scenarios built to flag it, and its run of any other
scenario the session selects is paid in full (for a control that strands a load, the
suite's whole bounded wait) and read by nothing.
"""

from __future__ import annotations

from collections.abc import Collection, Mapping


def each_control_only_its_own(
    scenarios: Collection[str], named: Mapping[str, Collection[str]]
) -> str:
    """Every connector over ``scenarios``, except that each control in ``named`` (a name
    that appears in its connector spec) runs only the scenarios named for it."""
    parts = [f"({' or '.join(sorted(scenarios))})"]
    for control, own in sorted(named.items()):
        others = sorted(set(scenarios) - set(own))
        if others:
            parts.append(f"not ({control} and ({' or '.join(others)}))")
    return " and ".join(parts)
