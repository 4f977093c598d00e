"""The P/D overhead bench's pure parts, without servers: the seeded workload, the round
order, percentiles, pooling and the ratios on its last line. (The bench itself, with real
``vllm serve`` processes, runs as ``e2e/test_pd_overhead.py``, outside the default run.)"""

from __future__ import annotations

import math

import pytest

from bench.pd_overhead import (
    OUTPUT_TOKENS,
    PROMPT_TOKENS,
    ArmSummary,
    Round,
    Sample,
    last_line,
    paired_ratios,
    percentile,
    ratios,
    schedule,
    summarize,
    workload,
)


def test_workload_is_a_function_of_its_seed() -> None:
    a, b = workload(64, seed=17), workload(64, seed=17)
    assert a == b
    assert workload(64, seed=18) != a
    assert workload(8, seed=17) == a[:8]  # a smaller run is a prefix of the full one


def test_workload_mixes_lengths_within_the_servers_limits() -> None:
    reqs = workload(64, seed=17)
    lengths = {len(r.prompt) for r in reqs}
    outputs = {r.max_tokens for r in reqs}
    assert len(lengths) > 32 and len(outputs) > 16  # mixed, not one shape
    assert all(PROMPT_TOKENS[0] <= n <= PROMPT_TOKENS[1] for n in lengths)
    assert all(OUTPUT_TOKENS[0] <= n <= OUTPUT_TOKENS[1] for n in outputs)
    assert all(len(r.prompt) + r.max_tokens <= 512 for r in reqs)  # --max-model-len
    assert len({r.prompt for r in reqs}) == 64


def test_workload_refuses_an_empty_run() -> None:
    with pytest.raises(ValueError):
        workload(0, seed=1)


def test_percentile_interpolates_between_ranks() -> None:
    xs = [4.0, 1.0, 3.0, 2.0]
    assert percentile(xs, 0) == 1.0
    assert percentile(xs, 100) == 4.0
    assert percentile(xs, 50) == 2.5
    assert percentile(range(1, 101), 99) == pytest.approx(99.01)
    assert percentile([7.0], 99) == 7.0


@pytest.mark.parametrize("bad", [-1.0, 100.5])
def test_percentile_refuses_bad_input(bad: float) -> None:
    with pytest.raises(ValueError):
        percentile([1.0], bad)
    with pytest.raises(ValueError):
        percentile([], 50)


def test_each_set_of_rounds_flips_its_order() -> None:
    # Sets of adjacent rounds, one per arm, the order flipping from set to set.
    arms = ["upstream", "kvfail", "guard"]
    assert schedule(3) == [*arms, *arms[::-1], *arms]


def _round(arm: str, wall: float, tokens: list[int], ttfts: list[float], cpu: float) -> Round:
    samples = [Sample(True, n, t) for n, t in zip(tokens, ttfts, strict=True)]
    return Round("nixl", arm, 0, wall, samples, d_cpu_s=cpu)


def test_summary_pools_rounds_and_counts_only_good_requests() -> None:
    a = _round("kvfail", 2.0, [10, 30], [0.1, 0.3], 1.0)
    b = _round("kvfail", 3.0, [20, 40], [0.2, 0.4], 2.0)
    b.samples.append(Sample(False, 5, None, "finish_reason=error"))
    assert b.failed == 1 and b.tokens == 60 and b.tps == 20.0
    s = summarize([a, b])
    assert s.tps == 100 / 5.0
    assert s.ttft_p50_s == pytest.approx(0.25)
    assert s.ttft_p99_s == pytest.approx(0.397)
    assert s.d_cpu_ms_per_token == pytest.approx(30.0)
    assert s.rounds == 2


def test_ratios_are_kvfail_over_upstream_and_named_per_transport() -> None:
    up = ArmSummary(tps=100.0, ttft_p50_s=0.5, ttft_p99_s=2.0, d_cpu_ms_per_token=1.0)
    kv = ArmSummary(tps=99.0, ttft_p50_s=0.51, ttft_p99_s=1.9, d_cpu_ms_per_token=1.0)
    r = ratios("mooncake", up, kv)
    assert r == {
        "pd_tps_ratio_mooncake": 0.99,
        "pd_ttft_p50_ratio_mooncake": 1.02,
        "pd_ttft_p99_ratio_mooncake": 0.95,
    }
    zero = ArmSummary(tps=0.0, ttft_p50_s=0.0, ttft_p99_s=0.0, d_cpu_ms_per_token=0.0)
    assert all(math.isnan(v) for v in ratios("nixl", zero, kv).values())


def test_last_line_puts_throughput_first_as_documented() -> None:
    up = ArmSummary(tps=100.0, ttft_p50_s=0.5, ttft_p99_s=2.0, d_cpu_ms_per_token=1.0)
    values = {**ratios("mooncake", up, up), **ratios("nixl", up, up)}
    names = [pair.split("=")[0] for pair in last_line(values).split()]
    assert names == [
        "pd_tps_ratio_mooncake",
        "pd_tps_ratio_nixl",
        "pd_ttft_p50_ratio_mooncake",
        "pd_ttft_p99_ratio_mooncake",
        "pd_ttft_p50_ratio_nixl",
        "pd_ttft_p99_ratio_nixl",
    ]


def test_paired_ratios_take_the_median_pair_so_one_slow_round_does_not_decide() -> None:
    up = [_round("upstream", 1.0, [100], [1.0], 0.0) for _ in range(3)]
    kv = [
        _round("kvfail", 1.0, [99], [1.0], 0.0),
        _round("kvfail", 1.0, [101], [1.02], 0.0),
        _round("kvfail", 4.0, [100], [3.0], 0.0),  # a burst of foreign load hit this round
    ]
    r = paired_ratios("nixl", up, kv)
    assert r["pd_tps_ratio_nixl"] == 0.99
    assert r["pd_ttft_p50_ratio_nixl"] == 1.02
    with pytest.raises(ValueError):
        paired_ratios("nixl", up, kv[:2])


def test_the_guard_column_has_its_own_names_and_a_spread() -> None:
    up = [_round("upstream", 1.0, [100], [1.0], 0.0) for _ in range(3)]
    guard = [_round("guard", 1.0, [n], [1.0], 0.0) for n in (97, 99, 100)]
    r = paired_ratios("mooncake", up, guard, "guard")
    assert r == {
        "pd_guard_tps_ratio_mooncake": 0.99,
        "pd_guard_ttft_p50_ratio_mooncake": 1.0,
        "pd_guard_ttft_p99_ratio_mooncake": 1.0,
        "pd_guard_tps_ratio_spread_mooncake": 0.03,
    }
    names = [
        pair.split("=")[0] for pair in last_line({**r, **paired_ratios("mooncake", up, up)}).split()
    ]
    assert names[:4] == [
        "pd_guard_tps_ratio_mooncake",
        "pd_guard_tps_ratio_spread_mooncake",
        "pd_tps_ratio_mooncake",
        "pd_tps_ratio_spread_mooncake",
    ]  # throughput first, then the TTFT ratios
