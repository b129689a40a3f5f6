"""First-boot settings on the boot partition: ``fractal/settings.toml``, readable and editable on
any computer (the boot partition is FAT), as Raspberry Pi Imager's customisation or cloud-init's
NoCloud seed are. ``fractal image configure`` writes it with mtools (no mount); at every boot the
board reads it (``python3 -m firmware.osimage.settings apply``, from ``files/service.sh``) into
the node's device settings (``data/node.extra.toml`` of the device directory, which
``fractal boot`` appends to every slot's node config) and sets the hostname, which is the node id.

Keys: ``broker`` (mqtt:// or mqtts://), ``fleet`` (http:// or https://), ``swarm``,
``enroll_token``, optional ``api_token`` (the node's HTTP API then requires it as
``Authorization: Bearer``), ``hostname``, ``ntp_server``. The fleet URL and enrolment token are
kept in ``data/enrollment.toml`` for the enrolment step (``edgenode/enrol.py``).
"""

from __future__ import annotations

import argparse
import json
import re
import subprocess
import sys
import tomllib
from dataclasses import asdict, dataclass, fields
from pathlib import Path

from firmware.errors import ImageError
from fractal.files import atomic_write

__all__ = ["Settings", "SETTINGS_PATH", "parse", "render", "apply", "configure_image"]

SETTINGS_PATH = "fractal/settings.toml"  # on the boot partition
_ID = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,63}$")  # a topic level (federation.topics.validate_id)
_HOST = re.compile(r"^[A-Za-z0-9]([A-Za-z0-9-]{0,61}[A-Za-z0-9])?$")  # one DNS label
_TOKEN = re.compile(r"^[\x21-\x7e]{8,256}$")  # printable, no spaces: goes into HTTP headers


@dataclass(frozen=True)
class Settings:
    broker: str
    fleet: str
    swarm: str
    enroll_token: str
    api_token: str = ""
    hostname: str = ""
    ntp_server: str = ""

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
        return self


def render(s: Settings) -> str:
    """The settings file: TOML with comments, JSON-quoted strings (valid TOML basic strings)."""
    lines = [
        "# fractal-edge board settings, read at every boot (written by `fractal image configure`;",
        "# edit on any computer). broker/fleet: URLs the board reaches; swarm: its swarm id;",
        "# enroll_token: presented to the fleet at enrolment; api_token: required by the node's",
        "# HTTP API as `Authorization: Bearer` (empty: none); hostname: also the node id.",
    ]
    lines += [f"{k} = {json.dumps(v)}" for k, v in asdict(s).items()]
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
    """Write ``s`` into the image's boot partition (mtools; the image is not mounted)."""
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
        src = Path(tmp) / "fractal"
        src.mkdir()
        (src / "settings.toml").write_text(render(s))
        disk.fat_write(img, parts["boot"], Path(tmp))
    return img


def main(argv: list[str] | None = None) -> int:
    """On the board, at every boot: settings file -> device settings + hostname."""
    ap = argparse.ArgumentParser(prog="python3 -m firmware.osimage.settings")
    ap.add_argument("cmd", choices=["apply"])
    ap.add_argument("--boot", type=Path, default=Path("/boot"))
    ap.add_argument("--device", type=Path, default=Path("/data/device"))
    a = ap.parse_args(argv)
    path = a.boot / SETTINGS_PATH
    if not path.is_file():
        print("settings: none on the boot partition (run `fractal image configure`); the node runs alone")
        return 0
    try:
        s = parse(path.read_text())
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
