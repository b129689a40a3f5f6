"""Signed envelopes for every state-changing MQTT payload (pure: no broker, no I/O but key files).

Every payload a member or the fleet publishes is wrapped in an envelope signed with the
sender's ed25519 key; receivers verify it against the swarm's keyring before parsing the
payload. The broker's credentials and ACLs are a second wall, not the only one.

Envelope (all integers little-endian)::

    offset size  field        meaning
    ------ ----  ----------   -------------------------------------------------------------
     0      2    magic        b"FS"
     2      1    version      1; any other value is MALFORMED
     3      1    flags        bit 0: WILL (a Last Will, signed at connect, see below)
     4      8    seq          u64, strictly increasing per signer: max(last + 1, unix time in us)
    12      8    epoch        u64, random per signer instance (process / connection)
    20      1    sender_len   then the sender id (UTF-8, node-id pattern)
    21      1    key_id_len   then the key id (UTF-8)
    22      2    topic_len    u16, then the MQTT topic the payload was published on (UTF-8)
    24      ..   sender, key_id, topic
    ..      64   signature    ed25519 over DOMAIN + every byte before it + sha256(payload)
    ..      ..   payload      the message itself (JSON or a binary frame), to the end

The payload is pre-hashed with SHA-256 (SHA-NI: ~1.8 GB/s here) so that signing a 256 KiB
ring frame costs one hash plus a 32-byte ed25519 signature, and the payload stays a zero-copy
tail of the received buffer.

Checks, in order; the first that fails names the :class:`Reject` reason (and is counted):

* MALFORMED: not an envelope of this version, truncated, bad ids.
* UNSIGNED: the payload does not even start with the envelope magic (a plain JSON/frame).
* WRONG_TOPIC: the signed topic differs from the topic the message arrived on (a message
  signed for one topic never verifies on another).
* UNKNOWN_KEY: key id not in the keyring (or revoked), or it belongs to another sender.
* BAD_SIGNATURE: the signature does not verify.
* WRONG_ROLE: the sender may not publish on this topic (:func:`swarm_policy`: only the fleet
  key may publish commands; a node only its own status and events; ring traffic only nodes).
* STALE: ``seq`` (a timestamp) is older than ``max_age_s`` or further than ``max_skew_s`` in
  the future (members need roughly synchronised clocks, e.g. NTP).
* REPLAYED: ``(sender, seq)`` already accepted, or below the sender's replay window.

Last Wills are signed when the connection is made and published by the broker much later,
so they are exempt from STALE; instead a WILL is accepted only if its ``epoch`` equals the
epoch of the newest message already accepted from that sender (the will of the *current*
instance), or if the receiver has heard nothing from the sender yet (a fresh observer reading
a retained will). A captured will of an older instance is REPLAYED.
"""

from __future__ import annotations

import base64
import enum
import hashlib
import json
import re
import secrets
import struct
import threading
import time
from collections import Counter, OrderedDict
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from pathlib import Path

from cryptography.exceptions import InvalidSignature
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey, Ed25519PublicKey
from cryptography.hazmat.primitives.asymmetric.x25519 import X25519PrivateKey, X25519PublicKey
from cryptography.hazmat.primitives.serialization import Encoding, PublicFormat

from federation.errors import FederationError
from fractal.keyfile import KeyFile, KeyFileError, read_key_file

__all__ = [
    "MAGIC",
    "VERSION",
    "DOMAIN",
    "SIG_SIZE",
    "Role",
    "Reject",
    "AuthRejected",
    "KeyEntry",
    "Keyring",
    "Signer",
    "Verified",
    "Verifier",
    "swarm_policy",
    "is_envelope",
    "generate_key",
    "private_key_bytes",
    "load_private_key",
    "load_key_file",
    "public_key_b64",
]

MAGIC = b"FS"
VERSION = 1
DOMAIN = b"fractal-edge/envelope/v1\x00"
SIG_SIZE = 64
_HEAD = struct.Struct("<2sBBQQBBH")  # magic, version, flags, seq, epoch, sender_len, key_len, topic_len
FLAG_WILL = 0x01
_ID = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,63}$")
KEYRING_VERSION = 1


class Role(enum.StrEnum):
    FLEET = "fleet"  # starts and aborts rounds
    NODE = "node"  # a swarm member


