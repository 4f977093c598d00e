"""Which driver runs a ``--connector`` value: a name registered in the ``kvfail.drivers``
entry-point group (kvfail's own drivers are registered there exactly as a third party's
are), ``vllm:<RegistryName>`` (vLLM's ``KVConnectorFactory``) and ``module:Class``; any of
them after ``guard:`` runs that driver with D's connector wrapped by kvfail's guard
(:mod:`kvfail.conformance.guard_driver`).

Why a module of its own: :mod:`kvfail.conformance.driver` is the base API every driver
imports, so it must import no driver; this module is the one place that maps a connector
class to the in-tree driver for its transport (each driver module is imported when a
value needs it, since those modules import their transports' code).
"""

from __future__ import annotations

import importlib
import importlib.metadata
from typing import Any

from kvfail.conformance.driver import ENTRY_POINT_GROUP, Driver, DriverUnavailable

__all__ = ["entry_point_modules", "registered", "resolve", "spec_problem"]


def _entry_point_drivers() -> dict[str, Any]:
    return {ep.name: ep for ep in importlib.metadata.entry_points(group=ENTRY_POINT_GROUP)}


def entry_point_modules() -> dict[str, str]:
    """Registered ``--connector`` name -> the module of its driver factory (not imported)."""
    return {name: ep.module for name, ep in _entry_point_drivers().items()}


def registered() -> list[str]:
    """The ``--connector`` names registered in the ``kvfail.drivers`` entry-point group."""
    return sorted(_entry_point_drivers())


def _import_class(path: str) -> type:
    module_name, _, qualname = path.partition(":")
    if not module_name or not qualname:
        raise ValueError(f"expected module:Class, got {path!r}")
    obj: Any = importlib.import_module(module_name)
    for part in qualname.split("."):
        obj = getattr(obj, part)
    if not isinstance(obj, type):
        raise TypeError(f"{path} is not a class")
    return obj


def _driver_for_class(name: str, cls: type, registry_name: str | None = None) -> Driver:
    from kvfail.conformance.guard_driver import GuardDriver, control_inner

    inner = control_inner(cls)  # a broken guard: its inner's driver, D wrapped by it
    if inner is not None:
        wrapped = GuardDriver(
            name, resolve(inner), guard_connector=cls.__name__, guard_module=cls.__module__
        )
        return wrapped  # type: ignore[return-value]
    from kvfail.conformance.mooncake_driver import MooncakeDriver, mooncake_bases
    from kvfail.conformance.toy_driver import ToyDriver
    from kvfail.harness.toy import ToyConnector

    if issubclass(cls, ToyConnector):
        return ToyDriver(name, cls)
    mooncake = mooncake_bases()
    if mooncake is not None and issubclass(cls, mooncake[0]):
        upstream, kvfail_cls = mooncake
        # P runs the unbroken connector nearest above D's: a D-side control tests D only.
        p_cls = kvfail_cls if kvfail_cls is not None and issubclass(cls, kvfail_cls) else upstream
        if registry_name is not None:
            return MooncakeDriver(name, connector=registry_name, connector_module=None)
        return MooncakeDriver(
            name,
            connector=cls.__name__,
            connector_module=cls.__module__,
            p_connector=p_cls.__name__,
            p_connector_module=None if p_cls is upstream else p_cls.__module__,
        )
    from kvfail.conformance.nixl_push_driver import NixlPushDriver, push_base

    push = push_base()
    if push is not None and issubclass(cls, push):
        return NixlPushDriver.for_class(name, cls, registry_name)
    from kvfail.conformance.nixl_driver import NixlDriver, nixl_bases

    nixl = nixl_bases()
    if nixl is not None and issubclass(cls, nixl[0]):
        return NixlDriver.for_class(name, cls, registry_name)
    from kvfail.conformance.mooncake_store_driver import MooncakeStoreDriver, store_base

    store = store_base()
    if store is not None and issubclass(cls, store) and cls is not store:
        return MooncakeStoreDriver(name, connector_cls=cls)  # a subclass: a negative control
    from kvfail.conformance.multi_driver import MultiDriver, multi_base

    multi = multi_base()
    if multi is not None and issubclass(cls, multi) and cls is not multi:
        return MultiDriver(name, connector_cls=cls)  # a subclass: a negative control
    from kvfail.conformance.store_driver import ExampleDriver, example_base

    example = example_base()
    if example is not None and issubclass(cls, example) and cls is not example:
        return ExampleDriver(name, connector_cls=cls)  # a subclass: a negative control
    from kvfail.conformance.generic_driver import GenericDriver

    return GenericDriver(name, cls, registry_name)


def spec_problem(spec: str) -> str | None:
    """What is wrong with a ``--connector`` value by its form alone (None: nothing yet);
    cheap, imports nothing, so a typo stops the run before any vLLM import."""
    accepted = (
        f"accepted: one of {registered()} (a {ENTRY_POINT_GROUP!r} entry point), "
        "vllm:<RegistryName> or module:Class, each also after guard:"
    )
    if spec.startswith("guard:"):
        inner = spec.removeprefix("guard:")
        return spec_problem(inner) if inner else f"no connector after 'guard:'; {accepted}"
    if spec in _entry_point_drivers():
        return None
    if spec.startswith("vllm:"):
        return None if spec.removeprefix("vllm:") else f"no registry name after 'vllm:'; {accepted}"
    module, sep, qualname = spec.partition(":")
    if sep and module and qualname:
        return None
    return f"unknown connector; {accepted}"


def resolve(spec: str) -> Driver:
    """Turn a ``--connector`` value into a driver.

    A ``kvfail.drivers`` entry-point name (``toy``, ``mooncake``, ``nixl``, ...) |
    ``vllm:<RegistryName>`` (vLLM's ``KVConnectorFactory`` registry) | ``module:Class`` |
    ``guard:`` followed by any of these. A registered name wins over the other forms
    (``vllm:MooncakeConnector`` is one).
    Raises :class:`DriverUnavailable` when the name cannot be resolved to a class at all.
    """
    if spec.startswith("guard:"):
        from kvfail.conformance.guard_driver import GuardDriver

        return GuardDriver(spec, resolve(spec.removeprefix("guard:")))  # type: ignore[return-value]
    entry_points = _entry_point_drivers()
    if spec in entry_points:
        factory = entry_points[spec].load()
        driver = factory(spec)
        if not isinstance(driver, Driver):
            raise TypeError(f"entry point {spec!r} returned {type(driver).__name__}, not Driver")
        return driver
    if spec.startswith("vllm:"):
        registry_name = spec.removeprefix("vllm:")
        from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory

        try:
            cls = KVConnectorFactory.get_connector_class_by_name(registry_name)
        except Exception as exc:
            raise DriverUnavailable(
                f"vLLM connector {registry_name!r} cannot be loaded ({type(exc).__name__}: {exc})"
            ) from exc
        return _driver_for_class(spec, cls, registry_name)
    if ":" in spec:
        try:
            cls = _import_class(spec)
        except Exception as exc:
            raise DriverUnavailable(
                f"{spec} cannot be imported ({type(exc).__name__}: {exc})"
            ) from exc
        return _driver_for_class(spec, cls)
    known = sorted(entry_points)
    raise DriverUnavailable(
        f"unknown connector {spec!r}: use one of {known}, vllm:<RegistryName> or module:Class"
    )
