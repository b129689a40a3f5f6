"""Binary frames of the allreduce (and broadcast / star) traffic.

Every transport message is exactly one frame. All integers are little-endian.

    offset size  field         meaning
    ------ ----  -----------   ---------------------------------------------------------------
     0      2    magic         b"FE" (0x46 0x45)
     2      1    version       frame format version, currently 2; other values are rejected
     3      1    kind          FrameKind: 1 DATA, 2 ACK, 3 ABORT
     4      1    phase         Phase: 1 REDUCE_SCATTER, 2 ALL_GATHER, 3 BROADCAST,
                               4 GATHER (star: member -> coordinator), 5 SCATTER (star: coordinator -> member)
     5      1    codec         Codec of the payload: 0 F32, 1 F16, 2 INT8, 3 TOPK (see compression.py)
     6      2    step          u16 step inside the phase (ring step, broadcast hop)
     8      4    chunk         u32 chunk index (ring chunk; 0 for broadcast / star)
    12      4    part          u32 part index inside the chunk (chunks are split to fit max_payload)
    16      4    nparts        u32 number of parts of this chunk
    20      8    offset        u64 first element of this part in the whole vector
    28      4    count         u32 number of elements in this part
    32      8    total         u64 length of the whole vector (elements)
    40      4    payload_len   u32 bytes of payload
    44      1    swarm_len     u8, then swarm id bytes (UTF-8)
    45      1    tag_len       u8, then round tag bytes (UTF-8)
    46      1    sender_len    u8, then sender member id bytes (UTF-8)
    47      ..   swarm, tag, sender (in that order, no separators)
    ..      0-7  pad           zero bytes up to the next multiple of 8 (so float payloads are aligned)
    ..      ..   payload       payload_len bytes, starting at offset align8(47 + ids)
    end-4   4    crc32         zlib.crc32 (IEEE 802.3) of every byte before it; 0 (not computed,
                               not checked) for frames carried in a ring MAC envelope (version 3 of
                               federation/ringmac.py), whose tag already covers every byte

Payloads by kind:
* DATA: ``count`` elements encoded by ``codec`` (byte layouts in :mod:`federation.compression`).
* ACK: phase/step/chunk/part/tag name the first DATA frame being acknowledged and ``sender``
  is the acknowledging member; the payload lists further DATA frames of the same tag and
  sender acknowledged by the same ACK, 12 bytes each: ``u8 phase, u8 0, u16 step, u32 chunk,
  u32 part`` (empty for a single frame). Every received DATA frame is acknowledged, duplicates
  included, possibly batched with others (version 2; version 1 had exactly one per ACK), or
  implicitly by the receiver's DATA of a later call (PROTOCOL.md section 5, "moving on").
* ABORT: UTF-8 JSON ``{"member": <blamed member id or null>, "reason": <text>,
  "rejected": <true if an update failed the checks (NaN/Inf)>}``; the round ``tag`` is
  aborted for every member that receives it. Header: phase 1, nparts 1, other numbers 0.

Any violation (short buffer, bad magic, unknown version/kind/phase/codec, length mismatch,
bad checksum, non-UTF-8 ids) raises :class:`FrameError`; the receiver counts the frame as
rejected and drops it without acknowledging, so the sender's retransmit timer resends it.
"""

from __future__ import annotations

import enum
import json
import struct
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from federation.errors import FrameError

try:  # zlib-ng: the same IEEE CRC-32, with carry-less-multiply acceleration (~10x zlib's speed)
    from zlib_ng.zlib_ng import crc32
except ImportError:  # pragma: no cover - boards without a zlib-ng wheel
    from zlib import crc32

__all__ = [
    "MAGIC",
    "VERSION",
    "HEADER",
    "MAX_OVERHEAD",
    "FrameKind",
    "Phase",
    "Codec",
    "Frame",
    "encode",
    "encode_ack",
    "ack_keys",
    "encode_abort",
    "decode",
    "abort_info",
    "header_sender",
]

MAGIC = b"FE"
VERSION = 2  # 2: ACKs may acknowledge several DATA frames (payload = extra keys)
HEADER = struct.Struct("<2sBBBBHIIIQIQIBBB")
_CRC = struct.Struct("<I")
ACK_KEY = struct.Struct("<BxHII")  # phase, step, chunk, part of one more acknowledged DATA frame
# Worst-case bytes of a frame that are not payload: header, three 255-byte ids, pad, crc.
MAX_OVERHEAD = HEADER.size + 3 * 255 + 7 + _CRC.size
_PADS = [bytes(i) for i in range(8)]
_NO_CRC = bytes(_CRC.size)


