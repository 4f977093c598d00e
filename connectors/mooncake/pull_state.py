"""What one Mooncake pull task on D has seen of its P worker, carried in the task's own
context.

Why a context: upstream funnels every failure of a pull through one handler with no
word of where it came from; asyncio gives each task its own context, so the task's
state (what P answered, whether P's push can still land) is found there without
changing upstream's signatures. ``ReplyDecoder`` fills it from P's replies.
"""

from __future__ import annotations

import contextvars
from collections.abc import Collection
from dataclasses import dataclass, field
from typing import Any, Final

from vllm.distributed.kv_transfer.kv_connector.v1.mooncake.mooncake_connector import (
    MooncakeXferResponse,
    MooncakeXferResponseStatus,
)

from connectors.mooncake.probe import PullWriter
from kvfail import Stage

__all__ = ["PULL", "STAGE_HINT", "PeerPull", "ReplyDecoder", "never_left_d"]


@dataclass
class PeerPull:
    """What one P-worker task has seen; lives in that task's context."""

    peer: tuple[int, str]
    #: Requests this task settled: P's answer, or a failure D reported for it.
    reported: set[str] = field(default_factory=set)
    #: Requests P named in a reply. P replies only after its push for them ended, so
    #: nothing more is written into their blocks by this P worker.
    answered: set[str] = field(default_factory=set)
    #: P ended the exchange (its FINISH or ERROR reply), or its process is gone: no
    #: request of this pull can be written into any more.
    over: bool = False
    last_status: int | None = None
    bad_reply: bool = False
    #: Which writer mark may still push into this pull's blocks (set when it leaves D,
    #: if P workers are watched); only that writer's end ends the holds it leaves.
    writer: PullWriter = field(default_factory=PullWriter)

    def may_still_write(self, req_ids: Collection[str]) -> set[str]:
        """The requests of this pull whose blocks P may still push into."""
        return set() if self.over else set(req_ids) - self.answered


#: The P-worker task we are running in, if any.
PULL: contextvars.ContextVar[PeerPull | None] = contextvars.ContextVar(
    "kvfail_mooncake_pull", default=None
)
#: Stage for failures reported outside a P-worker task (the bootstrap task).
STAGE_HINT: contextvars.ContextVar[Stage | None] = contextvars.ContextVar(
    "kvfail_mooncake_stage", default=None
)


#: Upstream's helper that builds (and connects) D's DEALER socket, before the pull is sent.
_SOCKET_SETUP: Final = "make_zmq_socket"

#: Reply statuses after which P writes nothing more for the exchange (P sends ERROR
#: before any push, and FINISH after its last one).
_TERMINAL: Final = frozenset({MooncakeXferResponseStatus.FINISH, MooncakeXferResponseStatus.ERROR})


class ReplyDecoder:
    """Wraps upstream's reply decoder to note, per task, what P answered.

    Lets ``_handle_failed_recv`` tell P's ERROR reply or an undecodable reply (the peer's
    fault, ``Stage.PEER``) from a socket error or timeout (``Stage.TRANSFER``).
    """

    def __init__(self, inner: Any) -> None:
        self._inner = inner

    def decode(self, buf: bytes) -> MooncakeXferResponse:
        state = PULL.get()
        try:
            response = self._inner.decode(buf)
        except Exception:
            if state is not None:
                state.bad_reply = True
            raise
        if state is not None:
            state.last_status = response.status
            if response.status in _TERMINAL:
                state.over = True
        return response


def never_left_d(state: PeerPull, exc: BaseException | None) -> bool:
    """Whether the pull failed before it could reach P (called inside upstream's
    ``except``): the error was raised while upstream built the DEALER socket, before
    its send. Anything else (a receive timeout, an undecodable reply, a send error)
    leaves P's push possible; so does a renamed helper upstream (the safe side)."""
    if exc is None or state.last_status is not None or state.bad_reply:
        return False
    tb = exc.__traceback__
    while tb is not None:
        if tb.tb_frame.f_code.co_name == _SOCKET_SETUP:
            return True
        tb = tb.tb_next
    return False
