"""The disk image file: GPT (or MBR for the Raspberry Pi), a FAT boot partition, ext4 root and
data partitions, without mounts.

Every tool writes into the one sparse image file at its partition's offset: ``sfdisk`` the
partition table, ``mkfs.fat --offset`` and ``mcopy -i IMG@@OFFSET`` the boot partition,
``mke2fs -d DIR -E offset=...`` the ext4 file systems (filled from a directory, so no loop device
and no root-only mount). Unwritten blocks stay holes, which ``bmaptool create`` maps so that
``bmaptool copy`` writes only the data to a card.
"""

from __future__ import annotations

import os
import shutil
import struct
import subprocess
from dataclasses import dataclass
from enum import Enum
from pathlib import Path

from compiler.manifest import file_sha256
from firmware.errors import ImageError
from fractal.files import atomic_open

__all__ = [
    "Partition",
    "PartSpec",
    "write_disk",
    "read_gpt",
    "read_mbr",
    "mbr_partuuid",
    "MBR_NAMES",
    "tree_bytes",
    "write_bmap",
    "write_sha256",
    "Compression",
    "compress",
    "fat_read",
    "fat_write",
    "fat_list",
    "BOOT_LABEL",
    "ROOT_LABEL",
    "DATA_LABEL",
    "MiB",
]

MiB = 1 << 20
SECTOR = 512
BOOT_LABEL = "FRACTALBOOT"  # FAT volume label (11 characters at most)
ROOT_LABEL = "fractal-root"
DATA_LABEL = "fractal-data"
_ESP = "C12A7328-F81F-11D2-BA4B-00A0C93EC93B"  # EFI system: what firmware looks for (UEFI boards later)
_LINUX = "0FC63DAF-8483-4772-8E79-3D69D8477DE4"  # Linux filesystem data
_MBR_FAT32_LBA = "c"  # what the Pi boot ROM and every OS take for a FAT32 boot partition
_MBR_LINUX = "83"
# An MBR has no partition names: the partitions of an image are these, in this order.
MBR_NAMES = ("boot", "root", "data")


@dataclass(frozen=True)
class PartSpec:
    name: str  # GPT partition name
    size: int  # bytes, a multiple of 1 MiB
    kind: str  # "fat" | "ext4"
    label: str
    content: Path  # directory copied into the file system


@dataclass(frozen=True)
class Partition:
    name: str
    start: int  # bytes
    size: int  # bytes


def _run(argv: list[str], what: str, env: dict[str, str] | None = None, stdin: str | None = None) -> str:
    exe = shutil.which(argv[0])
    if exe is None:
        pkg = {
            "sfdisk": "fdisk",
            "mkfs.fat": "dosfstools",
            "mcopy": "mtools",
            "mke2fs": "e2fsprogs",
            "bmaptool": "bmap-tools",
            "mdir": "mtools",
            "xz": "xz-utils",
            "zstd": "zstd",
        }.get(argv[0], argv[0])
        raise ImageError(
            f"{argv[0]} is not installed ({what})",
            hint=f"bash deploy/install-system-deps.sh (Debian package {pkg})",
        )
    r = subprocess.run(
        [exe, *argv[1:]],
        capture_output=True,
        text=True,
        check=False,
        input=stdin,
        env={**os.environ, **(env or {})},
    )
    if r.returncode != 0:
        raise ImageError(f"{what} failed: {(r.stderr or r.stdout).strip()[-300:]}")
    return r.stdout


