"""Board images beyond qemu's virt machines (firmware/osimage):

* ``x86_64``: a GPT disk whose ESP holds one Unified Kernel Image at ``EFI/BOOT/BOOTX64.EFI``;
  `fractal image try` boots it from the disk alone with OVMF (UEFI), KVM when usable, TCG
  otherwise, and its node answers an Open Inference Protocol request with onnxruntime's result.
* ``rpi4``: an MBR disk (qemu cannot boot a Pi 4): partition types, bootable flag, alignment,
  the Pi firmware and Debian's kernel/device tree on the FAT, ``config.txt`` naming files that
  are there and ``cmdline.txt`` the root partition's real PARTUUID; built ``--compress zstd``,
  ``bmaptool copy`` of the compressed file reproduces the raw image's sha256.
* ``rpi5``: the same layout with trixie-backports' kernel (7.3: the Pi 5's SD and RP1 drivers,
  loaded by the initramfs), its device tree and the debug UART console; ``bmaptool copy``.
* ``--compress xz|zstd`` on a small disk: what ``bmaptool copy`` writes is the raw image.
"""

from __future__ import annotations

import json
import os
import queue
import re
import signal
import subprocess
import urllib.request
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pytest

from compiler.manifest import file_sha256
from tests.edgenode.test_cli_node import free_port
from tests.firmware.conftest import CLI, REPO, assert_refused, cli
from tests.fixtures_osimage import image_try, stop_try

BOOT_TIMEOUT_S = 1500  # OVMF + kernel + the node's imports under TCG on a loaded 2-core machine


# The module's images: which fixture needs which (the artifact's C preset, board, build-os flags).
_IMAGES = {
    "x86_booted": ("x86_64-c", "x86_64", ()),
    "rpi4_image": ("aarch64-c", "rpi4", ("--compress", "zstd")),
    "rpi5_card": ("aarch64-c", "rpi5", ()),
}
BUILD_TIMEOUT_S = 1800  # the builds run side by side on a loaded 2-core machine


@pytest.fixture(scope="module")
def os_builds(
    request: pytest.FixtureRequest,
    tmp_path_factory: pytest.TempPathFactory,
    board_c_artifact: Callable[[str], Path],
    board_release_key: Path,
) -> Iterator[Callable[[str], Path]]:
    """``os_builds(fixture name) -> image``: the images of the fixtures in ``_IMAGES`` that the
    selected tests use, each by its own `fractal image build-os` process, all started together
    when the first is needed. A build is mostly one core at a time (unpacking packages, compiling
    bytecode, writing file systems), so the rpi images build while the x86_64 one builds and boots
    instead of after it."""
    wanted = sorted({
        f for item in request.session.items if getattr(item, "module", None) is request.module
        for f in getattr(item, "fixturenames", ()) if f in _IMAGES
    })  # fmt: skip
    from firmware.osimage.rootfs import build_python

    if wanted:
        build_python()  # unpacked once into the cache here: side-by-side builds would race to do it
    builds: dict[str, tuple[subprocess.Popen[bytes], Path]] = {}
    try:
        for name in wanted:
            preset, board, extra = _IMAGES[name]
            out = tmp_path_factory.mktemp(f"os-{board}") / f"{board}.img"
            with open(out.with_name("build.log"), "wb") as log:
                proc = subprocess.Popen(
                    [*CLI, "image", "build-os", str(board_c_artifact(preset)), "--board", board, "--key",
                     str(board_release_key), "--version", "1.0.0", "--out", str(out), *extra],
                    cwd=REPO, env={**os.environ, "PYTHONPATH": str(REPO)}, stdout=log,
                    stderr=subprocess.STDOUT,
                )  # fmt: skip
            builds[name] = (proc, out)

        def get(name: str) -> Path:
            proc, out = builds[name]
            code = proc.wait(BUILD_TIMEOUT_S)
            assert code == 0, out.with_name("build.log").read_text(errors="replace")[-3000:]
            return out

        yield get
    finally:
        for proc, _ in builds.values():
            if proc.poll() is None:
                proc.kill()
                proc.wait()


def _sfdisk(img: Path) -> dict:
    out = subprocess.run(["sfdisk", "-J", str(img)], capture_output=True, text=True, check=True).stdout
    return json.loads(out)["partitiontable"]


