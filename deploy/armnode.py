"""Run `fractal node` as an aarch64 process under qemu-user (``fractal swarm --emulate-arm``).

The aarch64 sysroot (``make sysroot``: Debian arm64 Python 3.11 + aarch64 wheels of TVM and
numpy) has only the compiled packages the artifact loader needs. The node also needs the
compiled core of pydantic: its aarch64 wheel is downloaded once into ``arm-node-site`` next to
the sysroot (``.cache/arm-node-site``).
Everything else the node imports is pure Python and comes from this venv's site-packages,
placed AFTER the aarch64 directories on ``PYTHONPATH`` so no x86 extension is ever picked up
where an aarch64 one exists (x86 extensions that are merely optional, e.g. uvloop, fail to
import and their users fall back to pure Python).
"""

from __future__ import annotations

import importlib.metadata
import os
import shutil
import subprocess
import sys
import sysconfig
import zipfile
from pathlib import Path

from deploy.errors import DeployError

__all__ = ["arm_python", "arm_site"]

REPO = Path(__file__).resolve().parents[1]
# Compiled packages the node imports that the sysroot lacks (pure-Python ones come from the venv).
_NATIVE = ("pydantic_core", "cryptography", "cffi")  # cryptography: signed swarms (edgenode/security.py)
_BLOCKED = ("torch",)  # x86-only packages in the venv that aarch64 code would try to import
_PLATFORMS = ("manylinux_2_17_aarch64", "manylinux2014_aarch64", "manylinux_2_28_aarch64")


def arm_site(cache_dir: Path) -> Path:
    """A directory with aarch64 builds of :data:`_NATIVE` (same versions as this venv), cached."""
    pins = [f"{name}=={importlib.metadata.version(name)}" for name in _NATIVE]
    pins += [f"blocked:{b}" for b in _BLOCKED]
    site = Path(cache_dir) / "arm-node-site"
    stamp = site / ".pins"
    if stamp.is_file() and stamp.read_text() == "\n".join(pins):
        return site
    shutil.rmtree(site, ignore_errors=True)
    wheels = site / ".wheels"
    wheels.mkdir(parents=True)
    cmd = [sys.executable, "-m", "pip", "download", "-q", "--no-deps", "--only-binary=:all:",
           "--python-version", "3.11", "--implementation", "cp", "-d", str(wheels)]
    for p in _PLATFORMS:
        cmd += ["--platform", p]
    proc = subprocess.run([*cmd, *(p for p in pins if "==" in p)], capture_output=True, text=True)
    if proc.returncode != 0:
        raise DeployError(f"could not download aarch64 wheels {' '.join(pins)}: {proc.stderr.strip()[-300:]}",
                         hint="check network access to PyPI, then retry")
    for whl in wheels.glob("*.whl"):
        with zipfile.ZipFile(whl) as z:
            z.extractall(site)
    # tvm_ffi imports torch when it can find it, and the venv's x86 torch fails with OSError (not
    # ImportError) under qemu: shadow it with a package that raises the ImportError tvm_ffi expects.
    for name in _BLOCKED:
        (site / name).mkdir(exist_ok=True)
        (site / name / "__init__.py").write_text(
            f"raise ImportError('{name} is not available to the emulated aarch64 node')\n")
    stamp.write_text("\n".join(pins))
    return site


def arm_python(sysroot: Path) -> tuple[list[str], dict[str, str]]:
    """argv prefix and environment that run the `fractal` CLI on the aarch64 sysroot's Python."""
    sysroot = Path(sysroot).resolve()
    if not (sysroot / ".done").is_file():
        raise DeployError(f"the aarch64 sysroot is missing ({sysroot})",
                         hint="run `make sysroot` once (Debian arm64 packages + aarch64 wheels)")
    qemu = shutil.which("qemu-aarch64")
    if qemu is None:
        raise DeployError("qemu-aarch64 is not installed", hint="apt-get install qemu-user")
    site = arm_site(sysroot.parent).resolve()  # lives next to the sysroot it extends
    venv_site = sysconfig.get_paths()["purelib"]
    path = [str(sysroot / "wheels"), str(site), venv_site, str(REPO)]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(path), "PYTHONNOUSERSITE": "1",
           # bytecode cached next to the sysroot, none in the repo (compiling the stdlib, numpy and
           # TVM again at every start under qemu costs tens of seconds)
           "PYTHONPYCACHEPREFIX": str(sysroot / ".pycache")}
    env.pop("PYTHONDONTWRITEBYTECODE", None)
    argv = [qemu, "-L", str(sysroot), str(sysroot / "usr/bin/python3.11"), "-c",
            "from api.cli import main; main()"]
    return argv, env
