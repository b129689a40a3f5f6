"""The pure stream windowing (edgenode/streams/window.py) and payload formats (formats.py)."""

from __future__ import annotations

import json
import struct

import numpy as np
import pytest

from edgenode.streams.formats import FrameClock, parse_f32, parse_json, parse_senml
from edgenode.streams.window import Outcome, Windower, WindowSpec

RATE = 100.0


def feed(w: Windower, slots, channels=1, value=lambda s: float(s)):
    outs, wins = [], []
    for s in slots:
        o, got = w.push(s / RATE, {c: value(s) + 1000 * c for c in range(channels)})
        outs.append(o)
        wins += got
    return outs, wins


def test_in_order_windows_with_hop_and_normalisation() -> None:
    w = Windower(WindowSpec(channels=2, rate_hz=RATE, length=4, hop=2, mean=(1.0, 1000.0), std=(2.0, 1.0)))
    outs, wins = feed(w, range(10), channels=2)
    assert set(outs) == {Outcome.ACCEPTED}
    # delay 0: a slot is final when it arrives; windows at rows 0-3, 2-5, 4-7, 6-9
    assert [round(x.start_s * RATE) for x in wins] == [0, 2, 4, 6]
    raw = np.array([[s, 1000 + s] for s in range(6, 10)], np.float32)
    np.testing.assert_allclose(wins[-1].values, (raw - [1.0, 1000.0]) / [2.0, 1.0])
    assert wins[-1].values.dtype == np.float32 and wins[-1].values.shape == (4, 2)


def test_hop_longer_than_window_skips_rows() -> None:
    w = Windower(WindowSpec(channels=1, rate_hz=RATE, length=2, hop=5))
    _, wins = feed(w, range(13))
    assert [round(x.start_s * RATE) for x in wins] == [0, 5, 10]


def test_out_of_order_within_delay_is_placed_late_is_dropped() -> None:
    w = Windower(WindowSpec(channels=1, rate_hz=RATE, length=6, hop=6, delay=2))
    outs, wins = feed(w, [0, 1, 3, 2, 4, 5, 6, 7, 1])
    assert outs[3] == Outcome.OUT_OF_ORDER  # slot 2 after 3, within the 2-slot delay
    assert outs[-1] == Outcome.LATE  # slot 1 is final by then
    assert len(wins) == 1
    np.testing.assert_array_equal(wins[0].values[:, 0], [0, 1, 2, 3, 4, 5])  # back in time order


def test_duplicates_are_dropped_and_the_first_value_kept() -> None:
    w = Windower(WindowSpec(channels=1, rate_hz=RATE, length=3, hop=3, delay=2))
    assert w.push(0.0, {0: 1.0})[0] == Outcome.ACCEPTED
    assert w.push(0.0, {0: 9.0})[0] == Outcome.DUPLICATE
    assert w.push(0.001, {0: 9.0})[0] == Outcome.DUPLICATE  # rounds to the same slot
    w.push(0.01, {0: 2.0})
    w.push(0.02, {0: 3.0})
    assert w.push(0.01, {0: 7.0})[0] == Outcome.DUPLICATE  # open slot, already filled
    _, wins = w.push(0.04, {0: 5.0})  # slots 0..2 final: the window, with the first values
    assert len(wins) == 1 and wins[0].values[:, 0].tolist() == [1.0, 2.0, 3.0]


@pytest.mark.parametrize("t,values", [
    (float("nan"), {0: 1.0}), (float("inf"), {0: 1.0}), (0.0, {0: float("nan")}), (0.0, {5: 1.0}),
    (0.0, {}), ("x", {0: 1.0}), (0.0, {0: "y"}), (1e300, {0: 1.0}), (0.0, {-1: 1.0}),
])
def test_malformed_readings_are_dropped_and_change_nothing(t, values) -> None:
    w = Windower(WindowSpec(channels=1, rate_hz=RATE, length=2, hop=2))
    assert w.push(t, values) == (Outcome.MALFORMED, [])
    assert w.held_slots == 0
    feed(w, [0])
    assert w.push(t, values)[0] == Outcome.MALFORMED
    assert w.push(0.01, {0: 1.0})[1]  # the stream goes on


def test_short_gap_is_bridged_long_gap_starts_a_new_window() -> None:
    w = Windower(WindowSpec(channels=1, rate_hz=RATE, length=5, hop=5, gap_slots=2))
    _, wins = feed(w, [0, 1, 4, 5, 6])  # slots 2, 3 missing: 2 <= tolerance, held at 1's value
    assert len(wins) == 1 and wins[0].values[:, 0].tolist() == [0, 1, 1, 1, 4]
    assert w.gaps == 0
    w2 = Windower(WindowSpec(channels=1, rate_hz=RATE, length=5, hop=5, gap_slots=2))
    _, wins = feed(w2, [0, 1, 2, 6, 7, 8, 9, 10, 11])  # 3 missing slots: longer than the tolerance
    assert w2.gaps == 1
    assert len(wins) == 1 and wins[0].values[:, 0].tolist() == [6, 7, 8, 9, 10]  # never 0..2 + 6..


