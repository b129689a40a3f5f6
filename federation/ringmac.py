"""Pairwise MACs for ring frames: the same guarantees as an ed25519 envelope, at a fraction of the cost.

Ring traffic (``ar/{dst}``, ``ack/{dst}``) is point to point: only the sender and the one
receiver need to check a frame. Each ordered pair of members (a -> b) has a key derived from
their X25519 keys in the keyring, ``K_a->b = HKDF-SHA256(X25519(a, B), salt = swarm,
info = "fractal-edge ring v3" + 0x00 + a + 0x00 + b)``, which nobody else can compute, not even
another member; the two directions of a pair never share a key. A frame is authenticated with
AES-256-GMAC (AES-GCM with an empty plaintext: the whole envelope is associated data) under
``K_a->b`` and the 12-byte nonce ``seq || epoch[0:4]``, unique per key as long as the sender's
``(seq, epoch)`` is (the same condition as the one-time keys of version 2).

Envelope version 3: a trailer after the ring frame (little-endian)::

    0    ..  payload     the ring frame (federation/framing.py, starts with b"FE"); its own
                         CRC-32 is 0 and not checked: the tag covers every byte of it
    ..   pad             pad_len zero bytes (room reserved for a longer topic, see below)
    ..   ..  sender, topic (UTF-8)
   -40   8   seq         u64, strictly increasing per sender (as in federation/auth.py)
   -32   8   epoch       u64, random per sender instance
   -24   1   sender_len
   -23   2   topic_len   u16
   -21   2   pad_len     u16
   -19   1   version     3
   -18   2   magic       b"FM"
   -16   16  tag         GMAC over every byte before it

Why a trailer: the bytes the tag covers are contiguous and the frame keeps offset 0, so a sender
whose frames are built with ``room`` spare bytes at the end (``framing.encode(room=...)``, see
:meth:`RingMac.seal_into`) seals a frame *in place*: no new buffer, no copy (a fresh 256 KiB
buffer per frame cost ~40 us here, mostly page faults: four times the MAC itself). The room is
sized for the longest possible topic; what a shorter one leaves is ``pad``. The receiver
verifies over a memoryview of the received buffer and hands the frame on as a view. A message
is taken for a ring MAC envelope when it does not start with the ed25519 envelope's b"FS" and
has b"FM" before its last 16 bytes (anything else that does is dropped as malformed or forged).

Why GMAC: with AES-NI and carry-less multiply it runs at ~27 GB/s here (9.4 us per 256 KiB),
Poly1305 at ~13 GB/s (19.7 us), and it needs no per-frame key derivation: one AESGCM object per
peer and direction, created once. Version 2 (header first, Poly1305 under a keyed-BLAKE2b
one-time key per frame, the frame copied into a new buffer) and version 1 (ChaCha20-derived
one-time keys, ~13 us per frame) are rejected (their header-first layout reads as UNSIGNED).

Where the time goes, and federation/_gmac.c: inside a busy node process (4 nodes, their
training workers and the broker on 2 cores) every step of the per-frame path costs several
times its hot-loop time, and in a digits-mlp round the Python around the MAC (trailer packing,
footer parsing, table lookups, the checks) cost more than the MAC itself; cryptography's AESGCM
also copies an OpenSSL context per call. So where ``pip install`` could build it, a small C
module does a frame's whole trailer and tag (``seal_frame``) and the receive fast path's
parsing, lookup, tag and named-sender checks (``open_frame``) in one call each, on one OpenSSL
context per peer and direction, keeping the GIL. Same envelopes, bit for bit; replay and
freshness stay in :meth:`Verifier.admit` (moving them and the seq counter to C too changed
nothing measurable). Its GHASH uses VPCLMULQDQ where the CPU has AVX-512 (the system's
OpenSSL 3.0 has no such code: 19 KB in ~1.0 us instead of ~4 us; 256 KiB in 11.6 us, as fast
as cryptography's AESGCM in a hot loop and without its per-call context copy), and then frames
of every size take the module; with OpenSSL's GHASH, frames over ``_SMALL`` (32 KiB) use
AESGCM, whose bundled OpenSSL hashes them faster. Without the module (a board's image, no compiler,
``FRACTAL_GMAC=python``) the same steps run in Python. Measured in docs/benchmarks-history.md
("Session 11", "Session 12", "Session 13").

Why not ed25519 here: per 256 KiB frame, sign + verify cost ~510 us (SHA-256 pre-hash twice plus
the curve operations, ~100 us even for an empty frame), which doubled the ring's time in
``fractal bench allreduce --signed``. Commands, statuses and round events stay ed25519-signed:
they are one-to-many, and the fleet's role must be provable to every node.

Rejections use the same :class:`~federation.auth.Reject` reasons and the same replay window
(the receiving :class:`~federation.auth.Verifier`).
"""

