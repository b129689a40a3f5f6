"""The board's root filesystem, assembled on an x86_64 build machine from pinned Debian packages.

Why ``dpkg-deb -x`` and no maintainer scripts: the build machine has no binfmt_misc, so no
foreign binary can run in a chroot (mmdebstrap and debootstrap's second stage need that), and a
configure step on the board at first boot would need dpkg, perl and apt on every card. The
packages here need almost no configuration: what their scripts would do is done below (the
``/bin``, ``/sbin``, ``/lib`` links of merged-/usr, the BLAS/LAPACK alternatives, the
``python3`` link, busybox's applet links, a few files in ``/etc``).

Why busybox init and not systemd: the image runs one service (the boot supervisor, which runs
the node); busybox (one static binary, ~2 MB) gives init with respawn, a shell for the boot
scripts, DHCP (udhcpc), NTP (ntpd), ``mount``/``findfs``/``ip``. systemd would add udev, dbus
and a journal, and its units need the maintainer scripts' configuration. The whole system
start is ``files/rcS.sh``, readable in a minute.

Python bytecode: Debian packages ship sources only (``py3compile`` runs in their postinst) and
the root filesystem is mounted read-only, so without a build-time compile every boot would
compile the node's imports again (minutes under emulation). Bytecode does not depend on the
architecture, only on the Python version: the build runs Debian trixie's amd64 python3.13
(pinned, same version as the boards') natively, ``compileall`` over the staging tree, with the
paths the board sees. (The boards' own Python under qemu-user took 5 minutes for the node's
imports alone, on this 2-core machine.)
"""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

from firmware import debs
from firmware.errors import ImageError
from firmware.osimage.boards import OsBoard

__all__ = [
    "PACKAGES",
    "fetch_debs",
    "unpack",
    "make_rootfs",
    "REPO",
    "APPLETS",
    "NODE_PACKAGES",
    "compile_bytecode",
    "build_python",
]

REPO = Path(__file__).resolve().parents[2]
HERE = Path(__file__).resolve().parent

# Python 3.13 + numpy and what they link, then the node's Python dependencies as Debian packages
# (the closure of `apt-cache depends --recurse`, as in firmware/sysroot.sh's riscv64 list;
# zlib-ng and amqtt are optional imports and not packaged), then busybox.
PACKAGES = (
    "python3.13-minimal",
    "libpython3.13-minimal",
    "libpython3.13-stdlib",
    "python3-numpy",
    "libc6",
    "libgcc-s1",
    "libstdc++6",
    "libgfortran5",
    "libblas3",
    "liblapack3",
    "zlib1g",
    "libffi8",
    "libexpat1",
    "libssl3t64",
    "libbz2-1.0",
    "liblzma5",
    "libzstd1",
    "libsqlite3-0",
    "libuuid1",
    "libncursesw6",
    "libtinfo6",
    "libreadline8t64",
    "libdb5.3t64",
    "libmpdec4",
    "media-types",
    "tzdata",
    "libuv1t64",
    "python3-annotated-types",
    "python3-anyio",
    "python3-bcrypt",
    "python3-certifi",
    "python3-cffi-backend",
    "python3-click",
    "python3-cryptography",
    "python3-decorator",
    "python3-dnspython",
    "python3-dotenv",
    "python3-email-validator",
    "python3-exceptiongroup",
    "python3-fastapi",
    "python3-h11",
    "python3-httpcore",
    "python3-httpx",
    "python3-idna",
    "python3-linkify-it",
    "python3-markdown-it",
    "python3-mdurl",
    "python3-paho-mqtt",
    "python3-platformdirs",
    "python3-prometheus-client",
    "python3-pydantic",
    "python3-pydantic-core",
    "python3-pydantic-settings",
    "python3-pygments",
    "python3-rich",
    "python3-shellingham",
    "python3-sniffio",
    "python3-starlette",
    "python3-typer",
    "python3-typing-extensions",
    "python3-uc-micro",
    "python3-uvicorn",
    "python3-uvloop",
    "python3-wsproto",
    "python3-multipart",
    "busybox-static",
    # the data partition grows to fill the card at first boot (files/growdata.sh): sfdisk moves
    # GPT's backup header and grows the partition, resize2fs grows its ext4 online
    "fdisk",
    "libfdisk1",
    "libmount1",
    "libsmartcols1",
    "libblkid1",
    "libselinux1",
    "libpcre2-8-0",
    "e2fsprogs",
    "libext2fs2t64",
    "libcom-err2",
    "libss2",
)
# The project's packages a node runs (no TVM: C-backend artifacts load through ctypes).
NODE_PACKAGES = ("fractal", "compiler", "federation", "edgenode", "firmware", "api")
# busybox applets linked into /usr/bin (the ones the boot scripts and an operator's shell use).
APPLETS = (
    "sh",
    "ash",
    "mount",
    "umount",
    "mkdir",
    "ln",
    "cat",
    "echo",
    "hostname",
    "ip",
    "udhcpc",
    "ntpd",
    "sleep",
    "date",
    "insmod",
    "modprobe",
    "lsmod",
    "switch_root",
    "findfs",
    "ls",
    "ps",
    "kill",
    "killall",
    "pidof",
    "reboot",
    "poweroff",
    "halt",
    "init",
    "sed",
    "grep",
    "tail",
    "head",
    "dmesg",
    "awk",
    "cut",
    "tr",
    "rm",
    "mv",
    "cp",
    "chmod",
    "sync",
    "blkid",
    "wc",
    "uname",
    "df",
    "du",
    "free",
    "top",
    "vi",
    "less",
    "ping",
    "wget",
    "nslookup",
    "test",
    "[",
    "true",
    "false",
    "env",
    "touch",
    "dd",  # with od and basename/readlink: the initramfs finds root=PARTUUID= (the Pi's cmdline)
    "od",
    "basename",
    "dirname",
    "readlink",
    "printf",
)
_DROP = (
    "usr/share/doc",
    "usr/share/man",
    "usr/share/info",
    "usr/share/locale",
    "usr/share/lintian",
    "usr/share/bug",
)
MIRROR = "http://deb.debian.org/debian"


