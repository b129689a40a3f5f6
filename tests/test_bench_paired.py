"""bench/paired.py: overhead of interleaved runs (pure arithmetic: runs in `make test`)."""

from __future__ import annotations

import pytest

from bench.paired import paired_overhead


def test_pairs_keep_what_a_ratio_of_medians_loses():
    # Load drifts from run to run; the variant costs exactly 4% more within each pair.
    base = [1.0, 1.5, 0.8, 2.0, 1.1, 0.9, 1.7]
    var = [b * 1.04 for b in base]
    r = paired_overhead(base, var)
    assert r["median"] == pytest.approx(0.04, abs=1e-4) and r["pairs"] == 7
    lo, hi = r["ci95"]
    assert lo == pytest.approx(0.04, abs=1e-4) and hi == pytest.approx(0.04, abs=1e-4)


def test_interval_widens_with_noise_and_is_reproducible():
    base = [1.0] * 15
    var = [1.0 + d for d in (0.10, -0.02, 0.05, 0.01, 0.07, -0.04, 0.03, 0.02, 0.12, 0.00, 0.04, 0.06,
                             -0.01, 0.02, 0.03)]
    r = paired_overhead(base, var)
    lo, hi = r["ci95"]
    assert lo <= r["median"] <= hi and lo < hi
    assert r["median"] == pytest.approx(0.03)
    assert paired_overhead(base, var) == r  # fixed seed: same runs, same interval
    assert paired_overhead(base, var, seed=1)["median"] == r["median"]


def test_too_few_pairs_and_bad_input():
    assert paired_overhead([1.0, 2.0], [1.1, 2.2])["ci95"] is None
    with pytest.raises(ValueError, match="not paired"):
        paired_overhead([1.0, 2.0], [1.0])
    with pytest.raises(ValueError, match="no runs"):
        paired_overhead([], [])
    with pytest.raises(ValueError, match="positive"):
        paired_overhead([0.0, 1.0], [1.0, 1.0])


def test_a_bias_between_sets_of_runs_widens_the_clustered_interval():
    # Four sets of 10 pairs: within a set the variant costs about the same (+-0.4 points), but the
    # sets disagree (+0, +2, +5, +7%), as fresh process sets of a benchmark may.
    biases = [0.0, 0.02, 0.05, 0.07]
    base = [1.0 + 0.01 * (i % 3) for i in range(40)]
    var = [b * (1 + biases[i // 10] + 0.002 * (i % 5 - 2)) for i, b in enumerate(base)]
    flat = paired_overhead(base, var)
    sets = paired_overhead(base, var, clusters=4)
    assert sets["median"] == flat["median"] == pytest.approx(0.035, abs=1e-4)
    assert sets["per_cluster"] == pytest.approx(biases, abs=1e-4) and "per_cluster" not in flat
    (flo, fhi), (slo, shi) = flat["ci95"], sets["ci95"]
    assert shi - slo > 1.5 * (fhi - flo)  # drawing whole sets shows how far they disagree
    assert slo < 0.01 and shi > 0.06
    with pytest.raises(ValueError, match="equal groups"):
        paired_overhead(base, var, clusters=3)


def test_rotating_orders_put_every_kind_in_every_slot():
    from bench.signed_round import _orders

    assert _orders(["a", "b"], 3) == [["a", "b"], ["b", "a"], ["a", "b"]]
    orders = _orders(["a", "b", "c"], 6)
    for slot in range(3):
        assert sorted(o[slot] for o in orders) == ["a", "a", "b", "b", "c", "c"]
