"""firmware/debs.py: the sysroot's Debian package lock and its verifying fetcher, against a
local HTTP mirror (a real server in a thread; pool files, an index and a Release file)."""

from __future__ import annotations

import hashlib
import http.server
import lzma
import subprocess
import sys
import threading
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from firmware import debs

REPO = Path(__file__).resolve().parents[2]


def _stanza(name: str, version: str, data: bytes, path: str) -> str:
    return (f"Package: {name}\nVersion: {version}\nArchitecture: riscv64\n"
            f"Description: test\n multi-line\nFilename: {path}\nSize: {len(data)}\n"
            f"SHA256: {hashlib.sha256(data).hexdigest()}\n")


@dataclass
class Mirror:
    url: str
    root: Path
    hits: dict[str, int] = field(default_factory=dict)  # GETs per path (to see retries)
    flaky: dict[str, int] = field(default_factory=dict)  # path -> 503s to answer before serving


@pytest.fixture
def mirror(tmp_path: Path) -> Iterator[Mirror]:
    """A directory served over HTTP by a real server in a thread."""
    root = tmp_path / "mirror"
    root.mkdir()
    hits: dict[str, int] = {}
    flaky: dict[str, int] = {}

    class Handler(http.server.SimpleHTTPRequestHandler):
        def __init__(self, *a: object, **kw: object) -> None:
            super().__init__(*a, directory=str(root), **kw)  # type: ignore[arg-type]

        def do_GET(self) -> None:
            hits[self.path] = hits.get(self.path, 0) + 1
            if flaky.get(self.path, 0) > 0:
                flaky[self.path] -= 1
                self.send_error(503)
                return
            super().do_GET()

        def log_message(self, *a: object) -> None:
            pass

    srv = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    t = threading.Thread(target=srv.serve_forever, daemon=True)
    t.start()
    try:
        yield Mirror(f"http://127.0.0.1:{srv.server_address[1]}", root, hits, flaky)
    finally:
        srv.shutdown()
        srv.server_close()


def _publish(root: Path, files: dict[str, bytes]) -> list[debs.Pin]:
    pins = []
    for name, data in files.items():
        path = f"pool/main/{name[0]}/{name}/{name}_1.0_riscv64.deb"
        (root / path).parent.mkdir(parents=True, exist_ok=True)
        (root / path).write_bytes(data)
        pins.append(debs.Pin(name, "1.0", hashlib.sha256(data).hexdigest(), len(data), path))
    return pins


def test_parse_index_and_release() -> None:
    text = _stanza("a", "1.0", b"x", "pool/a.deb") + "\n" + _stanza("b", "2", b"yy", "pool/b.deb")
    pins = debs.pins_from_packages(text, ["b", "a"])
    assert [(p.package, p.version, p.size, p.path) for p in pins] == [
        ("b", "2", 2, "pool/b.deb"), ("a", "1.0", 1, "pool/a.deb")]
    assert pins[0].sha256 == hashlib.sha256(b"yy").hexdigest()
    with pytest.raises(debs.DebsError, match="not in the index: c"):
        debs.pins_from_packages(text, ["a", "c"])
    # two versions of one package: the newer one wins (Debian order: 1.10 > 1.9, epoch beats all)
    two = _stanza("a", "1.9", b"old", "p/o.deb") + "\n" + _stanza("a", "1:0.1", b"new", "p/n.deb")
    assert debs.pins_from_packages(two, ["a"])[0].path == "p/n.deb"
    rel = ("Origin: Debian\nSHA256:\n " + "ab" * 32 + " 12 main/binary-riscv64/Packages.xz\n"
           " " + "cd" * 32 + " 99 main/binary-riscv64/Packages\n")
    assert debs.release_sha256(rel)["main/binary-riscv64/Packages.xz"] == ("ab" * 32, 12)


def test_lock_roundtrip_and_malformed(tmp_path: Path) -> None:
    pins = [debs.Pin("libc6", "2.41-12", "0" * 64, 10, "pool/main/g/glibc/libc6.deb")]
    lock = tmp_path / "x.lock"
    lock.write_text("# header\n\n" + "\n".join(p.line() for p in pins) + "\n")
    assert debs.read_lock(lock) == pins
    lock.write_text("libc6 2.41 notahash 10 pool/x.deb\n")
    with pytest.raises(debs.DebsError, match=r"x.lock:1: expected"):
        debs.read_lock(lock)


