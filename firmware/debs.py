"""Pinned Debian packages for the foreign-arch sysroots: a lock file and a verifying fetcher.

`apt-get update` needs the mirror's index files to match its signed Release file byte for byte;
a mirror (or a caching proxy in front of it) that is mid-sync, or that kept an older
``Packages.xz`` next to a newer ``Release``, fails the whole sysroot build with "File has
unexpected size ... Mirror sync in progress?". The sysroot does not need the index at all once it
knows which files it wants: a lock file names each package's pool path, size and SHA-256, and
``fetch`` downloads exactly those files and checks them, like a pip hash lock. Pool files are
immutable, so a lock stays valid until Debian removes a superseded version from the pool; then
``fetch`` fails with the package named and ``sysroot.sh`` falls back to apt.

Standalone (stdlib only, run with the host's ``python3`` before the project's venv exists)::

    python3 firmware/debs.py lock --mirror URL --suite trixie --arch riscv64 --out LOCK PKG...
        [--components main,non-free-firmware]
    python3 firmware/debs.py fetch --lock LOCK --dest DIR [--packages PKG...]

``lock`` checks the index against the suite's InRelease (signature with ``gpgv`` and the Debian
archive keyring, then the SHA-256 of ``Packages.xz``); an index that does not match is refused
unless ``--allow-unverified-index`` is given, and the lock then says so in its header.
"""

from __future__ import annotations

import argparse
import hashlib
import lzma
import os
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from dataclasses import dataclass
from pathlib import Path

KEYRING = "/usr/share/keyrings/debian-archive-keyring.gpg"
USER_AGENT = "fractal-edge-sysroot/1"
RETRY_DELAY_S = 1.0  # first back-off between network retries, doubled each time


class DebsError(Exception):
    """One-line, user-facing failure of lock or fetch."""


@dataclass(frozen=True)
class Pin:
    package: str
    version: str
    sha256: str
    size: int
    path: str  # pool path relative to the mirror root

    def line(self) -> str:
        return f"{self.package} {self.version} {self.sha256} {self.size} {self.path}"


def parse_stanzas(text: str) -> list[dict[str, str]]:
    """Debian control-file stanzas (Packages, Release): first line of each field, continuation
    lines appended with newlines (Release's checksum lists are continuation lines)."""
    out: list[dict[str, str]] = []
    cur: dict[str, str] = {}
    key = ""
    for raw in text.splitlines():
        if not raw.strip():
            if cur:
                out.append(cur)
            cur, key = {}, ""
            continue
        if raw[0] in " \t":
            if key:
                cur[key] += "\n" + raw.strip()
            continue
        if ":" not in raw:
            continue
        key, _, value = raw.partition(":")
        cur[key] = value.strip()
    if cur:
        out.append(cur)
    return out


def release_sha256(release_text: str) -> dict[str, tuple[str, int]]:
    """``{relative path: (sha256, size)}`` from a Release/InRelease file's SHA256 list."""
    stanzas = parse_stanzas(release_text)
    if not stanzas or "SHA256" not in stanzas[0]:
        raise DebsError("Release file has no SHA256 list")
    out: dict[str, tuple[str, int]] = {}
    for line in stanzas[0]["SHA256"].splitlines():
        parts = line.split()
        if len(parts) == 3:
            out[parts[2]] = (parts[0], int(parts[1]))
    return out


def pins_from_packages(packages_text: str, names: list[str]) -> list[Pin]:
    """The newest stanza of every named package (an index normally holds one per package)."""
    wanted = set(names)
    found: dict[str, dict[str, str]] = {}
    for st in parse_stanzas(packages_text):
        name = st.get("Package", "")
        if name in wanted and (name not in found or _newer(st["Version"], found[name]["Version"])):
            found[name] = st
    missing = [n for n in names if n not in found]
    if missing:
        raise DebsError(f"not in the index: {' '.join(missing)}")
    return [Pin(n, found[n]["Version"], found[n]["SHA256"], int(found[n]["Size"]),
                found[n]["Filename"]) for n in names]


def _newer(a: str, b: str) -> bool:
    # Debian version order; only needed when an index lists a package twice (rare).
    r = subprocess.run(["dpkg", "--compare-versions", a, "gt", b], check=False)
    return r.returncode == 0


def read_lock(path: Path) -> list[Pin]:
    pins = []
    for n, line in enumerate(path.read_text().splitlines(), 1):
        if not line.strip() or line.startswith("#"):
            continue
        parts = line.split()
        if len(parts) != 5 or len(parts[2]) != 64 or not parts[3].isdigit():
            raise DebsError(f"{path}:{n}: expected 'package version sha256 size path'")
        pins.append(Pin(parts[0], parts[1], parts[2], int(parts[3]), parts[4]))
    return pins


def _get(url: str, attempts: int = 4) -> bytes:
    """GET with a few retries on transient failures (5xx, connection errors); 404 is final."""
    delay = RETRY_DELAY_S
    for i in range(attempts):
        try:
            req = urllib.request.Request(url, headers={"User-Agent": USER_AGENT})
            with urllib.request.urlopen(req, timeout=60) as resp:
                return resp.read()
        except urllib.error.HTTPError as e:
            if e.code < 500 or i == attempts - 1:
                raise DebsError(f"{url}: HTTP {e.code}") from None
        except (urllib.error.URLError, TimeoutError, ConnectionError) as e:
            if i == attempts - 1:
                raise DebsError(f"{url}: {getattr(e, 'reason', e)}") from None
        time.sleep(delay)  # back-off between network retries, not a wait on an event
        delay *= 2
    raise AssertionError("unreachable")


