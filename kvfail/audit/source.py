"""Locate and parse Python source without importing it.

Importing a connector module runs its imports; several need packages that are not installed
(lmcache, flexkv, mooncake) and vLLM itself is slow to import. The audit only needs the text, so
modules are found on ``sys.path`` by hand and parsed with :mod:`ast`.
"""

from __future__ import annotations

import ast
import importlib.util
import sys
from dataclasses import dataclass, field
from pathlib import Path


@dataclass
class Module:
    """One parsed module: its dotted name, file, tree and top-level name bindings."""

    name: str
    path: Path
    tree: ast.Module
    is_package: bool
    classes: dict[str, ast.ClassDef] = field(default_factory=dict)
    # local name -> (absolute module, attribute or None for ``import x``)
    imports: dict[str, tuple[str, str | None]] = field(default_factory=dict)
    # modules re-exported whole (``from x import *``), in source order
    star_imports: list[str] = field(default_factory=list)


@dataclass(frozen=True)
class ClassRef:
    """A class found in source: where it lives and its definition."""

    module: Module
    node: ast.ClassDef

    @property
    def qualname(self) -> str:
        return f"{self.module.name}:{self.node.name}"


def find_module_file(name: str) -> Path | None:
    """Return the source file of a dotted module name without executing any package.

    ``importlib.util.find_spec`` is only used for the top-level package (it does not run
    it); the rest of the path is walked on the file system, so a parent ``__init__`` that
    would import torch or lmcache is never executed.
    """
    parts = name.split(".")
    try:
        spec = importlib.util.find_spec(parts[0])
    except (ImportError, ValueError):
        return None
    if spec is None:
        return None
    if len(parts) == 1:
        return Path(spec.origin) if spec.origin and spec.origin.endswith(".py") else None
    locations = list(spec.submodule_search_locations or [])
    for i, part in enumerate(parts[1:], start=1):
        last = i == len(parts) - 1
        found: Path | None = None
        next_locations: list[str] = []
        for loc in locations:
            pkg = Path(loc) / part
            if (pkg / "__init__.py").is_file():
                found = pkg / "__init__.py"
                next_locations = [str(pkg)]
                break
            if last and (Path(loc) / f"{part}.py").is_file():
                found = Path(loc) / f"{part}.py"
                break
        if found is None:
            return None
        if last:
            return found
        locations = next_locations
    return None


def package_installed(top: str) -> bool:
    """Whether a top-level package could be imported (checked without importing it)."""
    if top in sys.builtin_module_names or top in sys.stdlib_module_names:
        return True
    try:
        return importlib.util.find_spec(top) is not None
    except (ImportError, ValueError):
        return False


