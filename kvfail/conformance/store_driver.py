"""The store drivers' base: the conformance driver for vLLM's ``ExampleConnector``
(``--connector vllm:ExampleConnector``), which the MooncakeStore and MultiConnector drivers
build on (its pattern, its store faults, its P-in-process layout).

ExampleConnector is a store connector: P saves one safetensors file per layer under a
directory named by the prompt's hash, and a later D with the same prompt finds the
directory and loads the files synchronously, layer by layer, in ``start_load_kv``. Why a
driver of its own: its faults are the store's (a file deleted, truncated, corrupted,
replaced by a directory, overwritten), not a peer's.

P is a harness engine in this process running kvfail's Example connector for every D
(:func:`store_producer`; the real save path:
``save_kv_layer`` per layer, through the harness's layer forward context), writing real
files into a directory on disk that the driver creates and removes. Both engines' forwards
write a pattern that is a function of the token and the layer, so any KV slot D computed
or loaded can be compared with what it must hold (the integrity oracle).

Fault points (all provoked on P's files, before D steps; :data:`DAMAGE` says how):
``store_file_deleted``, ``store_file_truncated``, ``store_garbage_header``,
``store_replaced_by_dir``, ``store_data_overwritten``. TP 1, one KV-cache group.
"""

from __future__ import annotations

import shutil
import tempfile
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from types import MappingProxyType
from typing import TYPE_CHECKING, Any

from kvfail.conformance.claims import DriverClaim, Probe
from kvfail.conformance.driver import (
    Claim,
    Declared,
    Driver,
    EngineHandle,
    Injector,
    Provocation,
)
from kvfail.faults.points import FaultPoint

if TYPE_CHECKING:
    from vllm.v1.core.sched.output import SchedulerOutput

    from kvfail.harness.config import EngineSpec, Policy
    from kvfail.harness.engine import Engine
    from kvfail.harness.workers import Worker

__all__ = [
    "DAMAGE",
    "STORE_FAULTS",
    "ExampleDriver",
    "damage",
    "kvfail_example",
    "make_driver",
    "make_kvfail_driver",
    "pattern_value",
    "require_kvfail_example",
    "store_producer",
    "write_pattern",
]

BLOCK_SIZE = 32


def pattern_value(token: int, layer: int) -> float:
    """What every element of a token's KV slot in ``layer`` holds: exact in float16 (a
    multiple of 1/64 below 16), different for neighbouring tokens and layers."""
    return ((token % 997) + 3 * layer) % 1024 / 64


