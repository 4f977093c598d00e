"""The KV-integrity oracle of a real P/D pair: every block D treats as computed holds
exactly what it should, at every step, and nothing writes into a block after its release.

Why at every step and not once: wrong KV comes from writes that land *late* (a transfer
still writing after its load was reported, or after its blocks were handed back). A check
at a request's first schedule sees only what had landed by then.

D plays its model runner: in each forward it checks, per scheduled request,

* the positions loaded from P (the prefix the scheduler treated as computed at the
  request's first schedule) against P's pattern (the prompt seed);
* the positions D computed in earlier steps against D's own pattern (:func:`d_seed`);

and then writes D's pattern into the positions it computes in this step, as a model
would write their KV. Any other content in a computed position is a violation.

Blocks of a watched request are *poisoned* with a release pattern when they go back to
the free pool (failed, aborted or finished alike): no write may land after a release. A
block the request let go of that is still referenced without belonging to any request
(a connector's quarantine holds it while a transfer may still write, see
:mod:`kvfail.quarantine`) is poisoned only once it reaches the free pool: a write into it
before then is what the hold is for. A poisoned block that is handed to another request
leaves the watch (its new owner's checks cover it); one still free when the scenario
ends must still hold the poison. Blocks kept by vLLM's prefix cache are not poisoned, so
a later cache hit reads what was computed.

Requests D computes itself (no load) can be watched the same way (:meth:`IntegrityLedger.track`
with nothing loaded at their first schedule): their positions must hold D's pattern, so a
stray write into blocks they were given is caught at their next step.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from kvfail.peers.forwards import first_head
from kvfail.peers.pattern import mismatched_positions, write_pattern

if TYPE_CHECKING:
    from vllm.v1.core.sched.output import SchedulerOutput

    from kvfail.harness import Engine
    from kvfail.harness.hooks import RankView, SplitForward

__all__ = [
    "IntegrityItem",
    "IntegrityLedger",
    "apply_integrity",
    "block_digest",
    "check_poison",
    "d_seed",
    "poison_blocks",
]

#: At most this many wrong positions are kept per layer (enough to show the shape).
_KEEP = 8


def d_seed(prompt_seed: str) -> str:
    """The seed of the bytes D computes itself for a request with this prompt seed."""
    return f"D|{prompt_seed}"


def _release_seed(block_id: int) -> str:
    # Per block, not per request: a block released again (by its next owner) gets the
    # same bytes, so another request's watch of it in other layers stays valid.
    return f"released|{block_id}"


@dataclass(frozen=True)
class IntegrityItem:
    """One scheduled request in one step: positions ``[0, loaded)`` must hold P's bytes,
    ``[loaded, computed)`` D's; D then writes its bytes into ``[computed, write_end)``."""

    req_id: str
    block_ids: tuple[tuple[int, ...], ...]
    loaded: int
    computed: int
    write_end: int
    p_seed: str
    #: The patterns follow each rank's global KV heads (a real P writes each head shard;
    #: False: a P that sends every rank the same bytes).
    rank_seeded: bool = True


Wrong = dict[str, list[int]]


def apply_integrity(view: RankView, items: list[IntegrityItem]) -> dict[str, tuple[Wrong, Wrong]]:
    """On a rank: request -> (layers with wrong loaded positions, with wrong computed ones)."""
    out: dict[str, tuple[Wrong, Wrong]] = {}
    for item in items:
        p_seed, own = item.p_seed, d_seed(item.p_seed)
        head = first_head(view) if item.rank_seeded else 0
        p_wrong: Wrong = {}
        d_wrong: Wrong = {}
        for layer, name in enumerate(view.built.layer_names):
            kv = view.kv_caches[name]
            blocks = item.block_ids[view.layer_group(layer)]
            bad = mismatched_positions(kv, layer, blocks, 0, item.loaded, p_seed, head)
            if bad:
                p_wrong[name] = bad[:_KEEP]
            bad = mismatched_positions(kv, layer, blocks, item.loaded, item.computed, own, head)
            if bad:
                d_wrong[name] = bad[:_KEEP]
            write_pattern(kv, layer, blocks, item.computed, item.write_end, own, head)
        out[item.req_id] = (p_wrong, d_wrong)
    return out


def poison_blocks(view: RankView, blocks: tuple[tuple[int, ...], ...]) -> None:
    """On a rank: fill these blocks with the release pattern (``blocks[g]``: the block ids
    whose layers of KV-cache group ``g`` to fill)."""
    head = first_head(view)
    for layer, name in enumerate(view.built.layer_names):
        kv = view.kv_caches[name]
        for block in blocks[view.layer_group(layer)]:
            write_pattern(kv, layer, [block], 0, kv.shape[2], _release_seed(block), head)


def block_digest(view: RankView, blocks: tuple[tuple[int, ...], ...]) -> str:
    """On a rank: a digest of these blocks' bytes (one tuple per KV-cache group) in every
    layer. Two digests taken while D does not step differ only if something else (a
    transfer) wrote into the blocks: how a driver sees a late write land."""
    import hashlib

    import torch

    digest = hashlib.blake2b(digest_size=16)
    for layer, name in enumerate(view.built.layer_names):
        ids = list(blocks[view.layer_group(layer)])
        if ids:
            data = view.kv_caches[name][ids].contiguous().view(torch.uint8)
            digest.update(data.numpy().tobytes())
    return digest.hexdigest()