def test_one_channel_silent_too_long_ends_the_segment() -> None:
    w = Windower(WindowSpec(channels=2, rate_hz=RATE, length=3, hop=3, gap_slots=1))
    w.push(0.0, {0: 0.0, 1: 0.0})
    wins = []
    for s in range(1, 4):  # channel 1 silent for 3 slots
        wins += w.push(s / RATE, {0: float(s)})[1]
    assert w.gaps == 1 and wins == []
    for s in range(4, 7):
        wins += w.push(s / RATE, {0: float(s), 1: 1.0})[1]
    assert len(wins) == 1 and wins[0].values[:, 0].tolist() == [4, 5, 6]


def test_bounded_under_a_flood() -> None:
    spec = WindowSpec(channels=3, rate_hz=1000.0, length=64, hop=32, gap_slots=10, delay=20)
    w = Windower(spec)
    rng = np.random.default_rng(0)
    peak = 0
    for i in range(20_000):  # jittered, shuffled, duplicated, jumping readings
        t = (i + rng.integers(-30, 30)) / 1000.0 if i % 997 else rng.uniform(-1e6, 1e6)
        w.push(t, {int(rng.integers(0, 3)): float(rng.normal())})
        peak = max(peak, w.held_slots)
    assert peak <= spec.delay + 1 + spec.length


def test_flush_emits_only_whole_windows() -> None:
    w = Windower(WindowSpec(channels=1, rate_hz=RATE, length=3, hop=3, delay=5))
    _, wins = feed(w, range(5))
    assert wins == []
    wins = w.flush()
    assert len(wins) == 1 and wins[0].values[:, 0].tolist() == [0, 1, 2]


def test_senml_pack_resolves_base_fields_and_groups_by_time() -> None:
    pack = [{"bn": "urn:dev:m1:", "bt": 1.7e9, "n": "ax", "v": 1.0, "t": 0},
            {"n": "ay", "v": 2.0, "t": 0},
            {"n": "ax", "v": 3.0, "t": 0.01},
            {"n": "temp", "v": 20.0},
            {"n": "ax", "vs": "oops"},
            {"n": "ay", "v": float("nan") if False else None},
            "junk"]
    p = parse_senml(json.dumps(pack).encode(), {"urn:dev:m1:ax": 0, "urn:dev:m1:ay": 1}, now=0.0)
    assert p.readings == [(1.7e9, {0: 1.0, 1: 2.0}), (1.7e9 + 0.01, {0: 3.0})]
    assert p.unmapped == 1 and p.malformed == 3
    rel = parse_senml(b'[{"n":"ax","v":5,"t":-1}]', {"ax": 0}, now=1000.0)
    assert rel.readings == [(999.0, {0: 5.0})]  # RFC 8428: small times are relative to now
    for bad in (b"", b"{}", b"[]", b"not json", b"[NaN]", b'[{"n":"ax","v":NaN}]', b"[" * 100_000,
                b'[{"n":"ax","v":1' + b"0" * 400 + b"}]", b'[{"n":"ax","v":1e400}]', b'[{"n":"ax","v":true}]',
                b'[{"n":"ax","v":1,"t":"x"}]', b'[{"bn":5,"n":"ax","v":1}]'):
        assert parse_senml(bad, {"ax": 0}, now=0.0).malformed >= 1


def test_flat_json_and_raw_frames() -> None:
    p = parse_json(b'[{"t": 5, "x": 1, "y": 2, "z": 3}, {"t": "a", "x": 1}, {"x": 4}]', {"x": 0, "y": 1},
                   now=9.0)
    assert p.readings == [(5.0, {0: 1.0, 1: 2.0}), (9.0, {0: 4.0})]
    assert p.unmapped == 1 and p.malformed == 1
    frame = struct.pack("<6f", 1, 2, 3, 4, 5, 6)
    np.testing.assert_array_equal(parse_f32(frame, 2), [[1, 2], [3, 4], [5, 6]])
    assert parse_f32(frame[:-1], 2) is None and parse_f32(struct.pack("<2f", 1, float("inf")), 2) is None
    clock = FrameClock(rate_hz=100.0, tolerance_s=0.05)
    t0 = clock.start_of(10, arrival=100.0)
    assert clock.start_of(10, arrival=100.12) == pytest.approx(t0 + 0.1)  # continues the stream
    assert clock.start_of(10, arrival=105.0) == pytest.approx(104.9)  # after a gap: a new start
