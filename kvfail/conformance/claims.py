"""Which driver runs a connector class: chosen by what the class does, never by its name,
module or ancestry.

Each in-tree driver (and any registered in the ``kvfail.claims`` entry-point group) has a
classmethod ``claims(probe) -> DriverClaim | None``. A :class:`Probe` reads what a
connector's constructor builds and reads, without building it (that needs a whole vLLM
config): the classes its ``__init__`` chain constructs, transitively through what those
construct (its worker and scheduler, the transport agent they open), and the string
constants that code uses, among them the ``kv_connector_extra_config`` keys it reads. A
driver claims the classes whose probe shows the transport it drives, and says why.

Exactly one claim may win: none gives the generic driver (which declares no peer, so every
scenario needing a remote prefill is a named skip, and the coverage gate reports the
clauses left unverified); two are an error naming both, never a silent pick. Why probing
rather than ``issubclass``: a subclass under another name, or a class that does the same
thing with no common ancestor, must get the same rig and so be judged on the same
evidence; and the same class named two ways (``module:Class``, ``vllm:Name``) must too.
"""

from __future__ import annotations

import dis
import importlib
import importlib.metadata
import inspect
import types
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from kvfail.conformance.driver import Driver

__all__ = [
    "CLAIMANTS",
    "CLAIMS_GROUP",
    "Chosen",
    "DriverClaim",
    "Probe",
    "choose",
    "claimants",
    "connector_side",
    "probe",
    "split_options",
]

#: Entry-point group of third-party claimants: a value is a driver class with ``claims``.
CLAIMS_GROUP = "kvfail.claims"

#: The in-tree drivers that claim classes ("module:Class"), imported when a value needs one.
CLAIMANTS = (
    "kvfail.conformance.toy_driver:ToyDriver",
    "kvfail.conformance.mooncake_driver:MooncakeDriver",
    "kvfail.conformance.nixl_driver:NixlDriver",
    "kvfail.conformance.nixl_push_driver:NixlPushDriver",
    "kvfail.conformance.mooncake_store_driver:MooncakeStoreDriver",
    "kvfail.conformance.multi_driver:MultiDriver",
    "kvfail.conformance.store_driver:ExampleDriver",
)

#: How many class hops the probe follows from the connector (connector -> worker ->
#: transport agent); deeper is the transport library's own code.
_DEPTH = 3
#: Packages whose classes the probe does not enter: they build no transport of a connector.
_OPAQUE = frozenset({"builtins", "typing", "torch", "abc", "enum", "dataclasses", "collections"})


@dataclass(frozen=True)
class Probe:
    """What a connector class does, as far as its code shows without building it."""

    cls: type
    #: The vLLM registry name it was given by (``vllm:<Name>``), or None (``module:Class``).
    registry_name: str | None
    #: The classes its constructor builds, transitively (see the module docstring).
    built: frozenset[type]
    #: The string constants that code uses (the extra-config keys it reads among them).
    strings: frozenset[str]
    #: The modules that code imports where it runs (a transport library imported lazily).
    imports: frozenset[str] = frozenset()
    #: Contract method -> the names its code uses, through the helpers it calls.
    method_names: Mapping[str, frozenset[str]] = field(default_factory=lambda: MappingProxyType({}))
    #: Options from the ``--connector`` value (``?key=value``): the user's, never the class's.
    options: Mapping[str, str] = field(default_factory=lambda: MappingProxyType({}))

    @property
    def d_side(self) -> tuple[str, str | None]:
        """D's (connector, module path): a registry name has no module."""
        if self.registry_name is not None:
            return (self.registry_name, None)
        return (self.cls.__name__, self.cls.__module__)

    def reads(self, key: str) -> bool:
        """Whether its constructor's code uses the string ``key`` (an extra-config key)."""
        return key in self.strings

    def calls(self, method: str, *names: str) -> list[str]:
        """Which of ``names`` the code of contract method ``method`` uses (a lookup that
        checks files on disk uses ``exists``)."""
        return sorted(set(names) & self.method_names.get(method, frozenset()))

    def imports_from(self, *packages: str) -> list[str]:
        """The modules of ``packages`` its code imports where it runs."""
        return sorted(m for m in self.imports if _in(m, packages))

    def builds_from(self, *packages: str) -> list[type]:
        """The built classes whose module is in one of ``packages`` (a transport library)."""
        return sorted(
            (c for c in self.built if _in(c.__module__, packages)), key=lambda c: c.__qualname__
        )

    def builds_with(self, method: str) -> list[type]:
        """The built classes that have ``method`` (e.g. a worker's way of moving blocks)."""
        return sorted(
            (c for c in self.built if callable(getattr(c, method, None))),
            key=lambda c: c.__qualname__,
        )


