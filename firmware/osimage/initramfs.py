"""The initramfs: busybox, the kernel modules that reach the root filesystem, and an init script.

Debian's kernels build the virtio, ext4 and FAT drivers as modules, so something must load them
before root can be mounted. Debian's own initramfs-tools cannot run here (its hooks run target
binaries), so the initramfs is written by this module: a ``newc`` cpio archive (the kernel's
format, written in Python so it can hold a ``/dev/console`` node without root), holding the
board's static busybox, the needed modules decompressed (busybox ``insmod`` reads plain ``.ko``),
and ``files/initramfs-init.sh`` as ``/init``. The packages ship no ``modules.dep`` (``depmod``
runs in their maintainer scripts), so dependencies come from each module's ``.modinfo``.
"""

from __future__ import annotations

import gzip
import io
import lzma
import re
import stat
from pathlib import Path

from firmware.errors import ImageError

__all__ = ["build_initramfs", "module_order", "install_modules", "CpioWriter", "WANTED_MODULES"]

HERE = Path(__file__).resolve().parent
# virtio (mmio transport: qemu's virt machines; PCI is built in), disk, network, root and data
# (ext4 + crc32c, its checksum), the FAT boot partition that holds the settings.
WANTED_MODULES = (
    "virtio_mmio",
    "virtio_blk",
    "virtio_net",
    "ext4",
    "crc32c_generic",
    "vfat",
    "nls_cp437",
    "nls_ascii",
    "nls_iso8859-1",
)
# Wanted only where the kernel has it: ext4 reached crc32c through the crypto API up to 6.14
# (crc32c_generic provides it); later kernels (the Pi 5's 7.x) call the CRC library directly.
OPTIONAL_MODULES = frozenset({"crc32c_generic"})
_DEPENDS = re.compile(rb"(?:^|\x00)depends=([^\x00]*)\x00")


class CpioWriter:
    """A ``newc`` cpio archive (what the kernel unpacks as an initramfs)."""

    def __init__(self) -> None:
        self.buf = io.BytesIO()
        self.ino = 1

    def _entry(self, name: str, mode: int, data: bytes = b"", rdev: tuple[int, int] = (0, 0)) -> None:
        nb = name.encode() + b"\x00"
        fields = [self.ino, mode, 0, 0, 1, 0, len(data), 0, 0, rdev[0], rdev[1], len(nb), 0]
        self.ino += 1
        self.buf.write(b"070701" + b"".join(b"%08X" % f for f in fields) + nb)
        self.buf.write(b"\x00" * (-self.buf.tell() % 4))
        self.buf.write(data)
        self.buf.write(b"\x00" * (-self.buf.tell() % 4))

    def dir(self, name: str) -> None:
        self._entry(name, stat.S_IFDIR | 0o755)

    def file(self, name: str, data: bytes, mode: int = 0o644) -> None:
        self._entry(name, stat.S_IFREG | mode, data)

    def symlink(self, name: str, target: str) -> None:
        self._entry(name, stat.S_IFLNK | 0o777, target.encode())

    def chardev(self, name: str, major: int, minor: int) -> None:
        self._entry(name, stat.S_IFCHR | 0o600, rdev=(major, minor))

    def finish(self) -> bytes:
        self._entry("TRAILER!!!", 0)
        return self.buf.getvalue()


def _modules(moddir: Path) -> dict[str, Path]:
    """{module name with '_' for '-': path} of every module in the kernel package."""
    return {p.name.split(".ko")[0].replace("-", "_"): p for p in moddir.rglob("*.ko*")}


def _ko_bytes(path: Path) -> bytes:
    data = path.read_bytes()
    if path.name.endswith(".xz"):
        return lzma.decompress(data)
    if path.name.endswith(".gz"):
        return gzip.decompress(data)
    return data