def tree_bytes(path: Path) -> int:
    """Bytes a directory tree takes in ext4 (4 KiB blocks, one 256-byte inode per entry)."""
    total = 0
    for dirpath, dirnames, filenames in os.walk(path):
        for n in dirnames + filenames:
            st = os.lstat(os.path.join(dirpath, n))
            total += -(-st.st_size // 4096) * 4096 + 256
    return total


def write_disk(img: Path, parts: list[PartSpec], *, mbr_id: int | None = None) -> list[Partition]:
    """Create ``img`` (sparse) holding ``parts`` in order after a 1 MiB gap: GPT at both ends, or
    with ``mbr_id`` an MBR (dos) table with that disk identifier, the FAT partition bootable and
    the partitions in :data:`MBR_NAMES` order (an MBR has no names)."""
    if mbr_id is not None and tuple(p.name for p in parts) != MBR_NAMES[: len(parts)]:
        raise ImageError(f"an MBR image holds the partitions {MBR_NAMES} in that order")
    start = MiB
    layout = []
    for p in parts:
        layout.append(Partition(p.name, start, p.size))
        start += p.size
    total = start + MiB  # room for the backup GPT
    img.unlink(missing_ok=True)
    with open(img, "wb") as fh:
        fh.truncate(total)
    if mbr_id is None:
        script = ["label: gpt", "unit: sectors", "first-lba: 2048"]
    else:
        script = ["label: dos", f"label-id: 0x{mbr_id:08x}", "unit: sectors"]
    for spec, part in zip(parts, layout, strict=True):
        where = f"start={part.start // SECTOR}, size={part.size // SECTOR}"
        if mbr_id is None:
            kind = _ESP if spec.kind == "fat" else _LINUX
            script.append(f'{where}, type={kind}, name="{part.name}"')
        else:
            kind = _MBR_FAT32_LBA if spec.kind == "fat" else _MBR_LINUX
            script.append(f"{where}, type={kind}" + (", bootable" if spec.kind == "fat" else ""))
    _run(
        ["sfdisk", "--quiet", "--no-reread", "--no-tell-kernel", str(img)],
        "sfdisk (the partition table)",
        stdin="\n".join(script) + "\n",
    )
    for spec, part in zip(parts, layout, strict=True):
        if spec.kind == "fat":
            _run(
                [
                    "mkfs.fat",
                    "-F",
                    "32",
                    "-n",
                    spec.label,
                    "--offset",
                    str(part.start // SECTOR),
                    "-h",
                    str(part.start // SECTOR),
                    "-s",
                    "1",  # 1-sector clusters: enough for FAT32 in 128 MiB
                    str(img),
                    str(part.size // 1024),
                ],
                f"mkfs.fat of {spec.name}",
            )
            fat_write(img, part, spec.content)
        else:
            _run(
                [
                    "mke2fs",
                    "-q",
                    "-F",
                    "-t",
                    "ext4",
                    "-L",
                    spec.label,
                    "-d",
                    str(spec.content),
                    "-E",
                    f"offset={part.start},nodiscard",
                    "-m",
                    "0",
                    str(img),
                    f"{part.size // 1024}k",
                ],
                f"mke2fs of {spec.name}",
            )
    return layout


def _mtools_env() -> dict[str, str]:
    return {"MTOOLS_SKIP_CHECK": "1"}


def fat_write(img: Path, part: Partition, content: Path) -> None:
    """Copy the tree ``content`` into the FAT file system at ``part`` (replacing files)."""
    items = [str(p) for p in sorted(content.iterdir())]
    if items:
        _run(
            ["mcopy", "-o", "-s", "-i", f"{img}@@{part.start}", *items, "::/"],
            "mcopy into the boot partition",
            env=_mtools_env(),
        )


def fat_read(img: Path, part: Partition, name: str, dest: Path) -> Path:
    """Copy the file ``name`` out of the FAT file system at ``part`` to ``dest``."""
    _run(
        ["mcopy", "-o", "-n", "-i", f"{img}@@{part.start}", f"::/{name}", str(dest)],
        f"reading {name} from the boot partition",
        env=_mtools_env(),
    )
    return dest


def read_mbr(img: Path) -> tuple[int, list[tuple[int, bool, int, int]]]:
    """(disk identifier, [(type, bootable, start bytes, size bytes)]) of an MBR's primary entries;
    ImageError if ``img`` has no MBR boot signature."""
    with open(img, "rb") as fh:
        mbr = fh.read(SECTOR)
    if len(mbr) < SECTOR or mbr[510:512] != b"\x55\xaa":
        raise ImageError(
            f"{img} has no partition table", hint="pass an image made by `fractal image build-os`"
        )
    (disk_id,) = struct.unpack_from("<I", mbr, 440)
    out = []
    for i in range(4):
        boot, kind, first, count = struct.unpack_from("<B3xB3xII", mbr, 446 + 16 * i)
        if kind:
            out.append((kind, boot == 0x80, first * SECTOR, count * SECTOR))
    return disk_id, out


def mbr_partuuid(disk_id: int, number: int) -> str:
    """The kernel's PARTUUID of MBR partition ``number`` (1-based): disk id and number in hex."""
    return f"{disk_id:08x}-{number:02x}"


def read_gpt(img: Path) -> dict[str, Partition]:
    """{partition name: Partition} from the primary GPT of ``img``; for an MBR image (the Pi's)
    the partitions named by their place (:data:`MBR_NAMES`)."""
    with open(img, "rb") as fh:
        fh.seek(SECTOR)
        hdr = fh.read(92)
        if len(hdr) < 92 or hdr[:8] != b"EFI PART":
            try:
                _, entries = read_mbr(img)
            except ImageError:
                entries = []
            if entries and entries[0][0] != 0xEE:  # not a GPT's protective MBR: an MBR image
                return {n: Partition(n, e[2], e[3]) for n, e in zip(MBR_NAMES, entries, strict=False)}
            raise ImageError(
                f"{img} has no GPT partition table", hint="pass an image made by `fractal image build-os`"
            )
        entries_lba, count, esize = struct.unpack_from("<QII", hdr, 72)
        if not (0 < count <= 256 and 128 <= esize <= 1024):
            raise ImageError(f"{img}: implausible GPT header")
        fh.seek(entries_lba * SECTOR)
        raw = fh.read(count * esize)
    out = {}
    for i in range(count):
        e = raw[i * esize : (i + 1) * esize]
        if e[:16] == bytes(16):
            continue
        first, last = struct.unpack_from("<QQ", e, 32)
        name = e[56:128].decode("utf-16-le").rstrip("\x00")
        out[name] = Partition(name, first * SECTOR, (last - first + 1) * SECTOR)
    return out


def write_bmap(img: Path) -> Path:
    """``IMG.bmap`` (bmaptool's block map, with the checksums of the mapped ranges)."""
    out = img.with_name(img.name + ".bmap")
    _run(["bmaptool", "create", "-o", str(out), str(img)], "bmaptool create")
    return out


def write_sha256(img: Path) -> Path:
    """``IMG.sha256`` in ``sha256sum -c`` format."""
    out = img.with_name(img.name + ".sha256")
    out.write_text(f"{file_sha256(img)}  {img.name}\n")
    return out


class Compression(Enum):
    """How ``build-os --compress`` packs the image; ``bmaptool copy`` reads both directly."""

    XZ = "xz"
    ZSTD = "zstd"

    @property
    def suffix(self) -> str:
        return ".xz" if self is Compression.XZ else ".zst"

    def argv(self) -> list[str]:
        # all cores; xz's default level (6): smallest, ~5 min for a 600 MiB image on 2 busy cores;
        # zstd at 12: ~20% larger, 7x faster
        if self is Compression.XZ:
            return ["xz", "-T0", "-6", "-c"]
        return ["zstd", "-T0", "-12", "-q", "-c"]


def compress(img: Path, how: Compression) -> Path:
    """``IMG.xz`` or ``IMG.zst`` beside ``img`` (written atomically); ``img`` is left in place."""
    out = img.with_name(img.name + how.suffix)
    argv = [*how.argv(), str(img)]
    exe = shutil.which(argv[0])
    if exe is None:
        _run(argv, "compressing the image")  # raises the "not installed" error
    with atomic_open(out) as fh:  # a failed run leaves no file under the compressed name
        r = subprocess.run([str(exe), *argv[1:]], stdout=fh, stderr=subprocess.PIPE, text=True, check=False)
        if r.returncode != 0:
            raise ImageError(f"{argv[0]} of {img.name} failed: {r.stderr.strip()[-300:]}")
    return out


def fat_list(img: Path, part: Partition) -> list[str]:
    """Names in the root directory of the FAT file system at ``part``."""
    out = _run(
        ["mdir", "-b", "-i", f"{img}@@{part.start}", "::/"], "listing the boot partition", env=_mtools_env()
    )
    return [line.rstrip("/").rsplit("/", 1)[-1] for line in out.splitlines() if line.strip()]
