"""``build_os``: a complete board disk image from a compiled C-backend artifact and a release key.

The application (artifact, health reference, node template) is today's signed bundle
(:func:`firmware.image.build_image`), flashed into slot ``a`` of the device directory on the data
partition exactly as ``fractal image flash`` does on a running board, so over-the-air updates
(the same bundles) and rollbacks work unchanged on a flashed card. Its first boot is a trial
boot: ``fractal boot`` marks the slot good once its health check passes on the board.
"""

from __future__ import annotations

import json
import secrets
import shutil
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from firmware import keys as keymod
from firmware.artifact_view import artifact_info
from firmware.errors import ImageError
from firmware.osimage import bootfiles, disk, initramfs, rootfs
from firmware.osimage.boards import OsBoard, PartitionTable, get_os_board

__all__ = ["OsImage", "build_os", "BOOT_INFO", "kernel_cmdline"]

BOOT_INFO = "fractal/image.json"  # on the boot partition: board, kernel, initrd, command line
_BOOT_MB = 128
_DATA_MIN_MB = 256


@dataclass(frozen=True)
class OsImage:
    path: Path  # the image as written: raw, or compressed (IMG.xz / IMG.zst) with --compress
    bmap: Path  # describes the raw image (bmaptool copy reads the compressed one with it)
    sha256: Path  # of the raw image: what a card holds after `bmaptool copy`
    board: str
    version: str
    size: int  # bytes of the raw image (mostly holes)
    seconds: float
    stored: int  # bytes of ``path`` on disk (allocated blocks for a sparse raw image)


def kernel_cmdline(board: OsBoard, mbr_id: int | None = None) -> str:
    """The kernel command line: root by label, or on an MBR image (the Pi's, whose firmware and
    users expect it) by the root partition's PARTUUID."""
    root = f"PARTUUID={disk.mbr_partuuid(mbr_id, 2)}" if mbr_id is not None else f"LABEL={disk.ROOT_LABEL}"
    extra = f" {board.cmdline_extra}" if board.cmdline_extra else ""
    return f"root={root} ro console={board.console} panic=10 quiet{extra}"


def _check_artifact(artifact: Path, board: OsBoard) -> None:
    art = artifact_info(artifact)
    if art.runtime != "c" or art.preset not in board.presets:
        kind = "C backend" if art.runtime == "c" else "TVM runtime"
        raise ImageError(
            f"{artifact} is compiled for preset {art.preset} ({kind}); "
            f"board {board.name} runs C-backend artifacts of {', '.join(board.presets)} (no TVM on a board)",
            hint=f"fractal compile MODEL.onnx --target {board.presets[0]} --out DIR",
        )


def _kernel(board: OsBoard, debs: list[Path], stage: Path) -> tuple[Path, Path]:
    """(kernel image, modules directory) of the board's kernel package(s), unpacked under ``stage``
    (one linux-image package, or the linux-binary/-modules/-base packages of newer kernels, which
    keep vmlinuz in the modules directory)."""
    for deb in debs:
        rootfs.unpack(deb, stage)
    kernels = sorted((stage / "boot").glob("vmlinu[xz]-*")) + sorted(
        stage.glob("usr/lib/modules/*/vmlinu[xz]")
    )
    mods = sorted((stage / "usr/lib/modules").iterdir())
    if len(kernels) != 1 or len(mods) != 1:
        raise ImageError(
            f"{debs[0].name}: expected one kernel and one module tree, found "
            f"{[k.name for k in kernels]} and {[m.name for m in mods]}"
        )
    return kernels[0], mods[0]


