"""Buffered asynchronous aggregation (FedBuff-style), the pure part: messages, admission, weights.

A swarm in ``sync = "async"`` mode has no rounds. A member that comes online takes the newest
global version ``v`` it holds, trains locally and publishes one **update**: its parameter delta,
the base version ``v`` (and that version's sha256) and its sample count. The aggregator
(:mod:`federation.asyncagg`, run by the fleet service) admits updates into a buffer; when the
buffer holds ``buffer`` (K) admitted updates it applies their weighted mean to the current
version and publishes version ``v + 1`` with its full parameters and their sha256. Every member
that commits ``v + 1`` checks the hash, so all of them hold identical bytes, as the synchronous
ring promises (PROTOCOL.md section 13).

This module moves no bytes: :func:`encode_update` / :func:`decode_update` and
:func:`encode_version` / :func:`decode_version` are the payload formats (the signed envelope of
:mod:`federation.auth` wraps them on the wire), :class:`Buffer` admits or rejects updates and
:func:`aggregate` computes the next version. Everything a receiver enforces is bounded here.

Admission, in order; the first failing check names the :class:`Refusal` (counted, never raised
to the transport, so a bad update never stalls the swarm):

* MALFORMED: not a payload of this format, or the header disagrees with the body size.
* FORGED: the header names another member than the topic (whose key signed it).
* OVERSIZED: the delta has another length than the model (checked before anything is decoded).
* NON_FINITE: the delta or the sample count is NaN/Inf/negative.
* FUTURE: the base version is newer than the aggregator's (nobody can train from it).
* STALE: ``current - base > max_staleness`` (or the base's hash is no longer known).
* FORKED: the base hash differs from the aggregator's hash of that version.
* REPLAYED: the member already had an update admitted from this base version or a newer one.
* DUPLICATE: the member already has another update in this buffer (one update per member per
  buffer). The very same update again is a member re-sending it (it heard of no new version for a
  while: the aggregator may have restarted and lost its buffer) and changes nothing.
* OUTLIER: the delta's norm exceeds ``outlier_factor`` x the median norm of the buffer
  (screened when the buffer is full, :func:`federation.robust.screen`); the rest still apply.
"""

from __future__ import annotations

import enum
import hashlib
import json
import math
import struct
from dataclasses import dataclass, field

import numpy as np

from federation import robust

__all__ = [
    "FORMAT_VERSION",
    "Refusal",
    "Update",
    "Version",
    "Contribution",
    "Buffer",
    "staleness_weight",
    "aggregate",
    "encode_update",
    "decode_update",
    "encode_version",
    "decode_version",
    "params_sha256",
    "BUFFER_MAX",
    "STALENESS_MAX",
    "HEADER_MAX",
    "SAMPLES_WEIGHT_CAP",
]

FORMAT_VERSION = 1
_MAGIC_UPDATE = b"FU"
_MAGIC_VERSION = b"FV"
_HEAD = struct.Struct("<2sBI")  # magic, format version, header length; then JSON header, float32 body
HEADER_MAX = 64 * 1024  # a version's header names at most BUFFER_MAX contributors
BUFFER_MAX = 256  # K: updates per version
STALENESS_MAX = 1000  # S
SAMPLES_MAX = 2**48
SAMPLES_WEIGHT_CAP = 2.0  # a claimed sample count weighs at most this x the buffer's median count


class Refusal(enum.StrEnum):
    MALFORMED = "malformed"
    FORGED = "forged"
    OVERSIZED = "oversized"
    NON_FINITE = "non_finite"
    FUTURE = "future"
    STALE = "stale"
    FORKED = "forked"
    REPLAYED = "replayed"
    DUPLICATE = "duplicate"
    OUTLIER = "outlier"


class Refused(ValueError):
    def __init__(self, why: Refusal, detail: str) -> None:
        super().__init__(f"{why.value}: {detail}")
        self.why = why


def params_sha256(params: np.ndarray) -> str:
    return hashlib.sha256(np.ascontiguousarray(params, dtype="<f4").tobytes()).hexdigest()


def staleness_weight(staleness: int) -> float:
    """FedBuff's polynomial staleness discount: 1 / sqrt(1 + staleness)."""
    return 1.0 / math.sqrt(1.0 + staleness)


@dataclass(frozen=True)
class Update:
    member: str
    base: int  # the global version the member trained from
    base_sha256: str
    samples: int  # how many samples the member trained on (the update's weight)
    delta: np.ndarray  # float32 (L,): trained params - base params


@dataclass(frozen=True)
class Contribution:
    member: str
    base: int
    samples: int
    staleness: int
    weight: float


@dataclass(frozen=True)
class Version:
    version: int
    sha256: str
    params: np.ndarray  # float32 (L,)
    contributions: tuple[Contribution, ...] = ()
    excluded: dict[str, str] = field(default_factory=dict)  # member -> why (outliers)


