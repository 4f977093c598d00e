"""``with`` support shared by the rig's processes and the fault tools, whose ``close`` is
idempotent and never raises, so leaving the block (normally or by an exception) always cleans up."""

from __future__ import annotations

from types import TracebackType
from typing import Any, Self


class ClosesOnExit:
    def close(self) -> Any:
        raise NotImplementedError

    def __enter__(self) -> Self:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()
