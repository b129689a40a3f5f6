"""firmware: signed device images, the board's A/B slots, the boot supervisor, over-the-air staging.

* :mod:`firmware.image` the image format (signed manifest + members), build and verify;
  :mod:`firmware.manifest` the image manifest as one validated, typed object;
  :mod:`firmware.keys` ed25519 keys; :mod:`firmware.boards` which artifacts a board runs;
  :mod:`firmware.artifact_view` the one reader of a compiled artifact's manifest.
* :mod:`firmware.device` the device directory: flash into the inactive slot, atomic boot state,
  trusted keys, anti-rollback, rollback, status.
* :mod:`firmware.boot` the boot supervisor (trial counter, mark good, fallback, anti-rollback
  floor, halt); :mod:`firmware.health` its health check (bound to the node it started, one
  deadline); :mod:`firmware.nodeproc` the node process it started, and a leftover one.
* :mod:`firmware.ota` resumable download (HTTP ranges) and staging; ``DeviceUpdates``, a running
  node's handle on its device for fleet roll-outs (update, image rollback, report).

* :mod:`firmware.osimage` board disk images (``fractal image build-os`` / ``configure`` / ``try``):
  a Debian rootfs from pinned packages, kernel + initramfs, the application in slot ``a`` of the
  data partition; booted under qemu-system.

``sysroot.sh ARCH DEST`` builds the foreign-arch Python sysroot (Debian arm64 packages plus the
aarch64 wheels of apache-tvm, apache-tvm-ffi and numpy) that ``compiler.emulate`` runs artifacts
in under qemu-user; ``make sysroot`` calls it for aarch64 into ``.cache/sysroot-aarch64``.
"""

__all__: list[str] = []
