"""Board disk images: a file a user writes to a card (``fractal image build-os``) and boots.

* :mod:`firmware.osimage.boards` the boards (``x86_64``, ``rpi4``, ``aarch64-virt``,
  ``riscv64-virt``): Debian suite and architecture, lock file, kernel package, which artifacts
  they run, how their firmware and qemu boot them.
* :mod:`firmware.osimage.bootfiles` what each kind of boot needs on the FAT partition;
  :mod:`firmware.osimage.uki` the x86_64 board's Unified Kernel Image.
* :mod:`firmware.osimage.rootfs` the root filesystem: pinned Debian packages unpacked with
  ``dpkg-deb -x`` (no maintainer scripts, no binfmt_misc), busybox init, the node's code.
* :mod:`firmware.osimage.initramfs` the initramfs (busybox + the kernel modules that mount root).
* :mod:`firmware.osimage.disk` GPT, FAT boot partition, ext4 root and data partitions, written
  into one sparse file without a loop mount; ``.bmap`` and ``.sha256`` beside it.
* :mod:`firmware.osimage.build` ``build_os``: the whole image from an artifact, a board and a key.
* :mod:`firmware.osimage.qemu` ``fractal image try``: boot an image under qemu-system.

Layout of an image (GPT; MBR with the same partitions on the Pi)::

    p1 "boot"  FAT32   vmlinuz, initrd.img, cmdline.txt (x86_64: EFI/BOOT/BOOTX64.EFI; the Pi:
                       its firmware, device tree, config.txt), fractal/ (settings read at boot)
    p2 "root"  ext4    Debian trixie rootfs + /opt/fractal, mounted read-only
    p3 "data"  ext4    /data: device/ (today's A/B device directory: slots a, b, data/), home/
"""

__all__: list[str] = []
