"""Image format, signing and every refusal of `fractal image build/verify/info/flash` (real CLI processes;
loops over many corruptions send the first through a process and the rest through the CLI's main())."""

from __future__ import annotations

import json
import os
import shutil
import struct
from pathlib import Path

import pytest

from tests.firmware.conftest import assert_refused, cli, cli_main, tree


def pub(key: Path) -> Path:
    return Path(f"{key}.pub")


def build_cli(artifact: Path, board: str, key: Path, out: Path, version: str):
    """`fractal image build ARTIFACT --board B --key K --out O --version V` (a real CLI process)."""
    return cli("image", "build", artifact, "--board", board, "--key", key, "--out", out, "--version", version)


def test_keygen_writes_a_private_0600_key_and_refuses_to_overwrite(tmp_path):
    r = cli("image", "keygen", "--out", tmp_path / "k")
    assert r.returncode == 0, r.stderr
    assert (tmp_path / "k").stat().st_mode & 0o777 == 0o600
    assert b"PUBLIC KEY" in (tmp_path / "k.pub").read_bytes()
    before = (tmp_path / "k").read_bytes()
    assert_refused(cli("image", "keygen", "--out", tmp_path / "k"), "already exists")
    assert (tmp_path / "k").read_bytes() == before


def test_build_verify_info_round_trip(tmp_path, digits_artifact, fw_keys):
    out = tmp_path / "d.img"
    r = build_cli(digits_artifact, "x86_64", fw_keys["k1"], out, "1.2.3")
    assert r.returncode == 0, r.stderr
    r = cli("image", "verify", out, "--pubkey", pub(fw_keys["k1"]))
    assert r.returncode == 0 and "ok:" in r.stdout, r.stderr
    r = cli("image", "info", out, "--json")
    m = json.loads(r.stdout)
    assert (m["board"], m["arch"], m["version"], m["artifact_name"]) == (
        "x86_64",
        "x86_64",
        "1.2.3",
        "digits-mlp",
    )
    names = {e["name"] for e in m["members"]}
    assert {
        "artifact/manifest.json",
        "artifact/infer.so",
        "artifact/params.npz",
        "health/input.npz",
        "health/expected.npz",
        "node.toml.in",
    } <= names
    assert m["health"]["atol"] == pytest.approx(1e-4) and m["runtime"]["arch"] == "x86_64"


def test_build_refuses_an_artifact_the_board_cannot_run(tmp_path, digits_artifact, fw_keys):
    for board in ("rpi4", "riscv64"):
        out = tmp_path / f"{board}.img"
        assert_refused(
            build_cli(digits_artifact, board, fw_keys["k1"], out, "1.0.0"),
            "board",
            board,
        )
        assert not out.exists() and list(tmp_path.iterdir()) == []
    assert_refused(
        build_cli(digits_artifact, "vax", fw_keys["k1"], tmp_path / "x.img", "1.0.0"),
        "unknown board",
    )
    assert_refused(
        build_cli(digits_artifact, "x86_64", fw_keys["k1"], tmp_path / "x.img", "one"),
        "semantic version",
    )
    assert list(tmp_path.iterdir()) == []


def _header(img: bytes) -> tuple[int, int]:
    _, mlen, slen = struct.unpack(">8sIH", img[:14])
    return mlen, slen