@dataclass(frozen=True)
class DriverClaim:
    """One driver's claim on a probed class: the evidence, and how to build the driver."""

    #: What the probe saw that makes this driver the one (printed in the run's header).
    why: str
    #: The driver for a ``--connector`` value (its name).
    build: Callable[[str], Driver]


@dataclass(frozen=True)
class Chosen:
    """The outcome of :func:`choose`: the claimant (None: the generic driver) and why."""

    claimant: str | None
    claim: DriverClaim | None
    why: str


def _top(module: str) -> str:
    return module.split(".", 1)[0]


def _in(module: str, packages: tuple[str, ...]) -> bool:
    """``module`` belongs to one of ``packages``, or to a build of it (``nixl_cu12``)."""
    top = _top(module)
    return any(top == p or top.startswith(p + "_") for p in packages)


def _codes(code: types.CodeType) -> Iterator[types.CodeType]:
    yield code
    for const in code.co_consts:
        if isinstance(const, types.CodeType):
            yield from _codes(const)


def _inits(cls: type) -> list[Any]:
    return [
        k.__dict__["__init__"]
        for k in cls.__mro__
        if isinstance(k.__dict__.get("__init__"), types.FunctionType)
    ]


@dataclass
class _Reach:
    """What a walk of code met: classes built, strings, modules imported, names used."""

    built: set[type] = field(default_factory=set)
    strings: set[str] = field(default_factory=set)
    imports: set[str] = field(default_factory=set)
    names: set[str] = field(default_factory=set)


def _walk(start: list[Any], cls: type, *, enter_classes: bool) -> _Reach:
    """Follow ``start`` (functions of ``cls``), the helpers and methods their code calls
    by name, and (``enter_classes``) the constructors of the classes it names."""
    out = _Reach()
    seen: set[Any] = set()
    work: list[tuple[Any, type, int]] = [(f, cls, 0) for f in start]
    while work:
        fn, owner, depth = work.pop()
        fn = inspect.unwrap(fn)
        code = getattr(fn, "__code__", None)
        if code is None or fn in seen:
            continue
        seen.add(fn)
        scope = getattr(fn, "__globals__", {})
        for c in _codes(code):
            out.strings.update(k for k in c.co_consts if isinstance(k, str))
            out.imports.update(
                i.argval for i in dis.get_instructions(c) if i.opname == "IMPORT_NAME"
            )
            out.names.update(c.co_names)
            for name in c.co_names:
                found = scope.get(name)
                if isinstance(found, type) and _top(found.__module__) not in _OPAQUE:
                    if enter_classes and found not in out.built and depth < _DEPTH:
                        out.built.add(found)
                        work += [(f, found, depth + 1) for f in _inits(found)]
                elif isinstance(found, types.FunctionType):
                    work.append((found, owner, depth))
                member = inspect.getattr_static(owner, name, None)
                if isinstance(member, (classmethod, staticmethod)):
                    member = member.__func__
                if isinstance(member, types.FunctionType):
                    work.append((member, owner, depth))
    return out


#: The contract methods whose code a probe also reads (``Probe.calls``).
PROBED_METHODS = ("get_num_new_matched_tokens", "start_load_kv")