class SourceIndex:
    """Cache of parsed modules and class lookup across modules, following imports."""

    def __init__(self) -> None:
        self._modules: dict[str, Module | None] = {}

    def module(self, name: str) -> Module | None:
        if name not in self._modules:
            self._modules[name] = self._load(name)
        return self._modules[name]

    def _load(self, name: str) -> Module | None:
        path = find_module_file(name)
        if path is None:
            return None
        try:
            tree = ast.parse(path.read_text(encoding="utf-8"), filename=str(path))
        except (OSError, SyntaxError, UnicodeDecodeError):
            return None
        mod = Module(name, path, tree, path.name == "__init__.py")
        package = name if mod.is_package else name.rpartition(".")[0]
        for node in ast.walk(tree):
            if isinstance(node, ast.ClassDef) and node in tree.body:
                mod.classes[node.name] = node
            elif isinstance(node, ast.ImportFrom):
                base = _absolute(package, node.module, node.level)
                for alias in node.names:
                    if alias.name == "*":
                        mod.star_imports.append(base)
                    else:
                        mod.imports[alias.asname or alias.name] = (base, alias.name)
            elif isinstance(node, ast.Import):
                for alias in node.names:
                    local = alias.asname or alias.name.split(".")[0]
                    target = alias.name if alias.asname else alias.name.split(".")[0]
                    mod.imports[local] = (target, None)
        return mod

    def resolve_class(self, module: str, name: str, _depth: int = 0) -> ClassRef | None:
        """Find class ``name`` as seen from ``module`` (defined there or imported into it)."""
        if _depth > 8:
            return None
        mod = self.module(module)
        if mod is None:
            return None
        if name in mod.classes:
            return ClassRef(mod, mod.classes[name])
        alias = _module_alias(mod, name)
        if alias is not None:
            for expr in alias:
                found = self.resolve_expr(mod, expr, _depth + 1)
                if found is not None:
                    return found
            return None
        if name in mod.imports:
            src, attr = mod.imports[name]
            if attr is None:
                return None
            found = self.resolve_class(src, attr, _depth + 1)
            if found is None and self.module(f"{src}.{attr}") is not None:
                return None  # ``from pkg import submodule``: not a class
            return found
        # A package that re-exports its submodules whole (``from .part import *``): the
        # last one that has the class wins, as the later import would at run time.
        for src in reversed(mod.star_imports):
            found = self.resolve_class(src, name, _depth + 1)
            if found is not None:
                return found
        return None

    def resolve_expr(self, module: Module, expr: ast.expr, _depth: int = 0) -> ClassRef | None:
        """Resolve a base-class / constructor expression (``Name`` or ``mod.Name``).

        Standard-library classes are not resolved: the audit is about connector code, and
        following ``queue.Queue.get`` would credit a connector with the stdlib's timeouts.
        """
        found: ClassRef | None = None
        if isinstance(expr, ast.Name):
            found = self.resolve_class(module.name, expr.id, _depth)
        elif isinstance(expr, ast.Attribute) and isinstance(expr.value, ast.Name):
            imp = module.imports.get(expr.value.id)
            if imp is not None:
                target = imp[0] if imp[1] is None else f"{imp[0]}.{imp[1]}"
                found = self.resolve_class(target, expr.attr, _depth)
        elif isinstance(expr, ast.Subscript):  # Generic[T]
            found = self.resolve_expr(module, expr.value, _depth)
        if found is not None and found.module.name.split(".")[0] in sys.stdlib_module_names:
            return None
        return found


def _absolute(package: str, module: str | None, level: int) -> str:
    """Turn a (possibly relative) ``from`` import into an absolute module name."""
    if level == 0:
        return module or ""
    parts = package.split(".") if package else []
    base = parts[: len(parts) - (level - 1)] if level > 1 else parts
    return ".".join([*base, module] if module else base)


def expr_name(expr: ast.expr) -> str:
    """The last dotted component of a base-class expression (``a.b.C`` -> ``C``)."""
    if isinstance(expr, ast.Name):
        return expr.id
    if isinstance(expr, ast.Attribute):
        return expr.attr
    if isinstance(expr, ast.Subscript):
        return expr_name(expr.value)
    return ast.unparse(expr)


def _module_alias(mod: Module, name: str) -> list[ast.expr] | None:
    """Expressions a module-level ``name = ...`` may bind to a class.

    Covers ``NixlConnector = NixlPullConnector`` and a factory call such as
    ``LMCacheMPConnector = _resolve()`` (every ``return X`` of that function, in order; the
    first one found in source wins, which is the in-tree fallback when the optional
    package providing the others is missing).
    """
    for stmt in mod.tree.body:
        if not (
            isinstance(stmt, ast.Assign)
            and any(isinstance(t, ast.Name) and t.id == name for t in stmt.targets)
        ):
            continue
        value = stmt.value
        if isinstance(value, ast.Name | ast.Attribute):
            return [value]
        if isinstance(value, ast.Call) and isinstance(value.func, ast.Name):
            for fn in mod.tree.body:
                if isinstance(fn, ast.FunctionDef) and fn.name == value.func.id:
                    returns = [
                        r.value
                        for r in ast.walk(fn)
                        if isinstance(r, ast.Return) and r.value is not None
                    ]
                    # In-module names first: they are auditable without optional packages.
                    returns.sort(
                        key=lambda e: not (isinstance(e, ast.Name) and e.id in mod.classes)
                    )
                    return returns
        return []
    return None
