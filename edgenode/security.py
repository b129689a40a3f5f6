"""The node's side of a signed swarm: its identity, the signed link, and the rejection counters.

With ``key_file`` and ``keyring_file`` in NODE.toml (made by ``python -m deploy.keys``), every
payload the node publishes is signed (its status, Last Will, round events, ring frames) and
every payload it receives is verified first (commands must carry the fleet's signature; ring
frames their sender's MAC); what fails is dropped and counted in ``/metrics`` as
``fractal_node_messages_rejected_total{reason=...}``.
"""

from __future__ import annotations

import logging
from pathlib import Path

from prometheus_client import CollectorRegistry, Counter

from federation.auth import Reject
from federation.signed import Identity, SignedLink, load_identity
from federation.transport import PubSubLink
from fractal.files import atomic_write

__all__ = ["NodeAuth"]

log = logging.getLogger(__name__)


class NodeAuth:
    """Load once at node start; ``wrap`` the MQTT link, ``sign_will`` before connecting."""

    def __init__(self, key_file: str | Path, keyring_file: str | Path, node_id: str,
                 registry: CollectorRegistry) -> None:
        self.identity: Identity = load_identity(key_file, keyring_file)
        self._keyring_file = Path(keyring_file)
        if self.identity.signer.sender != node_id:
            from edgenode.errors import ConfigError

            raise ConfigError(f"key_file {key_file} belongs to {self.identity.signer.sender!r}, "
                              f"not to this node ({node_id!r})", hint="give each node its own keys/NODE.key")
        self.rejected = Counter("fractal_node_messages_rejected", "MQTT messages dropped by reason "
                                "(unsigned, forged, replayed, ...)", ["reason"], registry=registry)
        for reason in Reject:  # export every reason, zeros included
            self.rejected.labels(reason=reason.value)

    def sign_will(self, topic: str, payload: bytes | str) -> bytes:
        """The Last Will, signed now (the broker publishes it later; see federation/auth.py)."""
        return self.identity.signer.sign(topic, payload.encode() if isinstance(payload, str) else payload,
                                         will=True)

    def wrap(self, link: PubSubLink) -> SignedLink:
        self._follow_keyring(link)
        return self.identity.link(link, on_reject=self._on_reject)

    def _follow_keyring(self, link: PubSubLink) -> None:
        """Apply the fleet's signed keyring updates (enrolments, revocations) in place, and save them."""
        from federation import enrolment

        ring = self.identity.keyring

        def on_update(topic: str, payload: bytes) -> None:
            if not payload:
                return
            try:
                # retained: an update may be old; replays of older keyrings fail check_update
                added, revoked = enrolment.apply_update(
                    ring, topic, payload, lambda kr: self.identity.verifier(max_age_s=10 * 365 * 86400.0))
            except Exception as exc:  # a bad update is dropped and counted, never a crash
                self._on_reject(topic, Reject.MALFORMED)
                log.warning("keyring update dropped: %s", str(exc)[:300])
                return
            if added or revoked:
                atomic_write(self._keyring_file, ring.to_json())
                log.info("keyring updated: added %s, revoked %s", added, revoked)

        link.subscribe(enrolment.keyring_topic(link.swarm), on_update)

    def count(self, topic: str, reason: Reject) -> None:
        """Count a message the node dropped before verifying it (e.g. ``oversized``)."""
        self._on_reject(topic, reason)

    def _on_reject(self, topic: str, reason: Reject) -> None:
        self.rejected.labels(reason=reason.value).inc()
        log.debug("dropped message on %s: %s", topic, reason.value)
