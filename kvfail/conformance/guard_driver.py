"""``--connector guard:X``: X's own driver, with D's connector wrapped by the guard.

Why a wrapper and not a driver per transport: the guard (:mod:`connectors.guard`) is a
configuration of D, nothing else. So X's driver does everything as it does for X alone
(its P, its faults, its oracles' evidence), and only the spec of each D engine it builds
is rewritten, at the one place every engine is built from a spec
(:func:`kvfail.harness.engine.rewriting_specs`): D's connector becomes
``KvfailGuardConnector`` with ``inner`` naming X's class and ``inner_extra_config``
holding X's extra config. P engines (``role="producer"``) are left alone: P stays X's P.

A deadline the scenario asks for (the key kvfail's connectors read,
:data:`kvfail.deadline.DEADLINE_KEY`) becomes the guard's ``deadline_s``. A driver that
puts no deadline into X's config (X has none to set: a store driver) still gets one when
the scenario asks for it: :data:`SCENARIO_DEADLINE_S` (or the inner driver's own
``SCENARIO_DEADLINE_S``). Otherwise the guard keeps its default. The suite judges by what
the guard declares.
"""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING, Any

from kvfail.conformance.capabilities import Capabilities
from kvfail.conformance.driver import Driver, declared_capabilities
from kvfail.deadline import DEADLINE_KEY

if TYPE_CHECKING:
    from kvfail.harness.config import EngineSpec
    from kvfail.harness.engine import Engine

__all__ = [
    "GUARD_CONNECTOR",
    "GUARD_MODULE",
    "GUARD_PREFIX",
    "INNER_OPTION",
    "GuardDriver",
    "guard_spec",
]

GUARD_PREFIX = "guard:"
GUARD_CONNECTOR = "KvfailGuardConnector"
GUARD_MODULE = "connectors.guard"
#: The ``--connector`` option (``module:Class?inner=X``) that runs a guard class of the
#: user's (a negative control) around X under X's driver: the user names the inner, the
#: class under test does not.
INNER_OPTION = "inner"
#: The guard's deadline in a scenario that asks for one when X's driver sets none: the
#: pair drivers' value (``PairDriver.SCENARIO_DEADLINE_S``), short enough for the suite's
#: bounded wait.
SCENARIO_DEADLINE_S = 3.0


def guard_spec(
    spec: EngineSpec,
    *,
    connector: str = GUARD_CONNECTOR,
    module: str = GUARD_MODULE,
    deadline_s: float | None = None,
) -> EngineSpec:
    """``spec`` with a consumer's connector wrapped by the guard (others unchanged);
    ``deadline_s``: the guard's deadline when ``spec`` asks for none."""
    if spec.role != "consumer" or (spec.connector, spec.connector_module) == (connector, module):
        return spec
    inner_extra = dict(spec.extra_config)
    inner = (
        spec.connector
        if spec.connector_module is None
        else f"{spec.connector_module}:{spec.connector}"
    )
    extra: dict[str, Any] = {"inner": inner, "inner_extra_config": inner_extra}
    deadline = inner_extra.get(DEADLINE_KEY) or deadline_s
    if deadline:
        extra["deadline_s"] = deadline
    return dataclasses.replace(
        spec, connector=connector, connector_module=module, extra_config=extra
    )


class GuardDriver:
    """X's driver (``inner``) under the name ``guard:X``; see the module docstring.

    Everything but :meth:`build_engine` and :meth:`capabilities` is the inner driver's
    (``__getattr__``), so every handle, fault and peer stays where X's driver keeps it.
    ``guard_module``/``guard_connector`` name the wrapping class (a negative control
    swaps in a broken guard).
    """

    def __init__(
        self,
        name: str,
        inner: Driver,
        *,
        guard_connector: str = GUARD_CONNECTOR,
        guard_module: str = GUARD_MODULE,
    ) -> None:
        import importlib

        self.name = name
        self.inner = inner
        self._guard = (guard_connector, guard_module)
        self.connector_cls: type = getattr(importlib.import_module(guard_module), guard_connector)

    def __getattr__(self, attr: str) -> Any:
        inner = self.__dict__.get("inner")
        if inner is None or attr.startswith("__"):
            raise AttributeError(attr)
        return getattr(inner, attr)

    def capabilities(self) -> Capabilities:
        """The guard's class, introspected, with X's driver's faults, declarations and
        abilities."""
        return Capabilities.build(
            self.connector_cls,
            driver=self.name,
            faults=self.inner.faults,
            declared=declared_capabilities(self.inner),
        )

    def rewrite(self, spec: EngineSpec, deadline: bool = False) -> EngineSpec:
        connector, module = self._guard
        fallback = getattr(self.inner, "SCENARIO_DEADLINE_S", SCENARIO_DEADLINE_S)
        return guard_spec(
            spec, connector=connector, module=module, deadline_s=fallback if deadline else None
        )

    def build_engine(self, *args: Any, **kwargs: Any) -> Engine:
        from kvfail.harness.engine import rewriting_specs

        deadline = bool(kwargs.get("deadline", False))
        with rewriting_specs(lambda spec: self.rewrite(spec, deadline)):
            return self.inner.build_engine(*args, **kwargs)


Driver.register(GuardDriver)  # a Driver by its whole API, the inner's