def write_pattern(engine: Engine, worker: Worker, so: SchedulerOutput) -> None:
    """A forward (``ForwardHook``): every token this step computes gets its pattern in
    every layer, at the slot the layer context maps it to."""
    ctx = engine.layer_context(worker, so)
    bs = engine.spec.block_size
    positions: list[tuple[Any, int]] = []
    for req_id, n in so.num_scheduled_tokens.items():
        request = engine.scheduler.requests[req_id]
        first = request.num_computed_tokens - n
        positions += [(request, p) for p in range(first, first + n)]
    for i, name in enumerate(engine.built.layer_names):
        view = ctx.layers[name].kv_cache
        slots = ctx.attn_metadata[name].slot_mapping.tolist()
        for (request, pos), slot in zip(positions, slots, strict=True):
            view[slot // bs, :, slot % bs] = pattern_value(request.all_token_ids[pos], i)


def _delete(path: Path) -> None:
    path.unlink()


def _truncate(path: Path) -> None:
    data = path.read_bytes()
    path.write_bytes(data[: len(data) // 2])


def _garble_header(path: Path) -> None:
    data = path.read_bytes()
    path.write_bytes(b"\xff" * 16 + data[16:])


def _replace_by_dir(path: Path) -> None:
    path.unlink()
    path.mkdir()


def _overwrite_data(path: Path) -> None:
    from safetensors.torch import load_file, save_file

    tensors = load_file(str(path))
    save_file({k: v + 1.0 for k, v in tensors.items()}, str(path))


#: What each store fault does to one stored file.
DAMAGE: Mapping[FaultPoint, Callable[[Path], None]] = MappingProxyType(
    {
        FaultPoint.STORE_FILE_DELETED: _delete,
        FaultPoint.STORE_FILE_TRUNCATED: _truncate,
        FaultPoint.STORE_GARBAGE_HEADER: _garble_header,
        FaultPoint.STORE_REPLACED_BY_DIR: _replace_by_dir,
        FaultPoint.STORE_DATA_OVERWRITTEN: _overwrite_data,
    }
)
STORE_FAULTS = frozenset(DAMAGE)


def damage(path: Path, point: FaultPoint) -> None:
    """Provoke store fault ``point`` on one stored file."""
    if point not in DAMAGE:
        raise ValueError(f"no store fault {point.value}")
    DAMAGE[point](path)


def wrong_positions(engine: Engine, request_id: str, upto: int) -> list[str]:
    """Positions below ``upto`` whose KV in some layer is not the pattern (D's tensors)."""
    import torch

    request = engine.scheduler.requests.get(request_id)
    if request is None:
        return []
    bs = engine.spec.block_size
    blocks = engine.scheduler.kv_cache_manager.get_block_ids(request_id)[0]
    tokens = request.all_token_ids
    out: list[str] = []
    for i, name in enumerate(engine.built.layer_names):
        view = engine.workers[0].kv_caches[name]
        bad = [
            p
            for p in range(upto)
            if not torch.all(view[blocks[p // bs], :, p % bs] == pattern_value(tokens[p], i))
        ]
        if bad:
            out.append(f"{name}: positions {bad[0]}..{bad[-1]} ({len(bad)} of {upto})")
    return out


def kvfail_example() -> type | None:
    """kvfail's ``KvfailExampleConnector``, None where it cannot be imported."""
    try:
        from connectors.example import KvfailExampleConnector
    except Exception:
        return None
    return KvfailExampleConnector


def require_kvfail_example() -> type:
    """kvfail's ``KvfailExampleConnector``; the driver is unavailable without it."""
    cls = kvfail_example()
    if cls is None:
        from kvfail.conformance.driver import DriverUnavailable

        raise DriverUnavailable("connectors.example cannot be imported")
    return cls


def store_producer() -> tuple[str, str | None]:
    """P's (connector, module), the same for every D of this store: kvfail's Example
    connector, which writes each file exactly as vLLM's does and a digest beside it
    (``<file>.sha256``); vLLM's where kvfail's cannot be imported. Why one writer for
    every D: the rig is chosen by the transport, not by D's lineage, so any D may use
    the digest (and pass ``store_data_overwritten`` by checking it) or ignore it (and
    be judged on the bytes it ran on); the verdict is what D did either way."""
    ours = kvfail_example()
    if ours is None:
        return ("ExampleConnector", None)
    return (ours.__name__, ours.__module__)


class ExampleDriver(Driver["_StoreHandle"]):
    """vLLM's ExampleConnector over real files on disk (see the module docstring).

    ``connector_cls``: the class to run on D instead (kvfail's connector, a negative
    control, any class this driver claims); P is :func:`store_producer` for every D."""

    #: The registered connector D runs without a ``connector_cls`` (subclasses drive
    #: another store through the same P-in-this-process and oracle).
    D_CONNECTOR = "ExampleConnector"

    def __init__(self, name: str, *, connector_cls: type | None = None) -> None:
        from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory

        self.name = name
        self.connector_cls = connector_cls or KVConnectorFactory.get_connector_class_by_name(
            self.D_CONNECTOR
        )
        #: D's (connector, module): a registry name has no module.
        self._d = (
            (self.D_CONNECTOR, None)
            if connector_cls is None
            else (connector_cls.__name__, connector_cls.__module__)
        )
        #: P's (connector, module).
        self._p_connector = store_producer()
        self._root: Path | None = None
        self._p: Engine | None = None
        #: request id -> the files P wrote for its prompt (one per layer).
        self._files: dict[str, list[Path]] = {}

    @property
    def root(self) -> Path:
        if self._root is None:
            self._root = Path(tempfile.mkdtemp(prefix="kvfail-example-store-"))
        return self._root

    @classmethod
    def claims(cls, probe: Probe) -> DriverClaim | None:
        """A connector that reads ``shared_storage_path`` from its extra config and whose
        lookup checks for a prompt's files there: a store of files in a directory, which
        this driver creates and damages (a connector that only saves there is not one)."""
        checks = probe.calls("get_num_new_matched_tokens", "exists", "isdir", "is_dir")
        if not probe.reads("shared_storage_path") or not checks:
            return None
        return DriverClaim(
            "reads kv_connector_extra_config 'shared_storage_path' and its lookup checks "
            f"the files there ({checks[0]}); P runs {store_producer()[0]}",
            lambda name: cls(name, connector_cls=probe.cls),
        )

    def start(self) -> None:
        self.root  # noqa: B018 - the store directory exists before any engine

    def stop(self) -> None:
        if self._p is not None:
            self._p.close()
            self._p = None
        if self._root is not None:
            shutil.rmtree(self._root, ignore_errors=True)
            self._root = None
        self._files.clear()

    @property
    def injectors(self) -> dict[FaultPoint, Injector]:
        """Every store fault damages the first layer's file of the request (D has not
        stepped yet)."""
        return {point: Injector(provoke=self._damage_first_file) for point in DAMAGE}

    def _damage_first_file(self, call: Provocation) -> None:
        damage(self._files[call.request_id][0], call.point)

    def declared(self) -> Declared:
        return Declared(
            async_load=Claim(False, "ExampleConnector loads synchronously in start_load_kv"),
            sync_load=Claim(True, "get_num_new_matched_tokens answers (n, False)"),
            remote_prefill=Claim(True, "P, a harness engine, saves real files the D loads"),
            two_groups=Claim(False, "the driver builds one KV-cache group"),
            real_transport=Claim(True, "safetensors files in a directory on local disk"),
            tp2=Claim(False, "the driver runs TP 1 only"),
            hetero_tp=Claim(False, "the driver runs TP 1 only"),
        )

    def engine_spec(
        self, policy: Policy, *, num_kv_cache_groups: int = 1, tp_size: int = 1, deadline: bool
    ) -> EngineSpec:
        return self._spec(policy, "consumer", *self._d)

    def _spec(
        self,
        policy: Policy,
        role: str,
        connector: str = "ExampleConnector",
        module: str | None = None,
    ) -> EngineSpec:
        return self._store_spec(
            policy, role, connector, module, {"shared_storage_path": str(self.root)}
        )

    @staticmethod
    def _store_spec(
        policy: Policy, role: str, connector: str, module: str | None, extra: dict[str, Any]
    ) -> EngineSpec:
        """An engine of a store driver: the layer forward context, this block size."""
        from kvfail.harness.config import EngineSpec

        return EngineSpec(
            connector=connector,
            connector_module=module,
            role=role,  # type: ignore[arg-type]
            policy=policy,
            block_size=BLOCK_SIZE,
            layer_forward_context=True,
            extra_config=extra,
        )

    def forward(self) -> Any:
        return write_pattern

    def _producer(self) -> Engine:
        if self._p is None:
            from kvfail.harness.engine import Engine

            self._p = Engine(
                self._spec("fail", "producer", *self._p_connector), forward=write_pattern
            )
        return self._p

    def add_remote_request(
        self, engine: Engine, request_id: str, *, prompt_len: int = 100, max_tokens: int = 3
    ) -> str:
        """P prefills the prompt (its files land on disk), then D gets the same prompt."""
        before = set(self.root.rglob("*.safetensors"))
        p = self._producer()
        p.add_request(f"P-{request_id}", prompt_len=prompt_len, prompt_seed=request_id)
        p.run_until_idle(max_steps=20)
        if p.crashed is not None:
            raise RuntimeError(f"ExampleDriver: P crashed saving {request_id}: {p.crashed}")
        files = sorted(set(self.root.rglob("*.safetensors")) - before)
        if not files:
            raise RuntimeError(f"ExampleDriver: P wrote no file for {request_id}")
        self._files[request_id] = files
        engine.add_request(
            request_id, prompt_len=prompt_len, prompt_seed=request_id, max_tokens=max_tokens
        )
        return request_id

    def observe(self, engine: Engine) -> None:
        """After each step: every running request's computed positions hold the pattern
        (what P wrote for the loaded ones, what D's forward wrote for the rest)."""
        from vllm.v1.request import RequestStatus

        found = self.handle(engine).wrong
        for rid, request in engine.scheduler.requests.items():
            if rid in found or request.status != RequestStatus.RUNNING:
                continue
            wrong = wrong_positions(engine, rid, request.num_computed_tokens)
            if wrong:
                found[rid] = f"C1 wrong KV: {rid} ran on KV that is not P's ({'; '.join(wrong)})"

    def new_handle(self, engine: Engine) -> _StoreHandle:
        return _StoreHandle(engine)

    def integrity_findings(self, engine: Engine) -> list[str]:
        return list(self.handle(engine).wrong.values())

    def wrong_bytes_finding(self, engine: Engine, request_id: str) -> str | None:
        return self.handle(engine).wrong.get(request_id)

    def verify_bytes(self, engine: Engine, request_id: str) -> str | None:
        """What the integrity oracle saw while ``request_id`` ran (None: every loaded
        position held P's pattern at every step)."""
        return self.wrong_bytes_finding(engine, request_id)


@dataclass(eq=False)
class _StoreHandle(EngineHandle):
    """A D engine of the Example driver: the first wrong-KV finding per request it ran."""

    wrong: dict[str, str] = field(default_factory=dict)


def make_driver(name: str) -> ExampleDriver:
    """Entry point ``kvfail.drivers`` ``vllm:ExampleConnector``."""
    return ExampleDriver(name)


def make_kvfail_driver(name: str) -> ExampleDriver:
    """Entry point ``kvfail.drivers`` ``example``: kvfail's ``KvfailExampleConnector``
    (``connectors.example``) on D, and on P."""
    return ExampleDriver(name, connector_cls=require_kvfail_example())
