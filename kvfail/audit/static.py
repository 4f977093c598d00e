"""Static checks: what a connector's installed source says about the load-error contract.

Every finding is labelled ``STATIC``: it is a reading of the source (AST), never a test
result. Each check names the contract clause it reads for (``docs/contract.md``), its RFC 2119
level, and the upstream issue a failing cell resembles. The checks read the functions
reachable from the worker hooks, as the call graph (:mod:`kvfail.audit.callgraph`) finds
them.
"""

from __future__ import annotations

import ast
import linecache
import re
from collections.abc import Callable
from dataclasses import dataclass, field
from functools import cached_property

from kvfail.audit.callgraph import ClassModel, Evidence, Func, Graph
from kvfail.audit.inventory import Target
from kvfail.audit.source import SourceIndex, expr_name

PASS, FAIL, UNKNOWN, NA = "pass", "fail", "unknown", "n/a"

WORKER_HOOKS = ("start_load_kv", "wait_for_layer_load", "get_finished", "get_transfer_results")
RAISE_HOOKS = frozenset(WORKER_HOOKS)
BLOCK_METHOD = "get_block_ids_with_load_errors"

_RESULT_ATTRS = frozenset({"success", "succeeded", "ok", "status", "error", "failed", "is_ok"})
_RESULT_NAMES = frozenset({"success", "succeeded", "ok", "status", "result", "ret", "rc", "res"})
_DEADLINE_WORDS = frozenset(
    {
        "timeout",
        "timeouts",
        "deadline",
        "deadlines",
        "expire",
        "expired",
        "expires",
        "expiry",
        "expiration",
        "lease",
        "leases",
        "ttl",
        "rcvtimeo",
        "watchdog",
        "timed",
    }
)
_WORD_RE = re.compile(r"[A-Z]?[a-z0-9]+|[A-Z]+(?![a-z])")


def _is_deadline_name(name: str) -> bool:
    """Whole words only: ``_release_blocks`` must not match ``lease``."""
    return any(w.lower() in _DEADLINE_WORDS for w in _WORD_RE.findall(name))


@dataclass(frozen=True)
class CheckSpec:
    """What a check reads for: clause, level, and the issue a failure resembles."""

    id: str
    title: str
    clause: str
    level: str  # "MUST" | "SHOULD"
    resembles: str
    heuristic: bool = False
    #: The check itself (a static check's; None for the dynamic tier's columns, which
    #: reuse this spec to describe a scenario).
    run: Callable[[CheckContext], Finding] | None = field(default=None, compare=False, repr=False)


@dataclass
class Finding:
    """One cell: a check's outcome for one connector, with the lines that support it."""

    check: str
    status: str
    summary: str
    evidence: list[Evidence] = field(default_factory=list)
    tier: str = "STATIC"
    # Set by tiers with their own checks (the dynamic runner); static ones use CHECKS.
    check_spec: CheckSpec | None = None

    @property
    def spec(self) -> CheckSpec:
        return self.check_spec or CHECK_BY_ID[self.check]

    @property
    def violation(self) -> str | None:
        """ "MUST" / "SHOULD" when this cell breaks a rule of that level, else None."""
        return self.spec.level if self.status == FAIL else None

    def to_dict(self) -> dict[str, object]:
        spec = self.spec
        return {
            "check": self.check,
            "title": spec.title,
            "tier": self.tier,
            "clause": spec.clause,
            "level": spec.level,
            "heuristic": spec.heuristic,
            "status": self.status,
            "summary": self.summary,
            "resembles": spec.resembles if self.status == FAIL else None,
            "evidence": [{"path": e.path, "line": e.line, "text": e.text} for e in self.evidence],
        }


# ------------------------------------------------------------------ patterns


def _body(func: Func) -> list[ast.stmt]:
    """Statements minus the docstring."""
    body = list(func.node.body)
    if body and isinstance(body[0], ast.Expr) and isinstance(body[0].value, ast.Constant):
        body = body[1:]
    return body


def _is_empty_set(expr: ast.expr | None) -> bool:
    if isinstance(expr, ast.Call) and isinstance(expr.func, ast.Name):
        return expr.func.id in ("set", "frozenset") and not expr.args and not expr.keywords
    return isinstance(expr, ast.Set) and not expr.elts


def is_stub(func: Func) -> ast.AST | None:
    """The ``return set()`` of a function whose only real statement is that return."""
    body = [
        s
        for s in _body(func)
        if not isinstance(s, ast.Pass)
        and not (isinstance(s, ast.Expr) and isinstance(s.value, ast.Call))
    ]
    if len(body) == 1 and isinstance(body[0], ast.Return) and _is_empty_set(body[0].value):
        return body[0]
    return None