def _blkid(img: Path, offset: int) -> dict[str, str]:
    """What blkid finds in the file system at ``offset`` (probing the bytes, not a cache)."""
    r = subprocess.run(
        ["blkid", "-p", "-O", str(offset), "-o", "export", str(img)],
        capture_output=True,
        text=True,
        check=True,
    )
    return dict(line.split("=", 1) for line in r.stdout.splitlines() if "=" in line)


# ---------------------------------------------------------------------------------------- x86_64


@dataclass
class Booted:
    image: Path
    url: str
    proc: subprocess.Popen[str]
    console: Path
    ready_s: float


@pytest.fixture(scope="module")
def x86_booted(os_builds: Callable[[str], Path]) -> Iterator[Booted]:
    img = os_builds("x86_booted")
    console = img.with_name("console.log")
    proc, lines = image_try(img, console)
    try:
        line = lines.get(timeout=BOOT_TIMEOUT_S)
    except queue.Empty:
        line = ""
    if not line.startswith("node: "):
        stop_try(proc)  # its machine too
        pytest.fail(f"`image try` printed {line!r}; console:\n{console.read_text(errors='replace')[-4000:]}")
    m = re.search(r"answered ready ([0-9.]+) s", console.read_text(errors="replace"))
    yield Booted(img, line.split()[1], proc, console, float(m.group(1)) if m else -1.0)
    proc.send_signal(signal.SIGTERM)
    assert proc.wait(60) == 0
    with pytest.raises(ProcessLookupError):
        os.killpg(proc.pid, 0)


@pytest.mark.slow
@pytest.mark.timeout(2400)
def test_x86_64_image_boots_under_uefi_and_serves_inference(x86_booted: Booted, digits_onnx: Path) -> None:
    from compiler.verify import onnxruntime_reference
    from firmware.osimage import disk, uki

    # the disk: GPT, the ESP holds the UKI at the removable-media path and no loose kernel
    img = x86_booted.image
    table = _sfdisk(img)
    assert table["label"] == "gpt"
    esp = table["partitions"][0]
    assert esp["type"] == "C12A7328-F81F-11D2-BA4B-00A0C93EC93B" and esp["name"] == "boot", esp
    boot = disk.read_gpt(img)["boot"]
    assert {"EFI", "fractal"} <= set(disk.fat_list(img, boot)) and "vmlinuz" not in disk.fat_list(img, boot)
    efi = disk.fat_read(img, boot, "EFI/BOOT/BOOTX64.EFI", img.parent / "BOOTX64.EFI")
    sections = uki.pe_sections(efi)
    assert {".linux", ".initrd", ".cmdline", ".osrel"} <= set(sections), sections
    # booted by the firmware from the disk (no -kernel): the EFI stub handed over the initrd
    text = x86_booted.console.read_text(errors="replace")
    assert "EFI stub: Loaded initrd" in text or "BdsDxe: starting" in text, text[-3000:]
    with urllib.request.urlopen(f"{x86_booted.url}/v1/node", timeout=60) as r:
        node = json.loads(r.read())
    assert node["arch"] == "x86_64", node
    x = np.random.default_rng(11).random((1, 64)).astype(np.float32)
    req = urllib.request.Request(
        f"{x86_booted.url}/v2/models/digits-mlp/infer",
        data=json.dumps(
            {"inputs": [{"name": "x", "shape": [1, 64], "datatype": "FP32", "data": x.ravel().tolist()}]}
        ).encode(),
        headers={"Content-Type": "application/json"},
    )
    with urllib.request.urlopen(req, timeout=120) as r:
        reply = json.loads(r.read())
    out = {o["name"]: np.asarray(o["data"], np.float32).reshape(o["shape"]) for o in reply["outputs"]}
    ref = onnxruntime_reference(digits_onnx, {"x": x}, 1)
    assert np.abs(out["logits"] - ref["logits"]).max() <= 1e-4
    print(f"x86_64 boot to ready: {x86_booted.ready_s:.1f} s")


# ------------------------------------------------------------------------------------------ rpi4