class Reject(enum.StrEnum):
    UNSIGNED = "unsigned"
    UNKNOWN_KEY = "unknown_key"
    BAD_SIGNATURE = "bad_signature"
    REPLAYED = "replayed"
    WRONG_TOPIC = "wrong_topic"
    STALE = "stale"
    WRONG_ROLE = "wrong_role"
    MALFORMED = "malformed"
    OVERSIZED = "oversized"  # larger than MESSAGE_SIZE_LIMIT: dropped before it is parsed or verified


class AuthRejected(FederationError):
    """A message failed verification; ``reason`` says which check."""

    def __init__(self, reason: Reject, message: str) -> None:
        super().__init__(f"{reason.value}: {message}")
        self.reason = reason


# ---------------------------------------------------------------------------------- keys


def generate_key() -> Ed25519PrivateKey:
    return Ed25519PrivateKey.generate()


def private_key_bytes(key: Ed25519PrivateKey) -> bytes:
    """The 32-byte raw seed (base64 in the key files, fractal/keyfile.py)."""
    from cryptography.hazmat.primitives.serialization import NoEncryption, PrivateFormat

    return key.private_bytes(Encoding.Raw, PrivateFormat.Raw, NoEncryption())


def public_key_b64(key: Ed25519PrivateKey | Ed25519PublicKey) -> str:
    pub = key.public_key() if isinstance(key, Ed25519PrivateKey) else key
    return base64.b64encode(pub.public_bytes(Encoding.Raw, PublicFormat.Raw)).decode()


def load_key_file(path: str | Path) -> KeyFile:
    """Read a key file (the project's one format, fractal/keyfile.py: key id, sender, role, the
    ed25519 seed and, for nodes, the X25519 key of the ring's pairwise frame MACs)."""
    try:
        return read_key_file(path)
    except KeyFileError as exc:
        raise FederationError(str(exc), hint=exc.hint) from None


def load_private_key(path: str | Path) -> Ed25519PrivateKey:
    return load_key_file(path).private_key


def load_dh_key(path: str | Path) -> X25519PrivateKey | None:
    return load_key_file(path).dh_private


def raw_b64(key: X25519PrivateKey | X25519PublicKey) -> str:
    from cryptography.hazmat.primitives.serialization import NoEncryption, PrivateFormat

    if isinstance(key, X25519PrivateKey):
        return base64.b64encode(key.private_bytes(Encoding.Raw, PrivateFormat.Raw, NoEncryption())).decode()
    return base64.b64encode(key.public_bytes(Encoding.Raw, PublicFormat.Raw)).decode()


def _x25519_pub(text: str) -> X25519PublicKey:
    return X25519PublicKey.from_public_bytes(base64.b64decode(text, validate=True))


@dataclass(frozen=True)
class KeyEntry:
    key_id: str
    sender: str
    role: Role
    public_key: Ed25519PublicKey
    dh_public: X25519PublicKey | None = None  # nodes: X25519 key for pairwise ring-frame MACs


