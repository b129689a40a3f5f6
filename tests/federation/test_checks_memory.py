"""Update checks and the in-memory transport's fault injection."""

from __future__ import annotations

import numpy as np
import pytest

from federation.checks import all_finite, check_finite, clip_l2
from federation.errors import TransportError, UpdateRejected
from federation.memory import MemoryHub


def test_finite_checks_name_the_member() -> None:
    assert all_finite(np.zeros(0, np.float32)) and all_finite(np.ones(10, np.float32))
    big = np.full(10, 3e38, np.float32)  # the f32 sum overflows, yet every value is finite
    assert all_finite(big)
    for bad in (np.nan, np.inf, -np.inf):
        x = np.ones(100, np.float32)
        x[42] = bad
        assert not all_finite(x)
        with pytest.raises(UpdateRejected, match="node-7") as e:
            check_finite(x, member="node-7")
        assert e.value.member == "node-7" and e.value.hint


def test_clip_l2_scales_only_over_norm_vectors_and_copies() -> None:
    x = np.array([3, 4], np.float32)
    same, f = clip_l2(x, 10.0)
    assert same is x and f == 1.0
    y, f = clip_l2(x, 1.0)
    assert np.isclose(np.linalg.norm(y), 1.0) and np.isclose(f, 0.2) and x[0] == 3
    assert clip_l2(x, None)[0] is x
    with pytest.raises(ValueError):
        clip_l2(x, 0.0)


def _drain(t, timeout=0.05):
    out = []
    while (p := t.recv(timeout)) is not None:
        out.append(p)
    return out


def test_memory_transport_delivers_and_injects_faults() -> None:
    hub = MemoryHub()
    b = hub.transport("b")
    clean = hub.transport("a")
    clean.send("b", b"hello")
    assert _drain(b) == [b"hello"]
    with pytest.raises(TransportError, match="max_payload"):
        clean.send("b", bytes(clean.max_payload + 1))

    lossy = hub.transport("c", drop=0.3, duplicate=0.3, seed=1)
    for i in range(400):
        lossy.send("b", i.to_bytes(2, "big"))
    got = [int.from_bytes(p, "big") for p in _drain(b)]
    f = lossy.faults
    assert f.sent == 400 and 80 < f.dropped < 160 and f.duplicated > 50
    assert len(got) == 400 - f.dropped + f.duplicated

    shuffler = hub.transport("d", reorder=0.5, reorder_window=0.02, seed=2)
    for i in range(100):
        shuffler.send("b", i.to_bytes(2, "big"))
    got = [int.from_bytes(p, "big") for p in _drain(b)]
    assert sorted(got) == list(range(100)) and got != list(range(100))

    flipper = hub.transport("e", corrupt=1.0, seed=3)
    flipper.send("b", bytes(16))
    (p,) = _drain(b)
    assert p != bytes(16) and sum(bin(x).count("1") for x in p) == 1


def test_killed_members_neither_send_nor_receive() -> None:
    hub = MemoryHub()
    a, b = hub.transport("a", kill_after=2), hub.transport("b")
    for i in range(5):
        a.send("b", bytes([i]))
    assert _drain(b) == [b"\x00", b"\x01"]
    assert a.dead and not hub.alive("a")
    b.send("a", b"x")
    assert a.recv(0.05) is None
    hub.kill("b")
    a2 = hub.transport("a")  # a restarted member registers again
    a2.send("b", b"y")
    assert b.recv(0.05) is None
