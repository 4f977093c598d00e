"""A P process and how it starts: the zygote every P is forked from, and the handle that
drives one P over its JSON-line protocol (the P side is :mod:`kvfail.peers.protocol`).

Why apart from :mod:`kvfail.peers.base`: starting and talking to one P process is its
own job, shared by every transport's handle (Mooncake, NIXL); a pair
(:class:`~kvfail.peers.base.PeerPair`) builds D engines around a P it is given.
"""

from __future__ import annotations

import contextlib
import itertools
import json
import logging
import os
import sys
import threading
import time
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

from kvfail.peers.base import link_env, producer_engine_id
from kvfail.rig.loopback import LOOPBACK
from kvfail.rig.ports import free_port, lost_its_port
from kvfail.rig.processes import PeerExitedError, PeerProcess
from kvfail.rig.zygote import Zygote, ZygoteError, shared_zygote

if TYPE_CHECKING:
    from kvfail.faults.netns import NamespaceHost

__all__ = ["P_PRELOAD", "ProducerHandleBase", "p_zygote", "prestart_p_zygote", "repo_pythonpath"]

_log = logging.getLogger("kvfail.peers")


# --------------------------------------------------------------------------- P zygote

#: What the P zygote imports once: the harness (vLLM, torch, the Scheduler) with the
#: default engine's model configuration built (``kvfail.harness.preload``), and the
#: producers' own modules. Transport libraries are left to each P.
P_PRELOAD = (
    "kvfail.harness.preload",
    "kvfail.peers.producer",
    "kvfail.peers.nixl_producer",
)
#: The only variables any P reads while importing (the rest are read at run time and
#: come with each P's own environment): Hugging Face's offline switches, and the path
#: that makes this repository's ``connectors`` importable.
_P_IMPORT_ENV = ("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE")


def repo_pythonpath() -> str:
    """The repository root first (``connectors.*`` must import in P), then the rest."""
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    rest = os.environ.get("PYTHONPATH", "")
    return root + (os.pathsep + rest if rest else "")


def p_zygote() -> Zygote | None:
    """The process-wide zygote every P is forked from (None: ``KVFAIL_P_ZYGOTE=0``, or
    it could not start, and P is a fresh interpreter as before).

    Why: a fresh P imports vLLM (tens of seconds) and the suite replaces P after each
    scenario that kills it; a fork of the zygote is ready in the time its engine takes.
    """
    if os.environ.get("KVFAIL_P_ZYGOTE", "1") == "0":
        return None
    env = {k: "1" for k in _P_IMPORT_ENV}
    env["PYTHONPATH"] = repo_pythonpath()
    try:
        return shared_zygote(P_PRELOAD, env)
    except ZygoteError as exc:
        _log.warning("no P zygote (%s); P starts as a fresh interpreter", exc)
        return None


def prestart_p_zygote() -> bool:
    """Start the P zygote's import in a background thread, and return at once (False:
    ``KVFAIL_P_ZYGOTE=0``, no zygote wanted).

    Why: the zygote's vLLM import and this process's own (a suite's collection) each take
    tens of CPU seconds; begun here, they run side by side instead of one after the other.
    The first :func:`p_zygote` call waits for this start (the registry's lock) rather than
    starting a second zygote; a start that fails there is retried by that call.
    """
    if os.environ.get("KVFAIL_P_ZYGOTE", "1") == "0":
        return False
    threading.Thread(target=p_zygote, name="p-zygote-prestart", daemon=True).start()
    return True


# --------------------------------------------------------------------------- P handle


