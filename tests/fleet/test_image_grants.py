"""Issue 26, findings 5, 10 and 13: image-download grants and what "done" means for a roll-out.

A real fleet (uvicorn) on the session's Mosquitto, an image in its catalogue, and simulated nodes
that publish signed statuses. The attacker is an anonymous client on the same broker: it reads
the ImageUpdateCommand (signed, not secret) and tries its grant. Then a canary with a valid key
says "done" while its status still reports the old version.
"""

from __future__ import annotations

import json
import re
import time

import httpx
import pytest

from deploy.keys import provision
from federation import grants, topics
from federation.messages import ImageInfo, ImageUpdate, NodeState, NodeStatus
from federation.signed import SignedLink, load_identity

pytestmark = pytest.mark.mosquitto

IMAGE_ID = "ab" * 16
BLOB = bytes(range(256)) * 64


def _catalogue(directory) -> None:
    """One image in the catalogue, written as an upload would leave it (the file and its entry)."""
    directory.mkdir(parents=True, exist_ok=True)
    (directory / f"{IMAGE_ID}.img").write_bytes(BLOB)
    entry = {"id": IMAGE_ID, "version": "2.0.0", "board": "x86_64", "arch": "x86_64", "size": len(BLOB),
             "signer": "test", "rollback_index": 2, "artifact": "digits-mlp"}
    (directory / "catalogue.json").write_text(json.dumps([entry]))


def _status(node: str, version: str = "1.0.0", update: ImageUpdate | None = None) -> NodeStatus:
    image = ImageInfo(version=version, slot="a", state="good", health="passed", update=update)
    return NodeStatus(node_id=node, state=NodeState.ONLINE, arch="x86_64", board="x86_64",
                      model="digits-mlp", model_version=1, params_sha256="ab" * 32, samples=10, image=image)


def _get(fleet, url: str) -> httpx.Response:
    """GET without the operator token (the fixture's client sends it by default)."""
    return fleet.client.get(url, headers={"Authorization": ""})


@pytest.fixture
def signed_catalogue(make_fleet, tmp_path):
    swarm = f"grant{int(time.time() * 1000) % 10**8}"
    keys = tmp_path / "keys"
    provision(keys, swarm, ["n1", "n2"])
    _catalogue(tmp_path / "images")
    fleet = make_fleet(swarm=swarm, images_dir=str(tmp_path / "images"),
                       key_file=str(keys / "keys/fleet.key"), keyring_file=str(keys / "keyring.json"))
    members = {}
    for n in ("n1", "n2"):
        ident = load_identity(keys / f"keys/{n}.key", keys / "keyring.json")
        members[n] = (SignedLink(fleet.link(n), ident.signer, ident.verifier()), ident.signer)
    yield fleet, members
    raw = fleet.link("cleanup")
    for n in members:
        raw.publish(topics.status(fleet.swarm, n), b"", retain=True).wait_for_publish(5)


