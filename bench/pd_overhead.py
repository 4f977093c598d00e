"""Does adopting kvfail slow fault-free P/D serving? Upstream's D connector vs kvfail's, guarded.

Set-up, per transport (Mooncake over TCP, NIXL over UCX/TCP): the e2e tier's deployment
(``e2e.pd.start_deployment``: real ``vllm serve`` processes on CPU, the tiny seeded Llama
of ``e2e.model``, our proxy ``e2e.proxy`` in front of each D), with one P and two Ds started
together: D ``upstream`` runs vLLM's connector (``NixlConnector``; ``MooncakeConnector``
through ``e2e.upstream``, which only builds it inside the rig's CPU shim), D ``kvfail`` runs
kvfail's (``connectors.nixl`` / ``connectors.mooncake``, load deadline at the connector's
default, 30 s), and D ``guard`` runs upstream's connector inside kvfail's guard
(``connectors.guard``, ``deadline_s`` 30 s: configuration only, no code change). The Ds pull
from the same P, which runs upstream's connector (``--p`` switches it to kvfail's): only D's
connector differs between the arms.

Workload: ``--requests`` (64) seeded requests with mixed prompt lengths (130-400 tokens)
and output lengths (16-48 tokens, ``ignore_eos``), all sent at once through the proxy,
streamed, so the client sees each request's time to first token (TTFT: from sending to
the first token, P's prefill and D's KV pull included). Each D first gets one unmeasured
round; then ``--rounds`` measured rounds per arm, in sets of adjacent rounds (one per arm)
whose order flips from set to set (upstream, kvfail, guard, guard, kvfail, upstream, ...), so
drift on the shared machine hits every arm alike. A round counts only if every request
ended with all its tokens and D's ``external_kv_transfer`` prompt-token counter grew by at
least one block per request (the KV really came from P); otherwise the bench stops.

Figures: per round, wall time, output tokens/s, TTFT p50/p99, D's CPU seconds (every
process of its group, from /proc) and the idle Ds'. Per arm, all rounds pooled: tokens/s =
output tokens / summed round wall time; TTFT percentiles over every request; and the
pooled ratios. The last line holds kvfail ÷ upstream per set of adjacent rounds, the
median over the sets (:func:`paired_ratios` says why): ``pd_tps_ratio_<transport>``
(target >= 0.98) and ``pd_ttft_p50_ratio_<transport>`` / ``pd_ttft_p99_ratio_<transport>``
(target <= 1.02), with ``pd_tps_ratio_spread_<transport>`` (the largest set's ratio less the
smallest); the guard's column is the same figures named ``pd_guard_...``.

64 at once is not scaled down: a 2-core machine takes it (a round's length follows the
machine's load), and the three servers, the proxy and the client share those two
cores with whatever else runs there. The ratios are what this bench is for; absolute
figures move with the load, and under heavy load a server may not start within the e2e
tier's ``START_TIMEOUT_S`` (the run then stops with that error; run it again).
``--quick`` (16 requests, 2 rounds per arm) is a smoke run.

Run: ``.venv/bin/python -m bench.pd_overhead [--quick] [--transport nixl]``.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import math
import os
import random
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Literal

from bench._common import figures

if TYPE_CHECKING:
    from e2e.pd import Deployment
    from e2e.servers import Impl, VllmServer

ROOT = Path(__file__).resolve().parent.parent
ARMS: tuple[Impl, ...] = ("upstream", "kvfail", "guard")
#: What each measured arm must meet against upstream alone, in the same run.
TARGETS = {
    "pd_tps_ratio_mooncake": ">= 0.98",
    "pd_tps_ratio_nixl": ">= 0.98",
    "pd_guard_tps_ratio_mooncake": ">= 0.98",
    "pd_guard_tps_ratio_nixl": ">= 0.98",
}
TRANSPORTS: tuple[Literal["mooncake", "nixl"], ...] = ("mooncake", "nixl")

#: Prompt and output lengths of the workload. A prompt is longer than one 128-token CPU
#: block (so every request pulls at least one block from P), and prompt + output fits the
#: servers' ``--max-model-len`` 512.
PROMPT_TOKENS = (130, 400)
OUTPUT_TOKENS = (16, 48)
#: Tokens of one KV block on vLLM's CPU backend: the least a request's pull brings.
BLOCK_TOKENS = 128
#: kvfail's load deadline on the measured D: its connectors' default.
KVFAIL_DEADLINE_S = 30.0
#: Bound on one streamed request (a loaded machine answers 64 at once in seconds).
REQUEST_TIMEOUT_S = 300.0


# ---------------------------------------------------------------------------- pure parts


@dataclass(frozen=True)
class Request:
    """One request of the workload: token-id prompt and how many tokens to generate."""

    prompt: tuple[int, ...]
    max_tokens: int


def workload(
    n: int,
    seed: int,
    prompt_tokens: tuple[int, int] = PROMPT_TOKENS,
    output_tokens: tuple[int, int] = OUTPUT_TOKENS,
) -> list[Request]:
    """`n` requests drawn from `seed` alone: the same list in every round and every run."""
    if n < 1:
        raise ValueError(f"a workload needs at least one request, got {n}")
    rng = random.Random(seed)
    out: list[Request] = []
    for _ in range(n):
        length = rng.randint(*prompt_tokens)
        prompt = tuple(rng.randrange(10, 49_000) for _ in range(length))
        out.append(Request(prompt, rng.randint(*output_tokens)))
    return out


def percentile(values: Iterable[float], q: float) -> float:
    """The `q`-th percentile (0-100), interpolated linearly between the two nearest ranks
    (numpy's default), so p50 of an even count is the mean of the middle two."""
    xs = sorted(values)
    if not xs:
        raise ValueError("percentile of no values")
    if not 0.0 <= q <= 100.0:
        raise ValueError(f"percentile {q} outside 0..100")
    pos = (len(xs) - 1) * q / 100.0
    lo = math.floor(pos)
    hi = min(lo + 1, len(xs) - 1)
    return xs[lo] + (xs[hi] - xs[lo]) * (pos - lo)


@dataclass
class Sample:
    """What the client saw for one request."""

    ok: bool
    tokens: int
    ttft_s: float | None
    error: str | None = None


@dataclass
class Round:
    """One measured (or warm-up) round of one arm."""

    transport: str
    arm: str
    index: int
    wall_s: float
    samples: list[Sample]
    d_cpu_s: float = 0.0
    idle_d_cpu_s: float = 0.0
    external_tokens: float = 0.0

    @property
    def tokens(self) -> int:
        return sum(s.tokens for s in self.samples if s.ok)

    @property
    def ttfts(self) -> list[float]:
        return [s.ttft_s for s in self.samples if s.ok and s.ttft_s is not None]

    @property
    def failed(self) -> int:
        return sum(not s.ok for s in self.samples)

    @property
    def tps(self) -> float:
        return self.tokens / self.wall_s if self.wall_s > 0 else 0.0


@dataclass
class ArmSummary:
    """An arm's rounds pooled: tokens over summed wall time, TTFT over every request."""

    tps: float
    ttft_p50_s: float
    ttft_p99_s: float
    d_cpu_ms_per_token: float
    rounds: int = 0


def summarize(rounds: Sequence[Round]) -> ArmSummary:
    if not rounds:
        raise ValueError("no rounds to summarize")
    wall = sum(r.wall_s for r in rounds)
    tokens = sum(r.tokens for r in rounds)
    ttfts = [t for r in rounds for t in r.ttfts]
    cpu = sum(r.d_cpu_s for r in rounds)
    return ArmSummary(
        tps=tokens / wall if wall > 0 else 0.0,
        ttft_p50_s=percentile(ttfts, 50),
        ttft_p99_s=percentile(ttfts, 99),
        d_cpu_ms_per_token=1000.0 * cpu / tokens if tokens else 0.0,
        rounds=len(rounds),
    )


def _prefix(arm: str) -> str:
    """kvfail's figures keep their first names (``pd_tps_ratio_...``); another arm's
    carry its name (``pd_guard_tps_ratio_...``)."""
    return "pd_" if arm == "kvfail" else f"pd_{arm}_"


def ratios(
    transport: str, upstream: ArmSummary, measured: ArmSummary, arm: str = "kvfail"
) -> dict[str, float]:
    """``arm`` ÷ upstream for tokens/s and TTFT p50/p99, named as on the bench's last line."""

    def div(a: float, b: float) -> float:
        return round(a / b, 4) if b > 0 else math.nan

    pre = _prefix(arm)
    return {
        f"{pre}tps_ratio_{transport}": div(measured.tps, upstream.tps),
        f"{pre}ttft_p50_ratio_{transport}": div(measured.ttft_p50_s, upstream.ttft_p50_s),
        f"{pre}ttft_p99_ratio_{transport}": div(measured.ttft_p99_s, upstream.ttft_p99_s),
    }


def paired_ratios(
    transport: str, upstream: Sequence[Round], measured: Sequence[Round], arm: str = "kvfail"
) -> dict[str, float]:
    """:func:`ratios` of each set of adjacent rounds (upstream's i-th, ``arm``'s i-th), and
    per figure the median over the sets, with the tokens/s ratio's spread (largest less
    smallest). Why: the machine's load drifts within minutes, and pooling lets one slow
    stretch decide; the rounds of a set ran back to back, so their quotient holds the
    least drift, and the median drops a set one of whose rounds a burst of foreign load
    hit."""
    if len(upstream) != len(measured) or not upstream:
        raise ValueError(f"need pairs of rounds, got {len(upstream)} and {len(measured)}")
    per_pair = [
        ratios(transport, summarize([u]), summarize([k]), arm)
        for u, k in zip(upstream, measured, strict=True)
    ]
    out = {key: round(percentile((p[key] for p in per_pair), 50), 4) for key in per_pair[0]}
    tps = [p[f"{_prefix(arm)}tps_ratio_{transport}"] for p in per_pair]
    out[f"{_prefix(arm)}tps_ratio_spread_{transport}"] = round(max(tps) - min(tps), 4)
    return out


def schedule(rounds_per_arm: int) -> list[str]:
    """The measured rounds' order: sets of adjacent rounds, one per arm, whose order
    flips from set to set (upstream first, then upstream last, ...). Why: with one order
    for every set, a load that rises or falls through the run favours one arm."""
    order: list[str] = []
    for i in range(rounds_per_arm):
        order += ARMS if i % 2 == 0 else ARMS[::-1]
    return order


def last_line(values: dict[str, float]) -> str:
    """Every tps ratio first, then the TTFT ratios transport by transport."""
    order = sorted(values, key=lambda k: ("_tps_" not in k, k.rpartition("_")[2], k))
    return figures(**{k: values[k] for k in order})


# ---------------------------------------------------------------------------- servers


async def _stream_one(client: object, model: str, req: Request) -> Sample:
    """One streamed completion; TTFT is the first chunk that carries a token."""
    import openai

    assert isinstance(client, openai.AsyncOpenAI)
    t0 = time.monotonic()
    first: float | None = None
    tokens = 0
    finish: str | None = None
    try:
        stream = await client.completions.create(
            model=model,
            prompt=list(req.prompt),
            max_tokens=req.max_tokens,
            temperature=0,
            stream=True,
            extra_body={"return_token_ids": True, "ignore_eos": True},
        )
        async for chunk in stream:
            for choice in chunk.choices:
                ids = (choice.model_extra or {}).get("token_ids") or []
                if ids and first is None:
                    first = time.monotonic()
                tokens += len(ids)
                finish = choice.finish_reason or finish
    except openai.OpenAIError as exc:
        return Sample(False, tokens, None, repr(exc)[:300])
    ok = finish == "length" and tokens == req.max_tokens
    err = None if ok else f"finish_reason={finish} tokens={tokens}/{req.max_tokens}"
    return Sample(ok, tokens, None if first is None else first - t0, err)


async def _send_all(url: str, model: str, reqs: Sequence[Request]) -> tuple[float, list[Sample]]:
    import openai

    client = openai.AsyncOpenAI(
        base_url=f"{url}/v1", api_key="none", max_retries=0, timeout=REQUEST_TIMEOUT_S
    )
    try:
        t0 = time.monotonic()
        samples = await asyncio.gather(*(_stream_one(client, model, r) for r in reqs))
        return time.monotonic() - t0, list(samples)
    finally:
        await client.close()


def group_cpu_s(server: VllmServer) -> float:
    """CPU seconds (user + system) used so far by every live process of a server's group."""
    tick = os.sysconf("SC_CLK_TCK")
    total = 0.0
    for pid in server.proc.group_members():
        try:
            stat = Path(f"/proc/{pid}/stat").read_text()
        except OSError:
            continue
        fields = stat.rpartition(")")[2].split()
        total += (int(fields[11]) + int(fields[12])) / tick  # utime, stime
    return total


def run_round(dep: Deployment, transport: str, arm: str, index: int, reqs: list[Request]) -> Round:
    """Send the workload through `arm`'s proxy once; check it really was P/D, fault-free."""
    from e2e.pd import external_tokens, wait_idle

    d = dep.d[arm]
    others = [dep.d[a] for a in dep.d if a != arm]
    # Both servers idle first: a round starts with nothing of the previous one left on
    # P (its KV awaiting a pull, its bookkeeping) or on D.
    wait_idle(dep.p, None, 60.0)
    wait_idle(d, None, 60.0)
    ext0 = external_tokens(d)
    cpu0, idle0 = group_cpu_s(d), sum(map(group_cpu_s, others))
    wall, samples = asyncio.run(_send_all(dep.proxies[arm].url, dep.model, reqs))
    cpu1, idle1 = group_cpu_s(d), sum(map(group_cpu_s, others))
    r = Round(
        transport,
        arm,
        index,
        wall,
        samples,
        d_cpu_s=cpu1 - cpu0,
        idle_d_cpu_s=idle1 - idle0,
        external_tokens=external_tokens(d) - ext0,
    )
    bad = [s.error for s in samples if not s.ok]
    if bad:
        raise SystemExit(
            f"{transport} {arm} round {index}: {len(bad)} of {len(samples)} requests failed "
            f"(not a fault-free run; logs in {dep.log_dir}): {bad[:3]}"
        )
    if r.external_tokens < BLOCK_TOKENS * len(reqs):
        raise SystemExit(
            f"{transport} {arm} round {index}: D took only {r.external_tokens:.0f} prompt tokens "
            f"from P for {len(reqs)} requests: the KV did not come from P (logs in {dep.log_dir})"
        )
    return r


def print_round(r: Round, prompt_tokens: int) -> None:
    label = f"{r.transport}/{r.arm}/{'warm' if r.index < 0 else r.index}"
    print(
        f"  {label:22}{r.wall_s:8.2f}{r.tps:10.1f}{percentile(r.ttfts, 50):10.3f}"
        f"{percentile(r.ttfts, 99):10.3f}{r.d_cpu_s:9.2f}{r.idle_d_cpu_s:9.2f}"
        f"{r.external_tokens / prompt_tokens:9.2f}",
        flush=True,
    )


def run_transport(
    transport: Literal["mooncake", "nixl"],
    model: str,
    log_dir: Path,
    reqs: list[Request],
    rounds_per_arm: int,
    p_impl: Impl,
) -> dict[str, list[Round]]:
    from e2e.pd import start_deployment
    from e2e.servers import ServerSpec

    d_specs = {
        arm: ServerSpec(
            f"D-{arm}", transport, "kv_consumer", deadline_s=KVFAIL_DEADLINE_S, impl=arm
        )
        for arm in ARMS
    }
    t0 = time.monotonic()
    dep = start_deployment(
        transport, model, log_dir / transport, KVFAIL_DEADLINE_S, d_specs=d_specs, p_impl=p_impl
    )
    prompt_tokens = sum(len(r.prompt) for r in reqs)
    try:
        print(f"{transport}: P ({p_impl}) and both Ds ready in {time.monotonic() - t0:.1f} s")
        print(
            f"  {'round':22}{'wall s':>8}{'tok/s':>10}{'ttft p50':>10}{'ttft p99':>10}"
            f"{'D cpu s':>9}{'idle Ds':>9}{'kv/prmpt':>9}"
        )
        for arm in ARMS:  # one unmeasured round each: first pulls, first batch shapes
            print_round(run_round(dep, transport, arm, -1, reqs), prompt_tokens)
        done: dict[str, list[Round]] = {arm: [] for arm in ARMS}
        for arm in schedule(rounds_per_arm):
            r = run_round(dep, transport, arm, len(done[arm]), reqs)
            done[arm].append(r)
            print_round(r, prompt_tokens)
    finally:
        dep.close()
    for arm in ARMS:
        s = summarize(done[arm])
        tps = [r.tps for r in done[arm]]
        print(
            f"  {transport}/{arm} pooled over {s.rounds} rounds: {s.tps:.1f} tok/s (rounds "
            f"{min(tps):.1f}-{max(tps):.1f}), TTFT p50 {s.ttft_p50_s:.3f} s, p99 "
            f"{s.ttft_p99_s:.3f} s, D {s.d_cpu_ms_per_token:.2f} CPU-ms per output token"
        )
    return done


def generate_model(out_dir: Path) -> str:
    """The e2e tier's random-weight checkpoint, in a child (transformers stays out of here)."""
    subprocess.run(
        [sys.executable, "-m", "e2e.model", str(out_dir)],
        check=True,
        timeout=300,
        cwd=ROOT,
        capture_output=True,
    )
    return str(out_dir)


def main(argv: Sequence[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="16 requests, 2 rounds per arm")
    ap.add_argument("--requests", type=int, default=None, help="per round (default 64)")
    ap.add_argument("--rounds", type=int, default=None, help="measured, per arm (default 6)")
    ap.add_argument("--seed", type=int, default=17)
    ap.add_argument("--transport", choices=TRANSPORTS, action="append")
    ap.add_argument("--p", choices=ARMS, default="upstream", help="P's connector")
    ap.add_argument("--keep-logs", action="store_true", help="keep the servers' logs")
    args = ap.parse_args(argv)
    n = args.requests or (16 if args.quick else 64)
    rounds = args.rounds or (2 if args.quick else 6)
    transports = args.transport or list(TRANSPORTS)

    from e2e.servers import missing_serve_modules
    from kvfail.rig import shm

    missing = missing_serve_modules()
    if missing:
        raise SystemExit(f"vllm serve cannot import {missing}: run scripts/setup.sh")
    reqs = workload(n, args.seed)
    print(
        f"workload: {n} requests at once, seed {args.seed}, prompts "
        f"{min(len(r.prompt) for r in reqs)}-{max(len(r.prompt) for r in reqs)} tokens, "
        f"outputs {min(r.max_tokens for r in reqs)}-{max(r.max_tokens for r in reqs)} tokens; "
        f"{rounds} measured rounds per arm, in sets of flipping order; P runs {args.p}'s connector"
    )
    work = Path(tempfile.mkdtemp(prefix="kvfail-pd-overhead-"))
    segments = shm.segment_names()
    values: dict[str, float] = {}
    finished = False
    try:
        model = generate_model(work / "model")
        for transport in transports:
            arms = run_transport(transport, model, work / "logs", reqs, rounds, args.p)
            up = arms["upstream"]
            for arm in ARMS[1:]:
                pooled = ratios(transport, summarize(up), summarize(arms[arm]), arm)
                print(f"  pooled ratios ({arm}): " + figures(**pooled))
                values.update(paired_ratios(transport, up, arms[arm], arm))
        finished = True
    finally:
        # A server killed after its grace period cannot unlink its segments.
        shm.release_orphans(segments)
        if args.keep_logs or not finished:  # a failed run's server logs are its evidence
            print(f"logs in {work / 'logs'}")
        else:
            with contextlib.suppress(OSError):
                shutil.rmtree(work)
    print(last_line(values))


if __name__ == "__main__":
    main()
