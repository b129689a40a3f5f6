"""Device enrolment: tokens, pending devices, the operator's accept/reject/revoke (issue 25 item 5).

A board's first boot (``edgenode/enrol.py``) makes its own ed25519 + X25519 keys and announces
itself over HTTP (``POST /api/enroll``, open route, small body) with an enrolment token and a
proof that it holds the key. The token only buys a *pending* entry: nothing is granted until the
operator accepts (``POST /api/enrollments/{id}/accept``). Then the fleet

* adds the device's public keys to the swarm keyring, saves it, and publishes it signed by the
  fleet on ``fractal/v1/{swarm}/keyring`` (retained) so members learn the new key;
* creates the device's broker client through Mosquitto's dynamic-security plugin
  (``federation/dynsec.py``), so it can connect without a broker restart.

The device polls ``POST /api/enroll/{id}/status`` with a fresh signature of its key; once
accepted the answer holds the keyring (with the fleet's detached signature) and its broker
credentials. A pending, rejected or revoked device has no broker client: it can publish nothing.
Revocation revokes its key id in the keyring (published) and deletes its broker client.

State lives in the fleet's database (the same one as the round history: a SQLite file or
PostgreSQL, api/fleet/store.py), so a restarted fleet keeps its tokens and enrolments. Tokens are
stored as SHA-256 hashes.
"""

from __future__ import annotations

import base64
import hashlib
import json
import logging
import re
import secrets
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Annotated, Any

from pydantic import BaseModel, ConfigDict, Field, StringConstraints

from api.fleet.store import open_database
from federation import enrolment as wire
from federation.auth import KeyEntry, Role
from federation.signed import Identity
from fractal.files import atomic_write

log = logging.getLogger("fractal.fleet.enrollment")

__all__ = [
    "EnrollmentManager",
    "EnrollmentRejected",
    "TokenRequest",
    "EnrolRequest",
    "PollRequest",
    "MAX_PENDING",
    "MAX_TOKEN_TTL_S",
    "MAX_TOKEN_USES",
]

MAX_PENDING = 1000  # pending requests kept at once: a leaked token cannot fill the disk
MAX_TOKEN_TTL_S = 30 * 24 * 3600.0
MAX_TOKEN_USES = 1000
MAX_TOKENS = 1000  # live tokens at once

_ID = r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,63}$"
_B64_32 = r"^[A-Za-z0-9+/]{43}=$"
_B64_64 = r"^[A-Za-z0-9+/]{86}==$"

_SCHEMA = """
CREATE TABLE IF NOT EXISTS enrol_tokens (
    token_hash TEXT PRIMARY KEY,
    created_at REAL NOT NULL,
    expires_at REAL NOT NULL,
    uses_left  INTEGER NOT NULL,
    uses       INTEGER NOT NULL
);
CREATE TABLE IF NOT EXISTS enrollments (
    device_id    TEXT PRIMARY KEY,
    state        TEXT NOT NULL,
    arch         TEXT NOT NULL,
    board        TEXT NOT NULL,
    public_key   TEXT NOT NULL,
    dh_public    TEXT NOT NULL,
    requested_at REAL NOT NULL,
    decided_at   REAL,
    password     TEXT
);
"""


class EnrollmentRejected(Exception):
    """A request the fleet refuses; ``status_code`` is the HTTP answer (4xx)."""

    def __init__(self, reason: str, status_code: int = 409) -> None:
        super().__init__(reason)
        self.reason = reason
        self.status_code = status_code


class TokenRequest(BaseModel):
    """``POST /api/enrollment-tokens``: how long the token lives and how many devices it may announce."""

    model_config = ConfigDict(extra="forbid")
    ttl_s: float = Field(default=24 * 3600.0, gt=0, le=MAX_TOKEN_TTL_S)
    uses: int = Field(default=1, ge=1, le=MAX_TOKEN_USES)


