"""Enrolment through the fleet's HTTP API (issue 25 item 5): tokens are bounded, expire and run out;
a stolen token admits nobody without the operator; accept hands out a fleet-signed keyring that
members learn over MQTT; bad input is a 4xx naming the problem. A real device (edgenode/enrol.py)
talks to a real fleet service (uvicorn) on the session's Mosquitto."""

from __future__ import annotations

import base64
import threading
import time

import httpx
import pytest

from api.fleet.enrollment import EnrollmentManager, EnrollmentRejected, EnrolRequest, TokenRequest
from deploy.keys import provision
from edgenode.enrol import enrol
from edgenode.errors import ConfigError
from federation import enrolment as wire
from federation.auth import Keyring, generate_key, load_private_key
from federation.errors import FederationError
from federation.signed import load_identity
from tests.fleet.conftest import collect

pytestmark = pytest.mark.mosquitto


def _signed_fleet(make_fleet, tmp_path, swarm="enr", **kw):
    keys = tmp_path / "keys"
    swarm = f"{swarm}{abs(hash(tmp_path)) % 10**6}"
    provision(keys, swarm, ["node-1"])
    return make_fleet(swarm=swarm, key_file=str(keys / "keys/fleet.key"),
                      keyring_file=str(keys / "keyring.json"), db=str(tmp_path / "fleet.sqlite"), **kw), keys


def _device_dir(tmp_path, name, fleet_url, token):
    d = tmp_path / name / "data"
    d.mkdir(parents=True)
    (d / "enrollment.toml").write_text(f'fleet = "{fleet_url}"\nenroll_token = "{token}"\n')
    return d


def _enrol_in_thread(data, device_id, **kw):
    out: dict = {}

    def run():
        try:
            out["ok"] = enrol(data, device_id=device_id, arch="aarch64", board="aarch64-virt", poll_s=0.05,
                              **kw)
        except ConfigError as exc:
            out["err"] = str(exc)

    t = threading.Thread(target=run, daemon=True)
    t.start()
    return t, out


def _pending(fleet, device_id):
    rows = fleet.get("/api/enrollments").json()["enrollments"]
    return next((r for r in rows if r["device_id"] == device_id and r["state"] == "pending"), None)


def test_token_request_bounds_and_auth(fleet):
    for body, what in [({"ttl_s": 0}, "ttl_s"), ({"ttl_s": 31 * 86400}, "ttl_s"), ({"uses": 0}, "uses"),
                       ({"uses": 1001}, "uses"), ({"uses": "many"}, "uses"), ({"x": 1}, "x")]:
        r = fleet.post("/api/enrollment-tokens", json=body)
        assert r.status_code == 422 and what in r.text, (body, r.text)
    r = httpx.post(f"{fleet.url}/api/enrollment-tokens", json={})
    assert r.status_code == 401
    r = fleet.post("/api/enrollment-tokens", json={"ttl_s": 60, "uses": 2})
    assert r.status_code == 200 and len(r.json()["token"]) >= 16 and r.json()["uses"] == 2


def test_device_enrols_after_accept_and_members_learn_the_keyring(make_fleet, tmp_path):
    fleet, keys = _signed_fleet(make_fleet, tmp_path)
    token = fleet.post("/api/enrollment-tokens", json={"uses": 1}).json()["token"]
    watcher = fleet.link("keyring-watch")
    updates = collect(watcher, wire.keyring_topic(fleet.swarm))
    data = _device_dir(tmp_path, "dev", fleet.url, token)
    t, out = _enrol_in_thread(data, "board-7", timeout_s=30)
    row = fleet.wait_for(lambda: _pending(fleet, "board-7"), what="pending device")
    pub = wire.public_b64(load_private_key(data / "keys/device.key").public_key())
    assert row["arch"] == "aarch64" and row["board"] == "aarch64-virt"
    assert row["key_fingerprint"] == wire.fingerprint(pub) and row["requested_at"] > 0
    assert "board-7" not in Keyring.load(keys / "keyring.json").members()
    r = fleet.post("/api/enrollments/board-7/accept")
    assert r.status_code == 200 and r.json()["state"] == "accepted"
    t.join(30)
    assert "ok" in out, out
    e = out["ok"]
    ring = Keyring.load(e.keyring_file)
    assert "board-7" in ring.members() and "node-1" in ring.members()
    assert "board-7" in Keyring.load(keys / "keyring.json").members()  # the fleet saved it
    assert e.broker.startswith("mqtt://board-7:") and "fleet" not in e.broker
    # members learn it: a retained update signed by the fleet, which a member's keyring accepts
    # (the first one on the topic is the keyring the fleet republished at its start)
    topic, payload = updates.get(timeout=5)
    while b"board-7" not in payload:
        topic, payload = updates.get(timeout=5)
    member = load_identity(keys / "keys/node-1.key", keys / "keyring.json")
    mine = wire.device_key_id("board-7", pub)
    before = Keyring.from_json(ring.to_json())
    before._keys.pop(mine)  # noqa: SLF001 - the member's keyring before the enrolment
    added, revoked = wire.apply_update(before, topic, payload, lambda kr: member.verifier(max_age_s=1e9))
    assert added == [mine] and revoked == [] and "board-7" in before.members()
    # the same keyring signed by a member (not the fleet) is refused
    forged = member.signer.sign(topic, ring.to_json().encode())
    before._keys.pop(mine)  # noqa: SLF001
    with pytest.raises(FederationError, match="wrong_role"):
        wire.apply_update(before, topic, forged, lambda kr: member.verifier(max_age_s=1e9))
    # revocation: the key id is revoked in the saved and the published keyring
    assert fleet.post("/api/enrollments/board-7/revoke").json()["state"] == "revoked"
    assert mine in Keyring.load(keys / "keyring.json").revoked
    topic, payload = updates.get(timeout=5)
    assert wire.apply_update(Keyring.load(e.keyring_file), topic, payload,
                             lambda kr: member.verifier(max_age_s=1e9)) == ([], [mine])