class ProducerHandleBase:
    """The P process and its line protocol (see :mod:`kvfail.peers.protocol`).

    A subclass says which module runs P, the protocol line ``prefix``, what P's ready
    event starts with (``ready_key``), and the class attributes below.
    """

    prefix: str = ""
    ready_key: str = "engine_id"
    #: What a subclass names: the module P runs (``python -m``), the transport (in P's
    #: names), the variable that hands P its port, and the connector P runs by default.
    module: str = ""
    transport: str = ""
    port_env: str = ""
    default_connector: str = ""
    #: Respawns on a fresh port when P dies because its port was taken between our pick
    #: and its bind (a race no pick can close; see :func:`kvfail.rig.ports.free_ports`).
    bind_retries: int = 2

    port: int

    def __init__(
        self,
        *,
        connector: str | None = None,
        connector_module: str | None = None,
        engine_id: str | None = None,
        extra_config: Mapping[str, Any] | None = None,
        env: Mapping[str, str] | None = None,
        num_blocks: int = 64,
        tp_size: int = 1,
        num_kv_cache_groups: int = 1,
        host: NamespaceHost | None = None,
    ) -> None:
        """Start P (it comes up in the background; :meth:`wait_ready` waits for it).

        ``host`` runs P (and its ranks, which it forks) on a simulated host of its own,
        reached at :attr:`address` over a link a test can cut; by default P shares this
        machine's loopback with D.

        P gets the config every producer module reads, and listens on a port picked here
        (``self.port``, passed in :attr:`port_env`). ``tp_size`` > 1 runs P's ranks as
        processes in a real TP world (their pids are in P's ready event, ``rank_pids``,
        for one-rank faults)."""
        self.engine_id = engine_id or producer_engine_id(self.transport)
        self.host = host
        #: Where D reaches P: loopback, or the simulated host's own address.
        self.address = host.inner_addr if host is not None else LOOPBACK
        self._env = {**self._base_env(), **(env or {})}
        if host is not None:
            self._env.update(link_env(host, inside=True))
        self._config = json.dumps(
            {
                "connector": connector or self.default_connector,
                "connector_module": connector_module,
                "engine_id": self.engine_id,
                "extra_config": dict(extra_config or {}),
                "num_blocks": num_blocks,
                "tp_size": tp_size,
                "num_kv_cache_groups": num_kv_cache_groups,
            }
        )
        self._tp_size = tp_size
        self._ids = itertools.count(1)
        self._lock = threading.Lock()
        self._start_process()

    def _base_env(self) -> dict[str, str]:
        """The environment every P of this transport needs (``env=`` adds to it)."""
        return {}

    def _start_process(self) -> None:
        """(Re)start P's process on a freshly picked port, forked from the shared zygote
        (see :func:`p_zygote`) unless ``KVFAIL_P_ZYGOTE=0``."""
        self.port = free_port()
        self.started_at = time.monotonic()
        # A P on a simulated host is a fresh interpreter under `ip netns exec`, never a
        # fork of the zygote: besides the network, that gives it the host's own /sys,
        # where UCX looks up the devices it may use.
        zygote = p_zygote() if self.host is None else None
        argv = [sys.executable, "-m", self.module, "--config", self._config]
        if self.host is not None:
            argv = self.host.exec_argv(argv)
        before: list[str] = []
        if zygote is not None and self._tp_size > 1:
            # P's ranks then come from a forkserver forked off P, not a new interpreter.
            before.append("kvfail.harness.ranks:fork_forkserver")
        self.process = PeerProcess(
            argv,
            name=f"{self.transport}-P-{self.port}",
            env={**self._env, self.port_env: str(self.port)},
            stdin=True,
            zygote=zygote,
            before=tuple(before),
        )
        self.ready: dict[str, Any] | None = None

    def _parse(self, line: str) -> dict[str, Any]:
        parsed: dict[str, Any] = json.loads(line[line.index(self.prefix) + len(self.prefix) :])
        return parsed

    def wait_ready(self, timeout_s: float = 240.0) -> dict[str, Any]:
        """Block until P printed its ready event (it imports vLLM, which is slow on a busy machine).

        A P that died of ``EADDRINUSE`` is started again on a fresh port (at most
        :attr:`bind_retries` times); anything else it died of is raised."""
        retries = self.bind_retries
        while self.ready is None:
            try:
                line = self.process.wait_ready(
                    timeout_s, line=self.prefix + '{"' + self.ready_key + '"'
                )
            except PeerExitedError as exc:
                if retries <= 0 or not lost_its_port(str(exc)):
                    raise
                retries -= 1
                _log.warning("P %s lost its port to another bind; restarting it", self.engine_id)
                self.process.close()
                self._start_process()
                continue
            assert line is not None
            self.ready = self._parse(line)
            self.ready["ready_s"] = round(time.monotonic() - self.started_at, 3)
        return self.ready

    def request(self, cmd: Mapping[str, Any], timeout_s: float = 30.0) -> dict[str, Any]:
        """Send one command and wait (bounded) for its reply; raises if P does not answer."""
        with self._lock:
            rid = next(self._ids)
            self.process.write_stdin(json.dumps({**cmd, "id": rid}) + "\n")
            # Replies are json.dumps(sort_keys=True): '"id": N,' is unique per reply.
            line = self.process.wait_ready(timeout_s, line=f'"id": {rid},')
        assert line is not None
        reply = self._parse(line)
        if not reply.get("ok"):
            raise RuntimeError(f"P refused {cmd.get('cmd')}: {reply.get('error')}")
        return reply

    def prefill(
        self, req_id: str, prompt_len: int, prompt_seed: str, **fields: Any
    ) -> dict[str, Any]:
        """Run P's half of a request; returns upstream's ``kv_transfer_params`` for D.
        ``fields``: what this transport's P also reads from the command."""
        reply = self.request(
            {
                "cmd": "prefill",
                "req_id": req_id,
                "prompt_len": prompt_len,
                "prompt_seed": prompt_seed,
                **fields,
            }
        )
        return dict(reply["kv_transfer_params"])

    def prefill_batch(
        self,
        prompts: Mapping[str, str],
        prompt_len: int,
        timeout_s: float = 30.0,
        p_bound_s: float | None = None,
    ) -> dict[str, dict[str, Any]]:
        """Run P's half of every request (request id -> prompt seed) in one command;
        returns each one's ``kv_transfer_params`` for D, by request id.

        Why: P prefills them in the same engine steps, so a batch costs one round trip
        instead of one per request. P bounds the command (``p_bound_s``, else its own
        ``PREFILL_TIMEOUT_S``); the reply is awaited that long and ``timeout_s`` more."""
        requests = [
            {"req_id": req_id, "prompt_seed": seed, "prompt_len": prompt_len}
            for req_id, seed in prompts.items()
        ]
        cmd: dict[str, Any] = {"cmd": "prefill_batch", "requests": requests}
        if p_bound_s is not None:
            cmd["timeout_s"] = p_bound_s
            timeout_s += p_bound_s
        reply = self.request(cmd, timeout_s)
        params: dict[str, dict[str, Any]] = reply["kv_transfer_params"]
        return {req_id: dict(params[req_id]) for req_id in prompts}

    def stats(self, timeout_s: float = 10.0) -> dict[str, Any]:
        return self.request({"cmd": "stats"}, timeout_s)

    def close(self, timeout_s: float = 10.0) -> None:
        """Ask P to quit cleanly; kill its group if it cannot (dead, frozen, stuck)."""
        proc = self.process
        if proc.alive and not proc.frozen:
            with contextlib.suppress(Exception):
                proc.write_stdin('{"cmd": "quit"}\n')
                proc.wait(timeout_s)
        proc.close()
