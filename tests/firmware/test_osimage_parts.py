"""The pure parts of the board images, without booting anything: the settings file (render,
parse, refuse, apply into the device directory), the initramfs's cpio format and module
ordering, the GPT reader against sfdisk, and the lock files pinning exactly the packages the
rootfs unpacks."""

from __future__ import annotations

import lzma
import subprocess
import tomllib
from pathlib import Path

import pytest

from firmware.errors import ImageError
from firmware.osimage import disk, initramfs, rootfs
from firmware.osimage.boards import OS_BOARDS
from firmware.osimage.settings import Settings, apply, parse, render

BASE = 'broker = "mqtt://h"\nfleet = "http://f"\nswarm = "s"\n'
GOOD = Settings("mqtt://10.0.2.2:1883", "http://10.0.2.2:8000", "demo", "enrol-token-1", "api-token-1", "b1")


def test_settings_round_trip_and_apply(tmp_path: Path) -> None:
    text = render(GOOD)
    assert text.startswith("#") and 'broker = "mqtt://10.0.2.2:1883"' in text  # readable by a person
    assert parse(text) == GOOD
    apply(GOOD, tmp_path / "device")
    extra = tomllib.loads((tmp_path / "device/data/node.extra.toml").read_text())
    assert extra == {"broker": GOOD.broker, "swarm": "demo", "auth_token": "api-token-1"}
    enrol = tomllib.loads((tmp_path / "device/data/enrollment.toml").read_text())
    assert enrol == {"fleet": GOOD.fleet, "enroll_token": GOOD.enroll_token}


@pytest.mark.parametrize(
    ("text", "words"),
    [
        (
            'broker = "mqtt://h"\nfleet = "http://f"\nswarm = "s"\nenroll_token = "abcdefgh"\nx = "1"\n',
            "unknown key(s) x",
        ),
        ('broker = "mqtt://h"\nfleet = "http://f"\nswarm = "s"\n', "are required"),
        ('broker = "mqtt://h"\nfleet = "http://f"\nswarm = "s"\nenroll_token = 5\n', "must be a string"),
        ('broker = "mqtt://h"\nfleet = "http://f"\nswarm = "s"\nenroll_token = "short"\n', "enroll-token"),
        (BASE + 'enroll_token = "abcdefgh"\nhostname = "-x"\n', "hostname '-x'"),
        ('broker = "mqtt://h\n', "not valid TOML"),
        (
            'broker = "mqtt://h"\nfleet = "http://f"\nswarm = "s/#"\nenroll_token = "abcdefgh"\n',
            "swarm 's/#'",
        ),
    ],
)
def test_settings_refuse_bad_files(text: str, words: str) -> None:
    with pytest.raises(ImageError) as e:
        parse(text)
    assert words in str(e.value)


def test_cpio_newc_is_what_cpio_reads(tmp_path: Path) -> None:
    w = initramfs.CpioWriter()
    w.dir("bin")
    w.file("bin/hello", b"hi\n", 0o755)
    w.symlink("bin/sh", "hello")
    w.chardev("console", 5, 1)
    data = w.finish()
    assert len(data) % 4 == 0
    # parse it back: magic, names and sizes at their 4-byte aligned places
    names, off = [], 0
    while True:
        assert data[off : off + 6] == b"070701"
        fields = [int(data[off + 6 + 8 * i : off + 14 + 8 * i], 16) for i in range(13)]
        namesize, filesize = fields[11], fields[6]
        name = data[off + 110 : off + 110 + namesize - 1].decode()
        off = (off + 110 + namesize + 3) & ~3
        body = data[off : off + filesize]
        off = (off + filesize + 3) & ~3
        names.append((name, body))
        if name == "TRAILER!!!":
            break
    assert names[:4] == [("bin", b""), ("bin/hello", b"hi\n"), ("bin/sh", b"hello"), ("console", b"")]


def _ko(deps: str) -> bytes:
    return b"\x7fELF....\x00license=GPL\x00depends=" + deps.encode() + b"\x00name=x\x00"


def test_module_order_puts_dependencies_first_and_skips_builtins(tmp_path: Path) -> None:
    mods = tmp_path / "6.0"
    (mods / "kernel/fs").mkdir(parents=True)
    (mods / "modules.builtin").write_text("kernel/drivers/virtio/virtio_mmio.ko\n")
    (mods / "kernel/fs/ext4.ko.xz").write_bytes(lzma.compress(_ko("jbd2,mbcache")))
    (mods / "kernel/fs/jbd2.ko").write_bytes(_ko(""))
    (mods / "kernel/fs/mbcache.ko").write_bytes(_ko(""))
    (mods / "kernel/fs/nls_iso8859-1.ko").write_bytes(_ko(""))
    order = [n for n, _ in initramfs.module_order(mods, ("virtio_mmio", "ext4", "nls_iso8859-1"))]
    assert order == ["jbd2", "mbcache", "ext4", "nls_iso8859_1"]
    with pytest.raises(ImageError, match="virtio_blk"):
        initramfs.module_order(mods, ("virtio_blk",))


def test_gpt_reader_agrees_with_sfdisk(tmp_path: Path) -> None:
    img = tmp_path / "d.img"
    content = tmp_path / "empty"
    content.mkdir()
    (content / "a.txt").write_text("x")
    parts = disk.write_disk(
        img,
        [
            disk.PartSpec("boot", 64 * disk.MiB, "fat", disk.BOOT_LABEL, content),
            disk.PartSpec("data", 8 * disk.MiB, "ext4", disk.DATA_LABEL, content),
        ],
    )
    got = disk.read_gpt(img)
    assert list(got.values()) == parts
    dump = subprocess.run(["sfdisk", "-J", str(img)], capture_output=True, text=True, check=True).stdout
    import json

    table = json.loads(dump)["partitiontable"]["partitions"]
    assert [(p["name"], p["start"] * 512, p["size"] * 512) for p in table] == [
        (p.name, p.start, p.size) for p in parts
    ]
    assert "a.txt" in disk.fat_list(img, got["boot"])
    with pytest.raises(ImageError, match="no GPT"):
        disk.read_gpt(content / "a.txt")


@pytest.mark.parametrize("board", list(OS_BOARDS))
def test_lock_pins_exactly_the_rootfs_packages(board: str) -> None:
    from firmware.debs import read_lock

    b = OS_BOARDS[board]
    pins = read_lock(b.lock)
    assert {p.package for p in pins} == {
        *rootfs.PACKAGES,
        *b.extra_packages,
        b.kernel_package,
        *b.kernel_extra,
        *b.boot_packages,
    }
    # main, except the Pi's boot and Wi-Fi firmware (Debian keeps them in non-free-firmware)
    nonfree = {"raspi-firmware", "firmware-brcm80211"}
    assert all(
        p.path.startswith("pool/non-free-firmware/" if p.package in nonfree else "pool/main/")
        and len(p.sha256) == 64
        for p in pins
    )
