"""One ed25519 private key file format (fractal/keyfile.py) for the swarm's keys and the image
release keys; an image key in the old PKCS#8 PEM form still signs images (read for one release)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey
from cryptography.hazmat.primitives.asymmetric.x25519 import X25519PrivateKey

from deploy.keys import provision
from federation.auth import load_key_file
from federation.errors import FederationError
from federation.signed import load_identity
from firmware import keys as fwkeys
from firmware.errors import FirmwareError
from fractal.keyfile import KeyFile, KeyFileError, read_key_file, write_key_file

ROOT = Path(__file__).resolve().parents[1]


def _cli(*args: str | Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-c", "from api.cli import main; main()", *map(str, args)],
                          capture_output=True, text=True, timeout=120, cwd=ROOT,
                          env={"PYTHONPATH": str(ROOT), "PATH": "/usr/bin:/bin"})


def test_image_keygen_and_the_swarm_write_the_same_format(tmp_path):
    priv, pub = fwkeys.keygen(tmp_path / "release.key")
    provision(tmp_path / "swarm", swarm="s", nodes=["node-1"])
    for path in (priv, tmp_path / "swarm/keys/node-1.key", tmp_path / "swarm/keys/fleet.key"):
        doc = json.loads(path.read_text())
        assert doc["v"] == 1 and {"key_id", "sender", "role", "private_key"} <= set(doc), path
        assert path.stat().st_mode & 0o777 == 0o600, path
    rel = read_key_file(priv)
    assert (rel.role, rel.key_id) == ("image", fwkeys.key_id(fwkeys.load_public(pub)))
    node = load_key_file(tmp_path / "swarm/keys/node-1.key")
    assert (node.sender, node.role, node.dh_private is not None) == ("node-1", "node", True)
    ident = load_identity(tmp_path / "swarm/keys/node-1.key", tmp_path / "swarm/keyring.json")
    assert ident.signer.sender == "node-1" and ident.dh_key is not None


def test_an_image_key_in_the_old_pem_form_still_signs_images(tmp_path):
    key = Ed25519PrivateKey.generate()
    old = tmp_path / "old.key"
    old.write_bytes(key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                                      serialization.NoEncryption()))
    (tmp_path / "old.key.pub").write_bytes(fwkeys.public_pem(key.public_key()))
    kf = read_key_file(old)
    assert kf.role == "image" and kf.key_id == fwkeys.key_id(key.public_key())
    msg = b"manifest"
    assert fwkeys.verify_with([fwkeys.load_public(tmp_path / "old.key.pub")], msg,
                              fwkeys.sign(fwkeys.load_private(old), msg)) is not None
    # and a key written now round-trips, X25519 part included
    dh = X25519PrivateKey.generate()
    back = read_key_file(write_key_file(tmp_path / "k.key", KeyFile("n-k1", "n", "node", key, dh)))
    assert back.private_key.public_key().public_bytes_raw() == key.public_key().public_bytes_raw()
    assert back.dh_private is not None
    assert back.dh_private.public_key().public_bytes_raw() == dh.public_key().public_bytes_raw()


@pytest.mark.parametrize("content", [b"", b"{}", b'{"v": 9}', b"[1]", b"-----BEGIN PUBLIC KEY-----\nxx\n",
                                     b'{"v": 1, "key_id": "a", "sender": "b", "private_key": "!!"}'])
def test_a_bad_key_file_is_one_clear_error_in_every_layer(tmp_path, content):
    p = tmp_path / "bad.key"
    p.write_bytes(content)
    with pytest.raises(KeyFileError, match="not an ed25519 key file"):
        read_key_file(p)
    with pytest.raises(FirmwareError, match="not an ed25519 key file"):
        fwkeys.load_private(p)
    with pytest.raises(FederationError, match="not an ed25519 key file"):
        load_key_file(p)


def test_the_cli_makes_and_reads_keys(tmp_path):
    r = _cli("image", "keygen", "--out", tmp_path / "k")
    assert r.returncode == 0 and "key id" in r.stdout, r.stderr
    assert json.loads((tmp_path / "k").read_text())["role"] == "image"
    r = _cli("image", "keygen", "--out", tmp_path / "k")
    assert r.returncode != 0 and r.stderr.startswith("error: ") and "already exists" in r.stderr
    (tmp_path / "bad").write_text("not a key")
    r = _cli("image", "build", tmp_path, "--board", "x86_64", "--key", tmp_path / "bad", "--out",
             tmp_path / "x.img", "--version", "1.0.0")
    assert r.returncode != 0 and len(r.stderr.strip().splitlines()) == 1 and r.stderr.startswith("error: ")
