"""P's side of the JSON-line protocol, shared by every producer process (Mooncake, NIXL).

Why: both producers are the same loop: take the real stdout fd for the protocol before
vLLM is imported (:class:`Channel`), read commands from stdin in a thread
(:func:`read_commands`), print a ready event, then answer commands between engine steps
until ``quit`` or EOF (:func:`serve`). Only the standard library is imported here, so
a producer can set this up before it imports vLLM.
"""

from __future__ import annotations

import argparse
import json
import os
import queue
import sys
import threading
import time
from collections.abc import Callable, Mapping
from typing import IO, Any, NoReturn

from kvfail.rig.stacks import install_stack_dump

__all__ = ["Channel", "dispatch", "read_commands", "serve"]

#: A command handler: the command in, the reply out.
Handler = Callable[[dict[str, Any]], dict[str, Any]]
#: How long P's engine gets to close on ``quit`` before P exits anyway. Why a bound:
#: upstream Mooncake's shutdown terminates its ZMQ context while the sender loop still
#: holds a socket, and that ``term`` then never returns; the caller would wait out its
#: own timeout and kill P. What a close left running goes with P's process group, which
#: the caller kills after P exits (``PeerProcess.close``).
ENGINE_CLOSE_WAIT_S = 2.0


class Channel:
    """The protocol's output side: the real stdout fd, taken before vLLM is imported."""

    def __init__(self, prefix: str) -> None:
        self.prefix = prefix
        sys.stdout.flush()
        proto_fd = os.dup(1)
        os.dup2(2, 1)  # anything else written to fd 1 now lands on stderr
        self._out: IO[str] = os.fdopen(proto_fd, "w", buffering=1, encoding="utf-8")
        self._lock = threading.Lock()

    def send(self, obj: dict[str, Any]) -> None:
        line = self.prefix + json.dumps(obj, sort_keys=True, default=str)
        with self._lock:
            self._out.write(line + "\n")
            self._out.flush()


def read_commands(commands: queue.Queue[dict[str, Any] | None]) -> None:
    """Stdin reader thread; EOF (the parent went away) is a quit."""
    for raw in sys.stdin:
        raw = raw.strip()
        if not raw:
            continue
        try:
            commands.put(json.loads(raw))
        except json.JSONDecodeError as exc:
            commands.put({"cmd": "_bad", "error": str(exc), "raw": raw[:200]})
    commands.put(None)


def dispatch(cmd: dict[str, Any], handlers: Mapping[str, Handler]) -> dict[str, Any] | None:
    """The reply to ``cmd`` (None: quit); ``ping`` and ``quit`` are built in. A bad
    command must not kill P: it gets an error reply instead."""
    name = cmd.get("cmd")
    try:
        handler = handlers.get(str(name))
        if handler is not None:
            return handler(cmd)
        if name == "ping":
            return {"ok": True}
        if name == "quit":
            return None
        return {"ok": False, "error": f"unknown command {name!r}: {cmd}"}
    except Exception as exc:
        return {"ok": False, "error": f"{type(exc).__name__}: {exc}"}


def serve(
    argv: list[str] | None,
    *,
    doc: str | None,
    prefix: str,
    build: Callable[[dict[str, Any], Channel], Any],
    ready: Callable[[Any], dict[str, Any]],
    idle: Callable[[Any], None],
) -> NoReturn:
    """Run a producer process; never returns (``os._exit``: native transports may crash
    at a normal exit).

    ``build(config, channel)`` makes the producer (its ``engine`` is closed at the end,
    its ``handle(cmd)`` answers commands); ``ready(producer)`` is the ready event's
    fields after ``event``, ``pid`` and ``startup_s``; ``idle(producer)`` runs whenever
    no command is waiting.
    """
    parser = argparse.ArgumentParser(description=doc.splitlines()[0] if doc else None)
    parser.add_argument("--config", default="{}", help="JSON object (see module docstring)")
    args = parser.parse_args(argv)
    channel = Channel(prefix)
    install_stack_dump()  # a P that stops answering can still be asked where it is
    rc = 0
    try:
        config = json.loads(args.config)
        started = time.monotonic()
        producer = build(config, channel)
        channel.send(
            {
                "event": "ready",
                **ready(producer),
                "pid": os.getpid(),
                "startup_s": round(time.monotonic() - started, 3),
            }
        )
        commands: queue.Queue[dict[str, Any] | None] = queue.Queue()
        threading.Thread(target=read_commands, args=(commands,), daemon=True).start()
        while True:
            try:
                cmd = commands.get_nowait()
            except queue.Empty:
                idle(producer)
                continue
            reply = None if cmd is None else producer.handle(cmd)
            if reply is None:
                break
            if "id" in cmd:
                reply["id"] = cmd["id"]
            channel.send(reply)
        channel.send({"event": "bye", "closed": _close_bounded(producer.engine)})
    except BaseException as exc:
        rc = 1
        import traceback

        traceback.print_exc(file=sys.stderr)
        channel.send({"event": "error", "error": f"{type(exc).__name__}: {exc}"})
    sys.stderr.flush()
    os._exit(rc)


def _close_bounded(engine: Any) -> bool:
    """Close ``engine`` in a daemon thread, waiting at most :data:`ENGINE_CLOSE_WAIT_S`;
    whether it finished. What the close raised is raised here, as if it ran inline."""
    raised: list[BaseException] = []

    def close() -> None:
        try:
            engine.close()
        except BaseException as exc:
            raised.append(exc)

    closer = threading.Thread(target=close, name="p-engine-close", daemon=True)
    closer.start()
    closer.join(ENGINE_CLOSE_WAIT_S)
    if raised:
        raise raised[0]
    if closer.is_alive():
        print(
            f"P's engine did not close in {ENGINE_CLOSE_WAIT_S:g} s; exiting without it",
            file=sys.stderr,
        )
        return False
    return True
