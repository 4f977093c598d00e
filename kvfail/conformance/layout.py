"""The engine layouts a scenario runs in: D's TP size x P's TP size x KV-cache groups.

Why an axis of its own: the contract has clauses that only show in some layouts (with
two KV-cache groups a block-level report raises inside the scheduler, C5; at TP 2 a
failure on one rank must survive vLLM's ``KVOutputAggregator``, C8/C11), and a connector
can be right in one layout and wrong in another. ``--layout`` runs every scenario in
each chosen layout; a layout the driver cannot build is a named skip (``requires tp2`` /
``requires two_groups`` / ``requires hetero_tp``), as any other missing capability.

Names: ``tp1``/``tp2`` run P and D at the same TP size; ``p2d1`` runs P at TP 2 and D at
TP 1 (each D rank reads from two P ranks), ``p1d2`` the reverse (two D ranks read halves
of one P rank's heads): production P/D pairs a prefill fleet sharded wider or narrower
than its decoders, and a connector maps the ranks itself. ``-g2`` adds a second
KV-cache group to any of them.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

__all__ = [
    "ALL_LAYOUTS",
    "DEFAULT_LAYOUT",
    "POLICIES",
    "Layout",
    "parse_layout_policies",
    "parse_layouts",
]

_PATTERN = re.compile(r"^(?:tp(?P<tp>[12])|p(?P<p>[12])d(?P<d>[12]))(?:-g(?P<groups>[12]))?$")


@dataclass(frozen=True, order=True)
class Layout:
    #: D's TP size (the engine the suite judges).
    tp_size: int = 1
    num_kv_cache_groups: int = 1
    #: P's TP size; 0: the same as D's (a homogeneous layout, named ``tp<n>``).
    p_tp_size: int = 0

    def __post_init__(self) -> None:
        # One layout, one value: P at D's TP size is the homogeneous layout (``p2d2`` is
        # ``tp2``), so the two spellings never make two columns.
        if self.p_tp_size == self.tp_size:
            object.__setattr__(self, "p_tp_size", 0)

    @property
    def p_tp(self) -> int:
        """P's TP size."""
        return self.p_tp_size or self.tp_size

    @property
    def heterogeneous(self) -> bool:
        """P and D run different TP sizes."""
        return self.p_tp != self.tp_size

    @property
    def name(self) -> str:
        groups = "" if self.num_kv_cache_groups == 1 else f"-g{self.num_kv_cache_groups}"
        if self.heterogeneous:
            return f"p{self.p_tp}d{self.tp_size}{groups}"
        return f"tp{self.tp_size}{groups}"

    @property
    def requires(self) -> tuple[str, ...]:
        """The capabilities a driver needs to build this layout."""
        out: list[str] = []
        if max(self.tp_size, self.p_tp) > 1:
            out.append("tp2")
        if self.heterogeneous:
            out.append("hetero_tp")
        if self.num_kv_cache_groups > 1:
            out += ["two_groups", "hma"]
        return tuple(out)

    @classmethod
    def parse(cls, text: str) -> Layout:
        match = _PATTERN.match(text.strip())
        if match is None:
            raise ValueError(
                f"unknown layout {text!r}: use tp1, tp2, tp1-g2, tp2-g2, p2d1, p1d2 "
                "(P's TP, D's TP; -g2 too) or all"
            )
        groups = int(match["groups"] or 1)
        if match["tp"] is not None:
            return cls(int(match["tp"]), groups)
        return cls(int(match["d"]), groups, int(match["p"]))


DEFAULT_LAYOUT = Layout()
ALL_LAYOUTS = (
    Layout(1, 1),
    Layout(2, 1),
    Layout(1, 2),
    Layout(2, 2),
    Layout(1, 1, 2),
    Layout(2, 1, 1),
)


#: The ``kv_load_failure_policy`` values the suite runs under (a layout may be limited to some).
POLICIES = ("fail", "recompute")


def parse_layouts(values: list[str]) -> list[Layout]:
    """``--layout`` values (repeatable, comma-separated, ``all``) -> distinct layouts."""
    return parse_layout_policies(values)[0]


def parse_layout_policies(values: list[str]) -> tuple[list[Layout], dict[Layout, frozenset[str]]]:
    """Like :func:`parse_layouts`, where a layout may name the only policies it runs
    under: ``tp2-g2:recompute`` (``+`` joins several). Why: a connector cannot see the
    policy (the scheduler applies it to what the connector reported), so a costly layout
    can run under one policy in a quick run while the full matrix stays one option away.
    Returns the layouts and, for those limited, their policies."""
    out: list[Layout] = []
    only: dict[Layout, frozenset[str]] = {}
    for value in values:
        for part in value.split(","):
            name, _, limit = part.strip().partition(":")
            if not name:
                continue
            chosen = ALL_LAYOUTS if name == "all" else (Layout.parse(name),)
            out += [layout for layout in chosen if layout not in out]
            if limit:
                policies = frozenset(limit.split("+"))
                unknown = sorted(policies - set(POLICIES))
                if unknown:
                    raise ValueError(
                        f"unknown policy {unknown[0]!r} in {part.strip()!r}: use "
                        f"{' or '.join(POLICIES)}, joined by +"
                    )
                for layout in chosen:
                    only[layout] = only.get(layout, frozenset()) | policies
    return out or [DEFAULT_LAYOUT], only