class Keyring:
    """The swarm's public keys: who may sign, with which key, in which role.

    File format (JSON, written by ``deploy/keys.py``)::

        {"v": 1, "swarm": "default",
         "keys": [{"key_id": "fleet-1", "sender": "fleet", "role": "fleet", "public_key": "<b64 32 bytes>"},
                  {"key_id": "node-1-1", "sender": "node-1", "role": "node", "public_key": "..."}],
         "revoked": ["node-3-1"]}

    A revoked key id is treated as unknown. One sender may hold several keys (rotation).
    """

    def __init__(self, entries: Iterable[KeyEntry] = (), *, swarm: str = "default",
                 revoked: Iterable[str] = ()) -> None:
        self.swarm = swarm
        self.revoked = set(revoked)
        self._keys: dict[str, KeyEntry] = {}
        for e in entries:
            self.add(e)

    def add(self, entry: KeyEntry) -> None:
        if not _ID.match(entry.sender) or not _ID.match(entry.key_id):
            raise FederationError(f"invalid sender/key id {entry.sender!r}/{entry.key_id!r}")
        if entry.key_id in self._keys:
            raise FederationError(f"duplicate key id {entry.key_id!r} in the keyring")
        self._keys[entry.key_id] = entry

    def revoke(self, key_id: str) -> None:
        self.revoked.add(key_id)

    def get(self, key_id: str) -> KeyEntry | None:
        if key_id in self.revoked:
            return None
        return self._keys.get(key_id)

    def current(self, sender: str) -> KeyEntry | None:
        """The sender's newest unrevoked key (the last one added)."""
        found = None
        for k, e in self._keys.items():
            if e.sender == sender and k not in self.revoked:
                found = e
        return found

    def entries(self) -> list[KeyEntry]:
        """Every key, revoked ones included, in the order added."""
        return list(self._keys.values())

    def members(self, role: Role = Role.NODE) -> set[str]:
        """Senders holding at least one unrevoked key of ``role``."""
        return {e.sender for k, e in self._keys.items() if e.role == role and k not in self.revoked}

    def to_json(self) -> str:
        keys = [{"key_id": e.key_id, "sender": e.sender, "role": e.role.value,
                 "public_key": public_key_b64(e.public_key),
                 **({"dh_public": raw_b64(e.dh_public)} if e.dh_public else {})} for e in self._keys.values()]
        return json.dumps({"v": KEYRING_VERSION, "swarm": self.swarm, "keys": keys,
                           "revoked": sorted(self.revoked)}, indent=1) + "\n"

    @classmethod
    def from_json(cls, text: str | bytes) -> Keyring:
        try:
            doc = json.loads(text)
            if doc.get("v") != KEYRING_VERSION:
                raise FederationError(f"unsupported keyring version {doc.get('v')!r}")
            entries = [KeyEntry(k["key_id"], k["sender"], Role(k["role"]),
                                Ed25519PublicKey.from_public_bytes(
                                    base64.b64decode(k["public_key"], validate=True)),
                                _x25519_pub(k["dh_public"]) if k.get("dh_public") else None)
                       for k in doc["keys"]]
            return cls(entries, swarm=str(doc.get("swarm", "default")), revoked=doc.get("revoked", []))
        except FederationError:
            raise
        except (ValueError, KeyError, TypeError) as exc:
            raise FederationError(f"malformed keyring: {exc}",
                                  hint="regenerate it with deploy/keys.py") from exc

    @classmethod
    def load(cls, path: str | Path) -> Keyring:
        return cls.from_json(Path(path).read_bytes())


# ---------------------------------------------------------------------------------- policy


def swarm_policy(topic: str, sender: str, role: Role) -> bool:
    """May ``sender`` (holding a key of ``role``) publish on ``topic``? (topics.py's tree)

    * ``fractal/v1/{swarm}/cmd`` and ``.../keyring``: the fleet only.
    * ``status/{node}`` and ``rounds/{id}/events/{node}``: that node only.
    * ``ar/{dst}``, ``ack/{dst}``, ``params/{dst}``: any node but ``dst`` itself.
    * ``x/ar/{dst}`` (site leaders' ring, bridged between sites): any node but ``dst`` itself.
    * ``async/up/{node}`` (an asynchronous update): that node only; ``async/version``: the fleet
      only (it aggregates, PROTOCOL.md section 13).
    Anything else: nobody.
    """
    parts = topic.split("/")
    if len(parts) < 4 or parts[0] != "fractal" or parts[1] != "v1":
        return False
    rest = parts[3:]
    if rest == ["async", "version"]:
        return role == Role.FLEET
    if rest == ["cmd"] or rest == ["keyring"]:  # keyring: enrolment updates (federation/enrolment.py)
        return role == Role.FLEET
    if role != Role.NODE:
        return False
    if len(rest) == 2 and rest[0] == "status":
        return rest[1] == sender
    if len(rest) == 4 and rest[0] == "rounds" and rest[2] == "events":
        return rest[3] == sender
    if len(rest) == 2 and rest[0] in ("ar", "ack", "params"):
        return rest[1] != sender
    if len(rest) == 3 and rest[:2] == ["x", "ar"]:
        return rest[2] != sender
    if len(rest) == 3 and rest[:2] == ["async", "up"]:
        return rest[2] == sender
    return False


# ---------------------------------------------------------------------------------- signing


def _signed_bytes(head: bytes | memoryview, payload: bytes | bytearray | memoryview) -> bytes:
    return DOMAIN + bytes(head) + hashlib.sha256(payload).digest()