from __future__ import annotations

import os
import struct
import sys
import threading
from collections.abc import Callable
from typing import Any, NamedTuple, Protocol

from cryptography.exceptions import InvalidTag
from cryptography.hazmat.primitives import hashes
from cryptography.hazmat.primitives.asymmetric.x25519 import X25519PrivateKey
from cryptography.hazmat.primitives.ciphers.aead import AESGCM
from cryptography.hazmat.primitives.kdf.hkdf import HKDF

from federation.auth import AuthRejected, Keyring, Reject, Role, Signer, Verifier
from federation.framing import header_sender

__all__ = ["MAGIC", "VERSION", "TAG", "RingMac", "is_mac_envelope", "room_for", "gmac_backend",
           "gmac_describe"]

MAGIC = b"FM"
VERSION = 3
_INFO = b"fractal-edge ring v3\x00"
_FOOT = struct.Struct("<QQBHHB2s")  # seq, epoch, sender_len, topic_len, pad_len, version, magic
_NONCE = struct.Struct("<QI")  # seq, low 32 bits of epoch
TAG = 16
_TAIL = _FOOT.size + TAG
_MAX_RX_CACHE = 1024  # (topic, sender+topic ids) combinations remembered as valid
_ED_MAGIC = b"FS"  # federation/auth.py's envelope
_M0, _M1 = MAGIC


class _Mac(Protocol):
    """AES-256-GMAC under one key: the tag of ``buf[:end]`` stored at ``buf[end:end + 16]``."""

    def seal(self, buf: bytearray, end: int, seq: int, epoch: int) -> None: ...

    def verify(self, data: bytes | bytearray | memoryview, end: int, nonce_at: int) -> bool: ...


class _AesGcmMac:
    """The GMAC through cryptography's AESGCM (where federation/_gmac.c is not built): same tags."""

    __slots__ = ("aead",)

    def __init__(self, key: bytes) -> None:
        self.aead = AESGCM(key)

    def seal(self, buf: bytearray, end: int, seq: int, epoch: int) -> None:
        nonce = _NONCE.pack(seq, epoch & 0xFFFFFFFF)
        buf[end:end + TAG] = self.aead.encrypt(nonce, b"", memoryview(buf)[:end])

    def verify(self, data: bytes | bytearray | memoryview, end: int, nonce_at: int) -> bool:
        view = memoryview(data)
        try:
            self.aead.decrypt(bytes(view[nonce_at:nonce_at + 12]), bytes(view[end:end + TAG]), view[:end])
        except InvalidTag:
            return False
        return True


def _py_seal_frame(mac: _Mac, buf: bytearray, body: int, room: int, ids: bytes, slen: int, seq: int,
                   epoch: int) -> None:
    """Write the trailer (pad, ids, footer) and the tag into ``buf[body:]`` (``room`` bytes)."""
    pad = room - len(ids) - _TAIL
    trailer = _TRAILERS.get((pad, len(ids)))
    if trailer is None:
        if len(_TRAILERS) >= 64:
            _TRAILERS.clear()
        trailer = _TRAILERS[pad, len(ids)] = struct.Struct(f"<{pad}x{len(ids)}s{_FOOT.format[1:]}")
    trailer.pack_into(buf, body, ids, seq, epoch, slen, len(ids) - slen, pad, VERSION, MAGIC)
    mac.seal(buf, len(buf) - TAG, seq, epoch)


_TRAILERS: dict[tuple[int, int], struct.Struct] = {}


