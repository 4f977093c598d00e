"""The session's registry of shared P processes, and the P zygote's early start.

Why a registry: each P costs a vLLM import, the dearest step of a run, and several drivers
of one session want the same P (``mooncake`` and the real negative controls pull from
kvfail's P; every NIXL driver pulls from upstream's). A P lives here under its
configuration's key; a pair that finds a live one borrows it. The driver that started a P
owns it and closes it when it stops, unless it hands it off (:func:`hand_off`): then the
registry keeps it for the next driver, and :func:`close_shared_producers` closes it at the
end. :class:`kvfail.conformance.pair_driver.PairDriver` is the one user.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterable, Mapping
from typing import Any

__all__ = [
    "P_DRIVER_MODULES",
    "close_shared_producers",
    "hand_off",
    "prestart_for",
    "register_producer",
    "shared_producer",
]

#: One P process per P configuration, shared by the drivers of a session that want the
#: same P (``mooncake`` and the real negative controls pull from kvfail's P; every NIXL
#: driver pulls from upstream's): each P costs a vLLM import, the dearest step of a run. A pair that
#: finds a live P here borrows it. The driver that started it owns it and closes it in
#: ``stop``, unless the driver hands it off (:func:`hand_off`): then this registry
#: keeps it for the next driver and :func:`close_shared_producers` closes it at the end.
_SHARED_P: dict[str, Any] = {}

#: Registry keys whose P a stopped driver handed off, by that driver's class.
_HANDED_OFF: dict[str, type] = {}


def shared_producer(key: str) -> Any | None:
    """The live P registered under ``key``, if any."""
    shared = _SHARED_P.get(key)
    if shared is None or not shared.process.alive:
        return None
    return shared


def register_producer(key: str, producer: Any) -> None:
    """Offer a P its starter owns to the drivers that want the same P (they borrow it).

    A P it replaces that a stopped driver handed off has no owner left to close it (a
    borrower that killed it, or finds it dead, starts its own): it is closed here."""
    old = _SHARED_P.get(key)
    if old is not None and old is not producer and _HANDED_OFF.pop(key, None) is not None:
        with contextlib.suppress(Exception):
            old.close()
    _SHARED_P[key] = producer


def close_shared_producers(handed_off_by: type | None = None) -> None:
    """Close the registered P's (only those handed off by drivers of ``handed_off_by``
    when given: a P an idle registry keeps still costs CPU); idempotent."""
    keys = [
        k for k in list(_SHARED_P) if handed_off_by is None or _HANDED_OFF.get(k) is handed_off_by
    ]
    for key in keys:
        with contextlib.suppress(Exception):
            _SHARED_P[key].close()
        _SHARED_P.pop(key, None)
        _HANDED_OFF.pop(key, None)


def hand_off(key: str, producer: Any, owner: type) -> None:
    """Keep ``producer``, whose starter (a driver of class ``owner``) stops, for the next
    driver that wants the same P; :func:`close_shared_producers` closes it at the end."""
    _SHARED_P[key] = producer
    _HANDED_OFF[key] = owner


#: Modules of the drivers whose P is a real process forked from the P zygote
#: (:func:`kvfail.peers.producer_handle.p_zygote`).
P_DRIVER_MODULES = frozenset(
    {
        "kvfail.conformance.mooncake_driver",
        "kvfail.conformance.nixl_driver",
        "kvfail.conformance.nixl_push_driver",
    }
)


def prestart_for(specs: Iterable[str], modules: Mapping[str, str]) -> bool:
    """Start the P zygote's import now when a ``--connector`` value is a registered
    driver of :data:`P_DRIVER_MODULES` (``modules``: each registered name's driver module,
    read from its entry point, nothing imported); whether it was started. A
    ``module:Class`` or ``vllm:`` value is known only once resolved (a vLLM import): its
    P starts when first wanted, as before."""
    from kvfail.peers.producer_handle import prestart_p_zygote

    if not any(modules.get(spec) in P_DRIVER_MODULES for spec in specs):
        return False
    return prestart_p_zygote()
