"""Codecs and their documented error bounds, alone and inside the ring."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.extra.numpy import arrays

from federation import compression as comp
from federation.errors import FrameError
from federation.framing import Codec
from tests.federation.ringutil import assert_identical, close_all, ids, make_ring, run_members

finite32 = st.floats(-1e4, 1e4, width=32, allow_nan=False)


_payload = comp.join_pieces


@settings(max_examples=60, deadline=None)
@given(x=arrays(np.float32, st.integers(0, 300), elements=finite32))
def test_f32_is_exact_and_f16_within_relative_bound(x) -> None:
    assert comp.decode(Codec.F32, _payload(comp.encode(Codec.F32, x)), x.size).tobytes() == x.tobytes()
    y = comp.decode(Codec.F16, _payload(comp.encode(Codec.F16, x)), x.size)
    bound = np.maximum(np.abs(x) * 2.0**-11, 2.0**-25)
    assert np.all(np.abs(y - x) <= bound)


def test_f16_saturates_instead_of_overflowing() -> None:
    x = np.array([1e6, -1e6, 3.0], np.float32)
    y = comp.decode(Codec.F16, _payload(comp.encode(Codec.F16, x)), 3)
    assert np.all(np.isfinite(y)) and y[0] == comp.F16_MAX and y[1] == -comp.F16_MAX


@settings(max_examples=60, deadline=None)
@given(x=arrays(np.float32, st.integers(1, 300), elements=finite32))
def test_int8_error_is_at_most_half_a_step(x) -> None:
    y = comp.decode(Codec.INT8, _payload(comp.encode(Codec.INT8, x)), x.size)
    step = np.float32(np.abs(x).max() / 127)
    assert np.all(np.abs(y - x) <= step / 2 * (1 + 1e-5) + 1e-30)


def test_topk_keeps_the_largest_exactly_and_feedback_keeps_the_rest() -> None:
    rng = np.random.default_rng(0)
    x = rng.standard_normal(1000).astype(np.float32)
    residual = np.zeros_like(x)
    y = comp.decode(Codec.TOPK, _payload(comp.encode(Codec.TOPK, x, residual, topk_ratio=0.05)), x.size)
    kept = np.flatnonzero(y)
    assert kept.size == 50
    assert np.array_equal(np.sort(kept), np.sort(np.argsort(-np.abs(x))[:50]))
    assert np.array_equal(y[kept], x[kept])
    np.testing.assert_array_equal(y + residual, x)  # nothing lost: the residual holds the remainder


def test_malformed_payloads_are_frame_errors() -> None:
    with pytest.raises(FrameError):
        comp.decode(Codec.F32, b"\0" * 7, 2)
    with pytest.raises(FrameError):
        comp.decode(Codec.INT8, b"\0" * 4, 2)
    bad = np.array([2], "<u4").tobytes() + np.array([1, 1], "<u4").tobytes() + b"\0" * 8  # repeated index
    with pytest.raises(FrameError, match="increasing"):
        comp.decode(Codec.TOPK, bad, 4)
    with pytest.raises(ValueError, match="compression"):
        comp.codec_for("gzip")


def _ring_round(engines, vecs, tag, **kw):
    group = list(engines)
    fns = {m: (lambda m=m: engines[m].allreduce(vecs[m], group=group, tag=tag, **kw)) for m in engines}
    return assert_identical(run_members(fns))


def test_fp16_ring_within_documented_bound_and_bit_identical() -> None:
    n = 5
    hub, engines = make_ring(n, max_payload=2048)
    try:
        rng = np.random.default_rng(1)
        vecs = {m: rng.standard_normal(4000).astype(np.float32) * 100 for m in engines}
        got = _ring_round(engines, vecs, "h", op="sum", compression="fp16", timeout=10)
        exact = np.sum([v.astype(np.float64) for v in vecs.values()], axis=0)
        bound = n * 2.0**-11 * np.sum([np.abs(v) for v in vecs.values()], axis=0) * 1.01 + 1e-6
        assert np.all(np.abs(got - exact) <= bound)
        assert np.abs(got - exact).max() > 0  # really lossy, so the bound was exercised
    finally:
        close_all(engines)


def test_int8_error_feedback_keeps_accumulated_error_bounded() -> None:
    n, length, rounds = 4, 3000, 25
    hub, engines = make_ring(n, max_payload=2048)
    try:
        rng = np.random.default_rng(2)
        acc_err = np.zeros(length)
        abs_err_sum = np.zeros(length)
        xmax = 0.0
        for t in range(rounds):
            vecs = {m: rng.standard_normal(length).astype(np.float32) for m in engines}
            xmax = max(xmax, max(float(np.abs(v).max()) for v in vecs.values()))
            got = _ring_round(engines, vecs, f"q{t}", op="sum", compression="int8", timeout=10)
            err = got - np.sum([v.astype(np.float64) for v in vecs.values()], axis=0)
            acc_err += err
            abs_err_sum += np.abs(err)
        # Telescoping: sum of results - sum of exact = -(sum of the members' final residuals).
        residuals = np.sum([e.feedback_residual for e in engines.values()], axis=0)
        np.testing.assert_allclose(acc_err, -residuals, atol=1e-3)
        # Each member's residual is at most half a step of what it sent: a partial sum of at most
        # n vectors, so |step| <= n * xmax / 127. The bound does not depend on the number of rounds.
        assert np.abs(acc_err).max() <= n * (n * xmax / 254) * 1.05
        assert abs_err_sum.mean() > 5 * np.abs(acc_err).mean()  # without the telescope it would grow
    finally:
        close_all(engines)


def test_topk_with_error_feedback_converges_in_toy_sgd() -> None:
    n, dim = 4, 64
    rng = np.random.default_rng(3)
    w_true = rng.standard_normal(dim)
    data = {}
    for m in ids(n):
        a = rng.standard_normal((200, dim))
        data[m] = (a, a @ w_true + 0.01 * rng.standard_normal(200))
    hub, engines = make_ring(n, engine_kw=dict(topk_ratio=0.1))

    def train(m):
        a, b = data[m]
        w = np.zeros(dim, np.float32)
        for t in range(150):
            g = (a.T @ (a @ w - b) / len(b)).astype(np.float32)
            w = w - 0.3 * engines[m].allreduce(g, group=ids(n), tag=f"sgd{t}", compression="topk", timeout=10)
        return w

    try:
        res = run_members({m: (lambda m=m: train(m)) for m in engines})
        w = assert_identical(res)
        assert np.linalg.norm(w - w_true) < 0.02 * np.linalg.norm(w_true)
    finally:
        close_all(engines)
