"""The conformance driver for vLLM's ``MultiConnector`` (``--connector vllm:MultiConnector``).

MultiConnector composes child connectors: it loads a request from the first child that
matches it and saves to every child, and merges the children's reports into its own. What
a driver of its own can test that a child's driver cannot: whether a failure in the child
that loads reaches the scheduler through the parent, whether a child that does not load
(a bystander) can disturb a load it takes no part in, and what happens when both fail.

The children are two vLLM ExampleConnectors, each with its own directory on disk (child 0
and child 1). P is a harness engine running a MultiConnector over the same two children,
so the real save path writes every prompt into both directories; D's MultiConnector finds
the prompt in child 0 first, so child 0 loads and child 1 is the bystander. Both forwards
write the pattern of :mod:`kvfail.conformance.store_driver`, so the integrity oracle
tells which bytes D ran on.

Fault points (all on disk, before D steps):

* the store faults of :data:`~kvfail.conformance.store_driver.DAMAGE`, on the
  loading child's entry (child 0);
* ``store_bystander_damaged``: child 1's entry keeps its format but holds other bytes:
  a parent that loads only from the child it chose runs on P's bytes;
* ``store_all_children_damaged``: both children's entries are deleted after the lookup.

With ``child`` set to kvfail's ``KvfailExampleConnector`` (entry point ``multi-example``,
or the option ``?children=connectors.example:KvfailExampleConnector`` after any class this
driver claims) the children report their failures through kvfail's mixin, so the same
faults show whether the parent merges a child's report into its own. The children come
from the entry point or the user's option, never from the class under test.

TP 1, one KV-cache group.
"""

from __future__ import annotations

import shutil
import tempfile
from dataclasses import replace
from pathlib import Path
from typing import TYPE_CHECKING, ClassVar

from kvfail.conformance.capabilities import Claim
from kvfail.conformance.claims import DriverClaim, Probe, connector_side
from kvfail.conformance.driver import Declared, Injector, Provocation
from kvfail.conformance.store_driver import ExampleDriver, damage
from kvfail.faults.points import FaultPoint

if TYPE_CHECKING:
    from kvfail.harness.config import EngineSpec, Policy
    from kvfail.harness.engine import Engine

__all__ = [
    "MultiDriver",
    "make_driver",
    "make_kvfail_children_driver",
]


