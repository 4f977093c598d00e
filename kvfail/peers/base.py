"""What every real P/D pair shares, whatever the transport (Mooncake, NIXL).

Why: the project rule is that whatever the Mooncake and NIXL adoptions both need lives
once, in kvfail. A pair is always P in its own OS process, driven over a JSON-line
protocol (:class:`~kvfail.peers.producer_handle.ProducerHandleBase`, the P side is
:mod:`kvfail.peers.protocol`), and D
engines built here as harness :class:`~kvfail.harness.Engine` objects
(:class:`PeerPair`): the same request bookkeeping, detection-time stamping, bytes check
and teardown. Each transport's module keeps only what is really its own (environment,
how D is built, how a run is stepped, which faults are honest with it).
"""

from __future__ import annotations

import contextlib
import itertools
import logging
import os
import socket
import time
import weakref
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from typing import TYPE_CHECKING, Any

from kvfail.peers.decode_record import DecodeRecord
from kvfail.peers.stepping import PairStepping
from kvfail.peers.stuck_evidence import StuckEvidence
from kvfail.rig.environ import environ_set
from kvfail.rig.procfs import signal_landed

if TYPE_CHECKING:
    from kvfail.faults.netns import NamespaceHost
    from kvfail.harness import Engine, EngineSpec
    from kvfail.harness.hooks import SplitForward
    from kvfail.peers.integrity import IntegrityLedger

_log = logging.getLogger("kvfail.peers")


def link_env(host: NamespaceHost, *, inside: bool) -> dict[str, str]:
    """What makes a vLLM engine serve and advertise on one end of ``host``'s link, for
    every transport: the host IP (Mooncake's transfer engine), NIXL's side channel, and
    UCX's TCP device (UCX must be given the link's device, not ``lo``). ``inside``: P's
    end, in the host; otherwise D's, in the test's namespace."""
    if inside:
        addr, device = host.inner_addr, host.inner_if
    else:
        addr, device = host.outer_addr, host.outer_if
    return {"VLLM_HOST_IP": addr, "VLLM_NIXL_SIDE_CHANNEL_HOST": addr, "UCX_NET_DEVICES": device}


__all__ = [
    "P_POOL_FACTOR",
    "PeerPair",
    "closed_port",
    "producer_engine_id",
    "unknown_engine",
    "with_param",
]


def closed_port() -> int:
    """A loopback port nobody listens on (bound then released)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


#: P's block pool, as a multiple of D's. P keeps a prefilled request's blocks until D
#: pulls them or P's abort timeout drops them, and a failed or aborted load is never
#: pulled: a P no larger than D runs out after a few such loads and then prefills only
#: as that timeout frees blocks, a wait of the rig's own that no verdict rests on. D's
#: pool, the one the suite judges, keeps its size.
P_POOL_FACTOR = 4

_P_SEQ = itertools.count(1)


def producer_engine_id(transport: str) -> str:
    """A P engine id unique across this machine's test processes (pid + a counter)."""
    return f"P-{transport}-{os.getpid()}-{next(_P_SEQ)}"


def with_param(params: Mapping[str, Any], key: str, value: Any) -> dict[str, Any]:
    """A copy of ``params`` with ``key`` set to ``value`` (the misaddressing faults)."""
    out = dict(params)
    out[key] = value
    return out


def unknown_engine(params: Mapping[str, Any], engine_id: str = "no-such-engine") -> dict[str, Any]:
    """``params`` naming an engine id P does not answer for (Mooncake's bootstrap server
    does not know it; NIXL's side channel answers for its own): both transports name
    P's engine in the same key."""
    return with_param(params, "remote_engine_id", engine_id)


# --------------------------------------------------------------------------- the pair


