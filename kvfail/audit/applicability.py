"""Why a connector has no dynamic verdict: it never loads external KV, or it cannot run here.

Every row of the audit must say why it has, or has not, run through a transport driver.
Two of the reasons can be read from the installed source, and are, at audit time:

* **never loads** (not applicable to the load-error contract): the scheduler side never
  reports an external match (every ``return`` of ``get_num_new_matched_tokens`` is a
  literal 0), or the load path only synthesizes values (it calls value generators such as
  ``torch.normal`` / ``torch.full`` and reads from no file, socket or transfer engine);
* **blocked** here: the code the connector reaches calls CUDA-only APIs (CUDA streams,
  ``cudaHostRegister``), launches Triton kernels, or imports a package that is not
  installed.

Each finding carries the source lines it rests on (file:line in the installed vLLM), so a
vLLM release that removes the reason makes the finding disappear instead of going stale.

Why a call walk and not an import walk: vLLM's import closure reaches its GPU model
runner from any connector, so every row would be "blocked". The walk follows what the
connector's own methods call: ``self`` methods, ``self.attr`` objects whose class can be
read, module functions (imported ones too), classes it constructs, and lazy registrations
(``register_x("name", "pkg.module", "Class")``) of a factory it calls.
"""

from __future__ import annotations

import ast
import itertools
import linecache
from dataclasses import dataclass, field

from kvfail.audit.callgraph import STOP_BASES, Evidence, Func, Graph, reach
from kvfail.audit.inventory import is_connector_class
from kvfail.audit.source import ClassRef, Module, SourceIndex, package_installed

NOT_APPLICABLE = "not_applicable"
BLOCKED = "blocked"
#: How many calls deep the walk goes from a connector's methods.
MAX_DEPTH = 6
#: Value generators: a load path that only calls these writes numbers it made up.
_SYNTH_CALLS = frozenset({"normal", "full", "fill_", "normal_", "uniform_", "rand", "randn"})
#: Calls that read bytes from somewhere (a file, a socket, a store, a transfer engine).
_READ_CALLS = frozenset(
    {
        "open",
        "safe_open",
        "load_file",
        "load",
        "read",
        "readinto",
        "pread",
        "recv",
        "recv_multipart",
        "recv_pyobj",
        "batch_get_into",
        "get_into",
        "batch_transfer_sync_read",
        "transfer_sync_read",
        "make_prepped_xfer",
        "transfer",
        "frombuffer",
        "from_file",
    }
)


@dataclass
class Applicability:
    """One row's reason for having no transport driver (kind, words, source lines)."""

    kind: str  # NOT_APPLICABLE | BLOCKED
    reason: str
    evidence: list[Evidence] = field(default_factory=list)

    @property
    def label(self) -> str:
        """The short cell text: ``never loads: not applicable`` / ``blocked: <reason>``."""
        return "never loads: not applicable" if self.kind == NOT_APPLICABLE else "blocked"

    def to_dict(self) -> dict[str, object]:
        return {
            "kind": self.kind,
            "reason": self.reason,
            "evidence": [{"path": e.path, "line": e.line, "text": e.text} for e in self.evidence],
        }