def test_stolen_token_admits_nobody_without_the_operator(make_fleet, tmp_path):
    fleet, keys = _signed_fleet(make_fleet, tmp_path)
    token = fleet.post("/api/enrollment-tokens", json={"uses": 3}).json()["token"]
    thief = _device_dir(tmp_path, "thief", fleet.url, token)
    t, out = _enrol_in_thread(thief, "evil-1", timeout_s=30)
    fleet.wait_for(lambda: _pending(fleet, "evil-1"), what="the thief pending")
    # pending: no key in the keyring, nothing handed out
    assert "evil-1" not in Keyring.load(keys / "keyring.json").members()
    assert fleet.post("/api/enrollments/evil-1/reject").json()["state"] == "rejected"
    t.join(10)
    assert "rejected" in out.get("err", ""), out
    assert not (thief / "enrolled.toml").exists() and not (thief / "keys/keyring.json").exists()
    assert "evil-1" not in Keyring.load(keys / "keyring.json").members()
    # a rejected device stays rejected (no second try with the same key), and accepting it is refused
    assert fleet.post("/api/enrollments/evil-1/accept").status_code == 409
    # the thief cannot take over a genuine pending device's id with its own key
    good = _device_dir(tmp_path, "good", fleet.url, token)
    t2, out2 = _enrol_in_thread(good, "board-9", timeout_s=30)
    fleet.wait_for(lambda: _pending(fleet, "board-9"), what="the genuine device pending")
    k = generate_key()
    pub, dh = wire.public_b64(k.public_key()), wire.public_b64(generate_key().public_key())
    proof = k.sign(wire.request_message("board-9", "x86_64", "x86_64", pub, dh, token))
    r = httpx.post(f"{fleet.url}/api/enroll", json={
        "token": token, "device_id": "board-9", "arch": "x86_64", "board": "x86_64", "public_key": pub,
        "dh_public": dh, "proof": base64.b64encode(proof).decode()})
    assert r.status_code == 409 and "another key" in r.text
    # nor poll for its credentials: the poll must be signed by the device's own key
    sig = k.sign(wire.poll_message("board-9", int(time.time())))
    r = httpx.post(f"{fleet.url}/api/enroll/board-9/status",
                   json={"ts": int(time.time()), "sig": base64.b64encode(sig).decode()})
    assert r.status_code == 401
    fleet.post("/api/enrollments/board-9/accept")
    t2.join(30)
    assert "ok" in out2, out2


def test_bad_enrolment_input_is_4xx(make_fleet, tmp_path):
    fleet, _ = _signed_fleet(make_fleet, tmp_path)
    token = fleet.post("/api/enrollment-tokens", json={}).json()["token"]
    k = generate_key()
    pub = wire.public_b64(k.public_key())
    good = {"token": token, "device_id": "d1", "arch": "x86_64", "board": "x86_64", "public_key": pub,
            "dh_public": pub, "proof": base64.b64encode(k.sign(b"wrong")).decode()}
    cases = [({**good, "device_id": "../x"}, 422, "device_id"),
             ({**good, "public_key": "AAAA"}, 422, "public_key"),
             ({**good, "token": "short"}, 422, "token"), ({**good, "extra": 1}, 422, "extra"),
             (good, 400, "proof"), ({"token": token}, 422, "device_id")]
    for body, code, what in cases:
        r = httpx.post(f"{fleet.url}/api/enroll", json=body)
        assert r.status_code == code and what in r.text, (body, r.text)
    r = httpx.post(f"{fleet.url}/api/enroll", content=b"x" * 100_000,
                   headers={"content-type": "application/json"})
    assert r.status_code == 413
    r = httpx.post(f"{fleet.url}/api/enroll/nobody/status", json={"ts": 1, "sig": "A" * 86 + "=="})
    assert r.status_code == 404
    assert fleet.post("/api/enrollments/nobody/accept").status_code == 404
    assert fleet.post("/api/enrollments/nobody/reject").status_code == 404
    assert httpx.post(f"{fleet.url}/api/enrollments/nobody/accept").status_code == 401
    assert httpx.get(f"{fleet.url}/api/enrollments").status_code == 401


