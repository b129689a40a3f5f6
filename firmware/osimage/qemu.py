"""``fractal image try IMG``: boot a board image under qemu-system, as a user does before flashing.

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
from firmware.osimage.boards import OsBoard, get_os_board
from firmware.osimage.build import BOOT_INFO

__all__ = ["qemu_argv", "try_image", "boot_files", "NODE_PORT"]

NODE_PORT = 8080  # the node's port inside the board (files/env.sh)


@dataclass(frozen=True)
class BootFiles:
    board: OsBoard
    kernel: Path
    initrd: Path
    cmdline: str


def boot_files(img: Path, dest: Path) -> BootFiles:
    """Kernel, initrd and command line copied out of the image's boot partition into ``dest``."""
    if not img.is_file():
        raise ImageError(f"{img}: no such image file", hint="build one with `fractal image build-os`")
    parts = disk.read_gpt(img)
    if "boot" not in parts:
        raise ImageError(
            f"{img} has no partition named boot", hint="pass an image made by `fractal image build-os`"
        )
    info = json.loads(disk.fat_read(img, parts["boot"], BOOT_INFO, dest / "image.json").read_text())
    board = get_os_board(str(info["board"]))
    kernel = disk.fat_read(img, parts["boot"], str(info["kernel"]), dest / "kernel")
    initrd = disk.fat_read(img, parts["boot"], str(info["initrd"]), dest / "initrd.img")
    cmdline = disk.fat_read(img, parts["boot"], "cmdline.txt", dest / "cmdline.txt").read_text().strip()
    return BootFiles(board, kernel, initrd, cmdline)


def qemu_argv(img: Path, files: BootFiles, port: int, *, cpus: int = 2, memory_mb: int = 1024) -> list[str]:
    exe = shutil.which(files.board.qemu)
    if exe is None:
        pkg = "qemu-system-arm" if files.board.arch == "aarch64" else "qemu-system-misc"
        raise ImageError(f"{files.board.qemu} is not installed", hint=f"apt-get install {pkg}")
    return [
        exe,
        *files.board.qemu_machine,
        "-smp",
        str(cpus),
        "-m",
        str(memory_mb),
        "-nographic",
        "-monitor",
        "none",
        "-serial",
        "stdio",
        "-kernel",
        str(files.kernel),
        "-initrd",
        str(files.initrd),
        "-append",
        files.cmdline,
        "-drive",
        f"file={img},format=raw,if=none,id=disk0,cache=writeback",
        "-device",
        "virtio-blk-device,drive=disk0",
        "-netdev",
        f"user,id=net0,hostfwd=tcp:127.0.0.1:{port}-:{NODE_PORT}",
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
) -> int:
    """Boot ``img`` and block until the machine stops; ``on_ready(url)`` once the node answers
    ready. Returns qemu's exit code (0 after a power-off or a stop by signal)."""
    img = Path(img).resolve()
    stopping: list[int] = []
    with tempfile.TemporaryDirectory(prefix="fractal-try-") as tmp:
        files = boot_files(img, Path(tmp))
        argv = qemu_argv(img, files, port)
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