class _Walker:
    """Functions reachable from a connector's methods (see the module docstring)."""

    def __init__(self, index: SourceIndex, graph: Graph) -> None:
        self.index = index
        self.graph = graph
        #: Callees per function node: rows share most of vLLM's code, walk it once.
        self._callees: dict[int, list[Func]] = {}

    def class_methods(self, ref: ClassRef) -> list[Func]:
        """Every method defined in ``ref``'s bases above vLLM's interface."""
        out: list[Func] = []
        for klass in self.graph.model(ref).mro:
            if klass.node.name in STOP_BASES:
                continue
            out += [
                Func(klass.module, stmt, klass)
                for stmt in klass.node.body
                if isinstance(stmt, ast.FunctionDef | ast.AsyncFunctionDef)
            ]
        return out

    def is_connector(self, ref: ClassRef) -> bool:
        return bool(is_connector_class(self.index, ref))

    def function(self, module: Module, name: str, depth: int = 0) -> Func | None:
        """Module-level function ``name`` as seen from ``module`` (defined or imported)."""
        for stmt in module.tree.body:
            if isinstance(stmt, ast.FunctionDef | ast.AsyncFunctionDef) and stmt.name == name:
                return Func(module, stmt, None)
        imp = module.imports.get(name)
        if imp is None or imp[1] is None or depth > 4 or not _ours(imp[0], module):
            return None
        origin = self.index.module(imp[0])
        return self.function(origin, imp[1], depth + 1) if origin is not None else None

    def module_function(self, module: Module, alias: str, name: str) -> Func | None:
        """``alias.name(...)`` where ``alias`` is an imported module of the same distribution."""
        imp = module.imports.get(alias)
        if imp is None:
            return None
        target = imp[0] if imp[1] is None else f"{imp[0]}.{imp[1]}"
        if not _ours(target, module):
            return None
        origin = self.index.module(target)
        return self.function(origin, name) if origin is not None else None

    def callees(self, func: Func) -> list[Func]:
        key = id(func.node)
        if key not in self._callees:
            self._callees[key] = self._find_callees(func)
        return self._callees[key]

    def _find_callees(self, func: Func) -> list[Func]:
        out, _external = self.graph.callees(func)
        for node in ast.walk(func.node):
            if not isinstance(node, ast.Call):
                continue
            target = node.func
            if isinstance(target, ast.Name):
                found = self.function(func.module, target.id)
                if found is not None:
                    out.append(found)
                    continue
            if isinstance(target, ast.Attribute) and isinstance(target.value, ast.Name):
                found = self.module_function(func.module, target.value.id, target.attr)
                if found is not None:
                    out.append(found)
                    continue
            owner = target.value if isinstance(target, ast.Attribute) else target
            if not isinstance(owner, ast.Name | ast.Attribute) or not _ours_expr(func, owner):
                continue
            ref = self.index.resolve_expr(func.module, owner)
            if ref is None or not _ours(ref.module.name, func.module):
                continue
            if self.is_connector(ref):  # a child connector is a row of its own
                continue
            if owner is target:  # ``Class(...)``: what the connector will call on it
                out += self.class_methods(ref)
            else:  # ``Class.method(...)``: a factory, and what it registered lazily
                method = self.graph.model(ref).method(target.attr)  # type: ignore[union-attr]
                if method is not None:
                    out.append(method)
                    out += self.registered(ref.module)
        return out

    def registered(self, module: Module) -> list[Func]:
        """Methods of classes a module registers by name (``f("x", "pkg.mod", "Cls")``)."""
        out: list[Func] = []
        for stmt in module.tree.body:
            if not (isinstance(stmt, ast.Expr) and isinstance(stmt.value, ast.Call)):
                continue
            args = [a.value for a in stmt.value.args if isinstance(a, ast.Constant)]
            strings = [a for a in args if isinstance(a, str)]
            for mod_name, cls_name in itertools.pairwise(strings):
                if "." not in mod_name:
                    continue
                ref = self.index.resolve_class(mod_name, cls_name)
                if ref is not None and not self.is_connector(ref):
                    out += self.class_methods(ref)
        return out

    def reachable(self, roots: list[Func]) -> list[Func]:
        return reach(roots, self.callees, MAX_DEPTH)


def _ours(module_name: str, seen_from: Module) -> bool:
    """Follow code of the connector's own distribution only (vLLM for vLLM's): the
    standard library and torch are not what decides whether a connector runs here."""
    return module_name.split(".")[0] == seen_from.name.split(".")[0]


def _ours_expr(func: Func, expr: ast.expr) -> bool:
    root = expr
    while isinstance(root, ast.Attribute):
        root = root.value
    if not isinstance(root, ast.Name) or root.id == "self":
        return False
    imp = func.module.imports.get(root.id)
    return imp is None or _ours(imp[0], func.module)