def test_fetch_verifies_every_file_and_retries_transient_errors(
        mirror: Mirror, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(debs, "RETRY_DELAY_S", 0.01)
    url, root, hits = mirror.url, mirror.root, mirror.hits
    pins = _publish(root, {"liba": b"A" * 100, "libb": b"B" * 50})
    mirror.flaky["/" + pins[1].path] = 2  # two 503s, then the file
    got = debs.fetch(pins, url, tmp_path / "out")
    assert [p.read_bytes() for p in got] == [b"A" * 100, b"B" * 50]
    assert hits["/" + pins[1].path] == 3
    assert not list((tmp_path / "out").glob(".part-*"))
    # a second fetch keeps verified files and downloads nothing
    before = dict(hits)
    debs.fetch(pins, url, tmp_path / "out")
    assert hits == before

    # a file whose bytes changed on the mirror is refused, named, and not left behind
    (root / pins[0].path).write_bytes(b"A" * 99 + b"!")
    with pytest.raises(debs.DebsError, match="liba 1.0: downloaded file does not match the lock"):
        debs.fetch(pins, url, tmp_path / "fresh")
    assert not (tmp_path / "fresh" / Path(pins[0].path).name).exists()
    # a pin removed from the pool: 404 is final (no retries), the URL is named
    (root / pins[0].path).unlink()
    n = hits.get("/" + pins[0].path, 0)
    with pytest.raises(debs.DebsError, match="HTTP 404"):
        debs.fetch(pins, url, tmp_path / "fresh")
    assert hits["/" + pins[0].path] == n + 1


def test_cli_fetch_refuses_a_stale_lock_with_one_line(tmp_path: Path) -> None:
    lock = tmp_path / "l.lock"
    lock.write_text(debs.Pin("liba", "1", "0" * 64, 1, "pool/a.deb").line() + "\n")
    r = subprocess.run([sys.executable, str(REPO / "firmware" / "debs.py"), "fetch", "--lock",
                        str(lock), "--dest", str(tmp_path / "d"), "--packages", "liba", "libb"],
                       capture_output=True, text=True, check=False)
    assert r.returncode == 1
    assert r.stderr.count("\n") == 1 and "stale: missing ['libb']" in r.stderr


def test_shipped_riscv64_lock_pins_exactly_the_sysroot_packages() -> None:
    """sysroot.sh's package list and the lock agree (sysroot.sh refuses a stale lock too)."""
    script = (REPO / "firmware" / "sysroot.sh").read_text()
    block = script.split("RV_DEBS=(", 1)[1].split("\n  )", 1)[0]
    names = {w for line in block.splitlines() if not line.strip().startswith("#")
             for w in line.split()}
    pins = debs.read_lock(REPO / "firmware" / "sysroot-riscv64.lock")
    assert {p.package for p in pins} == names
    assert all(p.path.startswith("pool/main/") and p.path.endswith(".deb") for p in pins)


def test_lock_checks_the_index_against_the_signed_release(
        mirror: Mirror, monkeypatch: pytest.MonkeyPatch) -> None:
    """`lock` pins from an index only when it matches the Release's SHA-256 (the signature itself
    is gpgv's job and stubbed here); a mismatching index needs --allow-unverified-index and the
    lock says so."""
    data = {"liba": b"A" * 10, "libb": b"B" * 20}
    pins = _publish(mirror.root, data)
    index = "\n".join(_stanza(p.package, p.version, data[p.package], p.path) for p in pins)
    xz = lzma.compress(index.encode())
    d = mirror.root / "dists/trixie/main/binary-riscv64"
    d.mkdir(parents=True)
    (d / "Packages.xz").write_bytes(xz)
    sha = hashlib.sha256(xz).hexdigest()
    release = {"text": f"Origin: Debian\nSHA256:\n {sha} {len(xz)} main/binary-riscv64/Packages.xz\n"}
    monkeypatch.setattr(debs, "verified_release", lambda m, s, k: release["text"])
    text = debs.make_lock(mirror.url, "trixie", "riscv64", ["libb", "liba"], keyring="k",
                          allow_unverified=False)
    assert "verified against the signed InRelease: yes" in text
    lines = [ln for ln in text.splitlines() if not ln.startswith("#")]
    assert lines == [pins[1].line(), pins[0].line()]
    # the mirror now serves an index the Release does not describe (mid-sync)
    (d / "Packages.xz").write_bytes(lzma.compress((index + "\n").encode()))
    with pytest.raises(debs.DebsError, match="does not match trixie's signed Release"):
        debs.make_lock(mirror.url, "trixie", "riscv64", ["liba"], keyring="k",
                       allow_unverified=False)
    text = debs.make_lock(mirror.url, "trixie", "riscv64", ["liba"], keyring="k",
                          allow_unverified=True)
    assert "verified against the signed InRelease: NO" in text
