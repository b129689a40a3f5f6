"""What goes on a board's FAT boot partition, one function per way its firmware boots it.

* :func:`direct`: ``vmlinuz``/``vmlinux``, ``initrd.img``, ``cmdline.txt`` (qemu ``-kernel``).
* :func:`uefi`: ``EFI/BOOT/BOOTX64.EFI``, a Unified Kernel Image (:mod:`firmware.osimage.uki`).
* :func:`rpi`: the Pi firmware (``start4.elf``, ``fixup4.dat``, ...), ``vmlinuz``, ``initrd.img``,
  the board's device tree, ``config.txt`` (what the firmware loads) and ``cmdline.txt``.

Each returns the fields of ``fractal/image.json`` that say what it wrote.
"""

from __future__ import annotations

import shutil
from dataclasses import dataclass
from pathlib import Path

from firmware.errors import ImageError
from firmware.osimage import rootfs, uki
from firmware.osimage.boards import BootKind, OsBoard

__all__ = ["BootInput", "populate", "config_txt", "RPI_FIRMWARE_DIR", "UEFI_PATH"]

RPI_FIRMWARE_DIR = "usr/lib/raspi-firmware"  # in Debian's raspi-firmware package
UEFI_PATH = {"x86_64": "EFI/BOOT/BOOTX64.EFI", "aarch64": "EFI/BOOT/BOOTAA64.EFI"}
_STUB = {"x86_64": "linuxx64.efi.stub", "aarch64": "linuxaa64.efi.stub"}


@dataclass(frozen=True)
class BootInput:
    """The parts every boot partition is made of (unpacked kernel package, built initramfs)."""

    kernel: Path  # boot/vmlinuz-* of the unpacked kernel package
    kernel_version: str
    initrd: bytes
    cmdline: str
    debs: dict[str, Path]
    stage: Path  # scratch directory for unpacking boot packages
    kernel_root: Path  # where the kernel package(s) were unpacked


def direct(board: OsBoard, src: BootInput, boot: Path) -> dict[str, object]:
    name = src.kernel.name.split("-")[0]
    shutil.copyfile(src.kernel, boot / name)
    (boot / "initrd.img").write_bytes(src.initrd)
    (boot / "cmdline.txt").write_text(src.cmdline + "\n")
    return {"kernel": name, "initrd": "initrd.img", "cmdline": src.cmdline}


def uefi(board: OsBoard, src: BootInput, boot: Path) -> dict[str, object]:
    pkg = src.stage / "systemd-boot-efi"
    rootfs.unpack(src.debs["systemd-boot-efi"], pkg)
    stub = pkg / "usr/lib/systemd/boot/efi" / _STUB[board.arch]
    if not stub.is_file():
        raise ImageError(f"systemd-boot-efi has no {stub.name}", hint="check the board's lock file")
    initrd = src.stage / "initrd.img"
    initrd.write_bytes(src.initrd)
    target = boot / UEFI_PATH[board.arch]
    target.parent.mkdir(parents=True)
    os_release = (
        f'ID=fractal-edge\nPRETTY_NAME="fractal-edge {board.name}"\nVERSION_ID="{src.kernel_version}"\n'
    )
    uki.build_uki(stub, src.kernel, initrd, src.cmdline, os_release, target)
    # no cmdline.txt: the command line is inside the image, editing a file would not change it
    return {"kernel": UEFI_PATH[board.arch], "initrd": None, "cmdline": src.cmdline}


_UART_COMMENT = {
    "rpi4": "# the serial console on the GPIO header (pins 8/10)",
    "rpi5": "# the kernel's console is the debug UART connector; this enables the GPIO header's UART too",
}


def config_txt(board: OsBoard, kernel: str, initrd: str) -> str:
    """The Pi firmware's config.txt: 64-bit kernel, initramfs after it, the board's device tree."""
    dtb = Path(board.dtbs[0]).name
    return (
        f"# {board.description}: read by the Pi's boot firmware (fractal image build-os)\n"
        "arm_64bit=1\n"
        f"kernel={kernel}\n"
        f"initramfs {initrd} followkernel\n"
        f"device_tree={dtb}\n"
        "# Debian's kernel is the upstream one: its device trees, not the firmware's overlays\n"
        "upstream_kernel=1\n"
        f"{_UART_COMMENT.get(board.name, _UART_COMMENT['rpi4'])}\n"
        "enable_uart=1\n"
        "disable_overscan=1\n"
    )


def rpi(board: OsBoard, src: BootInput, boot: Path) -> dict[str, object]:
    fw = src.stage / "raspi-firmware"
    rootfs.unpack(src.debs["raspi-firmware"], fw)
    files = sorted(
        p
        for p in (fw / RPI_FIRMWARE_DIR).iterdir()
        if p.is_file() and (p.suffix in (".elf", ".dat") or p.name == "bootcode.bin")
    )
    if not any(p.name == "start4.elf" for p in files):
        raise ImageError("raspi-firmware has no start4.elf", hint="check the board's lock file")
    for p in files:
        shutil.copyfile(p, boot / p.name)
    # /usr/lib/linux-image-VERSION: the device trees (a link into the modules directory in the
    # split kernel packages of 6.16 and later)
    dtbdir = src.kernel_root / "usr/lib" / f"linux-image-{src.kernel_version}"
    for dtb in board.dtbs:
        if not (dtbdir / dtb).is_file():
            raise ImageError(
                f"the kernel package has no device tree {dtb}", hint="check the board's kernel package"
            )
        shutil.copyfile(dtbdir / dtb, boot / Path(dtb).name)
    shutil.copyfile(src.kernel, boot / "vmlinuz")
    (boot / "initrd.img").write_bytes(src.initrd)
    (boot / "config.txt").write_text(config_txt(board, "vmlinuz", "initrd.img"))
    (boot / "cmdline.txt").write_text(src.cmdline + "\n")  # the firmware passes it to the kernel
    return {"kernel": "vmlinuz", "initrd": "initrd.img", "cmdline": src.cmdline}


_BY_KIND = {BootKind.QEMU_DIRECT: direct, BootKind.UEFI: uefi, BootKind.RPI: rpi}


def populate(board: OsBoard, src: BootInput, boot: Path) -> dict[str, object]:
    """Fill the boot partition's directory ``boot`` for ``board``; the image.json fields."""
    src.stage.mkdir(parents=True, exist_ok=True)
    return _BY_KIND[board.boot](board, src, boot)
