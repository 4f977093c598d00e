"""Which driver runs a ``--connector`` value: a name registered in the ``kvfail.drivers``
entry-point group (kvfail's own drivers are registered there exactly as a third party's
are), ``vllm:<RegistryName>`` (vLLM's ``KVConnectorFactory``) and ``module:Class``; any of
them after ``guard:`` runs that driver with D's connector wrapped by kvfail's guard
(:mod:`kvfail.conformance.guard_driver`).

A class (``vllm:``/``module:``) gets the driver whose claim wins on what the class does
(:mod:`kvfail.conformance.claims`), whichever way it is named; ``?key=value`` options
after it are the user's set-up of that driver (e.g. ``?children=...`` for a Multi
connector), never read from the class. Why a module of its own:
:mod:`kvfail.conformance.driver` is the base API every driver imports, so it must import
no driver; each driver module is imported when a value needs it, since those modules
import their transports' code.
"""

from __future__ import annotations

import importlib
import importlib.metadata
from typing import Any

from kvfail.conformance.claims import split_options
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


def _driver_for_class(
    name: str, cls: type, registry_name: str | None = None, options: dict[str, str] | None = None
) -> Driver:
    """The driver whose claim wins for ``cls`` (:mod:`kvfail.conformance.claims`), or the
    generic one; ``driver.chosen`` says why. With ``?inner=X``: ``cls`` is a guard the
    user runs around X, under X's driver (as ``guard:X`` runs kvfail's guard)."""
    from kvfail.conformance.guard_driver import INNER_OPTION, GuardDriver

    options = dict(options or {})
    inner = options.pop(INNER_OPTION, None)
    if inner is not None:
        if options:
            raise DriverUnavailable(
                f"?{INNER_OPTION}= takes no other option, got {sorted(options)}"
            )
        wrapped = GuardDriver(
            name, resolve(inner), guard_connector=cls.__name__, guard_module=cls.__module__
        )
        wrapped.chosen = f"the option ?{INNER_OPTION}={inner}: {cls.__qualname__} wraps D"
        return wrapped  # type: ignore[return-value]
    from kvfail.conformance.claims import choose, claimants, probe

    chosen = choose(probe(cls, registry_name, options or {}))
    if chosen.claim is None:
        from kvfail.conformance.generic_driver import GenericDriver

        driver: Driver = GenericDriver(name, cls, registry_name)
        accepted: dict[str, str] = {}
    else:
        driver_cls = claimants()[chosen.claimant or ""]
        accepted = dict(getattr(driver_cls, "OPTIONS", {}))
    unknown = sorted(set(options or {}) - set(accepted))
    if unknown:
        raise DriverUnavailable(
            f"options {unknown} are not taken by the driver chosen for {cls.__qualname__} "
            f"({chosen.why}); it takes {sorted(accepted) or 'none'}"
        )
    if chosen.claim is not None:
        driver = chosen.claim.build(name)
    driver.chosen = chosen.why
    return driver


def spec_problem(spec: str) -> str | None:
    """What is wrong with a ``--connector`` value by its form alone (None: nothing yet);
    cheap, imports nothing, so a typo stops the run before any vLLM import."""
    accepted = (
        f"accepted: one of {registered()} (a {ENTRY_POINT_GROUP!r} entry point), "
        "vllm:<RegistryName> or module:Class (each of these two with ?key=value options), "
        "each also after guard:"
    )
    if spec.startswith("guard:"):
        inner = spec.removeprefix("guard:")
        return spec_problem(inner) if inner else f"no connector after 'guard:'; {accepted}"
    try:
        spec, options = split_options(spec)
    except ValueError as exc:
        return f"{exc}; options follow vllm:<Name> or module:Class as ?key=value&key=value"
    if options and not spec.startswith("vllm:") and ":" not in spec:
        return f"options follow vllm:<Name> or module:Class, not {spec!r}; {accepted}"
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
    (``vllm:MooncakeConnector`` is one) unless options follow it; its driver is the one a
    claim would give the same class.
    Raises :class:`DriverUnavailable` when the name cannot be resolved to a class at all.
    """
    if spec.startswith("guard:"):
        from kvfail.conformance.guard_driver import GuardDriver

        return GuardDriver(spec, resolve(spec.removeprefix("guard:")))  # type: ignore[return-value]
    base, options = split_options(spec)
    entry_points = _entry_point_drivers()
    if base in entry_points and not options:
        factory = entry_points[spec].load()
        driver = factory(spec)
        if not isinstance(driver, Driver):
            raise TypeError(f"entry point {spec!r} returned {type(driver).__name__}, not Driver")
        driver.chosen = driver.chosen or f"registered as {spec!r} in {ENTRY_POINT_GROUP!r}"
        return driver
    if base.startswith("vllm:"):
        registry_name = base.removeprefix("vllm:")
        from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory

        try:
            cls = KVConnectorFactory.get_connector_class_by_name(registry_name)
        except Exception as exc:
            raise DriverUnavailable(
                f"vLLM connector {registry_name!r} cannot be loaded ({type(exc).__name__}: {exc})"
            ) from exc
        return _driver_for_class(spec, cls, registry_name, options)
    if ":" in base:
        try:
            cls = _import_class(base)
        except Exception as exc:
            raise DriverUnavailable(
                f"{base} cannot be imported ({type(exc).__name__}: {exc})"
            ) from exc
        return _driver_for_class(spec, cls, None, options)
    known = sorted(entry_points)
    raise DriverUnavailable(
        f"unknown connector {spec!r}: use one of {known}, vllm:<RegistryName> or module:Class"
    )
