"""Run `fractal node` as an aarch64 process under qemu-user (``fractal swarm --emulate-arm``)."""

from __future__ import annotations

import shutil
from pathlib import Path

from api.fleet.errors import FleetError

__all__ = ["arm_python"]


def arm_python(sysroot: Path) -> tuple[list[str], dict[str, str]]:
    """argv prefix and environment that run the `fractal` CLI on the aarch64 sysroot's Python."""
    sysroot = Path(sysroot).resolve()
    if not (sysroot / ".done").is_file():
        raise FleetError(f"the aarch64 sysroot is missing ({sysroot})",
                         hint="run `make sysroot` once (downloads Debian arm64 packages and aarch64 wheels)")
    qemu = shutil.which("qemu-aarch64")
    if qemu is None:
        raise FleetError("qemu-aarch64 is not installed", hint="apt-get install qemu-user")
    raise FleetError("--emulate-arm is not available yet", hint="run without --emulate-arm")