def module_order(moddir: Path, wanted: tuple[str, ...] = WANTED_MODULES) -> list[tuple[str, bytes]]:
    """The wanted modules that are not built in, with their dependencies, each after what it needs."""
    builtin = {
        Path(line).name.split(".ko")[0].replace("-", "_")
        for line in (moddir / "modules.builtin").read_text().split()
    }
    mods = _modules(moddir)
    order: list[tuple[str, bytes]] = []
    seen: set[str] = set()

    def visit(name: str, chain: tuple[str, ...]) -> None:
        name = name.replace("-", "_")
        if name in seen or name in builtin:
            return
        if name not in mods:
            raise ImageError(
                f"kernel module {name} (needed by {' <- '.join(chain) or 'the image'}) is neither "
                f"built into the kernel nor in {moddir}",
                hint="check the board's kernel package",
            )
        seen.add(name)
        data = _ko_bytes(mods[name])
        m = _DEPENDS.search(data)
        for dep in m.group(1).decode().split(",") if m and m.group(1) else []:
            visit(dep, (name, *chain))
        order.append((name, data))

    for w in wanted:
        if w in OPTIONAL_MODULES and w.replace("-", "_") not in mods:
            continue
        visit(w, ())
    return order


def build_initramfs(
    busybox: Path, moddir: Path, applets: tuple[str, ...], extra_modules: tuple[str, ...] = ()
) -> bytes:
    """The initramfs (gzip-compressed cpio) for a kernel whose modules are under ``moddir``;
    ``extra_modules`` are the board's own (its disk and network controllers)."""
    w = CpioWriter()
    for d in ("bin", "dev", "proc", "sys", "newroot", "lib", "lib/modules"):
        w.dir(d)
    w.chardev("dev/console", 5, 1)
    w.chardev("dev/null", 1, 3)
    w.file("bin/busybox", busybox.read_bytes(), 0o755)
    for a in applets:
        w.symlink(f"bin/{a}", "busybox")
    order = module_order(moddir, WANTED_MODULES + extra_modules)
    for name, data in order:
        w.file(f"lib/modules/{name}.ko", data)
    w.file("lib/modules/load-order", "".join(f"{n}\n" for n, _ in order).encode())
    w.file("init", (HERE / "files" / "initramfs-init.sh").read_bytes(), 0o755)
    return gzip.compress(w.finish(), compresslevel=6, mtime=0)


def _depends(data: bytes) -> list[str]:
    m = _DEPENDS.search(data)
    return [d.replace("-", "_") for d in m.group(1).decode().split(",")] if m and m.group(1) else []


def install_modules(root: Path, moddir: Path, wanted: tuple[str, ...]) -> list[str]:
    """Modules the root filesystem loads after the initramfs (the Pi's Wi-Fi: brcmfmac loads its
    firmware from the root fs, which is only there after switch_root): ``wanted`` and what they
    need, decompressed into ``/usr/lib/modules/VERSION/``, with a ``modules.dep`` in kmod's format
    (busybox modprobe and the kernel's request_module through it) and ``load-order`` for rcS.
    Modules the initramfs already loaded are loaded again harmlessly (insmod says "exists")."""
    if not wanted:
        return []
    order = module_order(moddir, wanted)
    dest = root / "usr/lib/modules" / moddir.name
    dest.mkdir(parents=True, exist_ok=True)
    names = {n for n, _ in order}
    closure: dict[str, list[str]] = {}
    dep_lines = []
    for name, data in order:  # each after what it needs: its deps' closures are known
        need: list[str] = []
        for d in _depends(data):
            for x in [*closure.get(d, []), d]:
                if x in names and x not in need:
                    need.append(x)
        closure[name] = need
        (dest / f"{name}.ko").write_bytes(data)
        # kmod's order: the dependency loaded first is listed last
        dep_lines.append(f"{name}.ko:" + "".join(f" {d}.ko" for d in reversed(need)))
    (dest / "modules.dep").write_text("\n".join(dep_lines) + "\n")
    (dest / "load-order").write_text("".join(f"{n}\n" for n, _ in order))
    return [n for n, _ in order]