def _corruptions(img: bytes) -> dict[str, tuple[bytes, str]]:
    """name -> (corrupted bytes, a word the refusal must contain)."""
    mlen, slen = _header(img)
    sig_at = 14 + mlen
    payload_at = sig_at + slen

    def flip(at: int) -> bytes:
        b = bytearray(img)
        b[at] ^= 0x01
        return bytes(b)

    manifest = img[14 : 14 + mlen]
    at = manifest.index(b'"version":"') + len(b'"version":"')
    return {
        "tampered member (first byte)": (flip(payload_at), "sha256"),
        "tampered member (last byte)": (flip(len(img) - 1), "sha256"),
        "tampered member (middle)": (flip(payload_at + (len(img) - payload_at) // 2), "sha256"),
        "tampered manifest (version)": (img[: 14 + at] + b"9" + img[14 + at + 1 :], "signature"),
        "tampered signature": (flip(sig_at + 5), "signature"),
        "missing signature": (img[:14] + manifest, "truncated"),
        "zero signature": (img[:sig_at] + bytes(slen) + img[payload_at:], "signature"),
        "truncated payload": (img[:-100], "truncated"),
        "trailing bytes": (img + b"\0" * 10, "trailing"),
        "truncated header": (img[:10], "not a fractal device image"),
        "empty file": (b"", "not a fractal device image"),
        "not an image": (b"\x7fELF" + bytes(200), "not a fractal device image"),
        "huge manifest length": (
            img[:8] + struct.pack(">I", 0xFFFFFFFF) + img[12:],
            "not a fractal device image",
        ),
        "no signature length": (img[:12] + struct.pack(">H", 0) + img[14:], "not a fractal device image"),
    }


def test_verify_and_flash_refuse_every_corruption_and_write_nothing(tmp_path, fw_image, fw_keys):
    good = fw_image("1.0.0").read_bytes()
    device = tmp_path / "dev"
    r = cli("image", "flash", fw_image("1.0.0"), "--device", device, "--pubkey", pub(fw_keys["k1"]))
    assert r.returncode == 0, r.stderr
    before = tree(device)
    for k, (name, (data, word)) in enumerate(_corruptions(good).items()):
        run = cli if k == 0 else cli_main  # one through a real process, the rest through its main()
        bad = tmp_path / "bad.img"
        bad.write_bytes(data)
        assert_refused(run("image", "verify", bad, "--pubkey", pub(fw_keys["k1"])), word)
        assert_refused(run("image", "flash", bad, "--device", device), word)
        assert tree(device) == before, name
        new_dev = tmp_path / "new-dev"
        assert_refused(run("image", "flash", bad, "--device", new_dev, "--pubkey", pub(fw_keys["k1"])), word)
        assert tree(new_dev) in ({}, {".lock": tree(new_dev).get(".lock", "")}), name
        shutil.rmtree(new_dev, ignore_errors=True)


def test_unknown_key_is_refused(tmp_path, fw_image, fw_keys):
    img = fw_image("1.0.0", key="k2")
    assert_refused(cli("image", "verify", img, "--pubkey", pub(fw_keys["k1"])), "trusted key")
    device = tmp_path / "dev"
    assert (
        cli(
            "image", "flash", fw_image("1.0.0"), "--device", device, "--pubkey", pub(fw_keys["k1"])
        ).returncode
        == 0
    )
    before = tree(device)
    assert_refused(cli("image", "flash", img, "--device", device), "trusted key")
    # naming an untrusted key does not make the device trust it
    assert_refused(
        cli("image", "flash", img, "--device", device, "--pubkey", pub(fw_keys["k2"])), "not trusted"
    )
    assert tree(device) == before


def _boot_in_process(device: Path) -> None:
    from firmware.boot import _pick, _settle
    from firmware.device import Device

    slot, _, _ = _pick(Device(device), log=lambda m: None)
    _settle(Device(device), slot, None, log=lambda m: None)


def test_key_rotation_through_an_image_signed_by_a_trusted_key(tmp_path, fw_image, fw_keys):
    device = tmp_path / "dev"
    assert (
        cli(
            "image",
            "flash",
            fw_image("1.0.0", add_keys=("k2",)),
            "--device",
            device,
            "--pubkey",
            pub(fw_keys["k1"]),
        ).returncode
        == 0
    )
    _boot_in_process(device)  # the key the image adds is trusted once the image booted good
    r = cli("image", "flash", fw_image("1.1.0", key="k2"), "--device", device)
    assert r.returncode == 0, r.stderr
    assert_refused(cli("image", "flash", fw_image("1.2.0", key="k3"), "--device", device), "trusted key")
    s = json.loads(cli("image", "status", "--device", device, "--json").stdout)
    assert len(s["trusted_keys"]) == 2 and s["slots"]["b"]["version"] == "1.1.0"


def test_wrong_board_is_refused_at_flash(tmp_path, fw_image, fw_keys):
    device = tmp_path / "dev"
    assert (
        cli(
            "image",
            "flash",
            fw_image("1.0.0", board="x86_64"),
            "--device",
            device,
            "--pubkey",
            pub(fw_keys["k1"]),
        ).returncode
        == 0
    )
    before = tree(device)
    other = fw_image("2.0.0", board="x86_64-avx2")  # runs the same x86_64 artifact, a different board
    assert_refused(cli("image", "flash", other, "--device", device), "board")
    assert tree(device) == before


def test_downgrade_needs_allow_downgrade(tmp_path, fw_image, fw_keys):
    device = tmp_path / "dev"
    assert (
        cli(
            "image", "flash", fw_image("2.0.0"), "--device", device, "--pubkey", pub(fw_keys["k1"])
        ).returncode
        == 0
    )
    before = tree(device)
    assert_refused(cli("image", "flash", fw_image("1.0.0"), "--device", device), "older", "--allow-downgrade")
    assert tree(device) == before
    r = cli("image", "flash", fw_image("1.0.0"), "--device", device, "--allow-downgrade")
    assert r.returncode == 0, r.stderr


def test_crafted_images_signed_with_a_valid_key_are_still_refused(tmp_path, fw_image, fw_keys):
    """An attacker holding a trusted key still cannot escape the slot or oversize a member."""
    from firmware import keys as keymod

    img = fw_image("1.0.0").read_bytes()
    mlen, slen = _header(img)
    manifest = json.loads(img[14 : 14 + mlen])
    payload = img[14 + mlen + slen :]
    priv = keymod.load_private(fw_keys["k1"])
    for name, mutate, word in (
        ("traversal", lambda m: m["members"][0].update(name="../../etc/evil"), "unsafe member"),
        ("absolute", lambda m: m["members"][0].update(name="/etc/evil"), "unsafe member"),
        ("hidden", lambda m: m["members"][0].update(name="artifact/.hidden"), "unsafe member"),
        ("negative size", lambda m: m["members"][0].update(size=-1), "invalid manifest"),
        ("duplicate", lambda m: m["members"][1].update(name=m["members"][0]["name"]), "invalid manifest"),
    ):
        m = json.loads(json.dumps(manifest))
        mutate(m)
        mb = json.dumps(m, sort_keys=True, separators=(",", ":")).encode()
        data = struct.pack(">8sIH", b"FRCTIMG1", len(mb), 64) + mb + keymod.sign(priv, mb) + payload
        bad = tmp_path / f"{name}.img"
        bad.write_bytes(data)
        assert_refused(cli("image", "verify", bad, "--pubkey", pub(fw_keys["k1"])), word)
        dev = tmp_path / f"dev-{name}"
        assert_refused(cli("image", "flash", bad, "--device", dev, "--pubkey", pub(fw_keys["k1"])), word)
        assert not (dev / "a").exists() and not (tmp_path / "etc").exists()


def test_info_on_garbage_is_one_line(tmp_path):
    p = tmp_path / "x"
    p.write_bytes(os.urandom(1000))
    assert_refused(cli("image", "info", p), "not a fractal device image")
    assert_refused(cli("image", "info", tmp_path / "missing.img"), "does not exist")