def _py_open_frame(table: dict[bytes, _Rx], data: bytes, topic: str,
                   big: bool = False) -> tuple[str, int, int, int] | None:
    """The fast path of :meth:`RingMac.open`: ``(sender, seq, epoch, body)`` for a frame of a known
    (sender, topic) whose tag and named sender check out; None for anything else (the full path
    judges, counts and names it). Replay and freshness are the caller's. ``big``: check the tag
    with the entry's ``big`` MAC (see ``_SMALL``)."""
    n = len(data)
    foot = n - _TAIL
    if foot < 0 or data[n - TAG - 2:n - TAG] != MAGIC or data[:2] == _ED_MAGIC:
        return None
    seq, epoch, slen, tlen, pad, version, _ = _FOOT.unpack_from(data, foot)
    ids_at = foot - slen - tlen
    body = ids_at - pad
    if version != VERSION or ids_at < 0 or body < 0:
        return None
    rx = table.get(data[ids_at:foot])
    if rx is None or rx.topic != topic or slen != len(rx.sender_b):
        return None
    if not (rx.big if big else rx.mac).verify(data, n - TAG, foot):
        return None
    named = header_sender(data, body)
    if named is not None and named != rx.sender_b:
        return None
    return rx.sender, seq, epoch, body


def _backend() -> tuple[Callable[[bytes], _Mac], Callable[..., None], Callable[..., Any], str]:
    """federation/_gmac.c (one OpenSSL context per key, the trailer and the receive checks in one
    call each) unless it is not built or ``FRACTAL_GMAC=python``: then cryptography's AESGCM and
    the same steps in Python (same envelopes, bit for bit)."""
    if os.environ.get("FRACTAL_GMAC", "") != "python":
        try:
            from federation import _gmac  # type: ignore[attr-defined, unused-ignore]
        except ImportError:
            pass
        else:
            return _gmac.Gmac, _gmac.seal_frame, _gmac.open_frame, "openssl-context"
    return _AesGcmMac, _py_seal_frame, _py_open_frame, "cryptography"


_MAC, _SEAL_FRAME, _OPEN_FRAME, _BACKEND = _backend()
# Frames longer than this (buffer bytes) take cryptography's AESGCM where federation/_gmac.c hashes
# with the system OpenSSL (21 vs 7.6 GB/s here: past ~24 KB AESGCM wins; seal of 19 KB: 2.6 vs
# 2.8 us; 64 KiB: 8.0 vs 4.8 us; 256 KiB: 31.5 vs 14.1 us). With _gmac's own VPCLMULQDQ GHASH
# there is no limit (256 KiB: 11.6 vs 11.8 us in a hot loop, and the per-call cost AESGCM adds in
# a busy node process is gone: the 1M-element signed allreduce went from +7.3/+7.7% to +4.4/+5.3%,
# docs/benchmarks-history.md, "Session 13").
_SMALL = 32 * 1024


def _small_limit(mac_class: Callable[[bytes], _Mac]) -> int:
    """The longest frame the backend's own path takes: every frame with federation/_gmac.c's
    VPCLMULQDQ GHASH (as fast as AESGCM for large frames in a hot loop, faster below 64 KiB, and
    no context copied per call), else ``_SMALL``."""
    try:
        from federation import _gmac  # type: ignore[attr-defined, unused-ignore]
    except ImportError:
        return _SMALL
    return sys.maxsize if mac_class is _gmac.Gmac and _gmac.ghash() != "openssl" else _SMALL


def gmac_backend() -> str:
    """Which GMAC implementation ring frames use: "openssl-context" (federation/_gmac.c) or
    "cryptography" (AESGCM; the C module is not built, or FRACTAL_GMAC=python)."""
    return _BACKEND


def gmac_describe() -> str:
    """The backend and, for the C module, its GHASH ("openssl-context/vpclmulqdq-avx512"), as
    benchmarks report it."""
    if _BACKEND != "openssl-context":
        return _BACKEND
    from federation import _gmac  # type: ignore[attr-defined, unused-ignore]

    return f"{_BACKEND}/{_gmac.ghash()}"


def room_for(sender: str, topic_prefix: str, max_dst: int = 64) -> int:
    """Spare bytes a frame needs at its end to be sealed in place for any destination id of up
    to ``max_dst`` bytes on topics ``topic_prefix + dst``."""
    return len(sender.encode()) + len(topic_prefix.encode()) + max_dst + _TAIL


def is_mac_envelope(data: bytes | bytearray | memoryview) -> bool:
    return len(data) >= _TAIL and data[:2] != _ED_MAGIC and data[-_TAIL + _FOOT.size - 2:-TAG] == MAGIC


def _dst_of(topic: str) -> str:
    return topic.rsplit("/", 1)[-1]


