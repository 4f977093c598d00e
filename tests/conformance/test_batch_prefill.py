"""Several requests from one P cost one prefill command, and each keeps its own fault.

Why: over a real P every request D loads was prefilled with a round trip of its own, and
the soak adds hundreds. P now prefills a batch in one command (``prefill_batch``), and
``add_remote_requests`` uses it wherever its requests come from one P; what must not
change is when each fault happens: a per-request fault is armed and set up for each
request before D adds it, a fault on P's whole process happens once for the batch.
"""

from __future__ import annotations

import importlib
from types import SimpleNamespace
from typing import Any

import pytest

from kvfail.conformance.driver import Declared
from kvfail.conformance.many_loads import add_by_fault
from kvfail.conformance.pair_driver import Arming, OnPeer, PairDriver, PairInjector
from kvfail.faults.points import FaultPoint
from kvfail.peers.producer_engine import ProducerEngine
from kvfail.peers.producer_handle import ProducerHandleBase

PER_REQUEST = FaultPoint.PEER_ERR_REQS
WHOLE_P = FaultPoint.KILL_BEFORE_PULL

# ---------------------------------------------------------------- P's side


class _Engine:
    """What the prefill loop reads of P's engine: its crash and its steps."""

    def __init__(self) -> None:
        self.crashed: Any = None
        self.steps = 0


class _P(ProducerEngine):
    """A P whose requests are prefilled after ``done_at[req_id]`` steps (a string: the
    request ends that way instead)."""

    def __init__(self, done_at: dict[str, int | str]) -> None:
        self.engine = _Engine()  # type: ignore[assignment]
        self.engine_id = "P-test"
        self.done_at = done_at
        self.added: list[tuple[str, int]] = []
        self.crash_at: int | None = None
        self._init_counters()

    def _start_prefill(self, req: Any) -> None:
        self.added.append((str(req["req_id"]), self.engine.steps))

    def _prefilled(self, req_id: str) -> dict[str, Any] | str | None:
        done = self.done_at[req_id]
        if isinstance(done, str):
            return done if self.engine.steps >= 1 else None
        return {"from": req_id} if self.engine.steps >= done else None

    def _prefill_step(self) -> None:
        self.engine.steps += 1
        if self.crash_at is not None and self.engine.steps >= self.crash_at:
            self.engine.crashed = SimpleNamespace(message="rank 1 died")


def _batch(*rids: str) -> dict[str, Any]:
    return {"requests": [{"req_id": rid, "prompt_seed": rid, "prompt_len": 40} for rid in rids]}


def test_p_adds_the_whole_batch_then_steps_until_every_request_is_prefilled() -> None:
    p = _P({"a": 1, "b": 3, "c": 2})
    reply = p.prefill_batch(_batch("a", "b", "c"))
    assert reply == {"ok": True, "kv_transfer_params": {r: {"from": r} for r in "acb"}}
    assert p.added == [("a", 0), ("b", 0), ("c", 0)]  # all before P's first step
    assert p.engine.steps == 3  # the slowest one's, not the sum
    assert (p.prefills, p.failed_prefills) == (3, 0)


def test_a_request_of_the_batch_that_ends_wrong_fails_the_command() -> None:
    p = _P({"a": 1, "b": "P request ended FINISHED_ABORTED"})
    reply = p.prefill_batch(_batch("a", "b"))
    assert reply == {"ok": False, "error": "P request ended FINISHED_ABORTED"}
    assert (p.prefills, p.failed_prefills) == (1, 1)