def _align8(n: int) -> int:
    return (n + 7) & ~7


class FrameKind(enum.IntEnum):
    DATA = 1
    ACK = 2
    ABORT = 3


class Phase(enum.IntEnum):
    REDUCE_SCATTER = 1
    ALL_GATHER = 2
    BROADCAST = 3
    GATHER = 4
    SCATTER = 5
    EXCHANGE = 6  # all-to-all: every member's own vector, sent directly to every other member


class Codec(enum.IntEnum):
    F32 = 0
    F16 = 1
    INT8 = 2
    TOPK = 3


@dataclass(frozen=True, slots=True)
class Frame:
    """A decoded frame; ``payload`` is a zero-copy memoryview into the received buffer."""

    kind: FrameKind
    phase: Phase
    codec: Codec
    step: int
    chunk: int
    part: int
    nparts: int
    offset: int
    count: int
    total: int
    swarm: str
    tag: str
    sender: str
    payload: memoryview
    size: int = 0  # bytes of the whole frame as received

    @property
    def key(self) -> tuple[int, int, int, int]:
        """Identity of a DATA frame inside its tag (used for de-duplication and ACKs)."""
        return (int(self.phase), self.step, self.chunk, self.part)


def _id_bytes(value: str, what: str) -> bytes:
    b = value.encode("utf-8")
    if len(b) > 255:
        raise FrameError(f"{what} {value[:40]!r}... is longer than 255 bytes", hint="use shorter ids")
    return b


def encode(
    kind: FrameKind,
    phase: Phase,
    *,
    swarm: str,
    tag: str,
    sender: str,
    codec: Codec = Codec.F32,
    step: int = 0,
    chunk: int = 0,
    part: int = 0,
    nparts: int = 1,
    offset: int = 0,
    count: int = 0,
    total: int = 0,
    payload: Sequence[Any] = (),
    crc: bool = True,
    room: int = 0,
) -> bytes:
    """Build one frame. ``payload`` is a sequence of bytes-like pieces, joined without extra copies.
    ``crc=False``: leave the checksum 0 (the transport authenticates every frame end to end).
    ``room > 0``: a ``bytearray`` with ``room`` zero bytes after the frame, for a transport that
    seals it in place (``federation.ringmac.RingMac.seal_into``); the frame is ``buf[:-room]``."""
    sw, tg, sd = _id_bytes(swarm, "swarm id"), _id_bytes(tag, "tag"), _id_bytes(sender, "sender id")
    pieces = [memoryview(p).cast("B") if not isinstance(p, bytes) else p for p in payload]
    plen = sum(len(p) for p in pieces)
    try:
        head = HEADER.pack(
            MAGIC, VERSION, kind, phase, codec, step, chunk, part, nparts, offset, count, total, plen,
            len(sw), len(tg), len(sd),
        ) + sw + tg + sd
        head += _PADS[-len(head) % 8]
    except struct.error as e:
        raise FrameError(f"frame field out of range: {e}") from e
    if room:
        tail = _CRC.pack(_crc(head, pieces)) if crc else _NO_CRC
        # A bytearray reads like the bytes every caller expects; only the sealing transport writes it.
        return bytearray().join([head, *pieces, tail, bytes(room)])  # type: ignore[return-value]
    if not crc:
        return b"".join([head, *pieces, _NO_CRC])
    return b"".join([head, *pieces, _CRC.pack(_crc(head, pieces))])


def _crc(head: bytes, pieces: list) -> int:
    c = crc32(head)
    for p in pieces:
        c = crc32(p, c)
    return c


def encode_ack(data: Frame, *, sender: str, more: Sequence[Frame] = (), crc: bool = True,
               room: int = 0) -> bytes:
    """The ACK for a received DATA frame, and for the DATA frames ``more`` (same tag and sender)."""
    return encode(
        FrameKind.ACK, data.phase, swarm=data.swarm, tag=data.tag, sender=sender, codec=data.codec,
        step=data.step, chunk=data.chunk, part=data.part, nparts=data.nparts, offset=data.offset,
        count=data.count, total=data.total,
        payload=[b"".join([ACK_KEY.pack(*f.key) for f in more])] if more else (), crc=crc, room=room,
    )