def getattr_fallbacks(func: Func) -> list[ast.AST]:
    """``getattr(x, "get_block_ids_with_load_errors", ...)`` / ``hasattr(...)`` probes."""
    hits: list[ast.AST] = []
    for node in ast.walk(func.node):
        if (
            isinstance(node, ast.Call)
            and isinstance(node.func, ast.Name)
            and node.func.id in ("getattr", "hasattr")
            and len(node.args) >= 2
            and isinstance(node.args[1], ast.Constant)
            and node.args[1].value == BLOCK_METHOD
        ):
            hits.append(node)
    return hits


def _calls_named(func: Func, names: set[str]) -> list[ast.Call]:
    return [
        n
        for n in ast.walk(func.node)
        if isinstance(n, ast.Call) and isinstance(n.func, ast.Attribute) and n.func.attr in names
    ]


def done_without_result(func: Func) -> list[ast.AST]:
    """``.done()`` polled in a function that never reads ``.result()`` / ``.exception()``."""
    done = [c for c in _calls_named(func, {"done"}) if not c.args and not c.keywords]
    if not done or _calls_named(func, {"result", "exception"}):
        return []
    return list(done)


def result_asserts(func: Func) -> list[ast.AST]:
    """``assert`` whose test reads a transfer outcome (``.success``, ``ok``, ``status``...).

    Guard asserts (``x is not None``, ``isinstance``) are not counted: they are about
    wiring, not about whether a transfer worked.
    """
    hits: list[ast.AST] = []
    for node in ast.walk(func.node):
        if not isinstance(node, ast.Assert):
            continue
        test = node.test
        while isinstance(test, ast.UnaryOp) and isinstance(test.op, ast.Not):
            test = test.operand
        if (
            isinstance(test, ast.Call)
            and isinstance(test.func, ast.Name)
            and test.func.id in ("isinstance", "callable", "hasattr")
        ):
            continue
        if isinstance(test, ast.Compare) and all(
            isinstance(op, ast.Is | ast.IsNot) for op in test.ops
        ):
            continue
        for sub in ast.walk(test):
            if (isinstance(sub, ast.Attribute) and sub.attr in _RESULT_ATTRS) or (
                isinstance(sub, ast.Name) and sub.id in _RESULT_NAMES
            ):
                hits.append(node)
                break
    return hits


def raises(func: Func) -> list[ast.AST]:
    """``raise`` statements, except ``NotImplementedError`` (an unimplemented role)."""
    hits: list[ast.AST] = []
    for node in ast.walk(func.node):
        if isinstance(node, ast.Raise):
            exc = node.exc.func if isinstance(node.exc, ast.Call) else node.exc
            if exc is not None and expr_name(exc) == "NotImplementedError":
                continue
            hits.append(node)
    return hits


def fills_failed_recving(func: Func) -> list[ast.AST]:
    """Places that put something into ``failed_recving`` (keyword or attribute update)."""
    hits: list[ast.AST] = []
    for node in ast.walk(func.node):
        if isinstance(node, ast.keyword) and node.arg == "failed_recving":
            if not _is_empty_set(node.value):
                hits.append(node.value)
        elif isinstance(node, ast.Attribute) and node.attr == "failed_recving":
            hits.append(node)
    return hits


def deadline_names(func: Func) -> list[ast.AST]:
    """Identifiers that look like a deadline (timeout, expire, lease...). Heuristic."""
    hits: list[ast.AST] = []
    for node in ast.walk(func.node):
        name = None
        if isinstance(node, ast.Name):
            name = node.id
        elif isinstance(node, ast.Attribute):
            name = node.attr
        elif isinstance(node, ast.keyword):
            name = node.arg
            node = node.value
        if name and _is_deadline_name(name):
            hits.append(node)
    return hits


# ------------------------------------------------------------------ the audit


def _collect(funcs: list[Func], pattern) -> list[Evidence]:  # type: ignore[no-untyped-def]
    out: list[Evidence] = []
    for f in funcs:
        out.extend(f.ev(n) for n in pattern(f))
    return sorted(set(out), key=lambda e: (e.path, e.line))


def _fails_on(
    check_id: str, found: list[Evidence], failing: str, passing: str, shown: int | None = None
) -> Finding:
    """The cell of a check that fails on any evidence of a pattern: FAIL with the
    evidence (its first ``shown``) and ``failing``, else PASS with ``passing``. One
    place, so every such check words and trims its cell alike."""
    return Finding(check_id, FAIL if found else PASS, failing if found else passing, found[:shown])


