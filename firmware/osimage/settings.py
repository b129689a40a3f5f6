"""First-boot settings on the boot partition: ``fractal/settings.toml``, readable and editable on
any computer (the boot partition is FAT), as Raspberry Pi Imager's customisation or cloud-init's
NoCloud seed are. ``fractal image configure`` writes it with mtools (no mount); at every boot the
board reads it (``python3 -m firmware.osimage.settings apply``, from ``files/service.sh``) into
the node's device settings (``data/node.extra.toml`` of the device directory, which
``fractal boot`` appends to every slot's node config) and sets the hostname, which is the node id.

Keys: ``broker`` (mqtt:// or mqtts://), ``fleet`` (http:// or https://), ``swarm``,
``enroll_token``, optional ``api_token`` (the node's HTTP API then requires it as
``Authorization: Bearer``), ``hostname``, ``ntp_server``, and on boards with Wi-Fi (the Raspberry
Pi) ``wifi_ssid``, ``wifi_psk``, ``wifi_country``. The fleet URL and enrolment token are kept in
``data/enrollment.toml`` for the enrolment step (``edgenode/enrol.py``).

Wi-Fi (WPA2-Personal): ``configure`` stores the 256-bit PSK derived from the passphrase (what
``wpa_passphrase`` computes: PBKDF2-HMAC-SHA1 over the SSID, 4096 rounds), never the passphrase,
so the FAT partition anyone can read holds no password; a passphrase typed into the file by hand
works too. At boot ``/etc/fractal/wifi.sh`` runs ``python3 -m firmware.osimage.settings wifi``,
which writes ``/run/wpa_supplicant.conf`` (mode 0600 from creation) with the SSID and PSK in hex:
nothing a user typed is ever parsed by wpa_supplicant's quoting, so quotes, ``#`` or ``}`` in an
SSID or passphrase cannot change the file's meaning; control characters are refused.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import re
import subprocess
import sys
import tomllib
from dataclasses import asdict, dataclass, fields, replace
from pathlib import Path
from typing import TYPE_CHECKING

from firmware.errors import ImageError
from fractal.files import atomic_write

if TYPE_CHECKING:
    from firmware.osimage.disk import Partition

__all__ = [
    "Settings",
    "SETTINGS_PATH",
    "parse",
    "render",
    "apply",
    "configure_image",
    "wpa_supplicant_conf",
    "wifi_psk_hex",
]

SETTINGS_PATH = "fractal/settings.toml"  # on the boot partition
_ID = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,63}$")  # a topic level (federation.topics.validate_id)
_HOST = re.compile(r"^[A-Za-z0-9]([A-Za-z0-9-]{0,61}[A-Za-z0-9])?$")  # one DNS label
_TOKEN = re.compile(r"^[\x21-\x7e]{8,256}$")  # printable, no spaces: goes into HTTP headers
_HEX_PSK = re.compile(r"^[0-9A-Fa-f]{64}$")  # a raw 256-bit WPA PSK
_PASSPHRASE = re.compile(r"^[\x20-\x7e]{8,63}$")  # IEEE 802.11i: 8..63 printable ASCII characters
WPA_CONF = Path("/run/wpa_supplicant.conf")


@dataclass(frozen=True)
class Settings:
    broker: str
    fleet: str
    swarm: str
    enroll_token: str
    api_token: str = ""
    hostname: str = ""
    ntp_server: str = ""
    wifi_ssid: str = ""
    wifi_psk: str = ""  # a passphrase (8..63 printable ASCII) or the 64-hex-digit PSK
    wifi_country: str = ""  # ISO 3166 alpha-2: which channels and power the radio may use

    def check(self) -> Settings:
        """Self, or ImageError naming the first bad value."""
        if not re.match(r"^mqtts?://[^\s/]+(:\d+)?/?$", self.broker):
            raise ImageError(
                f"broker {self.broker!r} is not an mqtt:// or mqtts:// URL",
                hint="e.g. --broker mqtt://10.0.2.2:1883",
            )
        if not re.match(r"^https?://[^\s]+$", self.fleet):
            raise ImageError(
                f"fleet {self.fleet!r} is not an http:// or https:// URL",
                hint="e.g. --fleet http://10.0.2.2:8000",
            )
        if not _ID.match(self.swarm):
            raise ImageError(
                f"swarm {self.swarm!r} is not a valid id",
                hint="use 1-64 characters from [A-Za-z0-9_.-], starting with a letter or digit",
            )
        for name in ("enroll_token", "api_token"):
            v = getattr(self, name)
            if (v or name == "enroll_token") and not _TOKEN.match(v):
                raise ImageError(
                    f"{name.replace('_', '-')} must be 8-256 printable characters without spaces"
                )
        if self.hostname and not _HOST.match(self.hostname):
            raise ImageError(
                f"hostname {self.hostname!r} is not a valid host name",
                hint="letters, digits and '-', 1-63 characters, not starting or ending with '-'",
            )
        if self.ntp_server and not re.match(r"^[A-Za-z0-9.:-]{1,253}$", self.ntp_server):
            raise ImageError(f"ntp server {self.ntp_server!r} is not a host name or address")
        self._check_wifi()
        return self

    def _check_wifi(self) -> None:
        # the PSK is never echoed: an error names what is wrong with it, not its value
        if bool(self.wifi_ssid) != bool(self.wifi_psk):
            raise ImageError(
                "wifi-ssid and wifi-psk go together", hint="pass both (WPA2-Personal), or neither"
            )
        if not self.wifi_ssid:
            if self.wifi_country:
                raise ImageError("wifi-country without wifi-ssid", hint="pass --wifi-ssid and --wifi-psk too")
            return
        if len(self.wifi_ssid.encode()) > 32:
            raise ImageError(f"wifi-ssid {self.wifi_ssid!r} is longer than 32 bytes (802.11's limit)")
        if any(ord(c) < 0x20 or ord(c) == 0x7F for c in self.wifi_ssid):
            raise ImageError(
                f"wifi-ssid {self.wifi_ssid!r} contains a control character (newline, tab, ...)",
                hint="an SSID a phone or laptop shows has none",
            )
        if not (_HEX_PSK.match(self.wifi_psk) or _PASSPHRASE.match(self.wifi_psk)):
            raise ImageError(
                "wifi-psk must be a passphrase of 8-63 printable ASCII characters or 64 hex digits",
                hint="the Wi-Fi password as typed on a phone (WPA2-Personal)",
            )
        if self.wifi_country and not re.match(r"^[A-Z]{2}$", self.wifi_country):
            raise ImageError(
                f"wifi-country {self.wifi_country!r} is not a two-letter country code", hint="e.g. DE, GB, US"
            )

    def with_derived_psk(self) -> Settings:
        """Self with a passphrase replaced by the PSK it stands for (what goes on the card)."""
        return replace(self, wifi_psk=wifi_psk_hex(self.wifi_ssid, self.wifi_psk)) if self.wifi_ssid else self


def wifi_psk_hex(ssid: str, psk: str) -> str:
    """The 64-hex-digit WPA PSK: ``psk`` itself if it is one, else derived from the passphrase as
    802.11i says (PBKDF2-HMAC-SHA1, the SSID as salt, 4096 rounds, 32 bytes): wpa_passphrase's."""
    if _HEX_PSK.match(psk):
        return psk.lower()
    return hashlib.pbkdf2_hmac("sha1", psk.encode(), ssid.encode(), 4096, 32).hex()