class Signer:
    """Signs payloads for one sender. Thread-safe; ``seq`` is strictly increasing."""

    def __init__(self, sender: str, key_id: str, key: Ed25519PrivateKey, *,
                 clock: Callable[[], float] = time.time) -> None:
        if not _ID.match(sender) or not _ID.match(key_id):
            raise FederationError(f"invalid sender/key id {sender!r}/{key_id!r}")
        self.sender = sender
        self.key_id = key_id
        self._key = key
        self._clock = clock
        self._ids = sender.encode() + key_id.encode()
        self.epoch = secrets.randbits(64)
        self._seq = 0
        self._lock = threading.Lock()

    def _next_seq(self) -> int:
        with self._lock:
            self._seq = max(self._seq + 1, int(self._clock() * 1e6))
            return self._seq

    def sign(self, topic: str, payload: bytes | bytearray | memoryview, *, will: bool = False) -> bytes:
        """The envelope for ``payload`` published on ``topic`` (``will``: a Last Will)."""
        t = topic.encode()
        if len(t) > 0xFFFF:
            raise FederationError("topic too long to sign")
        head = _HEAD.pack(MAGIC, VERSION, FLAG_WILL if will else 0, self._next_seq(), self.epoch,
                          len(self.sender.encode()), len(self.key_id.encode()), len(t)) + self._ids + t
        sig = self._key.sign(_signed_bytes(head, payload))
        return b"".join((head, sig, payload))


    def sign_detached(self, message: bytes) -> bytes:
        """A bare ed25519 signature of ``message`` with this sender's key. The caller puts its own
        context string first (never :data:`DOMAIN`), so no such signature reads as an envelope's."""
        if message.startswith(DOMAIN):
            raise FederationError("a detached signature must not start with the envelope's domain")
        return self._key.sign(message)


def is_envelope(data: bytes | bytearray | memoryview) -> bool:
    return bytes(data[:2]) == MAGIC


# ---------------------------------------------------------------------------------- verifying


@dataclass(frozen=True)
class Verified:
    sender: str
    key_id: str
    role: Role
    seq: int
    epoch: int
    will: bool
    payload: memoryview  # zero-copy tail of the received buffer


@dataclass
class _Window:
    """Replay state of one sender: newest seq/epoch and the seqs accepted within max_age."""

    newest: int = 0
    epoch: int | None = None
    seen: OrderedDict[int, None] = field(default_factory=OrderedDict)
    floor: int = 0  # seqs at or below it are REPLAYED (evictions past the cap raise it)
    wills: OrderedDict[int, None] = field(default_factory=OrderedDict)  # epochs whose will was accepted