class PeerPair(PairStepping, StuckEvidence):
    """P (subprocess) + D engines (this process): what Mooncake and NIXL pairs share.

    A subclass sets ``records``/``decoders``/``d``/``p``/``owns_p``/``ready_timeout_s``,
    builds D with :meth:`_consumer_spec` + :meth:`_register`, and overrides
    :meth:`_stamp` when its detection clock starts somewhere else than at ``add``.
    """

    #: The function each D rank runs for :meth:`stuck_state` (``(view, req_id) -> str``,
    #: module-level so a rank process can run it); None: no rank state to show.
    load_state: Callable[[Any, str], str] | None = None

    #: Names D engine ids: ``D-<transport>-<name>-<pid>-<n>``.
    transport: str = ""
    #: How long :meth:`kill_p` waits for P's group to be reaped: a bound, never a verdict,
    #: so generous; a P process with TP ranks, on a loaded machine, took over 5 s to exit.
    kill_timeout_s: float = 30.0

    records: dict[str, DecodeRecord]
    integrity: IntegrityLedger
    decoders: dict[str, Engine]
    d: Engine | None
    p: Any
    owns_p: bool
    #: A second P process with :attr:`p`'s settings (own port, own engine id), for D
    #: engines that load from two peers at once; None until :meth:`second_p` starts it.
    #: Always this pair's own: never shared, closed by :meth:`close_second_p`.
    p2: Any
    ready_timeout_s: float

    def _init_pair(
        self,
        *,
        connector: str,
        connector_module: str | None,
        extra_config: Mapping[str, Any],
        p_kwargs: dict[str, Any],
        p_tp_size: int | None,
        env: Mapping[str, str],
        num_blocks: int,
        ready_timeout_s: float,
        tp_size: int,
        num_kv_cache_groups: int,
        host: NamespaceHost | None,
    ) -> None:
        """What every pair's constructor sets before P starts (:meth:`_start`): D's
        connector and configuration, P's settings (for :meth:`_new_producer`: the
        transport's ``p_kwargs``, and the layout P shares with D: its pool
        :data:`P_POOL_FACTOR` times D's, ``p_tp_size`` or D's TP size, D's KV-cache groups,
        the host), and the transport's environment defaults (``env``)."""
        self.connector = connector
        self.connector_module = connector_module
        self.extra_config = dict(extra_config)
        self.num_blocks = num_blocks
        self.ready_timeout_s = ready_timeout_s
        self.tp_size = tp_size
        self.num_kv_cache_groups = num_kv_cache_groups
        self._p_kwargs = {
            **p_kwargs,
            "num_blocks": num_blocks * P_POOL_FACTOR,
            "tp_size": p_tp_size or tp_size,
            "num_kv_cache_groups": num_kv_cache_groups,
            "host": host,
        }
        #: The simulated host P runs on (None: P shares loopback with D).
        self.host = host
        for key, value in env.items():
            os.environ.setdefault(key, value)
        self._init_common()
        self.d = None

    def _start(self, producer: Any, policy: str, *, build_default_consumer: bool = True) -> None:
        """Start P, or borrow ``producer`` (a running P with the same settings, which this
        pair then does not close), and build the default D meanwhile; closed again if
        anything fails."""
        self.owns_p = producer is None
        try:
            # P imports vLLM in its own process while D builds here: overlap the two.
            self.p = producer if producer is not None else self._new_producer()
            if build_default_consumer:
                self.d = self.consumer(policy)
            self.p.wait_ready(self.ready_timeout_s)
        except BaseException:
            self.close()
            raise

    def _d_spec(
        self,
        key: str,
        policy: str,
        extra_config: Mapping[str, Any] | None,
        *,
        connector: str | None = None,
        connector_module: str | None = None,
    ) -> EngineSpec:
        """The spec of D ``key``: the pair's connector (or ``connector``) and layout, the
        pair's configuration plus ``extra_config``."""
        return self._consumer_spec(
            key,
            policy,
            connector=connector or self.connector,
            connector_module=connector_module if connector is not None else self.connector_module,
            extra_config={**self.extra_config, **dict(extra_config or {})},
            tp_size=self.tp_size,
            tp_mode="processes" if self.tp_size > 1 else "simulated",
            num_kv_cache_groups=self.num_kv_cache_groups,
        )

    def restart_p(self, *, wait: bool = True) -> dict[str, Any] | None:
        """Replace P with a fresh process of its own (new port, new engine id).

        ``wait=False`` only spawns it (its vLLM import overlaps whatever runs next); the
        next call that needs P waits for it to be ready (:meth:`producer`).
        """
        if self.p is not None and self.owns_p:
            self.p.close()
        self.p = self._new_producer()
        self.owns_p = True
        ready: dict[str, Any] | None = self.p.wait_ready(self.ready_timeout_s) if wait else None
        return ready

    def producer(self) -> Any:
        """P, once ready (``restart_p(wait=False)`` may have left it starting)."""
        return self._ready_producer()

    def _init_common(self) -> None:
        from kvfail.peers.integrity import IntegrityLedger

        self.integrity = IntegrityLedger()
        self.records = {}
        self.decoders = {}
        #: D engine -> how many of its scheduler reports :meth:`observe` has read.
        self._seen: weakref.WeakKeyDictionary[Engine, int] = weakref.WeakKeyDictionary()
        self._seq = itertools.count()
        self.p = None
        self.owns_p = True
        self.p2 = None

    # ------------------------------------------------------------------ engines

    # ------------------------------------------------------------------ the pair protocol
    #
    # What a conformance driver (``kvfail.conformance.pair_driver.PairDriver``) asks of any
    # pair, whatever its transport: build a D, have P prefill, add D's request (``add``,
    # above ``prefill_and_add``), observe D's steps (``observe``), read the one
    # :class:`DecodeRecord` per request (``records``), and kill, stop or replace P.

    #: The session registry key of this pair's P, when drivers may share it.
    kvfail_share_key: str | None = None
    #: The simulated host P runs on (None: P shares this machine's loopback with D).
    host: NamespaceHost | None = None

    @contextlib.contextmanager
    def _d_address(self) -> Iterator[None]:
        """While a D is built: the environment that makes it reachable from P's host (its
        transfer engine reads it once, at construction). Nothing changes without a host."""
        env = link_env(self.host, inside=False) if self.host is not None else {}
        with environ_set(env):
            yield

    def consumer(
        self,
        policy: str = "fail",
        *,
        name: str | None = None,
        extra_config: Mapping[str, Any] | None = None,
    ) -> Engine:
        """The D engine called ``name`` (default: the policy's name), built on first use;
        a fresh name is a D that never talked to P ("cold")."""
        raise NotImplementedError

    def prefill(
        self, req_id: str, prompt_len: int = 100, prompt_seed: str | None = None
    ) -> dict[str, Any]:
        """P's half only; returns the params D gets (break them, then :meth:`add`)."""
        params: dict[str, Any] = self.producer().prefill(req_id, prompt_len, prompt_seed or req_id)
        return params

    def prefill_batch(
        self, req_ids: Sequence[str], prompt_len: int = 100, p_bound_s: float | None = None
    ) -> dict[str, dict[str, Any]]:
        """P's half of every request in one command (each prompt seeded by its id, as
        :meth:`prefill`'s default); returns the params D gets, by request id.
        ``p_bound_s``: P's bound on the command, if not its own default."""
        params: dict[str, dict[str, Any]] = self.producer().prefill_batch(
            {req_id: req_id for req_id in req_ids}, prompt_len, p_bound_s=p_bound_s
        )
        return params

    def _consumer_spec(
        self,
        key: str,
        policy: str,
        *,
        connector: str,
        connector_module: str | None,
        extra_config: Mapping[str, Any],
        **more: Any,
    ) -> EngineSpec:
        from kvfail.harness import EngineSpec

        return EngineSpec(
            role="consumer",
            connector=connector,
            connector_module=connector_module,
            policy=policy,  # type: ignore[arg-type]
            engine_id=f"D-{self.transport}-{key}-{os.getpid()}-{next(self._seq)}",
            extra_config=dict(extra_config),
            num_blocks=self.num_blocks,  # type: ignore[attr-defined]
            **more,
        )

    def _register(self, key: str, engine: Engine) -> Engine:
        self.decoders[key] = engine
        self._seen[engine] = 0
        return engine

    def _engine(self, consumer: str | Engine | None) -> Engine:
        if consumer is None:
            if self.d is None:
                raise RuntimeError("no default consumer; build one with consumer()")
            return self.d
        if not isinstance(consumer, str):
            return consumer
        if consumer not in self.decoders:
            raise KeyError(f"no consumer {consumer!r}; build it with consumer()")
        return self.decoders[consumer]

    @property
    def p_usable(self) -> bool:
        """P's process is alive and not stopped (it may still be importing vLLM)."""
        return self.p is not None and self.p.process.alive and not self.p.process.frozen

    def _ready_producer(self) -> Any:
        """P, waited for if it is still starting (e.g. after ``restart_p(wait=False)``)."""
        if self.p is None:
            raise RuntimeError("no P process")
        if self.p.ready is None and self.p.process.alive:
            self.p.wait_ready(self.ready_timeout_s)
        return self.p

    # ------------------------------------------------------------------ requests

    def _new_record(
        self, engine: Engine, req_id: str, seed: str, prompt_len: int, params: dict
    ) -> DecodeRecord:
        now = time.monotonic()
        return DecodeRecord(
            req_id, seed, prompt_len, params, now, now, steps_at_injection=engine.record.steps
        )

    def add(
        self,
        req_id: str,
        params: Mapping[str, Any],
        *,
        prompt_len: int = 100,
        prompt_seed: str | None = None,
        max_tokens: int = 4,
        consumer: str | Engine | None = None,
    ) -> Any:
        """Add D's request with these ``kv_transfer_params`` (the prompt must match P's)."""
        engine = self._engine(consumer)
        seed = prompt_seed or req_id
        record = self._new_record(engine, req_id, seed, prompt_len, dict(params))
        self.records[req_id] = record
        self.integrity.track(engine, req_id, seed, prompt_len)
        engine.add_request(
            req_id,
            prompt_len=prompt_len,
            prompt_seed=seed,
            max_tokens=max_tokens,
            kv_transfer_params=dict(params),
        )
        return record

    def prefill_and_add(
        self,
        req_id: str,
        prompt_len: int = 100,
        *,
        prompt_seed: str | None = None,
        max_tokens: int = 4,
        consumer: str | Engine | None = None,
    ) -> Any:
        """P prefills, then D adds the request with P's params: a normal P->D pull."""
        params = self.prefill(req_id, prompt_len, prompt_seed)  # type: ignore[attr-defined]
        return self.add(
            req_id,
            params,
            prompt_len=prompt_len,
            prompt_seed=prompt_seed,
            max_tokens=max_tokens,
            consumer=consumer,
        )

    # ------------------------------------------------------------------ observation

    def _after_step(self, engine: Engine) -> None:
        """Called by ``observe`` after each D step: the integrity oracle's release watch."""
        self.integrity.after_step(engine)

    def _stamp_reports(self, reports: Iterable[Any], now: float) -> None:
        """Stamp detection times and failure flags from these scheduler reports."""
        for report in reports:
            if report.rank is not None:
                continue
            for rid in report.failed_requests | report.finished_recving:
                rec = self.records.get(rid)
                if rec is None:
                    continue
                if rec.reported_s is None:
                    self._stamp(rec, report, now)
                if rid in report.failed_requests:
                    rec.failed = True

    def _stamp(self, rec: DecodeRecord, report: Any, now: float) -> None:
        """First report naming ``rec``'s request: its detection time from the injection
        (default: the add), and in D steps."""
        start = rec.injected_at if rec.injected_at is not None else rec.added_at
        rec.reported_s = round(now - start, 4)
        rec.reported_steps = report.step + 1 - rec.steps_at_injection

    def observe(self, engine: Engine) -> None:
        """Stamp detection times from ``engine``'s scheduler reports not seen yet, and run
        the integrity oracle's release watch; call after every step of a D stepped
        elsewhere (the conformance suite steps its own)."""
        seen = self._seen.get(engine, 0)
        reports = engine.record.kv_reports
        self._stamp_reports(reports[seen:], time.monotonic())
        self._after_step(engine)
        self._seen[engine] = len(reports)

    def verify(self, req_id: str) -> bool:
        """True iff D's KV blocks held exactly P's pattern for every pulled token."""
        rec = self.records.get(req_id)
        return bool(rec is not None and rec.verified)

    @property
    def check_forward(self) -> SplitForward:
        """D's forward, on every rank wherever the ranks run: the integrity oracle's
        checks and writes (:mod:`kvfail.peers.integrity`); a request's first schedule
        also gives its byte check (:meth:`verify`)."""
        return self.integrity.split_forward(on_first=self._first_check)

    def _first_check(self, engine: Engine, rank: int, req_id: str, loaded: int, wrong: Any) -> None:
        rec = self.records.get(req_id)
        if rec is None:
            return
        rec.checked_ranks.add(rank)
        if loaded == 0:  # computed locally (no load, or recompute): nothing was used
            rec.mismatches[f"rank{rank}"] = []
        for name, positions in wrong.items():
            rec.mismatches[f"rank{rank}:{name}"] = positions
        rec.verified = not rec.mismatches

    def integrity_findings(self, engine: Engine) -> list[str]:
        """The integrity oracle's findings for ``engine`` (clause first; empty: intact)."""
        return self.integrity.final_findings(engine)

    # ------------------------------------------------------------------ faults

    def kill_p(self) -> int:
        """SIGKILL P's process group (a crash: the kernel closes its sockets)."""
        return self._ready_producer().process.kill(timeout_s=self.kill_timeout_s)

    def freeze_p(self) -> None:
        """SIGSTOP P's group: a silent peer whose sockets stay open."""
        self._ready_producer().process.freeze()

    def thaw_p(self) -> None:
        self._ready_producer().process.thaw()

    def p_rank_pid(self, rank: int) -> int:
        """The pid of P's TP rank ``rank`` (P's own pid at TP 1)."""
        pids: list[int] = self._ready_producer().ready.get("rank_pids") or []
        if not 0 <= rank < len(pids):
            raise ValueError(f"P has no TP rank {rank} (rank pids: {pids})")
        return pids[rank]

    def signal_p_rank(self, rank: int, sig: int) -> None:
        """Send ``sig`` to P's rank ``rank`` only (SIGKILL, SIGSTOP, SIGCONT): a fault on
        one TP rank while the other ranks and P's scheduler go on. Returns once it has
        landed (:func:`kvfail.rig.procfs.signal_landed`): a rank killed is gone, its
        sockets closed, before the scenario's next step."""
        pid = self.p_rank_pid(rank)
        os.kill(pid, sig)
        signal_landed(pid, sig, timeout_s=self.kill_timeout_s)

    # ------------------------------------------------------------------ a second P

    def _new_producer(self) -> Any:
        """A fresh P process with this pair's P settings, not waited for."""
        raise NotImplementedError

    def second_p(self) -> Any:
        """The pair's second P, ready: started on first use, and again once the last one
        died (a scenario killed it). Its requests are prefilled with its own
        ``prefill``; D adds them with :meth:`add` as any other, and their bytes are
        checked the same way (the pattern depends on the prompt, not on which P)."""
        if self.p2 is None or not self.p2.process.alive:
            self.close_second_p()
            self.p2 = self._new_producer()
        try:
            self.p2.wait_ready(self.ready_timeout_s)
        except BaseException:
            self.close_second_p()
            raise
        return self.p2

    def kill_second_p(self) -> int | None:
        """SIGKILL the second P's process group and reap it (None: there is none)."""
        if self.p2 is None:
            return None
        return int(self.p2.process.kill(timeout_s=self.kill_timeout_s))

    def close_second_p(self) -> None:
        """Close the second P (quit, or kill its group if it cannot); idempotent, bounded,
        never raises. Why after every scenario that used one: an idle P still costs CPU,
        and no later scenario may inherit a peer it did not ask for."""
        producer, self.p2 = self.p2, None
        if producer is not None:
            with contextlib.suppress(Exception):
                producer.close()

    # ------------------------------------------------------------------ teardown

    def _close_extra(self) -> None:
        """What a transport closes between its D engines and P (default: nothing)."""

    def close(self) -> None:
        """Close D engines, whatever else the pair holds, and P's process group;
        idempotent, never raises."""
        for engine in list(self.decoders.values()):
            with contextlib.suppress(Exception):
                engine.close()
        self.decoders.clear()
        self._close_extra()
        self.close_second_p()
        if self.p is not None and self.owns_p:
            with contextlib.suppress(Exception):
                self.p.close()

    def __enter__(self) -> Any:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