def check_poison(view: RankView, blocks: tuple[tuple[int, ...], ...]) -> dict[str, list[int]]:
    """On a rank: layer -> block ids whose release pattern was overwritten (``blocks`` as
    for :func:`poison_blocks`)."""
    out: dict[str, list[int]] = {}
    head = first_head(view)
    for layer, name in enumerate(view.built.layer_names):
        kv = view.kv_caches[name]
        hit = [
            block
            for block in blocks[view.layer_group(layer)]
            if mismatched_positions(kv, layer, [block], 0, kv.shape[2], _release_seed(block), head)
        ]
        if hit:
            out[name] = hit
    return out


@dataclass
class _Ledger:
    """What the scheduler process knows of one remote-prefill request's positions."""

    p_seed: str
    prompt_len: int
    loaded: int | None = None
    computed: int = 0
    #: The request's blocks when last seen alive (to poison them at release).
    blocks: tuple[tuple[int, ...], ...] = ()


@dataclass
class _EngineState:
    """The oracle's state for one D engine."""

    #: request id -> its positions.
    requests: dict[str, _Ledger] = field(default_factory=dict)
    #: Released, poisoned block -> {KV-cache group whose layers at that block hold only
    #: the poison: the request that released it}. Per group: a block another request
    #: now owns in group g leaves the watch in g's layers only, as nobody writes a
    #: block's layers of another group (a late transfer for a former owner still can).
    watched: dict[int, dict[int, str]] = field(default_factory=dict)
    #: request id -> (group, block) pairs it let go of whose block is still referenced
    #: by no request (held by a quarantine): poisoned once they reach the free pool.
    held: dict[str, set[tuple[int, int]]] = field(default_factory=dict)
    #: request id -> the ranks that checked it once already.
    checked: dict[str, set[int]] = field(default_factory=dict)
    #: Findings so far, clause first.
    findings: list[str] = field(default_factory=list)


