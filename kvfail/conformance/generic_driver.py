"""The driver for a connector kvfail has no driver for: it can be built, not fed.

Resolution (``kvfail.conformance.resolve``) falls back to :class:`GenericDriver` for a
``vllm:<RegistryName>`` or ``module:Class`` no registered driver claims.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import TYPE_CHECKING

from kvfail.conformance.driver import (
    ENTRY_POINT_GROUP,
    Declared,
    Driver,
    DriverUnavailable,
    EngineHandle,
    Injector,
)
from kvfail.faults.points import FaultPoint

if TYPE_CHECKING:
    from kvfail.harness.config import EngineSpec, Policy
    from kvfail.harness.engine import Engine

__all__ = ["GenericDriver"]


class GenericDriver(Driver[EngineHandle]):
    """A connector with no kvfail driver: it can be built, but there is no peer to load
    from, so only the scenarios needing no remote prefill run; the rest are skipped
    naming ``remote_prefill``."""

    def __init__(self, name: str, connector_cls: type, registry_name: str | None = None) -> None:
        self.name = name
        self.connector_cls = connector_cls
        self._registry_name = registry_name

    @property
    def injectors(self) -> dict[FaultPoint, Injector]:
        return {}  # no peer, so no fault to provoke

    @property
    def why_not(self) -> str:
        return f"no kvfail driver for {self.name!r} (register one in {ENTRY_POINT_GROUP!r})"

    def declared(self) -> Declared:
        return Declared.nothing(self.why_not)

    def engine_spec(
        self, policy: Policy, *, num_kv_cache_groups: int = 1, tp_size: int = 1, deadline: bool
    ) -> EngineSpec:
        from kvfail.harness.config import EngineSpec

        # A registry name is vLLM's to resolve; otherwise the class is loaded by module path.
        if self._registry_name is not None:
            connector, module = self._registry_name, None
        else:
            connector, module = self.connector_cls.__name__, self.connector_cls.__module__
        return EngineSpec(
            connector=connector,
            connector_module=module,
            policy=policy,
            num_kv_cache_groups=num_kv_cache_groups,
            tp_size=tp_size,
        )

    #: Some connectors block forever while being built when a service they expect is
    #: absent (LMCache waits on its server); the suite must never hang on one.
    BUILD_TIMEOUT_S = 60.0

    def build_engine(
        self,
        policy: Policy,
        *,
        num_kv_cache_groups: int = 1,
        tp_size: int = 1,
        deadline: bool = False,
    ) -> Engine:
        """Build in a helper thread, bounded: a connector that cannot be built here raises,
        and the scenario fails (an error of the run, never a skip)."""
        import threading

        built: list[Engine] = []
        error: list[BaseException] = []

        def build() -> None:
            try:
                built.append(
                    super(GenericDriver, self).build_engine(
                        policy,
                        num_kv_cache_groups=num_kv_cache_groups,
                        tp_size=tp_size,
                        deadline=deadline,
                    )
                )
            except BaseException as exc:  # reported below, on the test's thread
                error.append(exc)

        worker = threading.Thread(target=build, name=f"kvfail-build-{self.name}", daemon=True)
        worker.start()
        worker.join(self.BUILD_TIMEOUT_S)
        if worker.is_alive():
            raise DriverUnavailable(
                f"{self.connector_cls.__name__} did not finish "
                f"construction within {self.BUILD_TIMEOUT_S:.0f} s in the generic harness "
                "(it blocks on a service that is absent here)"
            )
        if error:
            exc = error[0]
            raise DriverUnavailable(
                f"{self.connector_cls.__name__} cannot be constructed in "
                f"the generic harness ({type(exc).__name__}: {exc})"
            ) from exc
        return built[0]

    def add_remote_request(
        self, engine: Engine, request_id: str, *, prompt_len: int = 100, max_tokens: int = 3
    ) -> str:
        raise NotImplementedError(self.why_not)

    def settle(
        self, engine: Engine, request_id: str, *, ranks: Iterable[int] | None = None
    ) -> None:
        raise NotImplementedError(self.why_not)
