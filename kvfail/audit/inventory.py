"""Which connectors to audit, and where their source is.

Sources, in order: vLLM's ``KVConnectorFactory`` registrations (read from ``factory.py``'s
AST, so vLLM is not imported), connectors named on the command line as ``module:Class``,
the ``kvfail.connectors`` entry-point group, and kvfail's own connectors. Nothing is
imported: a connector whose optional package is missing is still audited from its file,
and the row says which import would fail.

A ``--connector`` value is checked here, where it is resolved, and nowhere else: one that
names nothing, or a ``module:Class`` whose class cannot be read from source or is not a
KV connector, raises :class:`UsageError` before any tier runs (a row of n/a cells would
look like an audit that ran).
"""

from __future__ import annotations

import ast
import builtins
import sys
from dataclasses import dataclass, field
from importlib import metadata
from pathlib import Path

from kvfail.audit.source import (
    ClassRef,
    Module,
    SourceIndex,
    expr_name,
    find_module_file,
    package_installed,
)

FACTORY_MODULE = "vllm.distributed.kv_transfer.kv_connector.factory"
ENTRY_POINT_GROUP = "kvfail.connectors"
#: kvfail's own rows, in the order the audit's dynamic tier runs them: the Example
#: connector's runs (files on disk, no peer) take about a second, so it goes before the
#: ones that start peers, where a tight budget cuts last.
KVFAIL_CONNECTORS = (
    "connectors.example:KvfailExampleConnector",
    "connectors.mooncake:KvfailMooncakeConnector",
    "connectors.nixl:KvfailNixlConnector",
)
#: vLLM's connector interfaces: a class with one of them among its bases is a KV connector.
CONNECTOR_BASES = frozenset({"KVConnectorBase_V1", "KVConnectorBase"})
ACCEPTED = (
    "expected a registered vLLM connector name, vllm:<RegistryName>, a kvfail.connectors "
    "entry point, or module:Class naming a KV connector class"
)


class UsageError(ValueError):
    """A ``--connector`` value the audit cannot turn into a row (the CLI exits 2)."""

    def __init__(self, selector: str, problem: str) -> None:
        super().__init__(" ".join(f"--connector {selector}: {problem}; {ACCEPTED}".split()))
        self.selector = selector


@dataclass
class Target:
    """One connector row: its name, origin, and (when found) its class in source."""

    name: str
    module: str
    class_name: str
    origin: str  # "vllm-registry", "cli", "entry-point", "kvfail", "guard"
    ref: ClassRef | None = None
    notes: list[str] = field(default_factory=list)
    #: For a ``Guard(X)`` row: X's target (the guard, :mod:`connectors.guard`, wraps it).
    guarded: Target | None = None

    @property
    def spec(self) -> str:
        return f"{self.module}:{self.class_name}"

    @property
    def installed(self) -> bool:
        return self.ref is not None

    @property
    def path(self) -> Path | None:
        return self.ref.module.path if self.ref else None


def guard_target(inner: Target) -> Target:
    """The ``Guard(X)`` row of a row X: kvfail's guard configured around X's class."""
    return Target(
        name=f"Guard({inner.name})",
        module="connectors.guard",
        class_name="KvfailGuardConnector",
        origin="guard",
        ref=inner.ref,
        guarded=inner,
    )


def registry_entries() -> list[tuple[str, str, str, Path, int]]:
    """(name, module, class, factory path, line) for each ``register_connector`` call.

    Read from the installed ``factory.py`` rather than ``KVConnectorFactory._registry``:
    the registry holds closures, and importing the factory imports vLLM, which is slow.
    """
    path = find_module_file(FACTORY_MODULE)
    if path is None:
        return []
    tree = ast.parse(path.read_text(encoding="utf-8"), filename=str(path))
    out: list[tuple[str, str, str, Path, int]] = []
    for node in ast.walk(tree):
        if not (
            isinstance(node, ast.Call)
            and isinstance(node.func, ast.Attribute)
            and node.func.attr == "register_connector"
            and len(node.args) >= 3
        ):
            continue
        args = node.args[:3]
        if all(isinstance(a, ast.Constant) and isinstance(a.value, str) for a in args):
            name, module, cls = (a.value for a in args)  # type: ignore[attr-defined]
            out.append((name, module, cls, path, node.lineno))
    return out


def _entry_point_specs() -> list[tuple[str, str]]:
    """(name, "module:Class") advertised by installed distributions; nothing is loaded."""
    try:
        eps = metadata.entry_points(group=ENTRY_POINT_GROUP)
    except Exception:  # a broken distribution must not stop the audit
        return []
    return [(ep.name, ep.value) for ep in eps]


