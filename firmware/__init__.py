"""firmware: device images and the board-side runtime pieces.

``sysroot.sh ARCH DEST`` builds the foreign-arch Python sysroot (Debian arm64 packages plus the
aarch64 wheels of apache-tvm, apache-tvm-ffi and numpy) that ``compiler.emulate`` runs artifacts
in under qemu-user; ``make sysroot`` calls it for aarch64 into ``.cache/sysroot-aarch64``.
"""

__all__: list[str] = []
