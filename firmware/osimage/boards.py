"""The boards ``fractal image build-os`` makes disk images for, and how qemu-system boots them.

How each board starts its kernel (:class:`BootKind`):

* ``aarch64-virt``, ``riscv64-virt``: qemu loads the kernel and initramfs from the boot partition
  itself (``-kernel``); a real board of that arch adds its boot firmware.
* ``x86_64``: UEFI. The ESP holds one Unified Kernel Image at the removable-media path
  ``EFI/BOOT/BOOTX64.EFI`` (Debian's kernel + our initramfs + the command line inside systemd's
  EFI stub), which any UEFI firmware boots from the disk alone: no boot loader to configure,
  no NVRAM entry; qemu runs it with OVMF.
* ``rpi4``, ``rpi5``: MBR, the Pi's own boot firmware (Debian's ``raspi-firmware``) reads
  ``config.txt`` on the FAT partition, loads the kernel, initramfs and device tree named there.
  qemu 7.2 has no Pi 4 or Pi 5 machine, so ``fractal image try`` refuses them. The Pi 5 runs
  trixie-backports' kernel (7.3): trixie's 6.12 lacks its SD controller and RP1 drivers.

Debian trixie on every board: riscv64 is an official Debian architecture only from trixie on
(bookworm has no riscv64), and for arm64 bookworm's packages are too old for the node
(python3-pydantic 1.10, python3-paho-mqtt 1.6, python3-fastapi 0.92, where the node needs
pydantic 2, paho-mqtt 2 and fastapi >= 0.110; pydantic 2's core is compiled, so it cannot be
vendored as a pure-Python wheel). One suite gives one Python (3.13) and one package set on both
architectures, the same closure the riscv64 qemu-user sysroot (firmware/sysroot.sh) already runs.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import Enum
from pathlib import Path

from firmware.errors import ImageError

__all__ = ["OsBoard", "OS_BOARDS", "get_os_board", "BootKind", "PartitionTable", "WIFI_PACKAGES"]

HERE = Path(__file__).resolve().parent


class BootKind(Enum):
    QEMU_DIRECT = "qemu-direct"  # qemu -kernel/-initrd from the boot partition (virt machines)
    UEFI = "uefi"  # a Unified Kernel Image at EFI/BOOT/BOOT<ARCH>.EFI on the ESP
    RPI = "rpi"  # Raspberry Pi firmware: config.txt, start*.elf, kernel, initramfs, device tree


class PartitionTable(Enum):
    GPT = "gpt"
    MBR = "mbr"  # the Pi boot ROM reads only an MBR (dos) partition table


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
    boot: BootKind = BootKind.QEMU_DIRECT
    table: PartitionTable = PartitionTable.GPT
    boot_packages: tuple[str, ...] = ()  # pinned packages the boot partition takes files from
    modules: tuple[str, ...] = ()  # kernel modules the initramfs loads beyond the common ones
    dtbs: tuple[str, ...] = ()  # device trees (paths under the kernel's dtb directory) on the FAT
    lock_variant: str = ""  # a lock of its own when the kernel differs from the arch's default
    cmdline_extra: str = ""  # kernel arguments of this board only
    extra_packages: tuple[str, ...] = ()  # pinned packages of this board's root fs beyond rootfs.PACKAGES
    rootfs_modules: tuple[str, ...] = ()  # modules /etc/init.d/rcS loads from the root fs (after root)
    # newer Debian kernels come in three packages: linux-binary-* (vmlinuz), linux-modules-*,
    # linux-base-* (modules.builtin, config, device trees); kernel_package is then the binary one
    kernel_extra: tuple[str, ...] = ()

    @property
    def lock(self) -> Path:
        variant = f"-{self.lock_variant}" if self.lock_variant else ""
        return HERE / f"{self.suite}-{self.debarch}{variant}.lock"

    @property
    def wifi(self) -> bool:
        """Whether the image joins the Wi-Fi network of its settings (wpa_supplicant on wlan0)."""
        return "wpasupplicant" in self.extra_packages

    @property
    def can_try(self) -> bool:
        """Whether `fractal image try` can boot the board under this qemu."""
        return self.boot is not BootKind.RPI


# Wi-Fi on the Pi: wpa_supplicant and the libraries it links (D-Bus, netlink, PC/SC), the
# brcmfmac firmware (the Pi 4's CYW43455: brcm/brcmfmac43455-sdio.bin, its .clm_blob and the
# board's NVRAM file brcmfmac43455-sdio.raspberrypi,4-model-b.txt; non-free-firmware) and the
# signed regulatory database cfg80211 reads for wifi_country.
WIFI_PACKAGES = (
    "wpasupplicant",
    "libdbus-1-3",
    "libsystemd0",
    "libcap2",
    "libnl-3-200",
    "libnl-genl-3-200",
    "libnl-route-3-200",
    "libpcsclite1",
    "firmware-brcm80211",
    "wireless-regdb",
)
# brcmfmac and its firmware-vendor modules (6.x asks for brcmfmac-wcc/-cyw by request_module; the
# root fs has their modules.dep so busybox modprobe finds them, and rcS loads them up front).
WIFI_MODULES = ("brcmfmac", "brcmfmac_wcc", "brcmfmac_cyw")


def _rpi(
    name: str,
    description: str,
    dtb: str,
    console: str,
    modules: tuple[str, ...],
    kernel: str = "linux-image-6.12.117+deb13-arm64-unsigned",
    kernel_extra: tuple[str, ...] = (),
    lock_variant: str = "rpi",
) -> OsBoard:
    return OsBoard(
        name,
        "aarch64",
        "arm64",
        "trixie",
        # the generic arm64 flavour: the cloud one has no Broadcom SoC drivers and no device trees
        kernel,
        ("aarch64-c",),
        console,
        "",
        (),
        description,
        boot=BootKind.RPI,
        table=PartitionTable.MBR,
        boot_packages=("raspi-firmware",),
        modules=modules,
        dtbs=(dtb,),
        lock_variant=lock_variant,
        extra_packages=WIFI_PACKAGES,
        rootfs_modules=WIFI_MODULES,
        kernel_extra=kernel_extra,
    )


# The Pi 5 needs a kernel newer than trixie's 6.12, which lacks the drivers of its SD controller
# (sdhci-brcmstb's bcm2712 support) and of RP1, the chip behind PCIe that holds its Ethernet
# and GPIO. trixie-backports' 7.3 has them all as modules (rp1_pci, clk-rp1, pinctrl-rp1, macb
# for RP1's GEM Ethernet, irq-bcm2712-mip for its PCIe MSIs, pinctrl-brcmstb-bcm2712 and
# gpio-brcmstb for the SoC's pins, sdhci-brcmstb) and the bcm2712-rpi-5-b device tree.
RPI5_KERNEL = "7.3.4+deb13-arm64"


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
        OsBoard(
            "x86_64",
            "x86_64",
            "amd64",
            "trixie",
            # the generic flavour, not cloud: real gateways need its SATA/NVMe/NIC drivers
            "linux-image-6.12.117+deb13-amd64-unsigned",
            ("x86_64-c",),
            "ttyS0",
            "qemu-system-x86_64",
            ("-M", "q35", "-bios", "/usr/share/ovmf/OVMF.fd"),
            "x86-64 edge gateway or PC with UEFI (GPT; boots EFI/BOOT/BOOTX64.EFI from the disk)",
            boot=BootKind.UEFI,
            boot_packages=("systemd-boot-efi",),
            # virtio-pci for qemu/KVM, then the disks and NICs of common gateways
            modules=("virtio_pci", "nvme", "ahci", "sd_mod", "e1000e", "igb", "igc", "r8169", "realtek"),
            # the IO-APIC timer check fails when a (loaded) host runs the guest slowly under
            # emulation, and the kernel then panics; modern PCs' timers do not need it
            cmdline_extra="no_timer_check",
        ),
        _rpi(
            "rpi4",
            "Raspberry Pi 4 Model B (BCM2711)",
            "broadcom/bcm2711-rpi-4-b.dtb",
            "ttyS1,115200",  # the GPIO header's mini UART (enable_uart=1)
            # SD card (the Pi 4's emmc2 is an iProc SDHCI), Ethernet (GENET and its Broadcom PHY)
            ("sdhci_iproc", "genet", "broadcom"),
        ),
        _rpi(
            "rpi5",
            "Raspberry Pi 5 (BCM2712)",
            "broadcom/bcm2712-rpi-5-b.dtb",
            "ttyAMA10,115200",  # the debug UART connector (the device tree's serial10)
            # SD card; pins and MSIs of the SoC; RP1 over PCIe, its clocks and pins, its GEM
            # Ethernet (macb) and the Broadcom PHY
            (
                "sdhci_brcmstb",
                "pinctrl_brcmstb_bcm2712",
                "gpio_brcmstb",
                "irq_bcm2712_mip",
                "rp1_pci",
                "clk_rp1",
                "pinctrl_rp1",
                "macb",
                "broadcom",
            ),
            kernel=f"linux-binary-{RPI5_KERNEL}",
            kernel_extra=(f"linux-base-{RPI5_KERNEL}", f"linux-modules-{RPI5_KERNEL}"),
            lock_variant="rpi5",
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