def test_a_grant_read_off_the_broker_opens_nothing_and_a_lying_canary_fails_the_rollout(signed_catalogue):
    fleet, m = signed_catalogue
    for n, (link, _) in m.items():
        link.publish(topics.status(fleet.swarm, n), _status(n), retain=True).wait_for_publish(5)
    fleet.wait_for(lambda: all((v := fleet.node(n)) and v["online"] and v["image"] for n in m), 10, "nodes")
    commands: list[bytes] = []
    attacker = fleet.link("attacker")  # anonymous, on the same broker
    attacker.subscribe(topics.command(fleet.swarm), lambda t, p: commands.append(p))

    r = fleet.post("/api/rollouts", json={"image": IMAGE_ID, "nodes": ["n1", "n2"]})
    assert r.status_code == 202, r.text
    rid = r.json()["rollout_id"]
    fleet.wait_for(lambda: commands, 10, "the canary's command on the broker")
    url = re.search(rb'"url":"([^"]+)"', commands[0]).group(1).decode()
    exp = int(re.search(r"[?&]exp=(\d+)", url).group(1))
    assert exp - time.time() <= 15 * 60 + 2, "a grant lives minutes, not days"

    # the grant as captured: refused; with a made-up proof, or another member's: refused
    r = _get(fleet, url)
    assert r.status_code == 401 and "proof" in r.json()["error"], r.text
    assert _get(fleet, f"{url}&node=n1&proof=n1-1:{'A' * 86}").status_code == 401
    assert _get(fleet, f"{url}&node=n1&proof=nonsense").status_code == 401
    n2_signer = m["n2"][1]
    r = _get(fleet, grants.prove_url(url, IMAGE_ID, n2_signer))  # a member the stage does not address
    assert r.status_code == 403 and "n2" in r.json()["error"], r.text
    # n2's proof presented as n1's: the signature is over the node id
    forged = grants.prove_url(url, IMAGE_ID, n2_signer).replace("node=n2", "node=n1")
    assert _get(fleet, forged).status_code == 401
    # the canary itself, with its proof: the image
    n1_signer = m["n1"][1]
    r = _get(fleet, grants.prove_url(url, IMAGE_ID, n1_signer))
    assert r.status_code == 200 and r.content == BLOB
    # expired, or made for another image: refused even with a good proof
    cat = fleet.service.images
    old = f"{fleet.url}/api/images/{IMAGE_ID}?{cat.grant_query(IMAGE_ID, int(time.time()) - 1)}"
    r = _get(fleet, grants.prove_url(old, IMAGE_ID, n1_signer))
    assert r.status_code == 401 and "expired" in r.json()["error"], r.text
    other = f"{fleet.url}/api/images/{IMAGE_ID}?{cat.grant_query('cd' * 16, exp)}"
    assert _get(fleet, grants.prove_url(other, IMAGE_ID, n1_signer)).status_code == 401

    # finding 5: the canary (valid key) says "done" but still reports version 1.0.0
    lie = _status("n1", "1.0.0", ImageUpdate(update_id=rid, phase="done", version="2.0.0"))
    m["n1"][0].publish(topics.status(fleet.swarm, "n1"), lie, retain=True).wait_for_publish(5)
    ro = fleet.wait_for(lambda: (x := fleet.get(f"/api/rollouts/{rid}").json())["state"] != "running" and x,
                        10, "the roll-out to end")
    assert ro["state"] == "failed", ro
    assert ro["reason"].startswith("canary n1 reported done, but its image is version '1.0.0'"), ro["reason"]
    assert ro["nodes"]["n2"]["sent_at"] is None
    time.sleep(0.5)  # a stage-2 command would have been published together with the state change
    assert len(commands) == 1, "the image went on to the other nodes"
    # no running roll-out: the canary's own proof opens nothing any more
    assert _get(fleet, grants.prove_url(url, IMAGE_ID, n1_signer)).status_code == 403


EXPS = ["²", "١٢٣٤٥٦٧٨٩٠", "９９９９９９９９９９", "𝟗𝟗𝟗𝟗𝟗𝟗𝟗𝟗𝟗𝟗", "99999999999999999999999999", "-1", "",
        " 1", "1e10", "0x1f", "1_000", "+5", "Infinity", "NaN", "١"]
GRANTS = ["²" * 64, "", "G" * 64, "A" * 64, "0" * 65, "0" * 63, "é", "%00"]


@pytest.mark.parametrize("exp", EXPS)
def test_malformed_grant_expiry_is_a_4xx(make_fleet, tmp_path, exp):
    """Issue 26, finding 13: ``exp=²`` answered 500 (``str.isdigit`` accepts '²', ``int`` does not)."""
    _catalogue(tmp_path / "images")
    fleet = make_fleet(images_dir=str(tmp_path / "images"))
    r = fleet.client.get(f"/api/images/{IMAGE_ID}", params={"exp": exp, "grant": "0" * 64},
                         headers={"Authorization": ""})
    assert r.status_code == 400, (exp, r.status_code, r.text)
    assert "exp" in r.json()["error"]


def test_malformed_grants_are_4xx_and_a_good_one_opens_the_image(make_fleet, tmp_path):
    _catalogue(tmp_path / "images")
    fleet = make_fleet(images_dir=str(tmp_path / "images"))
    exp = str(int(time.time()) + 60)
    for grant in GRANTS:
        r = fleet.client.get(f"/api/images/{IMAGE_ID}", params={"exp": exp, "grant": grant},
                             headers={"Authorization": ""})
        assert r.status_code == 400 and "grant" in r.json()["error"], (grant, r.status_code, r.text)
    for params, code in (({"exp": exp}, 400), ({"grant": "0" * 64}, 400), ({}, 401),
                         ({"exp": exp, "grant": "0" * 64}, 401)):
        r = fleet.client.get(f"/api/images/{IMAGE_ID}", params=params, headers={"Authorization": ""})
        assert r.status_code == code, (params, r.text)
    # an unsigned fleet: the grant alone opens the image (a bearer token of at most 15 minutes)
    query = fleet.service.images.grant_query(IMAGE_ID, int(time.time()) + 60)
    r = _get(fleet, f"/api/images/{IMAGE_ID}?{query}")
    assert r.status_code == 200 and r.content == BLOB
    # the operator token still works, whatever else the query says
    assert fleet.get(f"/api/images/{IMAGE_ID}", params={"exp": "²", "grant": ""}).status_code == 200
