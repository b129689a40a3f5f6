"""Wi-Fi on the Raspberry Pi images (firmware/osimage): what can run here without a radio.

* ``fractal image configure --wifi-ssid/--wifi-psk`` on a small image with the rpi4 build record:
  the card gets the derived PSK (never the passphrase); bad values and Wi-Fi on a board without it
  are refused in one line that does not show the PSK.
* The board's Wi-Fi step (``files/wifi.sh`` under busybox sh, against a fake root with stand-ins for
  ``ip``/``wpa_supplicant``/``udhcpc`` that record their arguments) writes a 0600
  wpa_supplicant.conf with the SSID and PSK in hex, starts wpa_supplicant and DHCP on wlan0, and
  prints no secret; hostile SSIDs/passphrases cannot add lines to the file.
* The DHCP event script keeps Ethernet first (route metric, name server order).
"""

from __future__ import annotations

import json
import os
import stat
import subprocess
import sys
from pathlib import Path

import pytest

from tests.firmware.conftest import assert_refused, cli

FILES = Path(__file__).resolve().parents[2] / "firmware" / "osimage" / "files"
REPO = Path(__file__).resolve().parents[2]
COMMON = [
    "--broker", "mqtt://10.0.0.2:1883", "--fleet", "http://10.0.0.2:8000", "--swarm", "pis",
    "--enroll-token", "enrol-token-1",
]  # fmt: skip


def _image(tmp: Path, board: str) -> Path:
    """A small MBR (rpi4) or GPT disk whose FAT holds the build record of ``board``."""
    from firmware.osimage import disk

    content = tmp / f"content-{board}"
    (content / "fractal").mkdir(parents=True)
    (content / "fractal" / "image.json").write_text(json.dumps({"format": 1, "board": board}))
    img = tmp / f"{board}.img"
    disk.write_disk(
        img,
        [disk.PartSpec("boot", 64 * disk.MiB, "fat", disk.BOOT_LABEL, content)],
        mbr_id=0x2345ABCD if board.startswith("rpi") else None,
    )
    return img


def _settings_text(img: Path, tmp: Path) -> str:
    from firmware.osimage import disk

    return disk.fat_read(img, disk.read_gpt(img)["boot"], "fractal/settings.toml", tmp / "s.toml").read_text()


def test_psk_derivation_matches_the_802_11i_test_vector() -> None:
    from firmware.osimage.settings import wifi_psk_hex

    # IEEE 802.11i-2004, H.4.3: passphrase "password", SSID "IEEE"
    assert (
        wifi_psk_hex("IEEE", "password") == "f42c6fc52df0ebef9ebb4b90b38a5f902e83fe1b135a70e23aed762e9710a12e"
    )
    raw = "AB" * 32
    assert wifi_psk_hex("any", raw) == raw.lower()  # a 64-hex PSK is taken as is


def test_configure_stores_the_derived_psk_not_the_passphrase(tmp_path: Path) -> None:
    from firmware.osimage.settings import parse, wifi_psk_hex

    img = _image(tmp_path, "rpi4")
    ssid, phrase = 'cafe "5G" # }', "pa ss\"w#rd}'x"
    r = cli(
        "image", "configure", img, *COMMON, "--wifi-ssid", ssid, "--wifi-psk", phrase, "--wifi-country", "DE"
    )
    assert r.returncode == 0, r.stderr
    assert phrase not in r.stdout + r.stderr
    text = _settings_text(img, tmp_path)
    assert phrase not in text and "w#rd" not in text
    s = parse(text)  # the card's file reads back: same SSID, the PSK the passphrase stands for
    assert (s.wifi_ssid, s.wifi_country) == (ssid, "DE")
    assert s.wifi_psk == wifi_psk_hex(ssid, phrase)