def build_os(
    artifact: str | Path,
    *,
    board: str,
    key: str | Path,
    version: str,
    out: str | Path,
    rollback_index: int = 0,
    compress: disk.Compression | None = None,
    log: Callable[[str], None] = print,
) -> OsImage:
    """Write ``out`` (raw disk image), ``out.bmap`` and ``out.sha256``; with ``compress``,
    ``out.xz``/``out.zst`` (and its own ``.sha256``) in place of the raw ``out``."""
    t0 = time.perf_counter()
    b = get_os_board(board)
    artifact, out = Path(artifact), Path(out)
    _check_artifact(artifact, b)
    priv = keymod.load_private(key)  # fail early on a bad key
    stage = out.parent / f".{out.name}.build"
    shutil.rmtree(stage, ignore_errors=True)
    stage.mkdir(parents=True)
    try:
        debs = rootfs.fetch_debs(b)
        log(
            f"build-os: {len(debs)} Debian {b.suite} {b.debarch} packages verified "
            f"({time.perf_counter() - t0:.1f} s)"
        )
        root = stage / "root"
        rootfs.make_rootfs(b, debs, root)
        log(
            f"build-os: root filesystem assembled ({disk.tree_bytes(root) // disk.MiB} MiB, "
            f"{time.perf_counter() - t0:.1f} s)"
        )
        kdir = stage / "kernel"
        kimg, moddir = _kernel(b, [debs[k] for k in (b.kernel_package, *b.kernel_extra)], kdir)
        if b.rootfs_modules:
            mods = initramfs.install_modules(root, moddir, b.rootfs_modules)
            log(f"build-os: {len(mods)} kernel modules for the root fs ({', '.join(b.rootfs_modules)})")
        boot = stage / "boot"
        (boot / "fractal").mkdir(parents=True)
        # the Pi finds its root by PARTUUID (the MBR's disk id): one per build, like mke2fs's UUIDs
        mbr_id = secrets.randbits(32) | 1 if b.table is PartitionTable.MBR else None
        cmdline = kernel_cmdline(b, mbr_id)
        initrd = initramfs.build_initramfs(root / "usr/bin/busybox", moddir, rootfs.APPLETS, b.modules)
        boot_fields = bootfiles.populate(
            b, bootfiles.BootInput(kimg, moddir.name, initrd, cmdline, debs, stage / "bootpkgs", kdir), boot
        )
        info = {
            "format": 1,
            "board": b.name,
            "arch": b.arch,
            **boot_fields,
            "kernel_version": moddir.name,
            "version": version,
        }
        (boot / BOOT_INFO).write_text(json.dumps(info, indent=2) + "\n")
        # the application: today's signed bundle, flashed into slot a of the data partition's device
        from firmware.device import flash
        from firmware.image import build_image

        art = artifact_info(artifact)
        bundle = build_image(
            artifact,
            board=art.preset,
            key=key,
            out=stage / "app.fimg",
            version=version,
            rollback_index=rollback_index,
        )
        data = stage / "data"
        (data / "home").mkdir(parents=True)
        pub = stage / "release.pub"
        pub.write_bytes(keymod.public_pem(priv.public_key()))
        flash(bundle, data / "device", [pub])
        log(f"build-os: application {art.name} {version} in slot a ({time.perf_counter() - t0:.1f} s)")
        root_mb = disk.tree_bytes(root) * 115 // 100 // disk.MiB + 64
        data_mb = max(_DATA_MIN_MB, 4 * bundle.stat().st_size // disk.MiB + 64)
        parts = [
            disk.PartSpec("boot", _BOOT_MB * disk.MiB, "fat", disk.BOOT_LABEL, boot),
            disk.PartSpec("root", root_mb * disk.MiB, "ext4", disk.ROOT_LABEL, root),
            disk.PartSpec("data", data_mb * disk.MiB, "ext4", disk.DATA_LABEL, data),
        ]
        tmp_out = out.with_name(f".{out.name}.part")
        disk.write_disk(tmp_out, parts, mbr_id=mbr_id)
        tmp_out.replace(out)
        bmap = disk.write_bmap(out)
        sha = disk.write_sha256(out)
        raw_size = out.stat().st_size
        written = out
        if compress is not None:
            written = disk.compress(out, compress)
            disk.write_sha256(written)
            out.unlink()
    finally:
        shutil.rmtree(stage, ignore_errors=True)
    secs = time.perf_counter() - t0
    stored = written.stat().st_blocks * 512 if compress is None else written.stat().st_size
    log(
        f"build-os: wrote {written} ({raw_size // disk.MiB} MiB raw, {stored // disk.MiB} MiB "
        f"{'compressed' if compress else 'allocated'}) in {secs:.1f} s"
    )
    return OsImage(written, bmap, sha, b.name, version, raw_size, secs, stored)
