"""fractal.files, the one atomic file replacement: a write that fails or a process killed at any
point leaves the old content or the new one, never a partial file, and no temp file under the
target's name. And no module of the project replaces a file by a hand-rolled tmp + rename."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from fractal import files

ROOT = Path(__file__).resolve().parents[1]
OLD, NEW = b"old content\n" * 1000, b"NEW CONTENT, longer than the old one\n" * 4000

# A child that replaces TARGET with NEW in 4 KiB writes and SIGKILLs itself at one point:
# "bytes:N" after N bytes were written, "fsync" after the data is durable, "rename" right after it.
CHILD = r"""
import os, signal, sys
from fractal import files
target, point, new = sys.argv[1], sys.argv[2], open(sys.argv[3], "rb").read()
die = lambda: os.kill(os.getpid(), signal.SIGKILL)
orig_replace = os.replace
if point == "rename":
    def replace(a, b):
        orig_replace(a, b)
        die()
    os.replace = replace
with files.atomic_open(target, before_rename=die if point == "fsync" else None) as fh:
    for i in range(0, len(new), 4096):
        if point.startswith("bytes:") and i >= int(point[6:]):
            fh.flush()
            die()
        fh.write(new[i:i + 4096])
"""


def _leftovers(d: Path, name: str) -> list[str]:
    return sorted(p.name for p in d.iterdir() if p.name != name)


@pytest.mark.parametrize("point", ["bytes:0", "bytes:4096", f"bytes:{len(NEW) // 2}", "fsync", "rename"])
def test_a_process_killed_mid_write_leaves_the_old_or_the_new_content(tmp_path, point):
    target, new = tmp_path / "state.json", tmp_path / "new.bin"
    target.write_bytes(OLD)
    new.write_bytes(NEW)
    r = subprocess.run([sys.executable, "-c", CHILD, str(target), point, str(new)], capture_output=True,
                       env={**os.environ, "PYTHONPATH": str(ROOT)}, timeout=60)
    assert r.returncode == -signal.SIGKILL, r.stderr
    assert target.read_bytes() == (NEW if point == "rename" else OLD), point
    # a killed writer's temp file stays (nobody ran to remove it) but never under the target's name
    assert all(re.fullmatch(r"\.state\.json\.[0-9a-f]{8}\.tmp", n) for n in _leftovers(tmp_path, "state.json")
               if n != "new.bin")


def test_a_write_that_fails_midway_leaves_the_old_content_and_no_temp_file(tmp_path):
    target = tmp_path / "keyring.json"
    target.write_bytes(OLD)
    with pytest.raises(RuntimeError, match="disk pulled"):
        with files.atomic_open(target) as fh:
            fh.write(NEW[: len(NEW) // 2])
            raise RuntimeError("disk pulled")
    assert target.read_bytes() == OLD and _leftovers(tmp_path, "keyring.json") == []


def test_a_failing_fsync_leaves_the_old_content(tmp_path, monkeypatch):
    """Fault injected into the write path itself: the data's fsync fails (EIO, a full disk)."""
    target = tmp_path / "boot-state.json"
    target.write_bytes(OLD)

    def eio(fd: int) -> None:
        raise OSError(5, "Input/output error")

    monkeypatch.setattr(files.os, "fsync", eio)
    with pytest.raises(OSError, match="Input/output"):
        files.atomic_write(target, NEW)
    monkeypatch.undo()
    assert target.read_bytes() == OLD and _leftovers(tmp_path, "boot-state.json") == []
    files.atomic_write(target, "new text")  # str is written as UTF-8
    assert target.read_text() == "new text" and _leftovers(tmp_path, "boot-state.json") == []


def test_a_private_file_is_private_from_its_first_byte(tmp_path):
    target = tmp_path / "device.key"
    with files.atomic_open(target, mode=0o600) as fh:
        (tmp,) = [p for p in tmp_path.iterdir()]
        assert tmp.stat().st_mode & 0o777 == 0o600  # the temp file, before any secret is in it
        fh.write(b"secret")
    assert target.stat().st_mode & 0o777 == 0o600 and target.read_bytes() == b"secret"


def test_replace_durably_moves_a_staged_file_over_the_target(tmp_path):
    staged, target = tmp_path / "params.next.npz", tmp_path / "params.npz"
    staged.write_bytes(NEW)
    target.write_bytes(OLD)
    files.replace_durably(staged, target)
    assert target.read_bytes() == NEW and not staged.exists()


# files allowed their own rename: directories (compiler artifacts, the C-backend cache), the
# unpacked packages an image's root is assembled from (moved, not replaced: firmware/osimage/rootfs.py),
# the disk image that sfdisk, mkfs.fat and mke2fs write in place under a temp name
# (firmware/osimage/build.py) and firmware/debs.py, which sysroot.sh runs with the system python3
# where the project is not importable
_OWN_RENAME = {"compiler/build.py", "compiler/cbackend.py", "firmware/debs.py", "firmware/osimage/build.py",
               "firmware/osimage/rootfs.py", "fractal/files.py"}


def test_no_module_replaces_a_file_by_its_own_tmp_and_rename():
    pat = re.compile(r"os\.replace\(|os\.rename\(|\btmp\w*\.(replace|rename)\(")
    found = []
    pkgs = ("fractal", "compiler", "federation", "firmware", "edgenode", "deploy", "api", "bench", "harness")
    for pkg in pkgs:
        for path in sorted((ROOT / pkg).rglob("*.py")):
            rel = str(path.relative_to(ROOT))
            if rel in _OWN_RENAME:
                continue
            for n, line in enumerate(path.read_text().splitlines(), 1):
                if pat.search(line):
                    found.append(f"{rel}:{n}: {line.strip()}")
    hint = "use fractal.files (atomic_write / atomic_open / replace_durably):\n"
    assert found == [], hint + "\n".join(found)