@pytest.mark.parametrize(
    ("args", "words"),
    [
        (["--wifi-ssid", "home"], ["wifi-ssid and wifi-psk go together"]),
        (["--wifi-psk", "secret-passphrase"], ["wifi-ssid and wifi-psk go together"]),
        (["--wifi-ssid", "home", "--wifi-psk", "short77"], ["8-63 printable ASCII", "64 hex"]),
        (["--wifi-ssid", "home", "--wifi-psk", "x" * 64], ["8-63 printable ASCII", "64 hex"]),
        (["--wifi-ssid", "home", "--wifi-psk", "good-pass\nnetwork={"], ["8-63 printable ASCII"]),
        (["--wifi-ssid", "home", "--wifi-psk", "pässwort-mit-umlaut"], ["8-63 printable ASCII"]),
        (["--wifi-ssid", "home\nnetwork={", "--wifi-psk", "secret-passphrase"], ["control character"]),
        (["--wifi-ssid", "s" * 33, "--wifi-psk", "secret-passphrase"], ["longer than 32 bytes"]),
        (
            ["--wifi-ssid", "home", "--wifi-psk", "secret-passphrase", "--wifi-country", "germany"],
            ["country"],
        ),
    ],
)
def test_configure_refuses_bad_wifi_settings_in_one_line(
    tmp_path: Path, args: list[str], words: list[str]
) -> None:
    from firmware.errors import ImageError
    from firmware.osimage import disk

    img = _image(tmp_path, "rpi4")
    r = cli("image", "configure", img, *COMMON, *args)
    assert_refused(r, *words)
    psk = args[args.index("--wifi-psk") + 1] if "--wifi-psk" in args else ""
    assert not psk or psk.splitlines()[0] not in r.stderr  # the PSK is never shown
    with pytest.raises(ImageError):  # nothing written
        disk.fat_read(img, disk.read_gpt(img)["boot"], "fractal/settings.toml", tmp_path / "s.toml")


def test_configure_refuses_wifi_on_a_board_without_it(tmp_path: Path) -> None:
    img = _image(tmp_path, "aarch64-virt")
    r = cli("image", "configure", img, *COMMON, "--wifi-ssid", "home", "--wifi-psk", "secret-passphrase")
    assert_refused(r, "board aarch64-virt has no Wi-Fi", "rpi4")


# ------------------------------------------------------------------------ the board's Wi-Fi step


def _fake_root(tmp: Path, settings: str | None, wlan: bool = True) -> dict[str, str]:
    """A root for wifi.sh: boot partition, sysfs, /run, and stand-ins recording their arguments."""
    (tmp / "boot" / "fractal").mkdir(parents=True)
    if settings is not None:
        (tmp / "boot" / "fractal" / "settings.toml").write_text(settings)
    (tmp / "sys" / "class" / "net").mkdir(parents=True)
    if wlan:
        (tmp / "sys" / "class" / "net" / "wlan0").mkdir()
    (tmp / "run").mkdir()
    bin_ = tmp / "bin"
    bin_.mkdir()
    for tool in ("ip", "wpa_supplicant", "udhcpc", "hostname"):
        (bin_ / tool).write_text(
            f'#!/bin/sh\necho "{tool} $*" >> {tmp}/calls\n[ {tool} != hostname ] || echo pi-1\n'
        )
        (bin_ / tool).chmod(0o755)
    (bin_ / "python3").write_text(f'#!/bin/sh\nexec {sys.executable} "$@"\n')
    (bin_ / "python3").chmod(0o755)
    (tmp / "env").write_text(f"export PATH={bin_}:/usr/bin:/bin\nexport PYTHONPATH={REPO}\n")
    return {
        "FRACTAL_ENV": str(tmp / "env"),
        "BOOT": str(tmp / "boot"),
        "CONF": str(tmp / "run" / "wpa_supplicant.conf"),
        "SYSFS": str(tmp / "sys"),
        "RUN": str(tmp / "run"),
        "PATH": "/usr/bin:/bin",
    }


def _settings(**wifi: str) -> str:
    from firmware.osimage.settings import Settings, render

    return render(Settings("mqtt://10.0.0.2:1883", "http://10.0.0.2:8000", "pis", "enrol-token-1", **wifi))


def _wifi_sh(env: dict[str, str]) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        ["busybox", "sh", str(FILES / "wifi.sh")], capture_output=True, text=True, env=env, timeout=120
    )