Id = Annotated[str, StringConstraints(pattern=_ID)]
Word = Annotated[str, StringConstraints(pattern=r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,31}$")]


class EnrolRequest(BaseModel):
    """``POST /api/enroll`` (a device, no operator token): who it is and the proof it holds its key."""

    model_config = ConfigDict(extra="forbid")
    token: Annotated[str, StringConstraints(pattern=r"^[\x21-\x7e]{8,256}$")]
    device_id: Id
    arch: Word
    board: Word
    public_key: Annotated[str, StringConstraints(pattern=_B64_32)]
    dh_public: Annotated[str, StringConstraints(pattern=_B64_32)]
    proof: Annotated[str, StringConstraints(pattern=_B64_64)]


class PollRequest(BaseModel):
    """``POST /api/enroll/{id}/status``: a fresh timestamp signed with the device's key."""

    model_config = ConfigDict(extra="forbid")
    ts: int = Field(ge=0, le=2**40)
    sig: Annotated[str, StringConstraints(pattern=_B64_64)]


def device_broker_url(settings: Any) -> str:
    """The broker URL accepted devices get: ``device_broker``, else the fleet's without its credentials."""
    if settings.device_broker:
        return str(settings.device_broker)
    from urllib.parse import urlsplit, urlunsplit

    u = urlsplit(settings.broker)
    host = u.hostname or ""
    netloc = (f"[{host}]" if ":" in host else host) + (f":{u.port}" if u.port else "")
    return urlunsplit((u.scheme, netloc, u.path, "", ""))


def _hash(token: str) -> str:
    return hashlib.sha256(token.encode()).hexdigest()


class EnrollmentManager:
    """Thread-safe; ``identity``/``keyring_file``: the fleet's signed-swarm identity (accepting needs it),
    ``dynsec``: a :class:`federation.dynsec.DynsecAdmin`-like object (None: no broker clients made),
    ``publish(topic, payload_bytes)``: a retained, signed publish on the fleet's link."""

    def __init__(
        self,
        db_path: str | Path,
        *,
        swarm: str,
        broker_url: str,
        identity: Identity | None,
        keyring_file: str | None,
        dynsec: Any = None,
        publish: Callable[[str, bytes], None] | None = None,
        clock: Callable[[], float] = time.time,
    ) -> None:
        self.swarm = swarm
        self.broker_url = broker_url
        self.identity = identity
        self.keyring_file = Path(keyring_file) if keyring_file else None
        self.dynsec = dynsec
        self.publish = publish
        self.clock = clock
        self._lock = threading.RLock()
        self._conn = open_database(db_path, _SCHEMA)  # a SQLite path or a postgresql:// URL

    def close(self) -> None:
        with self._lock:
            self._conn.close()

    # -- operator ---------------------------------------------------------------------------
    def create_token(self, req: TokenRequest) -> dict:
        now = self.clock()
        token = secrets.token_urlsafe(24)
        with self._lock:
            self._conn.execute("DELETE FROM enrol_tokens WHERE expires_at <= ? OR uses_left <= 0", (now,))
            (live,) = self._conn.execute("SELECT COUNT(*) FROM enrol_tokens").fetchone()
            if live >= MAX_TOKENS:
                raise EnrollmentRejected(
                    f"{live} enrolment tokens are live (at most {MAX_TOKENS}); let some expire first", 429
                )
            self._conn.execute(
                "INSERT INTO enrol_tokens VALUES (?, ?, ?, ?, ?)",
                (_hash(token), now, now + req.ttl_s, req.uses, req.uses),
            )
        return {"token": token, "expires_at": now + req.ttl_s, "uses": req.uses}

    def list(self, limit: int = 500) -> list[dict]:
        with self._lock:
            rows = self._conn.execute(
                "SELECT device_id, state, arch, board, public_key, dh_public, requested_at, decided_at "
                "FROM enrollments ORDER BY requested_at DESC LIMIT ?",
                (limit,),
            ).fetchall()
        return [self._view(r) for r in rows]

    @staticmethod
    def _view(r: tuple) -> dict:
        return {
            "device_id": r[0],
            "state": r[1],
            "arch": r[2],
            "board": r[3],
            "key_fingerprint": wire.fingerprint(r[4]),
            "dh_fingerprint": wire.fingerprint(r[5]),
            "key_id": wire.device_key_id(r[0], r[4]),
            "requested_at": r[6],
            "decided_at": r[7],
        }

    def _row(self, device_id: str) -> tuple | None:
        return self._conn.execute(
            "SELECT device_id, state, arch, board, public_key, dh_public, requested_at, decided_at, password "
            "FROM enrollments WHERE device_id = ?",
            (device_id,),
        ).fetchone()

    def _need(self, device_id: str, state: str, verb: str) -> tuple:
        row = self._row(device_id)
        if row is None:
            raise EnrollmentRejected(f"no enrolment request from device {device_id[:64]!r}", 404)
        if row[1] != state:
            raise EnrollmentRejected(f"device {device_id} is {row[1]}; only a {state} device can be {verb}")
        return row

    def accept(self, device_id: str) -> dict:
        """Add the device's keys to the keyring (saved, published) and make its broker client."""
        if self.identity is None or self.keyring_file is None:
            raise EnrollmentRejected(
                "this fleet runs an unsigned swarm (no key_file/keyring_file): it cannot hand out a keyring",
                409,
            )
        with self._lock:
            row = self._need(device_id, "pending", "accepted")
            ring = self.identity.keyring
            key_id = wire.device_key_id(device_id, row[4])
            if ring.current(device_id) is not None or ring.get(key_id) is not None:
                raise EnrollmentRejected(
                    f"{device_id} already holds a key in the keyring; a device id is enrolled once"
                )
            password = secrets.token_urlsafe(24)
            if self.dynsec is not None:
                from federation.errors import FederationError

                try:
                    role = self.dynsec.ensure_swarm_role(self.swarm)
                    self.dynsec.create_client(device_id, password, [role])
                except FederationError as exc:
                    raise EnrollmentRejected(f"the broker did not make the device's client: {exc}",
                                             503) from None
            from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PublicKey
            from cryptography.hazmat.primitives.asymmetric.x25519 import X25519PublicKey

            ring.add(
                KeyEntry(
                    key_id,
                    device_id,
                    Role.NODE,
                    Ed25519PublicKey.from_public_bytes(base64.b64decode(row[4])),
                    X25519PublicKey.from_public_bytes(base64.b64decode(row[5])),
                )
            )
            self._keyring_changed()
            now = self.clock()
            self._conn.execute(
                "UPDATE enrollments SET state = 'accepted', decided_at = ?, password = ? WHERE device_id = ?",
                (now, password, device_id),
            )
            return self._view(self._need(device_id, "accepted", "read"))

    def reject(self, device_id: str) -> dict:
        with self._lock:
            self._need(device_id, "pending", "rejected")
            self._conn.execute(
                "UPDATE enrollments SET state = 'rejected', decided_at = ? WHERE device_id = ?",
                (self.clock(), device_id),
            )
            return self._view(self._need(device_id, "rejected", "read"))

    def revoke(self, device_id: str) -> dict:
        """Take an accepted device out: key id revoked (keyring saved, published), broker client deleted."""
        with self._lock:
            row = self._need(device_id, "accepted", "revoked")
            assert self.identity is not None  # accepted implies a signed fleet
            self.identity.keyring.revoke(wire.device_key_id(device_id, row[4]))
            self._keyring_changed()
            if self.dynsec is not None:
                from federation.errors import FederationError

                try:
                    self.dynsec.delete_client(device_id)
                except FederationError as exc:  # the key is revoked; say the broker part failed
                    raise EnrollmentRejected(f"key revoked, but the broker did not delete the device's "
                                             f"client: {exc}; revoke again", 503) from None
            self._conn.execute(
                "UPDATE enrollments SET state = 'revoked', decided_at = ?, password = NULL "
                "WHERE device_id = ?",
                (self.clock(), device_id),
            )
            return self._view(self._need(device_id, "revoked", "read"))

    def _keyring_changed(self) -> None:
        assert self.identity is not None and self.keyring_file is not None
        text = self.identity.keyring.to_json()
        atomic_write(self.keyring_file, text)
        self.publish_keyring(text)

    def publish_keyring(self, text: str | None = None) -> None:
        """Publish the keyring, retained and signed (the fleet's link signs it); a broker that is
        down is logged, not raised: the fleet publishes it again at its next start."""
        if self.publish is None or self.identity is None:
            return
        try:
            self.publish(wire.keyring_topic(self.swarm), (text or self.identity.keyring.to_json()).encode())
        except Exception as exc:  # noqa: BLE001 - the decision stands; members catch up at the next publish
            log.warning("could not publish the keyring: %s", exc)

    def signed_keyring(self) -> dict:
        assert self.identity is not None
        text = self.identity.keyring.to_json()
        sig = self.identity.signer.sign_detached(wire.keyring_message(text))
        return {
            "keyring": text,
            "keyring_sig": base64.b64encode(sig).decode(),
            "fleet_key_id": self.identity.signer.key_id,
        }

    # -- device ------------------------------------------------------------------------------
    def request(self, req: EnrolRequest) -> dict:
        """A device's announcement: pending until the operator decides. A repeat of the same device
        with the same key answers its state and uses no token; the same id with another key is refused."""
        msg = wire.request_message(
            req.device_id, req.arch, req.board, req.public_key, req.dh_public, req.token
        )
        if not wire.verify_sig(req.public_key, req.proof, msg):
            raise EnrollmentRejected("the proof does not verify with the announced public key", 400)
        now = self.clock()
        with self._lock:
            row = self._row(req.device_id)
            if row is not None:
                if row[4] != req.public_key or row[5] != req.dh_public:
                    raise EnrollmentRejected(
                        f"device {req.device_id} is already {row[1]} with another key", 409
                    )
                return {"device_id": req.device_id, "state": row[1]}
            if self.identity is not None and self.identity.keyring.current(req.device_id) is not None:
                raise EnrollmentRejected(f"{req.device_id} is already a member of the swarm", 409)
            tok = self._conn.execute(
                "SELECT expires_at, uses_left FROM enrol_tokens WHERE token_hash = ?", (_hash(req.token),)
            ).fetchone()
            if tok is None or tok[0] <= now or tok[1] <= 0:
                raise EnrollmentRejected("enrolment token unknown, expired or used up", 403)
            (pending,) = self._conn.execute(
                "SELECT COUNT(*) FROM enrollments WHERE state = 'pending'"
            ).fetchone()
            if pending >= MAX_PENDING:
                raise EnrollmentRejected(f"{pending} devices are pending; decide on them first", 429)
            self._conn.execute(
                "UPDATE enrol_tokens SET uses_left = uses_left - 1 WHERE token_hash = ?", (_hash(req.token),)
            )
            self._conn.execute(
                "INSERT INTO enrollments VALUES (?, 'pending', ?, ?, ?, ?, ?, NULL, NULL)",
                (req.device_id, req.arch, req.board, req.public_key, req.dh_public, now),
            )
        return {"device_id": req.device_id, "state": "pending"}

    def poll(self, device_id: str, req: PollRequest) -> dict:
        """The device's state; accepted: the signed keyring and its broker credentials."""
        with self._lock:
            row = self._row(device_id)
        if row is None or not re.match(_ID, device_id):
            raise EnrollmentRejected(f"no enrolment request from device {device_id[:64]!r}", 404)
        if abs(self.clock() - req.ts) > wire.POLL_MAX_AGE_S:
            raise EnrollmentRejected(
                f"ts is more than {wire.POLL_MAX_AGE_S:.0f} s from the fleet's clock", 400
            )
        if not wire.verify_sig(row[4], req.sig, wire.poll_message(device_id, req.ts)):
            raise EnrollmentRejected("the signature does not verify with the device's key", 401)
        out: dict[str, Any] = {"device_id": device_id, "state": row[1]}
        if row[1] == "accepted":
            out |= self.signed_keyring() | {
                "swarm": self.swarm,
                "key_id": wire.device_key_id(device_id, row[4]),
                "broker": {"url": self.broker_url, "username": device_id, "password": row[8]},
            }
        return out

    def counts(self) -> dict[str, int]:
        with self._lock:
            rows = self._conn.execute("SELECT state, COUNT(*) FROM enrollments GROUP BY state").fetchall()
        return dict(rows)


def dumps(obj: Any) -> str:
    return json.dumps(obj, separators=(",", ":"))