def _split_spec(spec: str) -> tuple[str, str]:
    module, sep, cls = spec.partition(":")
    if not sep or not module or not cls:
        raise ValueError(f"expected module:Class, got {spec!r}")
    return module, cls


def _missing_imports(target: Target) -> list[str]:
    """Top-level packages the module imports unconditionally that are not installed.

    Imports inside ``try`` / ``if`` (optional-dependency guards, TYPE_CHECKING) are skipped:
    only an import that would make ``import module`` itself fail is named.
    """
    if target.ref is None:
        return []
    missing: set[str] = set()
    for node in target.ref.module.tree.body:
        roots: list[str] = []
        if isinstance(node, ast.Import):
            roots = [a.name.split(".")[0] for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            roots = [node.module.split(".")[0]]
        missing.update(r for r in roots if not package_installed(r))
    return sorted(missing)


def _resolve(index: SourceIndex, target: Target) -> Target:
    target.ref = index.resolve_class(target.module, target.class_name)
    if target.ref is None:
        if find_module_file(target.module) is None:
            target.notes.append(f"not installed: module {target.module} not found")
        else:
            target.notes.append(f"not installed: {target.class_name} not in {target.module}")
        return target
    missing = _missing_imports(target)
    if missing:
        target.notes.append(
            "import would fail (missing " + ", ".join(missing) + "); audited from source"
        )
    else:
        target.notes.append("audited from source, not imported")
    return target


def discover(
    index: SourceIndex,
    *,
    selectors: list[str] | None = None,
    include_registry: bool = True,
    include_entry_points: bool = True,
    include_kvfail: bool = True,
) -> list[Target]:
    """Build the list of rows to audit.

    ``selectors`` filters by registry / entry-point name or ``module:Class``; a
    ``module:Class`` selector that matches nothing known is added as its own row.
    """
    targets: list[Target] = []
    if include_registry:
        for name, module, cls, _path, _line in registry_entries():
            targets.append(Target(name, module, cls, "vllm-registry"))
    if include_entry_points:
        for name, spec in _entry_point_specs():
            try:
                module, cls = _split_spec(spec)
            except ValueError:
                continue
            targets.append(Target(name, module, cls, "entry-point"))
    if include_kvfail:
        for spec in KVFAIL_CONNECTORS:
            module, cls = _split_spec(spec)
            targets.append(Target(cls, module, cls, "kvfail"))
    if selectors:
        chosen: list[Target] = []
        for sel in selectors:
            hits = _select(index, targets, sel)
            chosen.extend(h for h in hits if h not in chosen)
        targets = chosen
    return [_resolve(index, t) for t in targets]


def _select(index: SourceIndex, targets: list[Target], sel: str) -> list[Target]:
    """The rows one ``--connector`` value names; raises :class:`UsageError` for none."""
    hits = [t for t in targets if sel in (t.name, t.spec)]
    if hits:
        return hits
    if sel.startswith("vllm:"):  # the conformance suite's spelling of a registry name
        name = sel.removeprefix("vllm:")
        hits = [t for t in targets if t.origin == "vllm-registry" and t.name == name]
        if not hits:
            known = sorted({t.name for t in targets if t.origin == "vllm-registry"})
            raise UsageError(
                sel, f"{name!r} is not in vLLM's connector registry (registered: {_names(known)})"
            )
        return hits
    if ":" not in sel:
        raise UsageError(
            sel, f"unknown connector name (known: {_names([t.name for t in targets])})"
        )
    try:
        module, cls = _split_spec(sel)
    except ValueError:
        raise UsageError(sel, "empty module or class name") from None
    problem = class_problem(index, module, cls)
    if problem is not None:
        raise UsageError(sel, problem)
    return [Target(cls, module, cls, "cli")]


def _names(names: list[str]) -> str:
    return ", ".join(dict.fromkeys(names)) or "none found"


def class_problem(index: SourceIndex, module: str, name: str) -> str | None:
    """Why ``module:name`` is not a KV connector class the audit can read, or None.

    Read from source like the rest of the inventory (importing a connector module would
    import vLLM and its optional packages). A class whose bases cannot all be read (an
    uninstalled package) gets the benefit of the doubt: only a base chain read to its end
    without vLLM's interface is rejected.
    """
    path = find_module_file(module)
    if path is None:
        return f"cannot import module {module!r} (ModuleNotFoundError: no source on sys.path)"
    mod = index.module(module)
    if mod is None:
        return f"cannot import module {module!r} ({_parse_error(path)})"
    ref = index.resolve_class(module, name)
    if ref is None:
        return _not_a_class(index, mod, name)
    if is_connector_class(index, ref) is False:
        return (
            f"{ref.qualname} is a class but not a KV connector "
            f"(none of its bases is {' or '.join(sorted(CONNECTOR_BASES))})"
        )
    return None


def _parse_error(path: Path) -> str:
    try:
        ast.parse(path.read_text(encoding="utf-8"), filename=str(path))
    except SyntaxError as exc:
        return f"SyntaxError: {exc.msg}, line {exc.lineno}"
    except (OSError, UnicodeDecodeError) as exc:
        return f"{type(exc).__name__}: {exc}"
    return "unreadable source"


def _bindings(body: list[ast.stmt]) -> list[ast.stmt]:
    """Module-level statements, including those under ``if`` / ``try`` / ``with``."""
    out: list[ast.stmt] = []
    for stmt in body:
        out.append(stmt)
        if isinstance(stmt, ast.If):
            out += _bindings(stmt.body) + _bindings(stmt.orelse)
        elif isinstance(stmt, ast.Try):
            out += _bindings(stmt.body) + _bindings(stmt.orelse) + _bindings(stmt.finalbody)
            for handler in stmt.handlers:
                out += _bindings(handler.body)
        elif isinstance(stmt, ast.With):
            out += _bindings(stmt.body)
    return out


def _not_a_class(index: SourceIndex, mod: Module, name: str, depth: int = 0) -> str:
    """What ``name`` is in ``mod`` when it is not a class the source index can resolve."""
    spec = f"{name!r} in module {mod.name!r}"
    if index.module(f"{mod.name}.{name}") is not None:
        return f"{spec} is a module, not a class"
    for stmt in _bindings(mod.tree.body):
        if isinstance(stmt, ast.FunctionDef | ast.AsyncFunctionDef) and stmt.name == name:
            return f"{spec} is a function (line {stmt.lineno}), not a class"
        if isinstance(stmt, ast.ClassDef) and stmt.name == name:
            return (
                f"{spec} is defined conditionally (line {stmt.lineno}); "
                "the audit reads top-level classes only"
            )
        targets = (
            stmt.targets
            if isinstance(stmt, ast.Assign)
            else [stmt.target]
            if isinstance(stmt, ast.AnnAssign)
            else []
        )
        if any(isinstance(t, ast.Name) and t.id == name for t in targets):
            return f"{spec} is assigned at line {stmt.lineno} and is not a class found in source"
    if name in mod.imports:
        src, attr = mod.imports[name]
        if attr is None:
            return f"{spec} is a module, not a class"  # ``import x as name``
        if find_module_file(src) is None:
            return f"cannot import {attr!r} from {src!r} (ModuleNotFoundError)"
        origin = index.module(src)
        if origin is not None and depth < 8:
            return _not_a_class(index, origin, attr, depth + 1)
        return f"{spec} is imported from {src!r}, whose source cannot be read"
    return f"module {mod.name!r} has no attribute {name!r} (AttributeError)"


def is_connector_class(index: SourceIndex, ref: ClassRef, depth: int = 0) -> bool | None:
    """True: vLLM's connector interface is among the bases; False: the bases were read to
    their end (builtins, the standard library) without it; None: cannot tell from source."""
    if ref.node.name in CONNECTOR_BASES:
        return True
    if depth > 12:
        return None
    unknown = False
    for base in ref.node.bases:
        if expr_name(base) in CONNECTOR_BASES:
            return True
        found = index.resolve_expr(ref.module, base)
        if found is not None:
            verdict = is_connector_class(index, found, depth + 1)
            if verdict:
                return True
            unknown = unknown or verdict is None
        elif not _outside_connectors(ref.module, base):
            unknown = True
    return None if unknown else False


def _outside_connectors(mod: Module, base: ast.expr) -> bool:
    """Whether a base the index does not resolve is a builtin or standard-library class."""
    if isinstance(base, ast.Subscript):
        return _outside_connectors(mod, base.value)
    if isinstance(base, ast.Attribute) and isinstance(base.value, ast.Name):
        base = base.value
    if not isinstance(base, ast.Name):
        return False
    if base.id in mod.imports:
        return mod.imports[base.id][0].split(".")[0] in sys.stdlib_module_names
    return base.id not in mod.classes and hasattr(builtins, base.id)