@pytest.mark.parametrize(
    ("ssid", "phrase"),
    [
        ("home", "correct horse battery"),
        ("a\"b'c # d } e", "p\"a#s}s'w o\\rd"),  # quotes, comment and brace characters, backslash
        ("Café 🚀", "x" * 63),  # UTF-8 SSID, the longest passphrase
        ("hex-psk", "0123456789abcdef" * 4),  # a raw PSK in the file
    ],
)
def test_wifi_step_writes_a_private_hex_conf_and_starts_wlan0(tmp_path: Path, ssid: str, phrase: str) -> None:
    from firmware.osimage.settings import wifi_psk_hex

    env = _fake_root(tmp_path, _settings(wifi_ssid=ssid, wifi_psk=phrase, wifi_country="GB"))
    r = _wifi_sh(env)
    assert r.returncode == 0, r.stdout + r.stderr
    assert phrase not in r.stdout + r.stderr and wifi_psk_hex(ssid, phrase) not in r.stdout + r.stderr
    conf = tmp_path / "run" / "wpa_supplicant.conf"
    assert stat.S_IMODE(conf.stat().st_mode) == 0o600
    lines = conf.read_text().splitlines()
    body = [line.strip() for line in lines if not line.startswith("#")]
    assert body == [
        "country=GB",
        "network={",
        f"ssid={ssid.encode().hex()}",
        "scan_ssid=1",
        "key_mgmt=WPA-PSK",
        f"psk={wifi_psk_hex(ssid, phrase)}",
        "}",
    ], body
    calls = (tmp_path / "calls").read_text().splitlines()
    start = [c for c in calls if not c.startswith("hostname")]
    assert start[0] == "ip link set wlan0 up", calls
    assert start[1].split() == [
        "wpa_supplicant", "-B", "-i", "wlan0", "-D", "nl80211", "-c", str(conf),
        "-P", str(tmp_path / "run" / "wpa_supplicant.pid"),
    ]  # fmt: skip
    assert start[2].startswith("udhcpc -b -S -i wlan0 -s /etc/fractal/udhcpc.sh"), calls


def test_wifi_step_without_wifi_settings_starts_nothing(tmp_path: Path) -> None:
    env = _fake_root(tmp_path, _settings())
    stale = tmp_path / "run" / "wpa_supplicant.conf"
    stale.write_text("network={}\n")  # left from an earlier boot with Wi-Fi: removed
    r = _wifi_sh(env)
    assert r.returncode == 0, r.stderr
    assert not stale.exists() and not (tmp_path / "calls").exists()


def test_wifi_step_with_a_bad_settings_file_says_so_and_starts_nothing(tmp_path: Path) -> None:
    text = _settings(wifi_ssid="home", wifi_psk="secret-passphrase").replace(
        'wifi_psk = "secret-passphrase"', 'wifi_psk = "short"'
    )
    env = _fake_root(tmp_path, text)
    r = _wifi_sh(env)
    assert r.returncode == 1
    assert "wifi: settings ignored" in r.stderr and "wifi: not started" in r.stderr
    assert "short" not in r.stderr.replace("ignored", "")
    assert not (tmp_path / "run" / "wpa_supplicant.conf").exists() and not (tmp_path / "calls").exists()


def test_dhcp_keeps_ethernet_first(tmp_path: Path) -> None:
    env = _fake_root(tmp_path, None)
    env["PATH"] = f"{tmp_path / 'bin'}:/usr/bin:/bin"

    def lease(iface: str, router: str, dns: str) -> None:
        e = {**env, "interface": iface, "ip": "192.168.1.9", "mask": "24", "router": router, "dns": dns}
        r = subprocess.run(
            ["busybox", "sh", str(FILES / "udhcpc.sh"), "bound"], capture_output=True, text=True, env=e
        )
        assert r.returncode == 0, r.stderr

    lease("wlan0", "192.168.1.1", "192.168.1.1")  # Wi-Fi may be up first
    lease("eth0", "10.0.0.1", "10.0.0.53 10.0.0.54")
    routes = [c for c in (tmp_path / "calls").read_text().splitlines() if "route add default" in c]
    assert routes == [
        "ip route add default via 192.168.1.1 dev wlan0 metric 20",
        "ip route add default via 10.0.0.1 dev eth0 metric 10",
    ]
    assert (tmp_path / "run" / "resolv.conf").read_text().split("\n")[:3] == [
        "nameserver 10.0.0.53",
        "nameserver 10.0.0.54",
        "nameserver 192.168.1.1",
    ]


def test_wifi_step_is_in_the_pi_images_only() -> None:
    """rcS starts it where wpa_supplicant is; the Pi's lock pins what its extra list names."""
    from firmware import debs
    from firmware.osimage.boards import OS_BOARDS

    rcs = (FILES / "rcS.sh").read_text()
    assert "[ -x /usr/sbin/wpa_supplicant ] && /etc/fractal/wifi.sh" in rcs
    assert rcs.index("udhcpc -b -S -i eth0") < rcs.index("/etc/fractal/wifi.sh")  # Ethernet first
    for b in OS_BOARDS.values():
        pinned = {p.package for p in debs.read_lock(b.lock)}
        assert set(b.extra_packages) <= pinned, b.name
        assert b.wifi == b.name.startswith("rpi"), b.name
    assert os.access(FILES / "wifi.sh", os.R_OK)