def fetch(pins: list[Pin], mirror: str, dest: Path) -> list[Path]:
    """Download every pinned file into ``dest`` (atomically, verified); files already there with
    the right hash are kept. Raises DebsError naming the first package that cannot be had."""
    dest.mkdir(parents=True, exist_ok=True)
    out = []
    for pin in pins:
        target = dest / Path(pin.path).name
        if target.exists() and _sha256(target.read_bytes()) == pin.sha256:
            out.append(target)
            continue
        data = _get(f"{mirror.rstrip('/')}/{pin.path}")
        if len(data) != pin.size or _sha256(data) != pin.sha256:
            raise DebsError(f"{pin.package} {pin.version}: downloaded file does not match the lock "
                            f"({len(data)} bytes, expected {pin.size})")
        # not fractal.files.atomic_write: sysroot.sh runs this file as a script with the system
        # python3, where the project is not importable (a torn download is re-fetched: sha256 above)
        fd, tmp = tempfile.mkstemp(dir=dest, prefix=".part-")
        with os.fdopen(fd, "wb") as f:
            f.write(data)
        os.replace(tmp, target)
        out.append(target)
    return out


def _sha256(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def verified_release(mirror: str, suite: str, keyring: str) -> str:
    """The suite's InRelease text after ``gpgv`` accepted its signature."""
    data = _get(f"{mirror.rstrip('/')}/dists/{suite}/InRelease")
    with tempfile.TemporaryDirectory() as tmp:
        signed = Path(tmp) / "InRelease"
        signed.write_bytes(data)
        plain = Path(tmp) / "Release"
        r = subprocess.run(["gpgv", "--keyring", keyring, "--output", str(plain), str(signed)],
                           capture_output=True, text=True, check=False)
        if r.returncode != 0:
            raise DebsError(f"InRelease of {suite}: signature not accepted by {keyring}")
        return plain.read_text()


def make_lock(mirror: str, suite: str, arch: str, names: list[str], *, keyring: str,
              allow_unverified: bool, components: tuple[str, ...] = ("main",)) -> str:
    """Lock text pinning ``names`` from the indexes of ``components`` (e.g. ``main`` and
    ``non-free-firmware``, where Debian keeps the Raspberry Pi boot firmware)."""
    release = release_sha256(verified_release(mirror, suite, keyring))
    texts, sums, verified = [], [], True
    for comp in components:
        rel_path = f"{comp}/binary-{arch}/Packages.xz"
        xz = _get(f"{mirror.rstrip('/')}/dists/{suite}/{rel_path}")
        expected = release.get(rel_path)
        ok = expected is not None and expected == (_sha256(xz), len(xz))
        if not ok and not allow_unverified:
            raise DebsError(f"{rel_path} does not match {suite}'s signed Release (mirror mid-sync?); "
                            "retry later or pass --allow-unverified-index")
        verified = verified and ok
        texts.append(lzma.decompress(xz).decode())
        sums.append(f"{comp} {_sha256(xz)}" if len(components) > 1 else _sha256(xz))
    pins = pins_from_packages("\n\n".join(texts), names)
    head = [
        f"# Debian {suite} {arch} packages for firmware/sysroot.sh (python3 firmware/debs.py lock)",
        f"# mirror {mirror}, {time.strftime('%Y-%m-%d', time.gmtime())}, index Packages.xz "
        f"sha256 {', '.join(sums)}",
        "# index verified against the signed InRelease: " + ("yes" if verified else
            "NO (mirror served an index that did not match; pins taken from it as served)"),
        "# package version sha256 size pool-path",
    ]
    return "\n".join(head + [p.line() for p in pins]) + "\n"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="debs.py", description=__doc__.splitlines()[0])
    sub = ap.add_subparsers(dest="cmd", required=True)
    lk = sub.add_parser("lock", help="write a lock file from the mirror's signed index")
    lk.add_argument("--mirror", default="http://deb.debian.org/debian")
    lk.add_argument("--suite", required=True)
    lk.add_argument("--arch", required=True)
    lk.add_argument("--out", required=True, type=Path)
    lk.add_argument("--keyring", default=KEYRING)
    lk.add_argument("--allow-unverified-index", action="store_true")
    lk.add_argument("--components", default="main",
                    help="comma-separated archive components to search, e.g. main,non-free-firmware")
    lk.add_argument("packages", nargs="+")
    fe = sub.add_parser("fetch", help="download and verify the files a lock pins")
    fe.add_argument("--lock", required=True, type=Path)
    fe.add_argument("--dest", required=True, type=Path)
    fe.add_argument("--mirror", default="http://deb.debian.org/debian")
    fe.add_argument("--packages", nargs="*", help="the set the lock must pin exactly")
    a = ap.parse_args(argv)
    try:
        if a.cmd == "lock":
            text = make_lock(a.mirror, a.suite, a.arch, a.packages, keyring=a.keyring,
                             allow_unverified=a.allow_unverified_index,
                             components=tuple(a.components.split(",")))
            a.out.write_text(text)
            print(f"debs: locked {len(a.packages)} packages in {a.out}")
        else:
            if not a.lock.exists():
                raise DebsError(f"{a.lock}: no such lock file")
            pins = read_lock(a.lock)
            if a.packages is not None:
                have, want = {p.package for p in pins}, set(a.packages)
                if have != want:
                    raise DebsError(f"{a.lock} is stale: missing {sorted(want - have)}, "
                                    f"extra {sorted(have - want)}; regenerate it with 'lock'")
            got = fetch(pins, a.mirror, a.dest)
            print(f"debs: {len(got)} packages verified in {a.dest}")
    except DebsError as e:
        print(f"debs: error: {e}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