def test_a_batch_past_its_bound_fails_naming_the_bound_the_command_carried(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The suite sends P its bound in the machine's time (``timeout_s``): a batch that
    waits longer fails the command with that bound, not P's idle default."""
    from kvfail.peers import producer_engine

    clock = iter(range(0, 1000, 7))  # each look at the clock: 7 s later
    monkeypatch.setattr(producer_engine.time, "monotonic", lambda: float(next(clock)))
    p = _P({"a": 100})
    reply = p.prefill_batch({**_batch("a"), "timeout_s": 30.0})
    assert reply == {"ok": False, "error": "prefill of ['a'] not done in 30 s"}
    assert p.engine.steps == 4  # 7, 14, 21, 28 s: stepped; 35 s: past the 30 s bound


def test_a_crash_fails_what_is_pending_in_words_the_nixl_driver_retries_on() -> None:
    p = _P({"a": 1, "b": 5, "c": 5})
    p.crash_at = 2
    reply = p.prefill_batch(_batch("a", "b", "c"))
    assert reply == {"ok": False, "error": "P crashed: rank 1 died"}
    assert (p.prefills, p.failed_prefills) == (1, 2)


def test_the_bound_is_on_the_whole_command(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr("kvfail.peers.producer_engine.PREFILL_TIMEOUT_S", 0.0)
    p = _P({"a": 0, "b": 9})
    reply = p.prefill_batch(_batch("a", "b"))
    assert not reply["ok"] and reply["error"] == "prefill of ['b'] not done in 0 s"


def test_the_one_request_command_is_a_batch_of_one() -> None:
    p = _P({"a": 2})
    reply = p.prefill({"cmd": "prefill", "req_id": "a", "prompt_len": 40})
    assert reply == {"ok": True, "req_id": "a", "kv_transfer_params": {"from": "a"}}
    assert p.added == [("a", 0)]


@pytest.mark.parametrize("module", ["kvfail.peers.producer", "kvfail.peers.nixl_producer"])
def test_both_producers_answer_the_batch_command(module: str) -> None:
    cls = importlib.import_module(module)._Producer
    p = cls.__new__(cls)
    p.prefill_batch = lambda cmd: {"ok": True, "requests": cmd["requests"]}
    assert p.handle({"cmd": "prefill_batch", "requests": ["x"]}) == {
        "ok": True,
        "requests": ["x"],
    }


def test_the_handle_sends_one_command_and_returns_params_by_request() -> None:
    handle = ProducerHandleBase.__new__(ProducerHandleBase)
    sent: list[tuple[dict[str, Any], float]] = []

    def request(cmd: dict[str, Any], timeout_s: float = 30.0) -> dict[str, Any]:
        sent.append((cmd, timeout_s))
        params = {r["req_id"]: {"seed": r["prompt_seed"]} for r in cmd["requests"]}
        return {"ok": True, "kv_transfer_params": dict(reversed(params.items()))}

    handle.request = request  # type: ignore[method-assign]
    got = handle.prefill_batch({"a": "sa", "b": "sb"}, 40)
    assert list(got) == ["a", "b"] and got["b"] == {"seed": "sb"}
    assert sent == [
        (
            {
                "cmd": "prefill_batch",
                "requests": [
                    {"req_id": "a", "prompt_seed": "sa", "prompt_len": 40},
                    {"req_id": "b", "prompt_seed": "sb", "prompt_len": 40},
                ],
            },
            30.0,
        )
    ]
    # P's own bound travels with the command; the reply is awaited that much longer.
    handle.prefill_batch({"c": "sc"}, 40, p_bound_s=50.0)
    assert sent[-1][0]["timeout_s"] == 50.0 and sent[-1][1] == 80.0


# ---------------------------------------------------------------- the driver's side


class _Pair:
    """A pair whose P prefills in memory; ``log`` is what P and D were asked, in order."""

    def __init__(self, log: list[tuple[Any, ...]]) -> None:
        self.log = log
        self.p = SimpleNamespace(process=SimpleNamespace(alive=True, frozen=False))

    def producer(self) -> Any:
        return self.p

    def prefill_batch(
        self, req_ids: Any, prompt_len: int, p_bound_s: float | None = None
    ) -> dict[str, dict[str, Any]]:
        self.log.append(("prefill", tuple(req_ids)))
        self.p_bound_s = p_bound_s
        return {rid: {"rid": rid} for rid in req_ids}

    def add(self, req_id: str, params: Any, **_: Any) -> None:
        self.log.append(("add", req_id, params.get("broken", False)))


class _Driver(PairDriver):
    """A pair driver with one per-request fault (its ``before_add`` breaks the params)
    and one on P's whole process."""

    def __init__(self, *, after_add: bool) -> None:
        self.name = "batch-test"
        self.connector_cls = object
        self.log: list[tuple[Any, ...]] = []
        self._pair = _Pair(self.log)  # type: ignore[assignment]
        self._layout_pairs = {}
        self.on_peer_after_add = after_add

    @property
    def injectors(self) -> dict[FaultPoint, PairInjector]:
        return {
            PER_REQUEST: PairInjector(before_add=self._break),
            WHOLE_P: PairInjector(on_peer=self._kill),
        }

    def declared(self) -> Declared:
        raise NotImplementedError

    def _break(self, arming: Arming, params: dict[str, Any]) -> dict[str, Any]:
        self.log.append(("arm", arming.fault.request_id, arming.fault.ranks))
        return {**params, "broken": True}

    def _kill(self, call: OnPeer) -> None:
        self.log.append(("kill", tuple(call.request_ids), call.ranks))


class _D:
    """Only a key for the driver's handle: nothing is stepped."""


def test_a_per_request_fault_is_armed_for_each_request_of_one_prefill() -> None:
    driver = _Driver(after_add=False)
    engine = _D()
    driver.add_remote_requests(engine, ["a", "b"], fault=PER_REQUEST, ranks=iter([1]))  # type: ignore[arg-type]
    assert driver.log == [
        ("prefill", ("a", "b")),
        ("arm", "a", (1,)),
        ("add", "a", True),
        ("arm", "b", (1,)),
        ("add", "b", True),
    ]
    assert sorted(driver.handle(engine).active) == ["a", "b"]  # type: ignore[arg-type]


@pytest.mark.parametrize("after_add", [False, True])
def test_a_fault_on_p_happens_once_after_p_prefilled_them_all(after_add: bool) -> None:
    driver = _Driver(after_add=after_add)
    driver.add_remote_requests(_D(), ["a", "b"], fault=WHOLE_P, ranks=[0])  # type: ignore[arg-type]
    adds = [("add", "a", False), ("add", "b", False)]
    kill = [("kill", ("a", "b"), (0,))]
    assert driver.log == [("prefill", ("a", "b")), *(adds + kill if after_add else kill + adds)]


def test_p_gets_its_bound_in_the_machines_time(monkeypatch: pytest.MonkeyPatch) -> None:
    """A loaded machine keeps P's blocks held longer: the driver stretches P's bound on a
    batch as the suite stretches its own waits, so that wait is never a verdict."""
    from kvfail.conformance import timebase
    from kvfail.peers.producer_engine import PREFILL_TIMEOUT_S

    monkeypatch.setattr(timebase, "_scale", 2.5)
    driver = _Driver(after_add=False)
    driver.add_remote_requests(_D(), ["y", "z"])  # type: ignore[arg-type]
    assert driver._pair.p_bound_s == 2.5 * PREFILL_TIMEOUT_S  # type: ignore[attr-defined]


def test_one_request_armed_alone_is_a_batch_of_one() -> None:
    driver = _Driver(after_add=False)
    engine = _D()
    driver.arm(engine, "x", WHOLE_P)  # type: ignore[arg-type]
    driver.add_remote_request(engine, "x")  # type: ignore[arg-type]
    driver.add_remote_requests(engine, ["y", "z"])  # type: ignore[arg-type]
    assert driver.log == [
        ("prefill", ("x",)),
        ("kill", ("x",), None),
        ("add", "x", False),
        ("prefill", ("y", "z")),
        ("add", "y", False),
        ("add", "z", False),
    ]


# ---------------------------------------------------------------- the soak's batches


def test_a_batch_is_added_one_call_per_fault_with_its_ids_unchanged() -> None:
    calls: list[tuple[list[str], FaultPoint | None, int]] = []

    def add_remote_requests(
        engine: Any, rids: list[str], *, fault: FaultPoint | None, prompt_len: int
    ) -> list[str]:
        calls.append((rids, fault, prompt_len))
        return rids

    scenario = SimpleNamespace(driver=SimpleNamespace(add_remote_requests=add_remote_requests))
    faults = {"s-1": None, "s-2": PER_REQUEST, "s-3": None, "s-4": FaultPoint.UNKNOWN_ENGINE}
    faults["s-5"] = PER_REQUEST
    add_by_fault(scenario, object(), faults, prompt_len=40)  # type: ignore[arg-type]
    assert calls == [
        (["s-1", "s-3"], None, 40),
        (["s-2", "s-5"], PER_REQUEST, 40),
        (["s-4"], FaultPoint.UNKNOWN_ENGINE, 40),
    ]


# ---------------------------------------------------------------- P's room for a batch


@pytest.mark.parametrize(
    ("pending", "incoming", "notify_armed", "expired"),
    [
        (10, 14, False, True),  # the leases alone are under the batch size, the batch is not
        (10, 2, False, False),  # room enough: leases end in a batch, later
        (16, 0, False, True),  # the old rule, kept: a full batch of leases ends at once
        (10, 14, True, False),  # D reads a notify_failed pull: its lease must stay
        (0, 40, False, False),  # nothing to end
    ],
)
def test_the_nixl_driver_ends_unread_leases_before_p_runs_out_of_blocks(
    pending: int, incoming: int, notify_armed: bool, expired: bool
) -> None:
    """P holds the blocks of a pull D never reads until its lease ends (upstream's abort
    timeout, minutes). Counting only the leases let a long row leave P without blocks for
    the next batch: the soak's prefill then waited out P's bound, a rig leak reported as
    the connector's failure."""
    from kvfail.conformance.nixl_driver import NixlDriver

    driver = NixlDriver.__new__(NixlDriver)
    leases = [f"p{i}" for i in range(pending)]
    driver._unreleased = list(leases)
    driver._notify_armed = [(None, "x")] if notify_armed else []
    ended: list[list[str]] = []
    pair = SimpleNamespace(expire_leases=lambda ids: ended.append(list(ids)))
    driver._make_room(pair, incoming)
    assert ended == ([leases] if expired else [])
    assert driver._unreleased == ([] if expired else leases)
