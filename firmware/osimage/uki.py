"""A Unified Kernel Image: kernel, initramfs and command line in one EFI executable.

systemd's EFI stub (``linuxx64.efi.stub`` from Debian's pinned ``systemd-boot-efi``) is a PE
program that, started by the UEFI firmware, finds its ``.linux``, ``.initrd`` and ``.cmdline``
sections and boots that kernel with that initramfs and command line. Placed at the removable-media
path ``EFI/BOOT/BOOTX64.EFI`` of the ESP, any UEFI firmware boots it from the disk alone: no boot
loader, no NVRAM entry, nothing run at build time but the host's ``objcopy``, which appends the
sections after the stub's own at addresses aligned to its ``SectionAlignment`` (the recipe in
systemd's documentation for building a UKI without ``ukify``).
"""

from __future__ import annotations

import re
import shutil
import subprocess
import tempfile
from pathlib import Path

from firmware.errors import ImageError

__all__ = ["build_uki", "pe_sections"]


def _tool(name: str) -> str:
    exe = shutil.which(name)
    if exe is None:
        raise ImageError(
            f"{name} is not installed (assembling the EFI kernel image)", hint="apt-get install binutils"
        )
    return exe


def _out(argv: list[str]) -> str:
    r = subprocess.run(argv, capture_output=True, text=True, check=False)
    if r.returncode != 0:
        raise ImageError(f"{Path(argv[0]).name} failed: {(r.stderr or r.stdout).strip()[-300:]}")
    return r.stdout


def pe_sections(pe: Path) -> dict[str, tuple[int, int]]:
    """{section name: (VMA, size)} of a PE file, as objdump reads them."""
    out = {}
    for line in _out([_tool("objdump"), "-h", str(pe)]).splitlines():
        m = re.match(r"^\s*\d+\s+(\S+)\s+([0-9a-f]+)\s+([0-9a-f]+)\s+[0-9a-f]+\s+[0-9a-f]+\s+2\*\*\d+", line)
        if m:
            out[m.group(1)] = (int(m.group(3), 16), int(m.group(2), 16))
    return out


def build_uki(stub: Path, kernel: Path, initrd: Path, cmdline: str, os_release: str, out: Path) -> Path:
    """Write ``out``: ``stub`` with .osrel, .cmdline, .initrd and .linux sections appended."""
    head = _out([_tool("objdump"), "-p", str(stub)])
    m = re.search(r"^SectionAlignment\s+([0-9a-fA-F]+)", head, re.M)
    if m is None:
        raise ImageError(f"{stub.name} is not a PE executable (no SectionAlignment)")
    align = int(m.group(1), 16)
    sections = pe_sections(stub)
    if not sections:
        raise ImageError(f"{stub.name}: no sections found")
    end = max(vma + size for vma, size in sections.values())
    with tempfile.TemporaryDirectory(prefix="fractal-uki-") as tmp:
        osrel = Path(tmp) / "os-release"
        osrel.write_text(os_release)
        cmd = Path(tmp) / "cmdline"
        cmd.write_bytes(cmdline.encode() + b"\x00")
        argv = [_tool("objcopy")]
        # .linux last: the stub only needs to find it, and the kernel is the largest part
        for name, path in ((".osrel", osrel), (".cmdline", cmd), (".initrd", initrd), (".linux", kernel)):
            vma = -(-end // align) * align
            argv += [
                "--add-section",
                f"{name}={path}",
                "--change-section-vma",
                f"{name}=0x{vma:x}",
                "--set-section-flags",
                f"{name}=data,readonly",
            ]
            end = vma + path.stat().st_size
        _out([*argv, str(stub), str(out)])
    return out