# ---------------------------------------------------------------------------------- wire formats


def _pack(magic: bytes, header: dict, body: np.ndarray) -> bytes:
    head = json.dumps(header, separators=(",", ":"), sort_keys=True).encode()
    return _HEAD.pack(magic, FORMAT_VERSION, len(head)) + head + np.ascontiguousarray(body, "<f4").tobytes()


def _unpack(magic: bytes, data: bytes | memoryview, size: int | None) -> tuple[dict, np.ndarray]:
    view = memoryview(data)
    if len(view) < _HEAD.size:
        raise Refused(Refusal.MALFORMED, "truncated")
    m, ver, hlen = _HEAD.unpack_from(view)
    if m != magic or ver != FORMAT_VERSION or hlen > HEADER_MAX or _HEAD.size + hlen > len(view):
        raise Refused(Refusal.MALFORMED, f"not a format-{FORMAT_VERSION} {magic!r} payload")
    body = view[_HEAD.size + hlen:]
    if len(body) % 4:
        raise Refused(Refusal.MALFORMED, "body is not float32")
    if size is not None and len(body) != 4 * size:  # before the header is even parsed
        raise Refused(Refusal.OVERSIZED, f"{len(body) // 4} values, the model has {size}")
    try:
        header = json.loads(bytes(view[_HEAD.size:_HEAD.size + hlen]))
    except ValueError:
        raise Refused(Refusal.MALFORMED, "header is not JSON") from None
    if not isinstance(header, dict):
        raise Refused(Refusal.MALFORMED, "header is not an object")
    return header, np.frombuffer(body, dtype="<f4")


def encode_update(u: Update) -> bytes:
    return _pack(_MAGIC_UPDATE, {"member": u.member, "base": u.base, "base_sha256": u.base_sha256,
                                 "samples": u.samples}, u.delta)


def decode_update(data: bytes | memoryview, *, size: int | None = None) -> Update:
    """The update in ``data`` (``size``: the model's length; any other is OVERSIZED)."""
    h, delta = _unpack(_MAGIC_UPDATE, data, size)
    try:
        member, base, sha, samples = h["member"], h["base"], h["base_sha256"], h["samples"]
    except KeyError as exc:
        raise Refused(Refusal.MALFORMED, f"header lacks {exc}") from None
    if not (isinstance(member, str) and isinstance(sha, str) and len(sha) == 64
            and type(base) is int and 0 <= base < 2**53):
        raise Refused(Refusal.MALFORMED, "bad member, base or base_sha256")
    if type(samples) is not int or not 0 < samples <= SAMPLES_MAX:
        raise Refused(Refusal.NON_FINITE, f"sample count {samples!r} is not a positive integer")
    return Update(member, base, sha, samples, delta)


def encode_version(v: Version) -> bytes:
    return _pack(_MAGIC_VERSION, {
        "version": v.version, "sha256": v.sha256,
        "contributions": [[c.member, c.base, c.samples, c.staleness, c.weight] for c in v.contributions],
        "excluded": v.excluded}, v.params)


def decode_version(data: bytes | memoryview, *, size: int | None = None) -> Version:
    """A published version; its params' sha256 must match the header (else MALFORMED)."""
    h, params = _unpack(_MAGIC_VERSION, data, size)
    version, sha = h.get("version"), h.get("sha256")
    if type(version) is not int or not 0 <= version < 2**53 or not isinstance(sha, str):
        raise Refused(Refusal.MALFORMED, "bad version or sha256")
    if params_sha256(params) != sha:
        raise Refused(Refusal.MALFORMED, f"version {version}'s parameters do not hash to {sha[:12]}")
    try:
        contribs = tuple(Contribution(str(m), int(b), int(s), int(t), float(w))
                         for m, b, s, t, w in h.get("contributions", []))
        excluded = {str(k): str(v) for k, v in dict(h.get("excluded", {})).items()}
    except (TypeError, ValueError):
        raise Refused(Refusal.MALFORMED, "bad contributions") from None
    return Version(version, sha, params, contribs, excluded)


# ---------------------------------------------------------------------------------- aggregation