def _dotted(expr: ast.expr) -> str:
    parts: list[str] = []
    while isinstance(expr, ast.Attribute):
        parts.append(expr.attr)
        expr = expr.value
    if isinstance(expr, ast.Name):
        parts.append(expr.id)
    return ".".join(reversed(parts))


# ------------------------------------------------------------------ never loads


def _literal_zero(expr: ast.expr | None) -> bool:
    if isinstance(expr, ast.Tuple) and expr.elts:
        expr = expr.elts[0]
    return isinstance(expr, ast.Constant) and expr.value == 0 and expr.value is not False


def _returns(func: Func) -> list[ast.Return]:
    """``return`` statements of ``func`` itself (not of nested functions)."""
    out: list[ast.Return] = []
    todo: list[ast.AST] = list(func.node.body)
    while todo:
        node = todo.pop()
        if isinstance(node, ast.Return):
            out.append(node)
        elif not isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef | ast.Lambda):
            todo += list(ast.iter_child_nodes(node))
    return out


def never_matches(graph: Graph, ref: ClassRef) -> Evidence | None:
    """The ``return 0`` of a ``get_num_new_matched_tokens`` whose every return is 0."""
    method = graph.model(ref).method("get_num_new_matched_tokens")
    if method is None or method.owner is None or method.owner.node.name in STOP_BASES:
        return None
    rets = _returns(method)
    if rets and all(_literal_zero(r.value) for r in rets):
        return method.ev(rets[0])
    return None


def synthesizes_only(walker: _Walker, ref: ClassRef) -> list[Evidence]:
    """Value-generator calls of a load path that reads from nowhere, else []."""
    start = walker.graph.model(ref).method("start_load_kv")
    if start is None or start.owner is None or start.owner.node.name in STOP_BASES:
        return []
    path = walker.reachable([start])
    synth: list[Evidence] = []
    for func in path:
        for node in ast.walk(func.node):
            if not isinstance(node, ast.Call):
                continue
            name = _dotted(node.func).rpartition(".")[2]
            if name in _READ_CALLS:
                return []
            # ``torch.full(...)`` makes values; ``x.fill_(...)`` writes made-up values.
            if name in _SYNTH_CALLS and (
                _dotted(node.func).startswith("torch.") or name[-1] == "_"
            ):
                synth.append(func.ev(node))
    if not synth:
        return []
    return [start.ev(start.node), *sorted(set(synth), key=lambda e: (e.path, e.line))[:3]]


# ------------------------------------------------------------------ blocked here


def _cuda_only(func: Func) -> list[tuple[str, ast.AST]]:
    hits: list[tuple[str, ast.AST]] = []
    for node in ast.walk(func.node):
        if not isinstance(node, ast.Call):
            continue
        name = _dotted(node.func)
        if name.endswith(("cuda.Stream", "cuda.stream")):
            hits.append(("CUDA streams (torch.cuda.Stream)", node))
        elif name.endswith("cudaHostRegister"):
            hits.append(("cudaHostRegister (pinned host memory)", node))
    return hits


def _triton_launches(walker: _Walker, func: Func) -> list[tuple[str, ast.AST]]:
    """``kernel[grid](...)`` where ``kernel`` is a ``@triton.jit`` function."""
    hits: list[tuple[str, ast.AST]] = []
    for node in ast.walk(func.node):
        if not (
            isinstance(node, ast.Call)
            and isinstance(node.func, ast.Subscript)
            and isinstance(node.func.value, ast.Name)
        ):
            continue
        kernel = walker.function(func.module, node.func.value.id)
        if kernel is not None and any(
            _dotted(d.func if isinstance(d, ast.Call) else d).endswith("jit")
            for d in kernel.node.decorator_list
        ):
            hits.append(("Triton kernels", node))
    return hits


