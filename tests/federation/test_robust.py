"""Outlier screening, claim-checked allreduce and robust aggregation (federation/robust.py):
pure functions against numpy, the claim check on a real in-memory ring (a member lying about its
norm, an excluded member still sending data) and the aggregates against numpy's."""

from __future__ import annotations

import numpy as np
import pytest

from federation import robust
from federation.errors import UpdateRejected
from federation.schedule import chunk_bounds
from tests.federation.ringutil import allreduce_all, assert_identical, close_all, ids, make_ring


def test_chunk_norms_match_numpy_and_never_undercut():
    rng = np.random.default_rng(0)
    x = rng.normal(size=1001).astype(np.float32)
    got = robust.chunk_norms(x, 4)
    for c, (a, b) in enumerate(chunk_bounds(4, x.size)):
        exact = np.linalg.norm(x[a:b].astype(np.float64))
        assert float(got[c]) >= exact and float(got[c]) == pytest.approx(exact, rel=1e-6)
    bad = x.copy()
    bad[3] = np.inf
    assert (robust.chunk_norms(bad, 4) == robust.NON_FINITE).all()
    assert robust.chunk_norms(np.zeros(2, np.float32), 4).tolist() == [0, 0, 0, 0]  # empty chunks


def test_screen_excludes_outliers_and_non_finite_only_among_contributors():
    s = robust.screen([1.0, 1.2, 1000.0, 0.9, float("nan"), 0.0], [True] * 5 + [False], 10.0)
    assert s.kept == (0, 1, 3) and set(s.excluded) == {2, 4}
    assert "median" in s.excluded[2] and "non-finite" in s.excluded[4]
    assert robust.screen([1.0, 1000.0, 1.0], [True] * 3, 0.0).kept == (0, 1, 2)  # factor 0 = off
    # two members: the median sits between them, nobody is an outlier (documented limit)
    assert robust.screen([1.0, 1000.0], [True, True], 10.0).kept == (0, 1)


def test_aggregates_match_numpy():
    rng = np.random.default_rng(1)
    rows = rng.normal(size=(5, 33)).astype(np.float32)
    want = np.median(rows, axis=0).astype(np.float32)
    np.testing.assert_array_equal(robust.aggregate(rows, "median"), want)
    s = np.sort(rows, axis=0)
    np.testing.assert_allclose(robust.aggregate(rows, "trimmed_mean", 0.2), s[1:4].mean(axis=0), rtol=1e-6)
    rows[2] *= 1e3  # one wild row barely moves the robust aggregates
    assert np.abs(robust.aggregate(rows, "median")).max() < 10
    assert np.abs(robust.aggregate(rows, "trimmed_mean")).max() < 10
    np.testing.assert_allclose(robust.aggregate(rows[:2], "trimmed_mean"), rows[:2].mean(axis=0), rtol=1e-6)


# Around the ring, or the direct path small F32 vectors take by default (federation/ring.py).
ALGOS = {"ring": {"direct_max_bytes": 0}, "direct": {"direct_max_bytes": 1 << 30}}


def _claims(vecs, members):
    return np.stack([robust.chunk_norms(vecs[m], len(members)) for m in members])


@pytest.mark.parametrize("compression,algo", [("none", "ring"), ("none", "direct"), ("fp16", "ring")])
def test_honest_claims_pass_and_the_sum_is_exact(compression, algo):
    members = ids(4)
    rng = np.random.default_rng(2)
    vecs = {m: rng.normal(size=5000).astype(np.float32) for m in members}
    hub, eng = make_ring(4, max_payload=4096, engine_kw=ALGOS[algo])  # several parts per chunk
    try:
        res = allreduce_all(eng, vecs, tag="t", op="mean", timeout=10, compression=compression,
                            claims=_claims(vecs, members))
        out = assert_identical(res)
        np.testing.assert_allclose(out, np.mean(list(vecs.values()), axis=0), rtol=1e-2, atol=1e-3)
    finally:
        close_all(eng)