def wpa_supplicant_conf(s: Settings) -> str:
    """wpa_supplicant's configuration for the settings' network. SSID and PSK are written as hex
    (both forms wpa_supplicant reads unquoted), so no user-typed character reaches its parser."""
    lines = ["# written at boot from the boot partition's fractal/settings.toml (/etc/fractal/wifi.sh)"]
    if s.wifi_country:
        lines.append(f"country={s.wifi_country}")
    lines += [
        "network={",
        f"\tssid={s.wifi_ssid.encode().hex()}",
        "\tscan_ssid=1",  # hidden networks too
        "\tkey_mgmt=WPA-PSK",
        f"\tpsk={wifi_psk_hex(s.wifi_ssid, s.wifi_psk)}",
        "}",
    ]
    return "\n".join(lines) + "\n"


def render(s: Settings) -> str:
    """The settings file: TOML with comments, JSON-quoted strings (valid TOML basic strings)."""
    lines = [
        "# fractal-edge board settings, read at every boot (written by `fractal image configure`;",
        "# edit on any computer). broker/fleet: URLs the board reaches; swarm: its swarm id;",
        "# enroll_token: presented to the fleet at enrolment; api_token: required by the node's",
        "# HTTP API as `Authorization: Bearer` (empty: none); hostname: also the node id.",
        "# wifi_ssid/wifi_psk (Raspberry Pi; WPA2-Personal): the PSK as 64 hex digits, or the",
        "# passphrase; wifi_country: two-letter code of where the board is.",
    ]
    # JSON escapes are TOML's, except that JSON writes characters beyond the BMP as surrogate
    # pairs, which TOML refuses: those (an emoji in an SSID) are written as themselves, UTF-8
    lines += [f"{k} = {json.dumps(v, ensure_ascii=False)}" for k, v in asdict(s).items()]
    return "\n".join(lines) + "\n"


def parse(text: str) -> Settings:
    """Settings from the file's text; ImageError naming a bad or unknown key."""
    try:
        raw = tomllib.loads(text)
    except tomllib.TOMLDecodeError as exc:
        raise ImageError(f"{SETTINGS_PATH}: not valid TOML ({exc})") from None
    known = {f.name for f in fields(Settings)}
    unknown = sorted(set(raw) - known)
    if unknown:
        raise ImageError(
            f"{SETTINGS_PATH}: unknown key(s) {', '.join(unknown)}", hint=f"known: {', '.join(known)}"
        )
    if any(not isinstance(v, str) for v in raw.values()):
        raise ImageError(f"{SETTINGS_PATH}: every value must be a string")
    try:
        return Settings(**raw).check()
    except TypeError:
        raise ImageError(f"{SETTINGS_PATH}: broker, fleet, swarm and enroll_token are required") from None


