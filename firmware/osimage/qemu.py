"""``fractal image try IMG``: boot a board image under qemu-system, as a user does before flashing.

The x86_64 board boots as on a PC: qemu's q35 machine with OVMF (UEFI firmware, Debian's
``ovmf``) starts ``EFI/BOOT/BOOTX64.EFI`` from the disk, under KVM when it is usable
(hardware-assisted: ``kvm_intel``/``kvm_amd`` loaded and ``/dev/kvm`` read-writable; a
paravirtual ``/dev/kvm`` such as kvm-pvm, which runs only guests built for it, does not count),
under TCG emulation otherwise. The Raspberry Pi boards cannot be booted (qemu 7.2 has no Pi 4).

The virt boards are booted directly by qemu (``-kernel``/``-initrd`` read from the image's boot
partition with mtools, the command line from ``cmdline.txt`` there): qemu's ``virt`` machines
need no boot loader on the disk (riscv64 still runs OpenSBI, qemu's default ``-bios``). The
disk is the image file itself, so what the board writes (the slot marked good, samples) stays
in it, as on a card. User-mode networking: the board gets 10.0.2.15 by DHCP, reaches the host
as 10.0.2.2, and its node port is forwarded to ``127.0.0.1:PORT``. A reboot from the board
restarts the machine (qemu resets); a power-off ends ``try``; SIGINT/SIGTERM stop the machine.
"""

from __future__ import annotations

import json
import os
import platform
import shutil
import signal
import subprocess
import tempfile
import time
import urllib.error
import urllib.request
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from types import FrameType

from firmware.errors import ImageError
from firmware.osimage import disk
from firmware.osimage.boards import BootKind, OsBoard, get_os_board
from firmware.osimage.build import BOOT_INFO

__all__ = ["qemu_argv", "try_image", "boot_files", "kvm_usable", "NODE_PORT"]

NODE_PORT = 8080  # the node's port inside the board (files/env.sh)


@dataclass(frozen=True)
class BootFiles:
    board: OsBoard
    kernel: Path | None  # None: the firmware boots from the disk (UEFI)
    initrd: Path | None
    cmdline: str


def boot_files(img: Path, dest: Path) -> BootFiles:
    """Kernel, initrd and command line copied out of the image's boot partition into ``dest``
    (for a UEFI board only its record: its firmware reads the disk itself)."""
    if not img.is_file():
        raise ImageError(f"{img}: no such image file", hint="build one with `fractal image build-os`")
    parts = disk.read_gpt(img)
    if "boot" not in parts:
        raise ImageError(
            f"{img} has no partition named boot", hint="pass an image made by `fractal image build-os`"
        )
    info = json.loads(disk.fat_read(img, parts["boot"], BOOT_INFO, dest / "image.json").read_text())
    board = get_os_board(str(info["board"]))
    if not board.can_try:
        raise ImageError(
            f"qemu cannot boot a {board.name} image ({board.description}): it has no such machine",
            hint=f"write it to a card: bmaptool copy {img.name} /dev/sdX",
        )
    if board.boot is BootKind.UEFI:
        return BootFiles(board, None, None, str(info["cmdline"]))
    kernel = disk.fat_read(img, parts["boot"], str(info["kernel"]), dest / "kernel")
    initrd = disk.fat_read(img, parts["boot"], str(info["initrd"]), dest / "initrd.img")
    cmdline = disk.fat_read(img, parts["boot"], "cmdline.txt", dest / "cmdline.txt").read_text().strip()
    return BootFiles(board, kernel, initrd, cmdline)


def kvm_usable(board: OsBoard) -> bool:
    """Whether qemu can run ``board`` under hardware-assisted KVM on this machine."""
    if board.arch != platform.machine() or not os.access("/dev/kvm", os.R_OK | os.W_OK):
        return False
    return any(Path("/sys/module", m).exists() for m in ("kvm_intel", "kvm_amd"))


_QEMU_PKG = {"aarch64": "qemu-system-arm", "riscv64": "qemu-system-misc", "x86_64": "qemu-system-x86"}


