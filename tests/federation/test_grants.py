"""federation/grants.py: a node's proof for an image-download grant, without a broker or a fleet."""

from __future__ import annotations

import pytest

from federation import grants
from federation.auth import DOMAIN, KeyEntry, Keyring, Role, Signer, generate_key
from federation.errors import FederationError

IMG = "ab" * 16
GRANT = "0f" * 32


@pytest.fixture
def ring():
    keys = {name: generate_key() for name in ("n1", "n2", "fleet")}
    ring = Keyring([KeyEntry(f"{n}-1", n, Role.FLEET if n == "fleet" else Role.NODE, k.public_key())
                    for n, k in keys.items()], swarm="s")
    signers = {n: Signer(n, f"{n}-1", k) for n, k in keys.items()}
    return ring, signers


def test_a_proof_verifies_only_for_its_node_grant_and_image(ring):
    keyring, s = ring
    proof = grants.prove(s["n1"], IMG, 1000, GRANT)
    assert grants.verify_proof(keyring, "n1", proof, IMG, 1000, GRANT)
    for node, image, exp, grant in (("n2", IMG, 1000, GRANT), ("n1", "cd" * 16, 1000, GRANT),
                                    ("n1", IMG, 1001, GRANT), ("n1", IMG, 1000, "1f" * 32)):
        assert not grants.verify_proof(keyring, node, proof, image, exp, grant)
    # a fleet key is not a node's; a revoked key is nobody's
    assert not grants.verify_proof(keyring, "fleet", grants.prove(s["fleet"], IMG, 1000, GRANT), IMG, 1000,
                                   GRANT)
    keyring.revoke("n1-1")
    assert not grants.verify_proof(keyring, "n1", proof, IMG, 1000, GRANT)


@pytest.mark.parametrize("proof", ["", ":", "n1-1", "n1-1:", "n1-1:" + "A" * 85, "n1-1:" + "=" * 86,
                                   "../x:" + "A" * 86, "n1-1:" + "²" * 86, "n9-1:" + "A" * 86])
def test_malformed_proofs_are_refused(ring, proof):
    keyring, _ = ring
    assert not grants.verify_proof(keyring, "n1", proof, IMG, 1000, GRANT)


def test_prove_url_appends_the_proof_and_leaves_other_urls_alone(ring):
    keyring, s = ring
    url = f"http://fleet/api/images/{IMG}?exp=1000&grant={GRANT}"
    proved = grants.prove_url(url, IMG, s["n2"])
    assert proved.startswith(url + "&node=n2&proof=n2-1:")
    assert grants.verify_proof(keyring, "n2", proved.split("proof=")[1], IMG, 1000, GRANT)
    for other in ("http://fleet/api/images/x?token=t", "http://fleet/x", "http://f/x?exp=²&grant=g"):
        assert grants.prove_url(other, IMG, s["n2"]) == other


def test_a_detached_signature_never_passes_for_an_envelope(ring):
    _, s = ring
    with pytest.raises(FederationError):
        s["n1"].sign_detached(DOMAIN + b"anything")
