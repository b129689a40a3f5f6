"""Binary frames: round trip, and every kind of damage is a FrameError."""

from __future__ import annotations

import struct
import zlib

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from federation.errors import FrameError
from federation.framing import (
    HEADER,
    MAX_OVERHEAD,
    VERSION,
    Codec,
    FrameKind,
    Phase,
    abort_info,
    ack_keys,
    decode,
    encode,
    encode_abort,
    encode_ack,
)


def sample(payload=None, **kw) -> bytes:
    x = np.arange(10, dtype=np.float32) if payload is None else payload
    fields = dict(swarm="default", tag="r1/3", sender="node-a", codec=Codec.F32, step=2, chunk=5, part=1,
                  nparts=3, offset=100, count=x.size, total=1000, payload=[x])
    fields.update(kw)
    return encode(FrameKind.DATA, Phase.ALL_GATHER, **fields)


def test_round_trip_keeps_every_field_and_payload_is_zero_copy() -> None:
    x = np.linspace(-1, 1, 10, dtype=np.float32)
    buf = sample(x)
    fr = decode(buf)
    assert (fr.kind, fr.phase, fr.codec) == (FrameKind.DATA, Phase.ALL_GATHER, Codec.F32)
    got = (fr.step, fr.chunk, fr.part, fr.nparts, fr.offset, fr.count, fr.total)
    assert got == (2, 5, 1, 3, 100, 10, 1000)
    assert (fr.swarm, fr.tag, fr.sender) == ("default", "r1/3", "node-a")
    assert np.array_equal(np.frombuffer(fr.payload, np.float32), x)
    assert fr.payload.obj is buf  # a view into the received bytes, not a copy
    ids = HEADER.size + len("default") + len("r1/3") + len("node-a")
    assert len(buf) == ids + (-ids % 8) + 40 + 4
    assert np.frombuffer(fr.payload, np.float32).flags.aligned
    assert fr.key == (int(Phase.ALL_GATHER), 2, 5, 1)


def test_ack_and_abort_frames() -> None:
    fr = decode(sample())
    ack = decode(encode_ack(fr, sender="node-b"))
    assert ack.kind == FrameKind.ACK and ack.key == fr.key and ack.sender == "node-b"
    assert len(ack.payload) == 0 and ack_keys(ack) == [fr.key]
    others = [decode(sample(part=p, step=s)) for p, s in [(0, 2), (2, 7)]]
    batch = decode(encode_ack(fr, sender="node-b", more=others))
    assert ack_keys(batch) == [fr.key, (int(Phase.ALL_GATHER), 2, 5, 0), (int(Phase.ALL_GATHER), 7, 5, 2)]
    with pytest.raises(FrameError, match="12-byte keys"):  # valid checksum, not a list of keys
        decode(encode(FrameKind.ACK, Phase.ALL_GATHER, swarm="s", tag="t", sender="b", payload=[b"12345"]))
    ab = decode(encode_abort(swarm="s", tag="t", sender="x", member="y", reason="NaN from y", rejected=True))
    assert ab.kind == FrameKind.ABORT and abort_info(ab) == ("y", "NaN from y", True)


@settings(max_examples=200, deadline=None)
@given(data=st.data())
def test_any_flipped_bit_is_rejected(data) -> None:
    buf = bytearray(sample())
    i = data.draw(st.integers(0, len(buf) - 1))
    buf[i] ^= 1 << data.draw(st.integers(0, 7))
    with pytest.raises(FrameError):
        decode(bytes(buf))


@given(cut=st.integers(0, 100))
def test_truncated_frames_are_rejected(cut: int) -> None:
    buf = sample()
    with pytest.raises(FrameError):
        decode(buf[: max(0, len(buf) - 1 - cut)])


def _reseal(buf: bytearray) -> bytes:
    """Recompute the crc so that only the semantic check can fail."""
    struct.pack_into("<I", buf, len(buf) - 4, zlib.crc32(bytes(buf[:-4])))
    return bytes(buf)


@pytest.mark.parametrize(
    ("offset", "value", "message"),
    [(0, b"XX", "magic"), (2, bytes([VERSION + 1]), "version"), (2, b"\x01", "version"),
     (3, b"\x09", "unknown"), (4, b"\x09", "unknown"), (5, b"\x09", "unknown")],
)
def test_bad_magic_version_and_codes_are_rejected_even_with_a_valid_crc(offset, value, message) -> None:
    buf = bytearray(sample())
    buf[offset : offset + len(value)] = value
    with pytest.raises(FrameError, match=message):
        decode(_reseal(buf))


def test_inconsistent_lengths_and_ranges_are_rejected() -> None:
    buf = bytearray(sample())
    struct.pack_into("<I", buf, 40, 44)  # payload_len disagrees with the frame size
    with pytest.raises(FrameError, match="length"):
        decode(_reseal(buf))
    with pytest.raises(FrameError, match="beyond"):
        decode(sample(offset=995))  # 995 + 10 > total 1000
    with pytest.raises(FrameError, match="part"):
        decode(sample(part=3, nparts=3))
    with pytest.raises(FrameError):
        sample(sender="x" * 300)
    with pytest.raises(FrameError, match="UTF-8"):
        buf = bytearray(sample())
        buf[HEADER.size] = 0xFF  # first byte of the swarm id
        decode(_reseal(buf))


def test_max_overhead_bounds_every_header() -> None:
    for n in range(250, 256):
        buf = encode(FrameKind.DATA, Phase.REDUCE_SCATTER, swarm="s" * n, tag="t" * 255, sender="m" * 255)
        assert len(buf) <= MAX_OVERHEAD
        assert decode(buf).sender == "m" * 255


def test_frame_checksum_is_the_ieee_crc32_of_zlib() -> None:
    """The accelerated CRC (zlib-ng when installed) must equal zlib's IEEE CRC-32 bit for bit,
    or members with and without it could not talk."""
    from federation import framing

    data = np.random.default_rng(0).standard_normal(100_003).astype(np.float32)
    view = memoryview(data).cast("B")[5:]
    assert framing.crc32(view) == zlib.crc32(view)
    assert framing.crc32(view, 12345) == zlib.crc32(view, 12345)
    buf = sample(data)
    assert struct.unpack("<I", buf[-4:])[0] == zlib.crc32(buf[:-4])