@dataclass
class CheckContext:
    """One connector under the static checks: its class model, the call graph, and the
    findings made so far (a check may build on another's, e.g. ``reports`` on both
    channels; :meth:`finding` runs that one first, once)."""

    target: Target
    model: ClassModel
    graph: Graph
    found: dict[str, Finding] = field(default_factory=dict)
    _reached: dict[tuple[str, ...], list[Func]] = field(default_factory=dict)

    def finding(self, check_id: str) -> Finding:
        if check_id not in self.found:
            run = CHECK_BY_ID[check_id].run
            assert run is not None, f"{check_id} is not a static check"
            self.found[check_id] = run(self)
        return self.found[check_id]

    @cached_property
    def block_root(self) -> Func | None:
        return self.model.method(BLOCK_METHOD)

    @cached_property
    def block_impls(self) -> list[Func]:
        """The block-level channel: the override and whatever it delegates to."""
        funcs = self.graph.reachable([self.block_root]) if self.block_root else []
        return [f for f in funcs if f.name == BLOCK_METHOD]

    @cached_property
    def stubs(self) -> list[Evidence]:
        return [f.ev(s) for f in self.block_impls if (s := is_stub(f)) is not None]

    def reach(self, *hooks: str) -> list[Func]:
        """Every function the named methods reach (the worker path), walked once."""
        if hooks not in self._reached:
            roots = [m for h in hooks if (m := self.model.method(h)) is not None]
            self._reached[hooks] = self.graph.reachable(roots)
        return self._reached[hooks]


def check_block_channel(ctx: CheckContext) -> Finding:
    block_root, block_impls = ctx.block_root, ctx.block_impls
    graph, model = ctx.graph, ctx.model
    probed = [f for f in block_impls if getattr_fallbacks(f)]
    real = [
        f
        for f in block_impls
        if is_stub(f) is None and not _is_pure_delegation(f) and f not in probed
    ]
    external = [
        (expr, f.ev(node))
        for f in block_impls
        for expr, node in graph.callees(f)[1]
        if expr.endswith("." + BLOCK_METHOD)
    ] + [("getattr(...)", f.ev(n)) for f in probed for n in getattr_fallbacks(f)]
    if block_root is None:
        return Finding("block_channel", FAIL, "not overridden")
    if real:
        ev = [real[0].ev(real[0].node)]
        where = "delegated" if real[0].owner is not model.ref else "yes"
        return Finding("block_channel", PASS, where, ev)
    if external:
        return Finding(
            "block_channel",
            UNKNOWN,
            f"delegated to {external[0][0]} (external)",
            [external[0][1]],
        )
    return Finding(
        "block_channel",
        FAIL,
        "only returns set()" if ctx.stubs else "no implementation",
        ctx.stubs or [block_root.ev(block_root.node)],
    )


def check_stub(ctx: CheckContext) -> Finding:
    stubs = ctx.stubs
    return Finding("stub", FAIL if stubs else PASS, "return set()" if stubs else "none", stubs)


def check_fallback(ctx: CheckContext) -> Finding:
    fallbacks = _collect(ctx.block_impls, getattr_fallbacks)
    return _fails_on("fallback", fallbacks, "getattr(..., set())", "none")


def check_request_channel(ctx: CheckContext) -> Finding:
    tr_root = ctx.model.method("get_transfer_results")
    if tr_root is None:
        return Finding("request_channel", FAIL, "no get_transfer_results")
    tr_funcs = ctx.graph.reachable([tr_root])
    fills = _collect(tr_funcs, fills_failed_recving)
    ext = [e for f in tr_funcs for e in ctx.graph.callees(f)[1]]
    if fills:
        return Finding("request_channel", PASS, "fills it", fills[:3])
    if ext:
        return Finding(
            "request_channel", UNKNOWN, f"delegated to {ext[0][0]}", [tr_root.ev(ext[0][1])]
        )
    return Finding("request_channel", FAIL, "never filled", [tr_root.ev(tr_root.node)])


def check_reports(ctx: CheckContext) -> Finding:
    """C1 as a whole: at least one channel carries failures."""
    channels = {k: ctx.finding(k) for k in ("block_channel", "request_channel")}
    statuses = {f.status for f in channels.values()}
    if PASS in statuses:
        which = [k for k, f in channels.items() if f.status == PASS]
        return Finding(
            "reports",
            PASS,
            " + ".join("block" if k == "block_channel" else "request" for k in which),
            [e for k in which for e in channels[k].evidence[:1]],
        )
    if UNKNOWN in statuses:
        return Finding("reports", UNKNOWN, "only via external code")
    return Finding("reports", FAIL, "no channel")