class Verifier:
    """Checks envelopes against a keyring and a topic policy, with per-sender replay windows.

    ``check`` returns the :class:`Verified` message or ``None`` (and counts the reason in
    ``counts``); ``verify`` raises :class:`AuthRejected`. Thread-safe.
    """

    def __init__(self, keyring: Keyring, *, policy: Callable[[str, str, Role], bool] = swarm_policy,
                 max_age_s: float = 60.0, max_skew_s: float = 30.0, window: int = 65536,
                 clock: Callable[[], float] = time.time) -> None:
        self.keyring = keyring
        self.policy = policy
        self.max_age_us = int(max_age_s * 1e6)
        self.max_skew_us = int(max_skew_s * 1e6)
        self.window = window
        self._clock = clock
        self._windows: dict[str, _Window] = {}
        self._lock = threading.Lock()
        self.counts: Counter[Reject] = Counter()
        self.accepted = 0

    def check(self, topic: str, data: bytes | bytearray | memoryview) -> Verified | None:
        try:
            return self.verify(topic, data)
        except AuthRejected:
            return None

    def verify(self, topic: str, data: bytes | bytearray | memoryview) -> Verified:
        try:
            msg = self._verify(topic, memoryview(data))
        except AuthRejected as exc:
            with self._lock:
                self.counts[exc.reason] += 1
            raise
        return msg

    def _verify(self, topic: str, view: memoryview) -> Verified:
        if len(view) < 2 or bytes(view[:2]) != MAGIC:
            raise AuthRejected(Reject.UNSIGNED, f"message on {topic} is not signed")
        if len(view) < _HEAD.size:
            raise AuthRejected(Reject.MALFORMED, "truncated envelope")
        magic, version, flags, seq, epoch, slen, klen, tlen = _HEAD.unpack_from(view)
        if version != VERSION or flags & ~FLAG_WILL:
            raise AuthRejected(Reject.MALFORMED, f"envelope version {version} / flags {flags:#x}")
        ids_end = _HEAD.size + slen + klen + tlen
        if len(view) < ids_end + SIG_SIZE:
            raise AuthRejected(Reject.MALFORMED, "truncated envelope")
        try:
            sender = bytes(view[_HEAD.size:_HEAD.size + slen]).decode()
            key_id = bytes(view[_HEAD.size + slen:_HEAD.size + slen + klen]).decode()
            signed_topic = bytes(view[_HEAD.size + slen + klen:ids_end]).decode()
        except UnicodeDecodeError:
            raise AuthRejected(Reject.MALFORMED, "ids are not UTF-8") from None
        if not _ID.match(sender):
            raise AuthRejected(Reject.MALFORMED, f"invalid sender id {sender[:80]!r}")
        if signed_topic != topic:
            raise AuthRejected(Reject.WRONG_TOPIC,
                               f"signed for {signed_topic[:200]!r}, received on {topic!r}")
        entry = self.keyring.get(key_id)
        if entry is None or entry.sender != sender:
            raise AuthRejected(Reject.UNKNOWN_KEY, f"key {key_id[:80]!r} of {sender!r} is not in the keyring")
        payload = view[ids_end + SIG_SIZE:]
        try:
            entry.public_key.verify(bytes(view[ids_end:ids_end + SIG_SIZE]),
                                    _signed_bytes(view[:ids_end], payload))
        except InvalidSignature:
            raise AuthRejected(Reject.BAD_SIGNATURE, f"bad signature from {sender!r}") from None
        if not self.policy(topic, sender, entry.role):
            raise AuthRejected(Reject.WRONG_ROLE,
                               f"{sender!r} ({entry.role.value}) may not publish on {topic}")
        will = bool(flags & FLAG_WILL)
        self._admit(sender, seq, epoch, will)
        return Verified(sender, key_id, entry.role, seq, epoch, will, payload)

    def admit(self, sender: str, seq: int, epoch: int, will: bool = False) -> None:
        """Freshness and replay checks alone (for callers that authenticated the sender
        another way, e.g. :mod:`federation.ringmac`); raises :class:`AuthRejected`, counted."""
        if not will:  # fast path: the next seq of a known sender, fresh, window not full
            now = int(self._clock() * 1e6)
            with self._lock:
                w = self._windows.get(sender)
                fresh = now - self.max_age_us <= seq <= now + self.max_skew_us
                if w is not None and seq > w.newest and fresh and len(w.seen) < self.window:
                    seen = w.seen
                    seen[seq] = None  # newer than every seq seen: neither REPLAYED nor below the floor
                    horizon = now - self.max_age_us
                    while next(iter(seen)) < horizon:  # seq itself is >= horizon: the loop ends
                        del seen[next(iter(seen))]
                    w.newest, w.epoch = seq, epoch
                    self.accepted += 1
                    return
        try:
            self._admit(sender, seq, epoch, will)
        except AuthRejected as exc:
            with self._lock:
                self.counts[exc.reason] += 1
            raise

    def count(self, reason: Reject) -> None:
        with self._lock:
            self.counts[reason] += 1

    def _admit(self, sender: str, seq: int, epoch: int, will: bool) -> None:
        now = int(self._clock() * 1e6)
        with self._lock:
            w = self._windows.get(sender)
            if will:
                # Exempt from STALE (signed at connect); at most once per instance, and only
                # the current instance's (or any, for an observer that knows nothing yet).
                if w is not None and (w.epoch not in (None, epoch) or epoch in w.wills):
                    raise AuthRejected(Reject.REPLAYED,
                                       f"{sender!r}: Last Will replayed or of an older instance")
                if w is None:
                    w = self._windows[sender] = _Window()
                w.wills[epoch] = None
                while len(w.wills) > 64:
                    w.wills.popitem(last=False)
                self.accepted += 1
                return
            if seq < now - self.max_age_us or seq > now + self.max_skew_us:
                raise AuthRejected(Reject.STALE, f"{sender!r}: message is {(now - seq) / 1e6:.1f} s old")
            if w is None:
                w = self._windows[sender] = _Window()
            if seq <= w.floor or seq in w.seen:
                raise AuthRejected(Reject.REPLAYED, f"{sender!r}: seq {seq} already seen")
            w.seen[seq] = None
            # Forget what STALE refuses anyway; past the cap, evictions raise the floor.
            horizon = now - self.max_age_us
            while w.seen:
                old = next(iter(w.seen))
                if len(w.seen) > self.window:
                    w.floor = max(w.floor, old)
                elif old >= horizon:
                    break
                del w.seen[old]
            if seq >= w.newest:
                w.newest, w.epoch = seq, epoch
            self.accepted += 1

    def forget(self, sender: str) -> None:
        """Drop a sender's replay state (e.g. after removing it from the keyring)."""
        with self._lock:
            self._windows.pop(sender, None)

    def rejected_total(self) -> int:
        return sum(self.counts.values())