def _req(token, device_id):
    k, dh = generate_key(), generate_key()
    pub, dpub = wire.public_b64(k.public_key()), wire.public_b64(dh.public_key())
    proof = k.sign(wire.request_message(device_id, "x86_64", "x86_64", pub, dpub, token))
    return EnrolRequest(token=token, device_id=device_id, arch="x86_64", board="x86_64", public_key=pub,
                        dh_public=dpub, proof=base64.b64encode(proof).decode())


@pytest.mark.parametrize("engine", ["sqlite", "postgres"])
def test_token_expiry_and_use_count(tmp_path, engine, request):
    now = [1000.0]
    db = str(tmp_path / "f.sqlite") if engine == "sqlite" else request.getfixturevalue("pg_url")
    m = EnrollmentManager(db, swarm="s", broker_url="mqtt://b", identity=None,
                          keyring_file=None, clock=lambda: now[0])
    tok = m.create_token(TokenRequest(ttl_s=60, uses=2))["token"]
    assert m.request(_req(tok, "a"))["state"] == "pending"
    assert m.request(_req(tok, "b"))["state"] == "pending"
    with pytest.raises(EnrollmentRejected) as exc:
        m.request(_req(tok, "c"))
    assert exc.value.status_code == 403 and "used up" in exc.value.reason
    tok2 = m.create_token(TokenRequest(ttl_s=60, uses=5))["token"]
    now[0] += 60.0
    with pytest.raises(EnrollmentRejected) as exc:
        m.request(_req(tok2, "d"))
    assert exc.value.status_code == 403 and "expired" in exc.value.reason
    # durable: a new manager on the same file (a restarted fleet) sees the same enrolments
    m.close()
    m2 = EnrollmentManager(db, swarm="s", broker_url="mqtt://b", identity=None,
                           keyring_file=None, clock=lambda: now[0])
    assert {r["device_id"]: r["state"] for r in m2.list()} == {"a": "pending", "b": "pending"}
    with pytest.raises(EnrollmentRejected) as exc:  # unsigned fleet: nothing to hand out
        m2.accept("a")
    assert exc.value.status_code == 409


def test_keyring_update_only_adds_or_revokes(tmp_path):
    provision(tmp_path, "s", ["n1", "n2"])
    ring = Keyring.load(tmp_path / "keyring.json")
    same = Keyring.from_json(ring.to_json())
    assert wire.check_update(ring, same) == ([], [])
    fewer = Keyring.from_json(ring.to_json())
    fewer._keys.pop("n2-k1")  # noqa: SLF001
    with pytest.raises(FederationError, match="removes"):
        wire.check_update(ring, fewer)
    ring2 = Keyring.from_json(ring.to_json())
    ring2.revoke("n1-k1")
    assert wire.check_update(ring, ring2) == ([], ["n1-k1"])
    with pytest.raises(FederationError, match="lifts"):
        wire.check_update(ring2, ring)
    provision(tmp_path / "other", "s", ["n1", "n2", "n3"])
    other = Keyring.load(tmp_path / "other/keyring.json")  # same ids, other keys: a changed key
    with pytest.raises(FederationError, match="changes"):
        wire.check_update(ring, other)


class _DownBroker:
    def ensure_swarm_role(self, swarm):
        from federation.dynsec import DynsecError

        raise DynsecError("no answer from the dynamic-security plugin within 10 s")


def test_accept_with_the_broker_down_is_503_and_changes_nothing(tmp_path):
    provision(tmp_path / "k", "s", ["node-1"])
    ident = load_identity(tmp_path / "k/keys/fleet.key", tmp_path / "k/keyring.json")
    published: list = []
    m = EnrollmentManager(tmp_path / "f.sqlite", swarm="s", broker_url="mqtt://b", identity=ident,
                          keyring_file=str(tmp_path / "k/keyring.json"), dynsec=_DownBroker(),
                          publish=lambda t, p: published.append(t))
    tok = m.create_token(TokenRequest())["token"]
    m.request(_req(tok, "dev-1"))
    with pytest.raises(EnrollmentRejected) as exc:
        m.accept("dev-1")
    assert exc.value.status_code == 503 and "no answer" in exc.value.reason
    assert [r["state"] for r in m.list()] == ["pending"] and published == []
    assert "dev-1" not in Keyring.load(tmp_path / "k/keyring.json").members()
    m.dynsec = None  # the broker is back (here: no broker clients at all): accept works now
    assert m.accept("dev-1")["state"] == "accepted" and published == ["fractal/v1/s/keyring"]