@pytest.mark.parametrize("algo", ALGOS)
@pytest.mark.parametrize("liar", ["m0", "m2"])
def test_a_member_lying_about_its_norm_is_caught_and_named(liar, algo):
    members = ids(4)
    rng = np.random.default_rng(3)
    vecs = {m: rng.normal(size=2000).astype(np.float32) for m in members}
    claims = _claims(vecs, members)  # the liar claims its honest norm ...
    vecs[liar] = vecs[liar] * np.float32(1e3)  # ... and sends 1000x
    hub, eng = make_ring(4, engine_kw=ALGOS[algo])
    try:
        res = allreduce_all(eng, vecs, tag="t", op="mean", timeout=10, claims=claims)
    finally:
        close_all(eng)
    for m in members:
        assert isinstance(res[m], UpdateRejected), (m, res[m])
        assert res[m].member == liar, (m, str(res[m]))


@pytest.mark.parametrize("algo", ALGOS)
def test_an_excluded_member_that_still_sends_is_caught(algo):
    members = ids(3)
    rng = np.random.default_rng(4)
    vecs = {m: rng.normal(size=300).astype(np.float32) for m in members}
    claims = _claims(vecs, members)
    claims[1] = 0  # everyone decided m1 is excluded (it must send zeros) ...
    hub, eng = make_ring(3, engine_kw=ALGOS[algo])
    try:
        res = allreduce_all(eng, vecs, tag="t", op="sum", timeout=10, claims=claims)
    finally:
        close_all(eng)
    assert all(isinstance(res[m], UpdateRejected) and res[m].member == "m1" for m in members), res


@pytest.mark.parametrize("size", [0, 7, 5000])
def test_exchange_gives_every_member_every_row_exactly(size):
    members = ids(4)
    rng = np.random.default_rng(5)
    vecs = {m: rng.normal(size=size).astype(np.float32) for m in members}
    vecs["m2"][:1] = np.nan  # carried as sent: screening decides what to do with it
    hub, eng = make_ring(4, max_payload=4096)  # several parts per row
    try:
        from tests.federation.ringutil import run_members

        res = run_members({m: (lambda m=m: eng[m].exchange(vecs[m], group=members, tag="x", timeout=10))
                           for m in members})
    finally:
        close_all(eng)
    want = np.stack([vecs[m] for m in members])
    for m in members:
        assert isinstance(res[m], np.ndarray), res[m]
        assert res[m].tobytes() == want.tobytes()


def _screen_for(members, me, vec, factor=10.0):
    """What a node passes as ``screen``: its claim row and the shared decision rule."""
    n = len(members)

    def decide(rows, vectors):
        s = robust.screen(robust.norms_from_claims(rows), [True] * n, factor)
        bounds = rows.astype(np.float64)
        for j in range(n):
            if j not in s.kept:
                bounds[j] = 0
        return bounds, members.index(me) in s.kept

    return robust.chunk_norms(vec, n), decide


@pytest.mark.parametrize("algo", ALGOS)
@pytest.mark.parametrize("lie", [False, True])
def test_screen_inside_the_allreduce_excludes_an_outlier_or_catches_a_liar(lie, algo):
    members = ids(4)
    rng = np.random.default_rng(6)
    vecs = {m: rng.normal(size=3000).astype(np.float32) for m in members}
    vecs["m1"] = vecs["m1"] * np.float32(1e3)
    screens = {}
    for m in members:
        row, decide = _screen_for(members, m, vecs[m])
        if lie and m == "m1":
            row = row / np.float32(1e3)  # claims its honest norm, sends 1000x
        screens[m] = (row, decide)
    hub, eng = make_ring(4, max_payload=4096, engine_kw=ALGOS[algo])
    try:
        from tests.federation.ringutil import run_members

        res = run_members({m: (lambda m=m: eng[m].allreduce(vecs[m], group=members, tag="s", op="sum",
                                                            timeout=10, screen=screens[m])) for m in members})
    finally:
        close_all(eng)
    if lie and algo == "ring":
        assert all(isinstance(res[m], UpdateRejected) and res[m].member == "m1" for m in members), res
    else:  # on the direct path nobody claims: m1's actual 1000x row is screened out either way
        out = assert_identical(res)
        want = sum(vecs[m].astype(np.float64) for m in members if m != "m1")
        np.testing.assert_allclose(out, want, rtol=1e-5, atol=1e-5)
