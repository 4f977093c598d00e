"""Which connectors to audit, and where their source is.

Sources, in order: vLLM's ``KVConnectorFactory`` registrations (read from ``factory.py``'s
AST, so vLLM is not imported), connectors named on the command line as ``module:Class``,
the ``kvfail.connectors`` entry-point group, and kvfail's own connectors. Nothing is
imported: a connector whose optional package is missing is still audited from its file,
and the row says which import would fail.
"""

from __future__ import annotations

import ast
from dataclasses import dataclass, field
from importlib import metadata
from pathlib import Path

from kvfail.audit.source import ClassRef, SourceIndex, find_module_file, package_installed

FACTORY_MODULE = "vllm.distributed.kv_transfer.kv_connector.factory"
ENTRY_POINT_GROUP = "kvfail.connectors"
KVFAIL_CONNECTORS = (
    "connectors.mooncake:KvfailMooncakeConnector",
    "connectors.nixl:KvfailNixlConnector",
)


@dataclass
class Target:
    """One connector row: its name, origin, and (when found) its class in source."""

    name: str
    module: str
    class_name: str
    origin: str  # "vllm-registry", "cli", "entry-point", "kvfail"
    ref: ClassRef | None = None
    notes: list[str] = field(default_factory=list)

    @property
    def spec(self) -> str:
        return f"{self.module}:{self.class_name}"

    @property
    def installed(self) -> bool:
        return self.ref is not None

    @property
    def path(self) -> Path | None:
        return self.ref.module.path if self.ref else None


def registry_entries() -> list[tuple[str, str, str, Path, int]]:
    """(name, module, class, factory path, line) for each ``register_connector`` call.

    Read from the installed ``factory.py`` rather than ``KVConnectorFactory._registry``:
    the registry holds closures, and importing the factory imports vLLM (10-20 s).
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
            hits = [t for t in targets if sel in (t.name, t.spec)]
            if not hits and ":" in sel:
                module, cls = _split_spec(sel)
                hits = [Target(cls, module, cls, "cli")]
            if not hits:
                raise ValueError(f"unknown connector {sel!r} (not registered; use module:Class)")
            chosen.extend(h for h in hits if h not in chosen)
        targets = chosen
    return [_resolve(index, t) for t in targets]