def check_hma(ctx: CheckContext) -> Finding:
    """A connector that supports HMA must report request-level (C5)."""
    model, ref = ctx.model, ctx.target.ref
    assert ref is not None
    hma_def = model.method("request_finished_all_groups")
    if "SupportsHMA" not in model.base_names and hma_def is None:
        return Finding("hma", NA, "no HMA")
    path = str(ref.module.path)
    hma_ev = (
        [hma_def.ev(hma_def.node)]
        if hma_def
        else [Evidence(path, ref.node.lineno, linecache.getline(path, ref.node.lineno).strip())]
    )
    req = ctx.finding("request_channel").status
    if ctx.finding("reports").status == FAIL:
        # No channel at all is C1's cell; C5 is about routing failures that are reported.
        return Finding("hma", NA, "HMA, no channel (C1)", hma_ev)
    if req == PASS:
        return Finding("hma", PASS, "HMA + failed_recving", hma_ev)
    if req == UNKNOWN:
        return Finding("hma", UNKNOWN, "HMA, channel external", hma_ev)
    return Finding("hma", FAIL, "HMA, block-level only", hma_ev)


def check_result_checked(ctx: CheckContext) -> Finding:
    done = _collect(ctx.reach(*WORKER_HOOKS), done_without_result)
    return _fails_on("result_checked", done, ".done() without .result()", "ok", shown=3)


def check_no_assert(ctx: CheckContext) -> Finding:
    asserts = _collect(ctx.reach(*WORKER_HOOKS), result_asserts)
    return _fails_on("no_assert", asserts, "asserts success", "none", shown=3)


def check_no_raise(ctx: CheckContext) -> Finding:
    hooks = [f for f in ctx.reach(*WORKER_HOOKS) if f.name in RAISE_HOOKS]
    raised = _collect(hooks, raises)
    return _fails_on("no_raise", raised, f"raise x{len(raised)}", "none", shown=3)


def check_deadline(ctx: CheckContext) -> Finding:
    load_path = ctx.reach("start_load_kv", "get_finished", "get_transfer_results")
    deadlines = _collect(load_path, deadline_names)
    return Finding(
        "deadline",
        PASS if deadlines else FAIL,
        "named in path" if deadlines else "none found",
        deadlines[:3],
    )


#: Every static check, in the audit's column order: what it reads for (the spec) and the
#: function that reads it. A new check is one function above and one entry here.
CHECKS: tuple[CheckSpec, ...] = (
    CheckSpec(
        "reports",
        "reports load failures",
        "C1",
        "MUST",
        "#49556 (method missing), LMCache #4600 (failure counted as success)",
        run=check_reports,
    ),
    CheckSpec(
        "block_channel",
        "get_block_ids_with_load_errors",
        "C1",
        "SHOULD",
        "#49556 (connector without the method)",
        run=check_block_channel,
    ),
    CheckSpec(
        "request_channel",
        "failed_recving",
        "C5",
        "SHOULD",
        "#54733 (request-level failures), PR #56855",
        run=check_request_channel,
    ),
    CheckSpec(
        "hma",
        "HMA routing",
        "C5",
        "MUST",
        "#45474, #50687 (HMA with block-level only)",
        run=check_hma,
    ),
    CheckSpec(
        "stub",
        "no hard-coded set()",
        "C1",
        "MUST",
        "LMCache PR #2973 (returned set())",
        run=check_stub,
    ),
    CheckSpec(
        "fallback",
        "no silent getattr fallback",
        "C1",
        "SHOULD",
        "#49556, LMCache PR #2973",
        run=check_fallback,
    ),
    CheckSpec(
        "result_checked",
        "future result read",
        "C1",
        "MUST",
        "HF3FS (.done() only), LMCache #4600",
        run=check_result_checked,
    ),
    CheckSpec(
        "no_assert",
        "no assert on transfer result",
        "C13",
        "MUST",
        "#39732, llm-d-kv-cache #514 (Offloading assert)",
        run=check_no_assert,
    ),
    CheckSpec(
        "no_raise", "no raise in load hooks", "C13", "MUST", "#40364, #44249", run=check_no_raise
    ),
    CheckSpec(
        "deadline",
        "in-flight deadline",
        "C10",
        "SHOULD",
        "#35943, #50719, LMCache #5047 (no timeout)",
        heuristic=True,
        run=check_deadline,
    ),
)
CHECK_BY_ID = {c.id: c for c in CHECKS}


def audit_target(target: Target, index: SourceIndex, graph: Graph | None = None) -> list[Finding]:
    """Run every static check on one connector; one finding per check, in CHECKS order."""
    if target.ref is None:
        return [Finding(c.id, NA, "not installed") for c in CHECKS]
    graph = graph or Graph(index)
    ctx = CheckContext(target, graph.model(target.ref), graph)
    return [ctx.finding(c.id) for c in CHECKS]


def _is_pure_delegation(func: Func) -> bool:
    """``return self.x.get_block_ids_with_load_errors()`` (plus guards): not itself a source."""
    body = [s for s in _body(func) if not isinstance(s, ast.Assert)]
    if len(body) != 1 or not isinstance(body[0], ast.Return):
        return False
    value = body[0].value
    return (
        isinstance(value, ast.Call)
        and isinstance(value.func, ast.Attribute)
        and value.func.attr == BLOCK_METHOD
    )