def aggregate(current: Version, updates: list[Update], *, outlier_factor: float = 10.0,
              server_lr: float = 1.0) -> Version:
    """Version ``current.version + 1``: ``current`` plus the staleness- and sample-weighted mean
    of the kept deltas (float64 sums in member order, so the result depends only on the inputs).
    Updates whose norm is above ``outlier_factor`` x the median norm are excluded (robust.screen);
    a sample count counts at most :data:`SAMPLES_WEIGHT_CAP` x the kept updates' median count."""
    updates = sorted(updates, key=lambda u: u.member)
    norms = [math.sqrt(float(np.dot(u.delta.astype(np.float64), u.delta.astype(np.float64))))
             for u in updates]
    scr = robust.screen(norms, [True] * len(updates), outlier_factor)
    excluded = {updates[k].member: why for k, why in scr.excluded.items()}
    acc = np.zeros(current.params.size, np.float64)
    total = 0.0
    contribs = []
    # A member holding a valid key could claim 2^48 samples and take the whole weight of the
    # mean: a claimed count weighs at most SAMPLES_WEIGHT_CAP x the kept updates' median count.
    cap = SAMPLES_WEIGHT_CAP * float(np.median([updates[k].samples for k in scr.kept])) if scr.kept else 0.0
    for k in scr.kept:
        u = updates[k]
        stale = current.version - u.base
        w = min(float(u.samples), cap) * staleness_weight(stale)
        acc += w * u.delta.astype(np.float64)
        total += w
        contribs.append(Contribution(u.member, u.base, u.samples, stale, w))
    params = current.params.astype(np.float64)
    if total > 0:
        params += server_lr * acc / total
    out = params.astype(np.float32)
    return Version(current.version + 1, params_sha256(out), out, tuple(contribs), excluded)


class Buffer:
    """The aggregator's state: the current version, the hashes of the last ``max_staleness``
    versions, the buffer of admitted updates and, per member, the newest base it was admitted
    from (replays). Not thread-safe: one aggregator thread owns it."""

    def __init__(self, initial: Version, *, buffer: int, max_staleness: int,
                 outlier_factor: float = 10.0, server_lr: float = 1.0) -> None:
        if not 1 <= buffer <= BUFFER_MAX:
            raise ValueError(f"buffer must be 1..{BUFFER_MAX}, not {buffer}")
        if not 0 <= max_staleness <= STALENESS_MAX:
            raise ValueError(f"max_staleness must be 0..{STALENESS_MAX}, not {max_staleness}")
        self.current = initial
        self.size = initial.params.size
        self.k = buffer
        self.max_staleness = max_staleness
        self.outlier_factor = outlier_factor
        self.server_lr = server_lr
        self.pending: dict[str, Update] = {}
        self._hashes: dict[int, str] = {initial.version: initial.sha256}
        self._newest_base: dict[str, int] = {}
        self.refused: dict[Refusal, int] = {}

    def admit(self, member: str, payload: bytes | memoryview) -> Version | None:
        """Admit ``member``'s (already signature-checked) update; the new version when the buffer
        filled. Raises :class:`Refused` (after counting it) for an update it will not use."""
        try:
            u = decode_update(payload, size=self.size)
            held = self.pending.get(member)
            if held is not None and held.base == u.base and np.array_equal(held.delta, u.delta):
                return None  # a member re-sending the update it has in the buffer: nothing new
            self._check(member, u)
        except Refused as exc:
            self.refused[exc.why] = self.refused.get(exc.why, 0) + 1
            raise
        self.pending[member] = u
        self._newest_base[member] = u.base
        if len(self.pending) < self.k:
            return None
        return self._advance()

    def _check(self, member: str, u: Update) -> None:
        cur = self.current.version
        if u.member != member:
            raise Refused(Refusal.FORGED, f"update names {u.member!r} but was signed by {member!r}")
        if not np.isfinite(u.delta).all():
            raise Refused(Refusal.NON_FINITE, f"{member}'s delta holds NaN or Inf")
        if u.base > cur:
            raise Refused(Refusal.FUTURE, f"base version {u.base} is newer than {cur}")
        if cur - u.base > self.max_staleness:
            raise Refused(Refusal.STALE, f"base version {u.base} is {cur - u.base} behind "
                                         f"(max_staleness {self.max_staleness})")
        if self._hashes.get(u.base) != u.base_sha256:
            raise Refused(Refusal.FORKED, f"base {u.base}'s hash {u.base_sha256[:12]} is not the "
                                          "aggregator's")
        if member in self.pending:
            raise Refused(Refusal.DUPLICATE, f"{member} already has an update in this buffer")
        if u.base <= self._newest_base.get(member, -1):
            raise Refused(Refusal.REPLAYED, f"{member} already sent an update from version "
                                            f"{self._newest_base[member]}")

    def _advance(self) -> Version:
        nxt = aggregate(self.current, list(self.pending.values()), outlier_factor=self.outlier_factor,
                        server_lr=self.server_lr)
        if nxt.excluded:
            self.refused[Refusal.OUTLIER] = self.refused.get(Refusal.OUTLIER, 0) + len(nxt.excluded)
        self.pending.clear()
        self.current = nxt
        self._hashes[nxt.version] = nxt.sha256
        self._hashes.pop(nxt.version - self.max_staleness - 1, None)
        return nxt