def cache_dir() -> Path:
    """Where downloaded packages are kept between builds (verified by sha256 on every use)."""
    return Path(os.environ.get("FRACTAL_OSIMAGE_CACHE", REPO / ".cache" / "osimage"))


def fetch_debs(board: OsBoard) -> dict[str, Path]:
    """{package: verified .deb} for the board's lock (downloads only what the cache lacks)."""
    pins = debs.read_lock(board.lock)
    have = {p.package for p in pins}
    want = {*PACKAGES, *board.extra_packages, board.kernel_package, *board.kernel_extra, *board.boot_packages}
    if have != want:
        raise ImageError(
            f"{board.lock.name} is stale: missing {sorted(want - have)}, extra {sorted(have - want)}",
            hint="regenerate it with `python3 firmware/debs.py lock` (see firmware/osimage/README)",
        )
    try:
        files = debs.fetch(pins, MIRROR, cache_dir() / "debs" / f"{board.suite}-{board.debarch}")
    except debs.DebsError as exc:
        raise ImageError(
            f"Debian packages for {board.name}: {exc}",
            hint="check the network, or regenerate the lock if Debian removed a pinned version",
        ) from None
    return {p.package: f for p, f in zip(pins, files, strict=True)}


def unpack(deb: Path, dest: Path) -> None:
    r = subprocess.run(["dpkg-deb", "-x", str(deb), str(dest)], capture_output=True, text=True, check=False)
    if r.returncode != 0:
        raise ImageError(f"dpkg-deb -x {deb.name} failed: {r.stderr.strip()[:200]}")


def _link(path: Path, target: str) -> None:
    if path.is_symlink() or path.exists():
        path.unlink()
    path.symlink_to(target)


def _merge_usr(root: Path) -> None:
    """/bin, /sbin, /lib as links into /usr (base-files, not unpacked, owns them in trixie)."""
    for d in ("bin", "sbin", "lib"):
        top = root / d
        if top.is_dir() and not top.is_symlink():  # a package that still ships files there
            (root / "usr" / d).mkdir(parents=True, exist_ok=True)
            for p in top.iterdir():
                os.replace(p, root / "usr" / d / p.name)
            top.rmdir()
        (root / "usr" / d).mkdir(parents=True, exist_ok=True)
        _link(top, f"usr/{d}")


def _etc(root: Path, board: OsBoard) -> None:
    etc = root / "etc"
    (etc / "init.d").mkdir(parents=True, exist_ok=True)
    (etc / "fractal").mkdir(exist_ok=True)
    (etc / "passwd").write_text("root:x:0:0:root:/data/home:/bin/sh\n")
    (etc / "group").write_text("root:x:0:\n")
    (etc / "shadow").write_text("root:*:19000:0:99999:7:::\n")  # no password login
    os.chmod(etc / "shadow", 0o600)
    (etc / "hosts").write_text("127.0.0.1 localhost\n::1 localhost\n")
    (etc / "fstab").write_text("# mounted by /etc/init.d/rcS\n")
    (etc / "os-release").write_text(
        f'PRETTY_NAME="fractal-edge board image (Debian {board.suite} {board.debarch})"\n'
        f"ID=fractal-edge\nID_LIKE=debian\nVARIANT_ID={board.name}\n"
    )
    _link(etc / "resolv.conf", "/run/resolv.conf")
    _link(etc / "hostname", "/run/hostname")
    _link(etc / "mtab", "/proc/self/mounts")  # resize2fs reads it to learn /data is mounted
    files = HERE / "files"
    shutil.copyfile(files / "inittab.txt", etc / "inittab")
    for src, dst in (
        ("rcS.sh", "init.d/rcS"),
        ("udhcpc.sh", "fractal/udhcpc.sh"),
        ("service.sh", "fractal/service.sh"),
        ("shutdown.sh", "fractal/shutdown.sh"),
        ("growdata.sh", "fractal/growdata.sh"),
        ("wifi.sh", "fractal/wifi.sh"),
        ("env.sh", "fractal/env"),
    ):
        shutil.copyfile(files / src, etc / dst)
        os.chmod(etc / dst, 0o755)


