"""Log lines computed under a lock and emitted after it is released.

Apart from :mod:`kvfail.tracker` because formatting and emitting a log line is not the
tracker's job, and must not happen inside its critical sections: a handler may block.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field

logger = logging.getLogger("kvfail")


@dataclass(slots=True)
class PendingLog:
    """Log lines computed under the lock and emitted after it is released."""

    lines: list[tuple[int, str, dict[str, object]]] = field(default_factory=list)

    def add(self, level: int, msg: str, **fields: object) -> None:
        self.lines.append((level, msg, fields))

    def flush(self) -> None:
        for level, msg, fields in self.lines:
            if logger.isEnabledFor(level):
                kv = " ".join(
                    f"{k}={v!r}" if isinstance(v, str) else f"{k}={v}" for k, v in fields.items()
                )
                logger.log(level, "%s %s", msg, kv, extra={"kvfail": fields})