class _Tx:
    """What sealing a frame for one (peer, topic) needs, computed once."""

    __slots__ = ("mac", "big", "ids", "slen", "need")

    def __init__(self, macs: tuple[_Mac, _Mac], sender: bytes, topic: bytes) -> None:
        (self.mac, self.big), self.ids, self.slen = macs, sender + topic, len(sender)
        self.need = len(self.ids) + _TAIL


class _Rx(NamedTuple):
    """A validated (sender, topic) combination of received envelopes: its key and names (a tuple:
    federation/_gmac.c's open_frame reads it)."""

    topic: str
    sender: str
    sender_b: bytes
    mac: _Mac  # the backend's (open_frame needs federation/_gmac.c's Gmac here)
    big: _Mac  # for frames longer than _SMALL


class RingMac:
    """MACs frames from ``signer.sender`` and checks frames addressed to it.

    ``signer`` supplies the sender id and the seq/epoch counter (shared with its ed25519
    envelopes, so the receiver's replay window covers both kinds); ``verifier`` holds the
    keyring and the replay windows. Thread-safe: per-peer state is created under a lock and
    only read afterwards (AESGCM objects are stateless between calls)."""

    def __init__(self, signer: Signer, dh_key: X25519PrivateKey, verifier: Verifier, swarm: str) -> None:
        self.signer = signer
        self.me = signer.sender
        self._dh = dh_key
        self.verifier = verifier
        self.swarm = swarm
        # Chosen when created (tests swap the module's backend before creating their members).
        self._mac_class, self._seal_frame, self._open_frame = _MAC, _SEAL_FRAME, _OPEN_FRAME
        self._small = _small_limit(_MAC)
        self._tx: dict[str, _Tx] = {}  # topic -> sealing state for its destination
        self._rx: dict[bytes, _Rx] = {}  # ids (sender + topic bytes) -> validated state
        self._lock = threading.Lock()

    @property
    def keyring(self) -> Keyring:
        return self.verifier.keyring

    def _direction_key(self, peer: str, outgoing: bool) -> tuple[_Mac, _Mac] | None:
        """(the backend's MAC, the MAC for frames longer than _SMALL) under K_src->dst."""
        entry = self.keyring.current(peer)
        if entry is None or entry.role != Role.NODE or entry.dh_public is None:
            return None
        src, dst = (self.me, peer) if outgoing else (peer, self.me)
        info = _INFO + src.encode() + b"\x00" + dst.encode()
        key = HKDF(algorithm=hashes.SHA256(), length=32, salt=self.swarm.encode(),
                   info=info).derive(self._dh.exchange(entry.dh_public))
        mac = self._mac_class(key)
        return mac, (mac if isinstance(mac, _AesGcmMac) or getattr(mac, "fast", False) else _AesGcmMac(key))

    def forget(self) -> None:
        """Drop cached pair keys (after a keyring change: revocations take effect)."""
        with self._lock:
            self._tx = {}
            self._rx = {}

    def _tx_for(self, topic: str) -> _Tx:
        dst = _dst_of(topic)
        macs = self._direction_key(dst, outgoing=True)
        if macs is None:
            raise AuthRejected(Reject.UNKNOWN_KEY, f"no ring key for {dst!r} in the keyring")
        t = topic.encode()
        if len(t) > 0xFFFF:
            raise AuthRejected(Reject.MALFORMED, "topic too long")
        tx = _Tx(macs, self.me.encode(), t)
        with self._lock:
            self._tx[topic] = tx
        return tx

    def seal(self, topic: str, payload: bytes | bytearray | memoryview) -> bytearray:
        """The envelope for ``payload`` on ``topic`` in a new buffer (one copy of the payload)."""
        tx = self._tx.get(topic) or self._tx_for(topic)
        buf = bytearray().join((payload, bytes(tx.need)))
        return self._seal(tx, buf, len(buf) - tx.need, tx.need)

    def seal_into(self, topic: str, frame: bytearray, room: int) -> bytearray:
        """Seal ``frame``, whose last ``room`` bytes are spare, in place (no copy) and return it.

        A buffer is sealed in place once: one already sealed (a retransmission, or an ABORT sent
        to several peers) is copied first, because the MQTT client may still hold the earlier
        envelope for a resend after a reconnect; so a buffer handed on is never changed again."""
        tx = self._tx.get(topic) or self._tx_for(topic)
        body = len(frame) - room
        if body < 0:
            raise AuthRejected(Reject.MALFORMED, f"frame of {len(frame)} bytes has no {room}-byte room")
        if tx.need > room:  # a topic longer than the room was sized for
            return self.seal(topic, memoryview(frame)[:body])
        if frame[-TAG - 1] == _M1 and frame[-TAG - 2] == _M0:  # sealed before: seal a copy
            frame = bytearray(frame)
            frame[body:] = bytes(room)
        return self._seal(tx, frame, body, room)

    def _seal(self, tx: _Tx, buf: bytearray, body: int, room: int) -> bytearray:
        signer = self.signer
        if len(buf) <= self._small:
            self._seal_frame(tx.mac, buf, body, room, tx.ids, tx.slen, signer._next_seq(), signer.epoch)
        else:
            _py_seal_frame(tx.big, buf, body, room, tx.ids, tx.slen, signer._next_seq(), signer.epoch)
        return buf

    def open(self, topic: str, data: bytes | bytearray | memoryview) -> tuple[str, memoryview]:
        """-> (sender, payload view); raises :class:`AuthRejected` (counted in the verifier).

        A ring frame (``b"FE"...``) whose header names another sender than the one the MAC
        proves is refused as WRONG_ROLE (impersonation)."""
        if type(data) is bytes:  # the fast path: a frame from an already validated combination
            if len(data) <= self._small:
                hit = self._open_frame(self._rx, data, topic)
            else:
                hit = _py_open_frame(self._rx, data, topic, True)
            if hit is not None:
                sender, seq, epoch, body = hit
                self.verifier.admit(sender, seq, epoch)  # counts what it refuses
                return sender, memoryview(data)[:body]
        try:
            return self._open(topic, memoryview(data))
        except AuthRejected as exc:
            if exc.reason is not Reject.REPLAYED and exc.reason is not Reject.STALE:
                self.verifier.count(exc.reason)  # admit() counted those already
            raise

    def _rx_for(self, topic: str, ids: bytes, slen: int) -> _Rx:
        """Validate the sender and topic of an envelope (first frame of each combination)."""
        try:
            sender = ids[:slen].decode()
            signed_topic = ids[slen:].decode()
        except UnicodeDecodeError:
            raise AuthRejected(Reject.MALFORMED, "ids are not UTF-8") from None
        if signed_topic != topic:
            raise AuthRejected(Reject.WRONG_TOPIC, f"MAC'd for {signed_topic[:200]!r}, received on {topic!r}")
        if _dst_of(topic) != self.me or sender == self.me:
            raise AuthRejected(Reject.WRONG_ROLE, f"frame for {_dst_of(topic)!r} from {sender!r}")
        macs = self._direction_key(sender, outgoing=False)
        if macs is None:
            raise AuthRejected(Reject.UNKNOWN_KEY, f"{sender[:80]!r} has no ring key in the keyring")
        rx = _Rx(topic, sender, sender.encode(), *macs)
        with self._lock:
            if len(self._rx) >= _MAX_RX_CACHE:
                self._rx = {}
            self._rx[ids] = rx
        return rx

    def _open(self, topic: str, view: memoryview) -> tuple[str, memoryview]:
        n = len(view)
        if n < _TAIL or view[n - TAG - 2] != _M0 or view[n - TAG - 1] != _M1 or view[:2] == _ED_MAGIC:
            raise AuthRejected(Reject.UNSIGNED, f"frame on {topic} has no MAC")
        end = n - TAG
        seq, epoch, slen, tlen, pad, version, _ = _FOOT.unpack_from(view, end - _FOOT.size)
        ids_end = end - _FOOT.size
        ids_at = ids_end - slen - tlen
        body = ids_at - pad
        if version != VERSION or body < 0:
            raise AuthRejected(Reject.MALFORMED, f"bad MAC envelope (version {version})")
        ids = bytes(view[ids_at:ids_end])
        rx = self._rx.get(ids)
        if rx is None or rx.topic != topic or slen != len(rx.sender_b):
            rx = self._rx_for(topic, ids, slen)
        if not rx.mac.verify(view, end, end - _FOOT.size):  # the nonce opens the footer
            raise AuthRejected(Reject.BAD_SIGNATURE, f"bad MAC from {rx.sender!r}")
        self.verifier.admit(rx.sender, seq, epoch)
        named = header_sender(view, body)
        if named is not None and bytes(named) != rx.sender_b:
            raise AuthRejected(Reject.WRONG_ROLE,
                               f"frame names {bytes(named)[:80]!r}, MAC'd by {rx.sender!r}")
        return rx.sender, view[:body]