@dataclass
class IntegrityLedger:
    """Scheduler-side state of the oracle for the D engines of one pair, by the engine's
    unique ``engine_id`` (never ``id()``, which a later engine may reuse)."""

    engines: dict[str, _EngineState] = field(default_factory=dict)
    #: P's pattern differs per TP rank (False for an in-memory P that sends every rank
    #: the same bytes).
    rank_seeded: bool = True

    def split_forward(
        self, on_first: Callable[[Engine, int, str, int, Wrong], None] | None = None
    ) -> SplitForward:
        """D's forward: this oracle's checks and writes on every rank, wherever it runs.
        ``on_first(engine, rank, request, loaded, wrong)`` sees each request's first check
        on each rank (the byte check of what it ran on)."""
        from kvfail.harness.hooks import SplitForward

        def collect(engine: Engine, rank: int, result: dict[str, tuple[Wrong, Wrong]]) -> None:
            for req_id, loaded, wrong in self.collect(engine, rank, result):
                if on_first is not None:
                    on_first(engine, rank, req_id, loaded, wrong)

        return SplitForward(
            plan=lambda engine, so: self.plan(engine, so) or None,
            apply=apply_integrity,
            collect=collect,
        )

    def _of(self, engine: Engine) -> _EngineState:
        return self.engines.setdefault(str(engine.spec.engine_id), _EngineState())

    def track(self, engine: Engine, req_id: str, prompt_seed: str, prompt_len: int) -> None:
        """Watch a remote-prefill request D adds."""
        self._of(engine).requests[req_id] = _Ledger(prompt_seed, prompt_len)

    # ------------------------------------------------------------------ forward

    def plan(self, engine: Engine, so: SchedulerOutput) -> list[IntegrityItem]:
        """The checks and writes of this step for every tracked scheduled request."""
        from kvfail.peers.forwards import request_blocks

        state = self._of(engine)
        items: list[IntegrityItem] = []
        for req_id, n in so.num_scheduled_tokens.items():
            ledger = state.requests.get(req_id)
            if ledger is None:
                continue
            request = engine.scheduler.requests[req_id]
            # schedule() already advanced num_computed_tokens by this step's tokens.
            start = request.num_computed_tokens - n
            if ledger.loaded is None:  # first schedule: the prefix it starts with was loaded
                ledger.loaded = min(start, ledger.prompt_len)
            elif start < ledger.computed:  # rescheduled from earlier (preempted, recompute)
                ledger.loaded = min(ledger.loaded, start)
            ledger.computed = start + n
            items.append(
                IntegrityItem(
                    req_id,
                    request_blocks(engine, req_id),
                    ledger.loaded,
                    start,
                    start + n,
                    ledger.p_seed,
                    self.rank_seeded,
                )
            )
        return items

    def collect(
        self, engine: Engine, rank: int, result: dict[str, tuple[Wrong, Wrong]]
    ) -> list[tuple[str, int, Wrong]]:
        """Record a rank's findings. Returns ``(request, loaded, wrong)`` for each request
        this rank checked for the first time: the pair's own byte check of what the request
        ran on (``wrong``: loaded positions that are not P's). A loaded position that
        changes *after* that check, or a computed one that is not D's, is a finding here."""
        state = self._of(engine)
        first: list[tuple[str, int, Wrong]] = []
        step = engine.record.steps
        for req_id, (p_wrong, d_wrong) in result.items():
            checked = state.checked.setdefault(req_id, set())
            if rank not in checked:
                checked.add(rank)
                first.append((req_id, state.requests[req_id].loaded or 0, p_wrong))
                if p_wrong:
                    state.findings.append(
                        f"C1 wrong KV: {req_id} ran on positions loaded from P that hold "
                        f"other bytes (rank {rank}, step {step}): {p_wrong}"
                    )
            elif p_wrong:
                state.findings.append(
                    f"C11 wrong KV: {req_id}'s positions loaded from P changed after it ran "
                    f"on them (rank {rank}, step {step}): {p_wrong}"
                )
            if d_wrong:
                state.findings.append(
                    f"C11 wrong KV: {req_id}'s positions computed by D hold other bytes "
                    f"(rank {rank}, step {step}): {d_wrong}"
                )
        return first

    # ------------------------------------------------------------------ releases

    def after_step(self, engine: Engine) -> None:
        """Poison the blocks of tracked requests the scheduler released once they are
        free (a block still held without an owner waits: a quarantine may let a transfer
        finish into it), and stop watching a released block in the layers of the group
        another request now owns it in."""
        from kvfail.peers.forwards import request_blocks

        state = self._of(engine)
        sched = engine.scheduler
        groups = len(engine.built.kv_cache_config.kv_cache_groups)
        live: list[set[int]] = [set() for _ in range(groups)]
        for rid in sched.requests:
            for g, ids in enumerate(sched.kv_cache_manager.get_block_ids(rid)):
                live[g].update(ids)
        anywhere = set().union(*live)
        for block in [b for b in state.watched if b in anywhere]:
            watched = state.watched[block]
            for g in [g for g in watched if block in live[g]]:
                del watched[g]
            if not watched:
                del state.watched[block]
        pool = sched.kv_cache_manager.block_pool
        # (group, block) pairs: a transfer writes a block's layers of its group only, and
        # a request re-allocated after a failure may get its block ids back in other groups.
        released: dict[str, set[tuple[int, int]]] = {}
        for rid, ledger in state.requests.items():
            before = {(g, b) for g, ids in enumerate(ledger.blocks) for b in ids}
            if rid in sched.requests:
                # A live request can let blocks go too (a request-level failure under
                # recompute, a preemption): those are released like a finished one's.
                ledger.blocks = request_blocks(engine, rid)
                dropped = before - {(g, b) for g, ids in enumerate(ledger.blocks) for b in ids}
                if dropped:
                    released[rid] = dropped
                continue
            if before:
                released[rid] = before
                ledger.blocks = ()
        for rid in list(state.held):
            released[rid] = state.held.pop(rid) | released.get(rid, set())
        for rid, pairs in released.items():
            # Not cached: free now, or still held by something (a quarantine) if no
            # request owns the block; one owned again in another group is poisoned in
            # this group's layers, which its new owner does not use.
            mine = {(g, b) for g, b in pairs if pool.blocks[b].block_hash is None}
            held = {(g, b) for g, b in mine if pool.blocks[b].ref_cnt != 0 and b not in anywhere}
            if held:
                state.held[rid] = held
            # Layers still watched for an earlier release keep that poison (and its
            # check): re-poisoning them would erase a late write into them.
            poison = tuple(
                tuple(
                    sorted(
                        b
                        for g2, b in mine - held
                        if g2 == g and b not in live[g] and g not in state.watched.get(b, {})
                    )
                )
                for g in range(groups)
            )
            if not any(poison):
                continue
            for worker in engine.workers:
                worker.call(poison_blocks, poison, world_size=len(engine.workers))
            for g, ids in enumerate(poison):
                for block in ids:
                    state.watched.setdefault(block, {})[g] = rid

    def final_findings(self, engine: Engine) -> list[str]:
        """Every finding for ``engine``, after checking the released blocks still free."""
        self.after_step(engine)
        state = self._of(engine)
        out = list(state.findings)
        groups = len(engine.built.kv_cache_config.kv_cache_groups)
        by_rid: dict[str, list[list[int]]] = {}
        for block, watched in sorted(state.watched.items()):
            for g, rid in watched.items():
                by_rid.setdefault(rid, [[] for _ in range(groups)])[g].append(block)
        for rid, per_group in by_rid.items():
            blocks = tuple(tuple(ids) for ids in per_group)
            for worker in engine.workers:
                hit = worker.call(check_poison, blocks, world_size=len(engine.workers))
                if hit:
                    out.append(
                        f"C11 write after release: blocks of {rid} changed after the scheduler "
                        f"freed them (rank {worker.rank}): {hit}"
                    )
        return out