def _missing_packages(funcs: list[Func], home: str) -> list[tuple[str, Evidence]]:
    """Imports of top-level packages that are not installed: in reached functions, or at
    the top of their modules outside ``TYPE_CHECKING``.

    An import guarded by ``try`` counts only in the connector's own package (``home``):
    there the guard sets the flag its code raises on (MoRIIO, HF3FS); in a shared module
    it is an optional speed-up with a fallback (vLLM's ``xxhash``)."""
    out: list[tuple[str, Evidence]] = []
    modules: dict[str, Module] = {f.module.name: f.module for f in funcs}
    scopes: list[tuple[Module, list[ast.stmt]]] = [(f.module, [f.node]) for f in funcs]
    scopes += [(m, _runtime_top(m.tree.body)) for m in modules.values()]
    for module, body in scopes:
        own = module.name == home or module.name.startswith(home + ".")
        for stmt in body:
            for node in _imports(stmt, guarded=False if own else None):
                roots: list[str] = []
                if isinstance(node, ast.Import):
                    roots = [a.name.split(".")[0] for a in node.names]
                elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                    roots = [node.module.split(".")[0]]
                out += [(r, _evidence(module, node)) for r in roots if not package_installed(r)]
    return out


def _imports(node: ast.AST, guarded: bool | None) -> list[ast.Import | ast.ImportFrom]:
    """Import statements under ``node``; those inside a ``try`` only when ``guarded`` is
    not None (None: skip guarded ones)."""
    if isinstance(node, ast.Import | ast.ImportFrom):
        return [node]
    if isinstance(node, ast.Try) and guarded is None:
        tail = [*node.orelse, *node.finalbody]
        return [i for stmt in tail for i in _imports(stmt, None)]
    return [i for child in ast.iter_child_nodes(node) for i in _imports(child, guarded)]


def _evidence(module: Module, node: ast.AST) -> Evidence:
    line = getattr(node, "lineno", 1)
    return Evidence(str(module.path), line, linecache.getline(str(module.path), line).strip())


def _runtime_top(body: list[ast.stmt]) -> list[ast.stmt]:
    """Top-level statements except ``if TYPE_CHECKING:`` blocks and definitions."""
    out: list[ast.stmt] = []
    for stmt in body:
        if isinstance(stmt, ast.If) and "TYPE_CHECKING" in ast.unparse(stmt.test):
            out += stmt.orelse
        elif not isinstance(stmt, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef):
            out.append(stmt)
    return out


class Assessor:
    """Assesses rows one by one, sharing the parsed source and the walk between them."""

    def __init__(self, index: SourceIndex, graph: Graph | None = None) -> None:
        self.walker = _Walker(index, graph or Graph(index))

    def __call__(self, ref: ClassRef | None) -> Applicability | None:
        return None if ref is None else _assess(self.walker, ref)


def _assess(walker: _Walker, ref: ClassRef) -> Applicability | None:
    """The row's not-applicable or blocked finding, None when neither is in the source."""
    graph = walker.graph
    zero = never_matches(graph, ref)
    if zero is not None:
        return Applicability(
            NOT_APPLICABLE,
            "get_num_new_matched_tokens only ever returns 0: the scheduler never asks it "
            "to load external KV",
            [zero],
        )
    synth = synthesizes_only(walker, ref)
    if synth:
        return Applicability(
            NOT_APPLICABLE,
            "start_load_kv only fills blocks with generated values and reads from no file, "
            "socket or transfer engine: no external KV is ever loaded",
            synth,
        )
    funcs = walker.reachable(walker.class_methods(ref))
    reasons: dict[str, list[Evidence]] = {}
    for func in funcs:
        for why, node in [*_cuda_only(func), *_triton_launches(walker, func)]:
            reasons.setdefault(why, []).append(func.ev(node))
    home = ref.module.name.rpartition(".")[0]
    for pkg, ev in _missing_packages(funcs, home):
        reasons.setdefault(f"package {pkg!r} is not installed", []).append(ev)
    if not reasons:
        return None
    evidence = [min(ev, key=lambda e: (e.path, e.line)) for ev in reasons.values()]
    return Applicability(BLOCKED, "; ".join(reasons), evidence)