def probe(
    cls: type, registry_name: str | None = None, options: Mapping[str, str] | None = None
) -> Probe:
    """Probe ``cls``: follow its constructor's code (the ``__init__`` of every class in
    its MRO, the helpers and methods that code calls by name, and the constructors of the
    classes it names) and collect the classes and strings met; and the names the code of
    each of :data:`PROBED_METHODS` uses."""
    init = _walk(_inits(cls), cls, enter_classes=True)
    calls = {}
    for method in PROBED_METHODS:
        fn = getattr(cls, method, None)
        calls[method] = frozenset(_walk([fn], cls, enter_classes=False).names if fn else ())
    return Probe(
        cls=cls,
        registry_name=registry_name,
        built=frozenset(init.built),
        strings=frozenset(init.strings),
        imports=frozenset(init.imports),
        method_names=MappingProxyType(calls),
        options=MappingProxyType(dict(options or {})),
    )


def split_options(spec: str) -> tuple[str, dict[str, str]]:
    """``<value>?key=value&key=value`` -> (value, options). Options are the user's set-up
    of the rig (e.g. a Multi connector's ``children``); the driver that wins says which it
    takes (``OPTIONS``)."""
    base, sep, query = spec.partition("?")
    options: dict[str, str] = {}
    for part in query.split("&") if sep else ():
        key, eq, value = part.partition("=")
        if not key or not eq or not value:
            raise ValueError(f"option {part!r} in {spec!r} is not key=value")
        if key in options:
            raise ValueError(f"option {key!r} given twice in {spec!r}")
        options[key] = value
    return base, options


def connector_class(name: str, module: str | None) -> Any:
    """The class a vLLM config's (connector, module path) names: with no module, the one
    vLLM's registry has under ``name`` (this imports vLLM); else ``module``'s ``name``."""
    if module is None:
        from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory

        return KVConnectorFactory.get_connector_class_by_name(name)
    return getattr(importlib.import_module(module), name)


def connector_side(value: str) -> tuple[str, str | None]:
    """A connector named in an option (``vllm:<Name>`` or ``module:Class``) as the
    (connector, module path) of a vLLM config; the class must load."""
    if value.startswith("vllm:"):
        name = value.removeprefix("vllm:")
        connector_class(name, None)
        return (name, None)
    module, sep, name = value.partition(":")
    if not sep or not module or not name or "." in name:
        raise ValueError(f"expected vllm:<Name> or module:Class, got {value!r}")
    if not isinstance(getattr(importlib.import_module(module), name, None), type):
        raise ValueError(f"{value} is not a class")
    return (name, module)


def _load(path: str) -> Any:
    module, _, name = path.partition(":")
    return getattr(importlib.import_module(module), name)


def claimants() -> dict[str, Any]:
    """The drivers that may claim a class: the in-tree ones and the ``kvfail.claims``
    entry points (name -> driver class). One whose module cannot be imported here (its
    transport is missing) claims nothing."""
    out: dict[str, Any] = {}
    for path in CLAIMANTS:
        try:
            out[path] = _load(path)
        except ImportError:
            continue
    for ep in importlib.metadata.entry_points(group=CLAIMS_GROUP):
        out[ep.value] = ep.load()
    return out


def choose(p: Probe) -> Chosen:
    """The one driver whose claim wins for ``p``; the generic driver where none claims.
    Raises ``ValueError`` naming the candidates where more than one claims."""
    claims = {
        name: claim
        for name, driver in claimants().items()
        if (claim := driver.claims(p)) is not None
    }
    if len(claims) > 1:
        named = "; ".join(f"{n} ({c.why})" for n, c in claims.items())
        raise ValueError(
            f"{p.cls.__qualname__} is claimed by more than one driver: {named}. "
            "A claim must say what only its transport does; name the driver to use with "
            "its registered --connector value"
        )
    if not claims:
        return Chosen(
            None,
            None,
            "no driver claims it (nothing it builds or reads is a transport a driver "
            "drives): the generic driver, which has no P, so every scenario needing a "
            "remote prefill is skipped and the clauses only they verify stay unverified",
        )
    ((name, claim),) = claims.items()
    return Chosen(name, claim, claim.why)