def ack_keys(frame: Frame) -> list[tuple[int, int, int, int]]:
    """Keys (phase, step, chunk, part) of every DATA frame an ACK frame acknowledges."""
    return [frame.key, *ACK_KEY.iter_unpack(frame.payload)]


def encode_abort(*, swarm: str, tag: str, sender: str, member: str | None, reason: str,
                 rejected: bool = False, crc: bool = True, room: int = 0) -> bytes:
    """An ABORT for round ``tag`` blaming ``member`` (None when nobody is to blame);
    ``rejected`` marks an update rejected by the checks (NaN/Inf) rather than a timeout."""
    body = json.dumps({"member": member, "reason": reason, "rejected": rejected}).encode()
    return encode(FrameKind.ABORT, Phase.REDUCE_SCATTER, swarm=swarm, tag=tag, sender=sender, payload=[body],
                  crc=crc, room=room)


def abort_info(frame: Frame) -> tuple[str | None, str, bool]:
    """``(member, reason, rejected)`` of an ABORT frame."""
    try:
        d = json.loads(bytes(frame.payload))
        member, reason = d.get("member"), d.get("reason")
        if member is not None and not isinstance(member, str):
            raise TypeError
        return member, str(reason), bool(d.get("rejected", False))
    except (ValueError, TypeError, AttributeError) as e:
        raise FrameError(f"malformed ABORT payload from {frame.sender}") from e


def header_sender(buf: bytes | memoryview, size: int | None = None) -> bytes | memoryview | None:
    """The sender id bytes named by the header of the frame in ``buf[:size]`` (no checks beyond
    the layout: for authenticating links that bind the named sender to the proven one), or None
    when it does not start like a frame."""
    size = len(buf) if size is None else size
    if size < HEADER.size or buf[:2] != MAGIC:
        return None
    start = HEADER.size + buf[44] + buf[45]  # + swarm and tag lengths
    end = start + buf[46]
    return buf[start:end] if end <= size else None


def decode(buf: bytes | bytearray | memoryview, *, check_crc: bool = True) -> Frame:
    """Parse and verify one frame; raises :class:`FrameError` on anything malformed.
    ``check_crc=False``: the transport already authenticated every byte (a MAC or signature)."""
    mv = memoryview(buf).cast("B") if not isinstance(buf, memoryview) or buf.format != "B" else buf
    n = len(mv)
    if n < HEADER.size + _CRC.size:
        raise FrameError(f"frame too short ({n} bytes)")
    (magic, version, kind, phase, codec, step, chunk, part, nparts, offset, count, total, plen,
     lsw, ltg, lsd) = HEADER.unpack_from(mv, 0)
    if magic != MAGIC:
        raise FrameError(f"bad magic {bytes(magic)!r}")
    if version != VERSION:
        raise FrameError(f"unsupported frame version {version} (this member speaks {VERSION})",
                         hint="upgrade every member of the swarm to the same release")
    body = HEADER.size + lsw + ltg + lsd
    start = _align8(body)
    if start + plen + _CRC.size != n:
        raise FrameError(f"frame length mismatch: header says {start + plen + _CRC.size} bytes, got {n}")
    if check_crc:
        (crc,) = _CRC.unpack_from(mv, n - _CRC.size)
        if crc32(mv[: n - _CRC.size]) != crc:
            raise FrameError("frame checksum mismatch")
    try:
        kind, phase, codec = FrameKind(kind), Phase(phase), Codec(codec)
    except ValueError as e:
        raise FrameError(f"unknown frame code: {e}") from e
    if part >= nparts and kind != FrameKind.ABORT:
        raise FrameError(f"part {part} of {nparts}")
    if offset + count > total:
        raise FrameError(f"elements [{offset}, {offset + count}) beyond vector length {total}")
    try:
        a = HEADER.size
        swarm = str(mv[a : a + lsw], "utf-8")
        tag = str(mv[a + lsw : a + lsw + ltg], "utf-8")
        sender = str(mv[a + lsw + ltg : body], "utf-8")
    except UnicodeDecodeError as e:
        raise FrameError("frame ids are not UTF-8") from e
    if kind == FrameKind.ACK and plen % ACK_KEY.size:
        raise FrameError(f"ACK payload of {plen} bytes is not a list of {ACK_KEY.size}-byte keys")
    return Frame(kind, phase, codec, step, chunk, part, nparts, offset, count, total, swarm, tag, sender,
                 mv[start : start + plen], n)