def _project(root: Path) -> None:
    """The node's code under /opt/fractal: Python sources and package data, no native build output."""
    dest = root / "opt" / "fractal"
    for pkg in NODE_PACKAGES:
        shutil.copytree(
            REPO / pkg,
            dest / pkg,
            ignore=shutil.ignore_patterns("__pycache__", "*.pyc", "*.so", "*.o", "tuned", "*.lock"),
        )


BUILD_PYTHON_LOCK = HERE / "trixie-amd64-buildpython.lock"


def build_python() -> tuple[list[str], Path]:
    """argv running the boards' Python version natively on this x86_64 machine: Debian trixie's
    amd64 python3.13 with its own glibc (through its dynamic loader, so the host's older glibc
    does not matter), unpacked once into the cache. Bytecode is the same on every architecture."""
    pins = debs.read_lock(BUILD_PYTHON_LOCK)
    dest = cache_dir() / "build-python"
    stamp = dest / ".done"
    want = "\n".join(p.sha256 for p in pins)
    if not (stamp.is_file() and stamp.read_text() == want):
        shutil.rmtree(dest, ignore_errors=True)
        dest.mkdir(parents=True)
        try:
            files = debs.fetch(pins, MIRROR, cache_dir() / "debs" / "trixie-amd64")
        except debs.DebsError as exc:
            raise ImageError(f"the build Python (Debian trixie amd64): {exc}") from None
        for f in files:
            unpack(f, dest)
        stamp.write_text(want)
    argv = [
        str(dest / "usr/lib64/ld-linux-x86-64.so.2"),
        "--library-path",
        str(dest / "usr/lib/x86_64-linux-gnu"),
        str(dest / "usr/bin/python3.13"),
    ]
    return argv, dest


def compile_bytecode(root: Path) -> None:
    """``compileall`` of the board's Python trees, paths recorded as the board sees them; the
    board's Python (same version: both pinned to trixie) then never compiles at boot."""
    argv, _ = build_python()
    dirs = [str(root / d) for d in ("usr/lib/python3.13", "usr/lib/python3/dist-packages", "opt/fractal")]
    r = subprocess.run(
        [
            *argv,
            "-m",
            "compileall",
            "-q",
            "-s",
            str(root),
            "-p",
            "/",
            "-x",
            r"/(test|tests|idlelib|tkinter|turtledemo|lib2to3)/",
            *dirs,
        ],
        capture_output=True,
        text=True,
        check=False,
        env={"PATH": "/usr/bin:/bin", "LANG": "C.UTF-8"},
    )
    if r.returncode != 0:
        raise ImageError(f"compiling the board's bytecode failed: {(r.stderr or r.stdout).strip()[-300:]}")


def make_rootfs(board: OsBoard, debs_by_name: dict[str, Path], root: Path) -> None:
    """Assemble the root filesystem tree in ``root`` (an empty directory)."""
    for d in ("bin", "sbin", "lib"):  # merged-/usr before unpacking, so nothing lands beside it
        (root / "usr" / d).mkdir(parents=True, exist_ok=True)
        _link(root / d, f"usr/{d}")
    for name in (*PACKAGES, *board.extra_packages):
        unpack(debs_by_name[name], root)
    _merge_usr(root)
    if (root / "usr/lib64").is_dir():  # amd64's ELF interpreter is /lib64/ld-linux-x86-64.so.2
        _link(root / "lib64", "usr/lib64")
    for d in _DROP:
        shutil.rmtree(root / d, ignore_errors=True)
    ml = root / "usr" / "lib" / f"{board.arch}-linux-gnu"
    # what update-alternatives would have linked
    _link(ml / "libblas.so.3", "blas/libblas.so.3")
    _link(ml / "liblapack.so.3", "lapack/liblapack.so.3")
    _link(root / "usr/bin/python3", "python3.13")
    for a in APPLETS:
        p = root / "usr" / "bin" / a
        if not p.exists() and not p.is_symlink():
            p.symlink_to("busybox")
    _link(root / "usr/sbin/init", "../bin/busybox")
    # the kernel runs /sbin/modprobe for request_module() (brcmfmac asks for its vendor module)
    _link(root / "usr/sbin/modprobe", "../bin/busybox")
    fw = root / "usr/lib/firmware"
    if (fw / "regulatory.db-debian").is_file():  # wireless-regdb: what update-alternatives links
        _link(fw / "regulatory.db", "regulatory.db-debian")
        _link(fw / "regulatory.db.p7s", "regulatory.db.p7s-debian")
    for d in ("proc", "sys", "dev", "run", "tmp", "data", "boot", "mnt", "var"):
        (root / d).mkdir(exist_ok=True)
    _link(root / "var" / "tmp", "/tmp")
    _etc(root, board)
    _project(root)
    compile_bytecode(root)