class MultiDriver(ExampleDriver):
    """vLLM's MultiConnector over two ExampleConnectors (see the module docstring).

    ``connector_cls``: the class to run on D (a negative control, any class this driver
    claims); P always runs the registered MultiConnector over the same children."""

    #: ``--connector`` options (``?key=value``) this driver takes.
    OPTIONS: ClassVar[dict[str, str]] = {
        "children": "both children's connector (vllm:<Name> or module:Class)"
    }

    D_CONNECTOR = "MultiConnector"

    def __init__(
        self,
        name: str,
        *,
        connector_cls: type | None = None,
        child: tuple[str, str | None] = ("ExampleConnector", None),
    ) -> None:
        """``child``: both children's (connector, module path), on P and on D."""
        super().__init__(name, connector_cls=connector_cls)
        self.child = child
        self._bystander_root: Path | None = None
        #: request id -> the bystander child's files for its prompt.
        self._bystander_files: dict[str, list[Path]] = {}

    @classmethod
    def claims(cls, probe: Probe) -> DriverClaim | None:
        """A connector that reads a ``connectors`` list from its extra config and builds
        each through vLLM's connector factory: a composition of children."""
        factories = [c for c in probe.built if c.__name__ == "KVConnectorFactory"]
        if not probe.reads("connectors") or not factories:
            return None
        given = probe.options.get("children")
        child = ("ExampleConnector", None) if given is None else connector_side(given)
        return DriverClaim(
            "reads kv_connector_extra_config 'connectors' and builds each child through "
            f"KVConnectorFactory; children: two {child[0]} "
            f"({'the option' if given is not None else 'the default'})",
            lambda name: cls(name, connector_cls=probe.cls, child=child),
        )

    @property
    def bystander_root(self) -> Path:
        if self._bystander_root is None:
            self._bystander_root = Path(tempfile.mkdtemp(prefix="kvfail-multi-child1-"))
        return self._bystander_root

    def start(self) -> None:
        super().start()
        self.bystander_root  # noqa: B018 - both children's directories exist before any engine

    def stop(self) -> None:
        super().stop()
        if self._bystander_root is not None:
            shutil.rmtree(self._bystander_root, ignore_errors=True)
            self._bystander_root = None
        self._bystander_files.clear()

    @property
    def injectors(self) -> dict[FaultPoint, Injector]:
        """The store faults on the loading child (0), and two on the bystander (1)."""
        return {
            **super().injectors,
            FaultPoint.STORE_BYSTANDER_DAMAGED: Injector(provoke=self._damage_bystander),
            FaultPoint.STORE_ALL_CHILDREN_DAMAGED: Injector(provoke=self._delete_both),
        }

    def _damage_bystander(self, call: Provocation) -> None:
        """Child 1's entry keeps its format but holds other bytes."""
        damage(self._bystander_files[call.request_id][0], FaultPoint.STORE_DATA_OVERWRITTEN)

    def _delete_both(self, call: Provocation) -> None:
        """Both children's entries are deleted after the lookup."""
        rid = call.request_id
        for path in (self._files[rid][0], self._bystander_files[rid][0]):
            damage(path, FaultPoint.STORE_FILE_DELETED)

    def declared(self) -> Declared:
        return replace(
            super().declared(),
            remote_prefill=Claim(
                True,
                "P, a harness engine with a MultiConnector, saves real files into both children",
            ),
            real_transport=Claim(True, f"two {self.child[0]} children, files on local disk"),
        )

    def _spec(
        self,
        policy: Policy,
        role: str,
        connector: str = "MultiConnector",
        module: str | None = None,
    ) -> EngineSpec:
        kv_role = "kv_consumer" if role == "consumer" else "kv_producer"
        child, child_module = self.child
        where = {} if child_module is None else {"kv_connector_module_path": child_module}
        children = [
            {
                "kv_connector": child,
                **where,
                "kv_role": kv_role,
                "kv_connector_extra_config": {"shared_storage_path": str(root)},
            }
            for root in (self.root, self.bystander_root)
        ]
        return self._store_spec(policy, role, connector, module, {"connectors": children})

    def _producer(self) -> Engine:
        if self._p is None:
            from kvfail.conformance.store_driver import write_pattern
            from kvfail.harness.engine import Engine

            self._p = Engine(self._spec("fail", "producer"), forward=write_pattern)
        return self._p

    def add_remote_request(
        self, engine: Engine, request_id: str, *, prompt_len: int = 100, max_tokens: int = 3
    ) -> str:
        """P saves the prompt into both children; D gets the same prompt."""
        before = set(self.bystander_root.rglob("*.safetensors"))
        super().add_remote_request(engine, request_id, prompt_len=prompt_len, max_tokens=max_tokens)
        files = sorted(set(self.bystander_root.rglob("*.safetensors")) - before)
        if not files:
            raise RuntimeError(f"MultiDriver: P wrote no file for {request_id} in child 1")
        self._bystander_files[request_id] = files
        return request_id


def make_driver(name: str) -> MultiDriver:
    """Entry point ``kvfail.drivers`` ``vllm:MultiConnector``."""
    return MultiDriver(name)


def make_kvfail_children_driver(name: str) -> MultiDriver:
    """Entry point ``kvfail.drivers`` ``multi-example``: vLLM's MultiConnector over two
    of kvfail's ``KvfailExampleConnector`` children, so a child's reported failure has
    to reach the parent's own report (``get_block_ids_with_load_errors``)."""
    from kvfail.conformance.store_driver import require_kvfail_example

    cls = require_kvfail_example()
    return MultiDriver(name, child=(cls.__name__, cls.__module__))
