"""Benchmark arithmetic on synthetic traces (no model, no MLX)."""

import pytest

from dflash_mlx.bench import metrics
from dflash_mlx.bench.metrics import Trace
from dflash_mlx.generate import tau
from dflash_mlx.progress import eta_seconds


def test_tau_counts_the_bonus_token_per_cycle():
    # cycles accepting 0, 3 and 15 drafted tokens commit 1, 4 and 16 tokens
    assert tau([0, 3, 15]) == pytest.approx(21 / 3)
    assert tau([]) == 0.0


def test_accept_histogram_has_one_bin_per_possible_accept_length():
    assert metrics.accept_histogram([0, 0, 3, 7], 8) == [2, 0, 0, 1, 0, 0, 0, 1]
    with pytest.raises(ValueError):
        metrics.accept_histogram([8], 8)  # at most B-1 drafted tokens exist


def test_generation_rate_excludes_prefill_tokens_and_time():
    t = Trace(tokens=list(range(11)), prompt_tokens=100, first_tokens=1,
              prefill_s=5.0, generation_s=2.0)
    assert t.generated == 10
    assert metrics.generation_tps(t) == pytest.approx(5.0)
    assert metrics.prefill_tps(t) == pytest.approx(20.0)
    # a stream that ended on its prefill token generated nothing
    assert metrics.generation_tps(Trace([1], 10, 1, 1.0, 0.0)) == 0.0


def test_speedup_efficiency_and_limit():
    s = metrics.speedup(30.0, 10.0)
    assert s == pytest.approx(3.0)
    assert metrics.efficiency(s, 4.0) == pytest.approx(0.75)
    # tau 4, decode 100 ms, 16-token verify 200 ms: at best 2x
    assert metrics.speedup_limit(4.0, 0.100, 0.200) == pytest.approx(2.0)
    assert metrics.speedup(1.0, 0.0) == 0.0


def test_first_mismatch_ignores_trailing_stop_tokens_only():
    eos = [2]
    assert metrics.first_mismatch([5, 6, 2], [5, 6], eos) is None
    assert metrics.first_mismatch([5, 6, 7], [5, 9, 7], eos) == 1
    assert metrics.first_mismatch([5, 6, 7], [5, 6], eos) == 2  # one stopped early
    assert metrics.first_mismatch([5, 2, 6], [5, 2, 6], eos) is None
    assert metrics.strip_stop([2, 5, 2, 2], eos) == [2, 5]


def test_per_cycle_split_divides_sums_by_cycles():
    split = metrics.per_cycle({"draft": 1.0, "verify": 3.0, "rollback": 0.5}, 10)
    assert split == pytest.approx({"draft": 0.1, "verify": 0.3, "rollback": 0.05, "other": 0.0})
    assert metrics.per_cycle(None, 3) is None


def _row(accept, generated, gen_s, base_generated, base_s, ratio=0.5, match=True):
    return {
        "accept_lengths": accept, "accept_hist": metrics.accept_histogram(accept, 4),
        "generated": generated, "generation_s": gen_s,
        "baseline_generated": base_generated, "baseline_generation_s": base_s,
        "prompt_tokens": 10, "prefill_s": 1.0, "baseline_prefill_s": 0.5,
        "cycle_time_sums": {"draft": 0.2, "verify": 0.6, "rollback": 0.1, "other": 0.1},
        "profiled_cycles": len(accept), "forward_ratio": ratio, "tokens_match": match,
    }


def test_aggregate_pools_tokens_and_time_rather_than_averaging_ratios():
    rows = [_row([3, 3], 8, 1.0, 8, 2.0), _row([0, 0, 0, 1], 5, 4.0, 5, 1.0, match=False)]
    s = metrics.aggregate(rows)
    assert s["cycles"] == 6
    assert s["tau"] == pytest.approx((4 + 4 + 1 + 1 + 1 + 2) / 6)
    assert s["dflash_tps"] == pytest.approx(13 / 5.0)
    assert s["baseline_tps"] == pytest.approx(13 / 3.0)
    assert s["speedup"] == pytest.approx(3.0 / 5.0)
    assert s["efficiency"] == pytest.approx(s["speedup"] / s["tau"])
    assert s["limit"] == pytest.approx(s["tau"] * 0.5)
    assert s["accept_hist"] == [3, 1, 0, 2]
    assert s["cycle_split_s"]["verify"] == pytest.approx(1.2 / 6)
    assert s["mismatches"] == 1
    assert s["prefill_tps"] == pytest.approx(20 / 2.0)


def test_eta_extrapolates_mean_time_per_unit():
    assert eta_seconds(0, 10, 5.0) is None
    assert eta_seconds(2, 10, 30.0) == pytest.approx(120.0)