@pytest.fixture(scope="module")
def rpi4_image(os_builds: Callable[[str], Path]) -> tuple[Path, Path]:
    """(compressed image as built, the raw image `bmaptool copy` wrote from it)."""
    img = os_builds("rpi4_image")
    d = img.parent
    assert not img.exists()  # compressed in place of the raw image
    card = d / "card.img"
    r = subprocess.run(
        ["bmaptool", "copy", "--bmap", str(d / "rpi4.img.bmap"), str(d / "rpi4.img.zst"), str(card)],
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert r.returncode == 0, r.stderr
    return d / "rpi4.img.zst", card


@pytest.mark.slow
def test_rpi4_card_reproduces_the_raw_image(rpi4_image: tuple[Path, Path]) -> None:
    zst, card = rpi4_image
    raw_sha, name = (zst.parent / "rpi4.img.sha256").read_text().split()
    assert name == "rpi4.img" and file_sha256(card) == raw_sha  # the card holds the image, holes included
    zsha, zname = (zst.parent / "rpi4.img.zst.sha256").read_text().split()
    assert zname == zst.name and zsha == file_sha256(zst)
    assert zst.stat().st_size < card.stat().st_size // 3


def _check_pi_card(card: Path, tmp_path: Path, firmware: set[str], dtb: str, console: str) -> dict[str, str]:
    """The Pi layout of a card: MBR table, boot files, config.txt, cmdline.txt; cmdline's args."""
    from firmware.osimage import disk

    table = _sfdisk(card)
    assert table["label"] == "dos", table
    parts = table["partitions"]
    assert [p["type"] for p in parts] == ["c", "83", "83"], parts
    assert [bool(p.get("bootable")) for p in parts] == [True, False, False], parts
    assert all(p["start"] % 2048 == 0 and p["size"] % 2048 == 0 for p in parts), parts  # 1 MiB aligned
    # what blkid reads in the partitions themselves
    boot_fs, root_fs = _blkid(card, parts[0]["start"] * 512), _blkid(card, parts[1]["start"] * 512)
    assert (boot_fs["TYPE"], boot_fs["LABEL"]) == ("vfat", disk.BOOT_LABEL), boot_fs
    assert (root_fs["TYPE"], root_fs["LABEL"]) == ("ext4", disk.ROOT_LABEL), root_fs
    boot = disk.read_gpt(card)["boot"]
    assert boot.start == parts[0]["start"] * 512
    files = set(disk.fat_list(card, boot))
    assert {*firmware, "vmlinuz", "initrd.img", dtb} <= files, files
    cfg = disk.fat_read(card, boot, "config.txt", tmp_path / "config.txt").read_text()
    settings = dict(
        re.split(r"[= ]", line, maxsplit=1) for line in cfg.splitlines() if line and not line.startswith("#")
    )
    assert settings["arm_64bit"] == "1" and settings["enable_uart"] == "1", settings
    assert settings["kernel"] in files and settings["device_tree"] == dtb, settings
    initrd, follow = settings["initramfs"].split()
    assert initrd in files and follow == "followkernel", settings
    # the kernel really is an arm64 Image (what the firmware jumps into with arm_64bit=1)
    kernel = disk.fat_read(card, boot, settings["kernel"], tmp_path / "kernel").read_bytes()
    assert kernel[56:60] == b"ARM\x64", kernel[56:60]
    cmdline = disk.fat_read(card, boot, "cmdline.txt", tmp_path / "cmdline.txt").read_text()
    assert cmdline.count("\n") == 1  # the firmware reads one line
    args = dict(a.split("=", 1) for a in cmdline.split() if "=" in a)
    partuuid = f"{int(table['id'], 16):08x}-02"  # the kernel's PARTUUID of MBR partition 2
    assert args["root"] == f"PARTUUID={partuuid}", (args, table["id"])
    assert disk.read_mbr(card)[0] == int(table["id"], 16)
    assert args["console"].startswith(console), args
    return args


@pytest.mark.slow
def test_rpi4_mbr_boot_files_config_and_cmdline(rpi4_image: tuple[Path, Path], tmp_path: Path) -> None:
    _check_pi_card(rpi4_image[1], tmp_path, {"start4.elf", "fixup4.dat"}, "bcm2711-rpi-4-b.dtb", "ttyS1")


def _ext4_cat(img: Path, offset: int, path: str) -> bytes:
    """A file of the ext4 file system at ``offset`` of ``img``, read with debugfs (no mount)."""
    r = subprocess.run(
        ["debugfs", "-R", f"cat {path}", f"{img}?offset={offset}"], capture_output=True, check=True
    )
    return r.stdout


def _ext4_link(img: Path, offset: int, path: str) -> str:
    """Where the symbolic link ``path`` points ("" if it is not one)."""
    r = subprocess.run(
        ["debugfs", "-R", f"stat {path}", f"{img}?offset={offset}"],
        capture_output=True,
        text=True,
        check=True,
    )
    m = re.search(r'Fast link dest: "([^"]*)"', r.stdout)
    return m.group(1) if m else ""


@pytest.mark.slow
def test_rpi4_root_has_wifi(rpi4_image: tuple[Path, Path]) -> None:
    """What the Pi needs to join Wi-Fi at boot, read from the card's root file system: the
    aarch64 wpa_supplicant and its libraries, the CYW43455 firmware with the Pi 4's NVRAM file,
    the regulatory database, brcmfmac with modules.dep/load-order for rcS, and the boot scripts."""
    from firmware.osimage import disk

    _, card = rpi4_image
    off = disk.read_gpt(card)["root"].start
    wpa = _ext4_cat(card, off, "/usr/sbin/wpa_supplicant")
    assert wpa[:4] == b"\x7fELF" and int.from_bytes(wpa[18:20], "little") == 183  # EM_AARCH64
    for lib in ("libnl-genl-3.so.200", "libdbus-1.so.3", "libpcsclite.so.1"):  # a link, or the file
        real = _ext4_link(card, off, f"/usr/lib/aarch64-linux-gnu/{lib}") or lib
        assert _ext4_cat(card, off, f"/usr/lib/aarch64-linux-gnu/{real}")[:4] == b"\x7fELF", (lib, real)
    fw = "/usr/lib/firmware/brcm"
    assert _ext4_link(card, off, f"{fw}/brcmfmac43455-sdio.bin") == "../cypress/cyfmac43455-sdio.bin"
    assert len(_ext4_cat(card, off, "/usr/lib/firmware/cypress/cyfmac43455-sdio.bin")) > 500_000
    assert len(_ext4_cat(card, off, "/usr/lib/firmware/cypress/cyfmac43455-sdio.clm_blob")) > 1000
    nvram = _ext4_cat(card, off, f"{fw}/brcmfmac43455-sdio.raspberrypi,4-model-b.txt").decode()
    assert "boardflags" in nvram
    assert _ext4_link(card, off, "/usr/lib/firmware/regulatory.db") == "regulatory.db-debian"
    assert len(_ext4_cat(card, off, "/usr/lib/firmware/regulatory.db-debian")) > 1000
    assert _ext4_link(card, off, "/usr/sbin/modprobe") == "../bin/busybox"
    kver = json.loads(
        disk.fat_read(
            card, disk.read_gpt(card)["boot"], "fractal/image.json", card.parent / "image.json"
        ).read_text()
    )["kernel_version"]
    mods = f"/usr/lib/modules/{kver}"
    order = _ext4_cat(card, off, f"{mods}/load-order").decode().split()
    assert {"cfg80211", "brcmutil", "brcmfmac", "brcmfmac_wcc"} <= set(order), order
    assert order.index("cfg80211") < order.index("brcmfmac") < order.index("brcmfmac_wcc"), order
    dep = dict(
        line.split(":", 1) for line in _ext4_cat(card, off, f"{mods}/modules.dep").decode().splitlines()
    )
    assert {"cfg80211.ko", "brcmutil.ko"} <= set(dep["brcmfmac.ko"].split()), dep
    assert "brcmfmac.ko" in dep["brcmfmac_wcc.ko"].split(), dep
    ko = _ext4_cat(card, off, f"{mods}/brcmfmac.ko")
    assert ko[:4] == b"\x7fELF" and b"brcm/brcmfmac43455-sdio" in ko  # plain .ko: busybox insmod reads it
    rcs = _ext4_cat(card, off, "/etc/init.d/rcS").decode()
    assert "load-order" in rcs and "/etc/fractal/wifi.sh" in rcs
    assert b"wpa_supplicant -B -i" in _ext4_cat(card, off, "/etc/fractal/wifi.sh")


@pytest.mark.slow
def test_rpi4_image_takes_settings_and_is_refused_by_try(
    rpi4_image: tuple[Path, Path], tmp_path: Path
) -> None:
    """`configure` writes the first-boot settings onto the Pi's FAT (an MBR image); `try` says in
    one line that qemu has no Pi 4 and how to write the card instead."""
    from firmware.osimage import disk

    card = tmp_path / "pi.img"  # a copy: the other tests read the card as written
    subprocess.run(["cp", "--sparse=always", str(rpi4_image[1]), str(card)], check=True)
    r = cli(
        "image", "configure", card, "--broker", "mqtt://10.0.0.2:1883", "--fleet", "http://10.0.0.2:8000",
        "--swarm", "pis", "--enroll-token", "enrol-token-1", "--hostname", "pi-1",
    )  # fmt: skip
    assert r.returncode == 0, r.stderr
    boot = disk.read_gpt(card)["boot"]
    text = disk.fat_read(card, boot, "fractal/settings.toml", tmp_path / "s.toml").read_text()
    assert 'hostname = "pi-1"' in text
    r = cli("image", "try", card, "--port", str(free_port()))
    assert_refused(r, "cannot boot a rpi4 image", "bmaptool copy")


# ------------------------------------------------------------------------------------------ rpi5


@pytest.fixture(scope="module")
def rpi5_card(os_builds: Callable[[str], Path]) -> Path:
    """The raw rpi5 image (raw: the compressed path is the rpi4's) written by `bmaptool copy`."""
    img = os_builds("rpi5_card")
    d = img.parent
    card = d / "card.img"
    r = subprocess.run(
        ["bmaptool", "copy", "--bmap", str(d / "rpi5.img.bmap"), str(img), str(card)],
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert r.returncode == 0, r.stderr
    assert file_sha256(card) == (d / "rpi5.img.sha256").read_text().split()[0]
    return card


@pytest.mark.slow
def test_rpi5_card_layout_kernel_and_drivers(rpi5_card: Path, tmp_path: Path) -> None:
    """The Pi 5 card: the Pi layout with trixie-backports' 7.3 kernel, its bcm2712 device tree,
    the debug UART console, and an initramfs that loads the SD (sdhci-brcmstb) and RP1 Ethernet
    (rp1_pci, clk-rp1, pinctrl-rp1, macb) drivers the Pi 5 needs to reach its root and network."""
    import gzip

    from firmware.osimage import disk

    _check_pi_card(rpi5_card, tmp_path, {"config.txt"}, "bcm2712-rpi-5-b.dtb", "ttyAMA10")
    boot = disk.read_gpt(rpi5_card)["boot"]
    info = json.loads(disk.fat_read(rpi5_card, boot, "fractal/image.json", tmp_path / "i.json").read_text())
    assert info["board"] == "rpi5" and info["kernel_version"].startswith("7."), info
    dtb = disk.fat_read(rpi5_card, boot, "bcm2712-rpi-5-b.dtb", tmp_path / "p5.dtb").read_bytes()
    assert dtb[:4] == b"\xd0\x0d\xfe\xed" and b"brcm,bcm2712-sdhci" in dtb and b"raspberrypi,rp1-gem" in dtb
    initrd = gzip.decompress(disk.fat_read(rpi5_card, boot, "initrd.img", tmp_path / "initrd").read_bytes())
    order = re.search(rb"lib/modules/load-order\x00+([^\x00]*)", initrd)
    assert order, "no load-order in the initramfs"
    loaded = order.group(1).decode().split()
    for m in ("sdhci_brcmstb", "rp1_pci", "clk_rp1", "pinctrl_rp1", "macb", "ext4", "vfat"):
        assert m in loaded, (m, loaded)
        assert f"lib/modules/{m}.ko".encode() in initrd, m
    off = disk.read_gpt(rpi5_card)["root"].start  # the Pi 5's Wi-Fi NVRAM file (same CYW43455)
    nv = "/usr/lib/firmware/brcm/brcmfmac43455-sdio.raspberrypi,5-model-b.txt"
    assert _ext4_link(rpi5_card, off, nv) == "brcmfmac43455-sdio.raspberrypi,4-model-b.txt"


# -------------------------------------------------------------------------------------- compress


@pytest.mark.parametrize("how", ["xz", "zstd"])
def test_compressed_image_is_what_bmaptool_writes(tmp_path: Path, how: str) -> None:
    """A small two-partition disk compressed: `bmaptool copy` of the compressed file with the raw
    image's bmap writes the raw image byte for byte."""
    from firmware.osimage import disk

    content = tmp_path / "content"
    content.mkdir()
    (content / "hello.txt").write_text("hello\n" * 1000)
    img = tmp_path / "d.img"
    disk.write_disk(
        img,
        [
            disk.PartSpec("boot", 64 * disk.MiB, "fat", disk.BOOT_LABEL, content),
            disk.PartSpec("root", 16 * disk.MiB, "ext4", disk.ROOT_LABEL, content),
        ],
    )
    bmap = disk.write_bmap(img)
    packed = disk.compress(img, disk.Compression(how))
    assert packed.name == f"d.img{'.xz' if how == 'xz' else '.zst'}"
    assert packed.stat().st_size < img.stat().st_size // 20
    card = tmp_path / "card.img"
    r = subprocess.run(
        ["bmaptool", "copy", "--bmap", str(bmap), str(packed), str(card)], capture_output=True, text=True
    )
    assert r.returncode == 0, r.stderr
    assert file_sha256(card) == file_sha256(img)


def test_build_os_refuses_unknown_compression(tmp_path: Path, board_release_key: Path) -> None:
    r = cli(
        "image", "build-os", tmp_path, "--board", "x86_64", "--key", board_release_key, "--version", "1.0.0",
        "--out", tmp_path / "x.img", "--compress", "rar",
    )  # fmt: skip
    assert_refused(r, "unknown compression 'rar'", "zstd")


def test_build_os_help_and_refusal_name_every_board(tmp_path: Path, board_release_key: Path) -> None:
    from firmware.osimage.boards import OS_BOARDS

    r = cli("image", "build-os", "--help", env={"COLUMNS": "200"})
    assert r.returncode == 0 and all(b in r.stdout for b in OS_BOARDS), r.stdout
    r = cli(
        "image", "build-os", tmp_path, "--board", "rpi3", "--key", board_release_key, "--version", "1.0.0",
        "--out", tmp_path / "x.img",
    )  # fmt: skip
    assert_refused(r, "unknown board 'rpi3'", "x86_64", "rpi4", "rpi5")


def test_mbr_disk_as_sfdisk_and_blkid_read_it(tmp_path: Path) -> None:
    """The Pi's layout on a small disk, without a build: dos label with the given disk id, FAT32
    (type c, bootable) then Linux partitions, 1 MiB aligned; partitions found again by place."""
    from firmware.errors import ImageError
    from firmware.osimage import disk

    content = tmp_path / "content"
    content.mkdir()
    (content / "config.txt").write_text("arm_64bit=1\n")
    img = tmp_path / "pi.img"
    specs = [
        disk.PartSpec("boot", 64 * disk.MiB, "fat", disk.BOOT_LABEL, content),
        disk.PartSpec("root", 16 * disk.MiB, "ext4", disk.ROOT_LABEL, content),
    ]
    layout = disk.write_disk(img, specs, mbr_id=0x1234ABCD)
    table = _sfdisk(img)
    assert (table["label"], table["id"]) == ("dos", "0x1234abcd"), table
    assert [(p["type"], bool(p.get("bootable"))) for p in table["partitions"]] == [("c", True), ("83", False)]
    assert list(disk.read_gpt(img).values()) == layout
    assert disk.mbr_partuuid(disk.read_mbr(img)[0], 2) == "1234abcd-02"
    assert _blkid(img, layout[1].start)["LABEL"] == disk.ROOT_LABEL
    assert "config.txt" in disk.fat_list(img, layout[0])
    with pytest.raises(ImageError, match="in that order"):
        disk.write_disk(img, specs[::-1], mbr_id=1)