def apply(s: Settings, device: Path) -> None:
    """Write the node's device settings and the enrolment data into the device directory."""
    data = device / "data"
    data.mkdir(parents=True, exist_ok=True)
    extra = [f"broker = {json.dumps(s.broker)}", f"swarm = {json.dumps(s.swarm)}"]
    if s.api_token:
        extra.append(f"auth_token = {json.dumps(s.api_token)}")
    _write(
        data / "node.extra.toml",
        "# from the boot partition's fractal/settings.toml\n" + "\n".join(extra) + "\n",
    )
    _write(
        data / "enrollment.toml",
        f"fleet = {json.dumps(s.fleet)}\nenroll_token = {json.dumps(s.enroll_token)}\n",
    )


def _write(path: Path, text: str) -> None:
    atomic_write(path, text, mode=0o600)


def configure_image(img: Path, s: Settings) -> Path:
    """Write ``s`` into the image's boot partition (mtools; the image is not mounted). A Wi-Fi
    passphrase is stored as the PSK it stands for; Wi-Fi on a board without it is refused."""
    import tempfile

    from firmware.osimage import disk

    s.check()
    if not img.is_file():
        raise ImageError(f"{img}: no such image file", hint="build one with `fractal image build-os`")
    parts = disk.read_gpt(img)
    if "boot" not in parts:
        raise ImageError(
            f"{img} has no partition named boot", hint="pass an image made by `fractal image build-os`"
        )
    with tempfile.TemporaryDirectory() as tmp:
        if s.wifi_ssid:
            _check_board_has_wifi(img, parts["boot"], Path(tmp))
        src = Path(tmp) / "content" / "fractal"
        src.mkdir(parents=True)
        (src / "settings.toml").write_text(render(s.with_derived_psk()), encoding="utf-8")
        disk.fat_write(img, parts["boot"], src.parent)
    return img


def _check_board_has_wifi(img: Path, boot: Partition, tmp: Path) -> None:
    from firmware.osimage import disk
    from firmware.osimage.boards import OS_BOARDS
    from firmware.osimage.build import BOOT_INFO

    try:
        info = json.loads(disk.fat_read(img, boot, BOOT_INFO, tmp / "image.json").read_text())
    except (ImageError, ValueError):
        return  # an image without its build record: let the board decide
    board = OS_BOARDS.get(str(info.get("board")))
    if board is not None and not board.wifi:
        wifi = [b.name for b in OS_BOARDS.values() if b.wifi]
        raise ImageError(
            f"board {board.name} has no Wi-Fi support in its image",
            hint=f"Wi-Fi settings are for {', '.join(wifi)}; use Ethernet",
        )


def write_wpa_conf(boot: Path, conf: Path) -> int:
    """The board's Wi-Fi step (``/etc/fractal/wifi.sh``): ``conf`` (0600) from the settings'
    Wi-Fi network; 0 and ``conf`` written, 3 when no Wi-Fi is set (``conf`` removed), 1 when the
    settings do not parse. The PSK is never printed."""
    path = boot / SETTINGS_PATH
    try:
        s = parse(path.read_text(encoding="utf-8")) if path.is_file() else None
    except ImageError as exc:
        print(f"wifi: settings ignored: {exc}", file=sys.stderr)
        return 1
    if s is None or not s.wifi_ssid:
        conf.unlink(missing_ok=True)
        return 3
    _write(conf, wpa_supplicant_conf(s))
    print(f"wifi: network {s.wifi_ssid!r}{f' (country {s.wifi_country})' if s.wifi_country else ''}")
    return 0


def main(argv: list[str] | None = None) -> int:
    """On the board, at every boot: settings file -> device settings + hostname."""
    ap = argparse.ArgumentParser(prog="python3 -m firmware.osimage.settings")
    ap.add_argument("cmd", choices=["apply", "wifi"])
    ap.add_argument("--boot", type=Path, default=Path("/boot"))
    ap.add_argument("--device", type=Path, default=Path("/data/device"))
    ap.add_argument("--conf", type=Path, default=WPA_CONF, help="wifi: wpa_supplicant.conf to write")
    a = ap.parse_args(argv)
    if a.cmd == "wifi":
        return write_wpa_conf(a.boot, a.conf)
    path = a.boot / SETTINGS_PATH
    if not path.is_file():
        print("settings: none on the boot partition (run `fractal image configure`); the node runs alone")
        return 0
    try:
        s = parse(path.read_text(encoding="utf-8"))
    except ImageError as exc:
        print(f"settings: ignored: {exc}", file=sys.stderr)
        return 1
    apply(s, a.device)
    if s.hostname:
        Path("/run/hostname").write_text(s.hostname + "\n")
        subprocess.run(["hostname", s.hostname], check=False)
    if s.ntp_server:
        subprocess.run(["ntpd", "-p", s.ntp_server], check=False)
    print(
        f"settings: broker {s.broker}, swarm {s.swarm}, fleet {s.fleet}, hostname {s.hostname or '(default)'}"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