def qemu_argv(img: Path, files: BootFiles, port: int, *, cpus: int = 2, memory_mb: int = 1024) -> list[str]:
    b = files.board
    exe = shutil.which(b.qemu)
    if exe is None:
        raise ImageError(f"{b.qemu} is not installed", hint=f"apt-get install {_QEMU_PKG[b.arch]}")
    net = f"user,id=net0,hostfwd=tcp:127.0.0.1:{port}-:{NODE_PORT}"
    drive = f"file={img},format=raw,if=none,id=disk0,cache=writeback"
    common = ["-smp", str(cpus), "-m", str(memory_mb), "-nographic", "-monitor", "none", "-serial", "stdio"]
    if files.kernel is None:  # UEFI: the firmware boots EFI/BOOT/BOOT*.EFI from the disk
        firmware = next((a for a in b.qemu_machine if a.endswith(".fd")), "")
        if firmware and not Path(firmware).is_file():
            raise ImageError(f"UEFI firmware {firmware} is missing", hint="apt-get install ovmf")
        accel = ["-accel", "kvm", "-cpu", "host"] if kvm_usable(b) else ["-accel", "tcg", "-cpu", "max"]
        return [
            exe,
            *b.qemu_machine,
            *accel,
            *common,
            "-drive",
            drive,
            "-device",
            "virtio-blk-pci,drive=disk0,bootindex=0",
            "-netdev",
            net,
            # romfile= : no iPXE option ROM, so the firmware does not try a network boot first
            "-device",
            "virtio-net-pci,netdev=net0,romfile=",
        ]
    return [
        exe,
        *b.qemu_machine,
        *common,
        "-kernel",
        str(files.kernel),
        "-initrd",
        str(files.initrd),
        "-append",
        files.cmdline,
        "-drive",
        drive,
        "-device",
        "virtio-blk-device,drive=disk0",
        "-netdev",
        net,
        "-device",
        "virtio-net-device,netdev=net0",
    ]


def _ready(url: str) -> bool:
    try:
        with urllib.request.urlopen(f"{url}/v2/health/ready", timeout=5) as r:
            return int(r.status) == 200
    except (OSError, urllib.error.HTTPError):
        return False


def try_image(
    img: str | Path,
    *,
    port: int,
    ready_timeout_s: float = 1200.0,
    on_ready: Callable[[str], None] = print,
    console: int | None = None,
    log: Callable[[str], None] | None = None,
) -> int:
    """Boot ``img`` and block until the machine stops; ``on_ready(url)`` once the node answers
    ready. Returns qemu's exit code (0 after a power-off or a stop by signal)."""
    img = Path(img).resolve()
    stopping: list[int] = []
    with tempfile.TemporaryDirectory(prefix="fractal-try-") as tmp:
        files = boot_files(img, Path(tmp))
        argv = qemu_argv(img, files, port)
        if log is not None:
            how = "KVM" if "kvm" in argv else "TCG emulation"
            log(f"try: booting {img.name} ({files.board.name}) under {how} with {Path(argv[0]).name}")
        proc = subprocess.Popen(
            argv, stdin=subprocess.DEVNULL, stdout=console, stderr=console, start_new_session=True
        )

        def stop(signum: int, _frame: FrameType | None) -> None:
            stopping.append(signum)
            if proc.poll() is None:
                proc.terminate()  # qemu quits on SIGTERM

        old = {s: signal.signal(s, stop) for s in (signal.SIGINT, signal.SIGTERM)}
        try:
            url = f"http://127.0.0.1:{port}"
            deadline = time.monotonic() + ready_timeout_s
            while proc.poll() is None and not stopping:
                if _ready(url):
                    on_ready(url)
                    break
                if time.monotonic() > deadline:
                    proc.terminate()
                    proc.wait(30)
                    raise ImageError(
                        f"the board's node was not ready within {ready_timeout_s:.0f} s",
                        hint="read the board's console output above",
                    )
                time.sleep(1.0)  # polling the forwarded port: qemu gives no event for it
            code = proc.wait()
        finally:
            for s, h in old.items():
                signal.signal(s, h)
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
    if stopping:
        return 0
    return code
