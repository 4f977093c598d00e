"""The audit's model of a connector's source: its classes, their methods, and the
functions reachable from a set of roots.

Why a module of its own: the static checks (:mod:`kvfail.audit.static`), the
applicability reading (:mod:`kvfail.audit.applicability`) and the coverage reading
(:mod:`kvfail.audit.coverage`) all walk the same graph, and none of them should have to
know how it is built. The graph is followed through ``self.method`` references, module
functions and ``self.attr.method`` where ``attr``'s class can be read from an assignment
or annotation, which covers the usual ``self.connector_worker.X()`` delegation.
"""

from __future__ import annotations

import ast
import linecache
from collections.abc import Callable, Iterator
from dataclasses import dataclass

from kvfail.audit.source import ClassRef, Module, SourceIndex, expr_name

__all__ = ["MAX_DEPTH", "STOP_BASES", "ClassModel", "Evidence", "Func", "Graph", "reach"]

# Classes where the walk up the bases stops: vLLM's interface, whose defaults are the
# behaviour being audited (the base defines get_block_ids_with_load_errors as set()).
STOP_BASES = frozenset(
    {"KVConnectorBase_V1", "KVConnectorBase", "SupportsHMA", "ABC", "object", "Generic"}
)
#: How many calls deep :meth:`Graph.reachable` follows.
MAX_DEPTH = 6


@dataclass(frozen=True)
class Evidence:
    """A source location backing a finding."""

    path: str
    line: int
    text: str

    def __str__(self) -> str:
        return f"{self.path}:{self.line}: {self.text}"


@dataclass(frozen=True)
class Func:
    """A function definition and the class (if any) and module it belongs to."""

    module: Module
    node: ast.FunctionDef | ast.AsyncFunctionDef
    owner: ClassRef | None

    @property
    def name(self) -> str:
        return self.node.name

    def ev(self, node: ast.AST) -> Evidence:
        line = getattr(node, "lineno", self.node.lineno)
        text = linecache.getline(str(self.module.path), line).strip()
        return Evidence(str(self.module.path), line, text)


class ClassModel:
    """A class's bases (down to vLLM's interface), methods and attribute types."""

    def __init__(self, index: SourceIndex, ref: ClassRef) -> None:
        self.index = index
        self.ref = ref
        self.mro: list[ClassRef] = []
        self.base_names: set[str] = set()
        self._walk(ref, 0)
        self._attr_types: dict[str, list[ClassRef]] | None = None

    def _walk(self, ref: ClassRef, depth: int) -> None:
        if depth > 12 or any(r.node is ref.node for r in self.mro):
            return
        self.mro.append(ref)
        for base in ref.node.bases:
            name = expr_name(base)
            self.base_names.add(name)
            if name in STOP_BASES:
                continue
            found = self.index.resolve_expr(ref.module, base)
            if found is not None:
                self._walk(found, depth + 1)

    def method(self, name: str) -> Func | None:
        for ref in self.mro:
            for stmt in ref.node.body:
                if isinstance(stmt, ast.FunctionDef | ast.AsyncFunctionDef) and stmt.name == name:
                    return Func(ref.module, stmt, ref)
        return None

    def attr_types(self) -> dict[str, list[ClassRef]]:
        """``self.attr`` -> candidate classes, from constructor calls and annotations."""
        if self._attr_types is not None:
            return self._attr_types
        types: dict[str, list[ClassRef]] = {}

        def add(attr: str, module: Module, expr: ast.expr) -> None:
            for ref in self._classes_in(module, expr):
                bucket = types.setdefault(attr, [])
                if all(r.node is not ref.node for r in bucket):
                    bucket.append(ref)

        for ref in self.mro:
            for node in ast.walk(ref.node):
                if isinstance(node, ast.AnnAssign):
                    attr = _self_attr(node.target) or (
                        node.target.id if isinstance(node.target, ast.Name) else None
                    )
                    if attr:
                        add(attr, ref.module, node.annotation)
                        if node.value is not None and isinstance(node.value, ast.Call):
                            add(attr, ref.module, node.value.func)
                elif isinstance(node, ast.Assign) and isinstance(node.value, ast.Call):
                    for tgt in node.targets:
                        attr = _self_attr(tgt)
                        if attr:
                            add(attr, ref.module, node.value.func)
        self._attr_types = types
        return types

    def _classes_in(self, module: Module, expr: ast.expr) -> Iterator[ClassRef]:
        """Classes named in an annotation (``A | None``, ``Optional[A]``, ``"A"``) or call."""
        if isinstance(expr, ast.Constant) and isinstance(expr.value, str):
            try:
                expr = ast.parse(expr.value, mode="eval").body
            except SyntaxError:
                return
        for node in ast.walk(expr):
            if isinstance(node, ast.Name | ast.Attribute):
                found = self.index.resolve_expr(module, node)
                if found is not None:
                    yield found


def _self_attr(node: ast.AST) -> str | None:
    if (
        isinstance(node, ast.Attribute)
        and isinstance(node.value, ast.Name)
        and node.value.id == "self"
    ):
        return node.attr
    return None


class Graph:
    """Functions reachable from a set of roots, plus delegations it could not resolve."""

    def __init__(self, index: SourceIndex) -> None:
        self.index = index
        self._models: dict[int, ClassModel] = {}

    def model(self, ref: ClassRef) -> ClassModel:
        key = id(ref.node)
        if key not in self._models:
            self._models[key] = ClassModel(self.index, ref)
        return self._models[key]

    def callees(self, func: Func) -> tuple[list[Func], list[tuple[str, ast.AST]]]:
        """Direct callees, and ``(expr, node)`` for ``self.attr.m()`` with attr unresolved."""
        out: list[Func] = []
        external: list[tuple[str, ast.AST]] = []
        model = self.model(func.owner) if func.owner else None
        for node in ast.walk(func.node):
            if isinstance(node, ast.Attribute) and model is not None:
                attr = _self_attr(node)
                if attr is not None:
                    target = model.method(attr)
                    if target is not None:
                        out.append(target)
                    continue
                inner = _self_attr(node.value)
                if inner is not None:
                    classes = model.attr_types().get(inner, [])
                    hit = False
                    for ref in classes:
                        target = self.model(ref).method(node.attr)
                        if target is not None:
                            out.append(target)
                            hit = True
                    if not hit and not classes:
                        external.append((f"self.{inner}.{node.attr}", node))
            elif isinstance(node, ast.Call) and isinstance(node.func, ast.Name):
                for stmt in func.module.tree.body:
                    if (
                        isinstance(stmt, ast.FunctionDef | ast.AsyncFunctionDef)
                        and stmt.name == node.func.id
                    ):
                        out.append(Func(func.module, stmt, None))
        return out, external

    def reachable(self, roots: list[Func]) -> list[Func]:
        return reach(roots, lambda f: self.callees(f)[0], MAX_DEPTH)


def reach(roots: list[Func], callees: Callable[[Func], list[Func]], max_depth: int) -> list[Func]:
    """Functions reachable from ``roots`` within ``max_depth`` calls, breadth first."""
    seen: dict[int, Func] = {}
    frontier = [(f, 0) for f in roots]
    while frontier:
        func, depth = frontier.pop(0)
        if id(func.node) in seen:
            continue
        seen[id(func.node)] = func
        if depth < max_depth:
            frontier += [(c, depth + 1) for c in callees(func) if id(c.node) not in seen]
    return list(seen.values())
