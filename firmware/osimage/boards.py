"""The boards ``fractal image build-os`` makes disk images for, and how qemu-system boots them.

Debian trixie on every board: riscv64 is an official Debian architecture only from trixie on
(bookworm has no riscv64), and for arm64 bookworm's packages are too old for the node
(python3-pydantic 1.10, python3-paho-mqtt 1.6, python3-fastapi 0.92, where the node needs
pydantic 2, paho-mqtt 2 and fastapi >= 0.110; pydantic 2's core is compiled, so it cannot be
vendored as a pure-Python wheel). One suite gives one Python (3.13) and one package set on both
architectures, the same closure the riscv64 qemu-user sysroot (firmware/sysroot.sh) already runs.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from firmware.errors import ImageError

__all__ = ["OsBoard", "OS_BOARDS", "get_os_board"]

HERE = Path(__file__).resolve().parent


@dataclass(frozen=True)
class OsBoard:
    name: str
    arch: str  # compiler preset arch: aarch64 | riscv64
    debarch: str  # Debian architecture
    suite: str
    kernel_package: str  # the pinned linux-image package (its version is in the lock)
    presets: tuple[str, ...]  # artifact presets the board runs (C backend only: no TVM on a board)
    console: str  # the kernel's serial console under qemu
    qemu: str  # qemu-system binary
    qemu_machine: tuple[str, ...]  # -M/-cpu/-bios ... arguments
    description: str

    @property
    def lock(self) -> Path:
        return HERE / f"{self.suite}-{self.debarch}.lock"


OS_BOARDS: dict[str, OsBoard] = {
    b.name: b
    for b in (
        OsBoard(
            "aarch64-virt",
            "aarch64",
            "arm64",
            "trixie",
            "linux-image-6.12.117+deb13-cloud-arm64-unsigned",
            ("aarch64-c",),
            "ttyAMA0",
            "qemu-system-aarch64",
            ("-M", "virt", "-cpu", "cortex-a72"),
            "generic 64-bit ARM board (qemu's virt machine; real boards add their boot firmware)",
        ),
        OsBoard(
            "riscv64-virt",
            "riscv64",
            "riscv64",
            "trixie",
            "linux-image-6.12.117+deb13-riscv64",
            ("riscv64", "riscv64-rvv"),
            "ttyS0",
            "qemu-system-riscv64",
            # OpenSBI (qemu-system-misc's default -bios) then the kernel; a CPU with RVV so both
            # riscv64 presets' libraries run (rv64gcv is a superset of rv64gc).
            ("-M", "virt", "-cpu", "rv64,v=true,vlen=128,vext_spec=v1.0", "-bios", "default"),
            "generic 64-bit RISC-V board (qemu's virt machine with OpenSBI)",
        ),
    )
}


def get_os_board(name: str) -> OsBoard:
    """The board called ``name``; ImageError naming the known ones otherwise."""
    try:
        return OS_BOARDS[name]
    except KeyError:
        raise ImageError(
            f"unknown board {name!r} for a disk image", hint=f"choose one of: {', '.join(OS_BOARDS)}"
        ) from None
