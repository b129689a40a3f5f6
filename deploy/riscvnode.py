"""Run `fractal node` as a riscv64 process under qemu-user (``fractal swarm --emulate-riscv``).

The riscv64 sysroot (``make sysroot-riscv64``: Debian trixie riscv64 python3.13, numpy and the
node's Python dependencies, all as Debian packages) needs nothing from this venv: riscv64
artifacts are C-backend libraries loaded with ctypes (compiler/clib.py), so no TVM runs on the
node. Only this repository goes on ``PYTHONPATH``; the venv's site-packages stay off it so no
x86 extension module (or a version the sysroot's Python cannot import) is ever picked up.

qemu runs the interpreter on a CPU with RVV (``rv64,v=true,vlen=128``), a superset of rv64gc,
so both riscv64 presets' libraries run.
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path

from deploy.errors import DeployError

__all__ = ["riscv_python", "RISCV_CPU"]

REPO = Path(__file__).resolve().parents[1]
RISCV_CPU = ("-cpu", "rv64,v=true,vlen=128,vext_spec=v1.0")  # (an explicit spec: no warning per thread)
_PYTHON = "usr/bin/python3.13"


def riscv_python(sysroot: Path) -> tuple[list[str], dict[str, str]]:
    """argv prefix and environment that run the `fractal` CLI on the riscv64 sysroot's Python."""
    sysroot = Path(sysroot).resolve()
    if not (sysroot / ".done").is_file() or not (sysroot / _PYTHON).exists():
        raise DeployError(f"the riscv64 sysroot is missing ({sysroot})",
                         hint="run `make sysroot-riscv64` once (Debian trixie riscv64 packages)")
    qemu = shutil.which("qemu-riscv64")
    if qemu is None:
        raise DeployError("qemu-riscv64 is not installed", hint="apt-get install qemu-user")
    env = {
        "PATH": os.environ.get("PATH", "/usr/bin:/bin"),
        "HOME": os.environ.get("HOME", "/tmp"),
        "LANG": "C.UTF-8",
        "PYTHONPATH": str(REPO),
        "PYTHONNOUSERSITE": "1",
        # bytecode cached next to the sysroot, none in the repo (compiling it again at every start
        # under qemu costs tens of seconds)
        "PYTHONPYCACHEPREFIX": str(sysroot / ".pycache"),
        "PYTHONUNBUFFERED": "1",
        # trixie splits OpenSSL's legacy provider into a package the sysroot does not carry; the
        # node's signatures (ed25519, HMAC-SHA256) need no legacy algorithm.
        "CRYPTOGRAPHY_OPENSSL_NO_LEGACY": "1",
    }
    argv = [qemu, "-L", str(sysroot), *RISCV_CPU, str(sysroot / _PYTHON), "-c",
            "from api.cli import main; main()"]
    return argv, env
