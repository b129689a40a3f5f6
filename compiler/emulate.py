"""Run a foreign-arch artifact under qemu-user in a Python sysroot built by ``make sysroot``.

There is no binfmt_misc here, so the aarch64 interpreter is started explicitly::

    qemu-aarch64 -L SYSROOT SYSROOT/usr/bin/python3.11 -m compiler.runner ARTIFACT IN.npz OUT.npz

with ``PYTHONPATH=SYSROOT/wheels:REPO`` (the aarch64 wheels of apache-tvm, apache-tvm-ffi and
numpy, and this repository for :mod:`compiler.runner` / :mod:`compiler.artifact`). The sysroot
is ``$FRACTAL_SYSROOT_AARCH64`` or the repository's ``.cache/sysroot-aarch64``.

Artifacts of the C backend (manifest ``libs.runtime == "c"``, every riscv64 preset) need no
Python at all: their runner ``fractal-run`` (compiler/cruntime/fractal_run.c) is started on .npy
files, natively on a matching machine or as ``qemu-riscv64 -L /usr/riscv64-linux-gnu -cpu
rv64,v=true,vlen=128 fractal-run main IN OUT`` (the cross libc of Debian's cross toolchain is the
only sysroot needed; ``vlen=128`` with ``v=true`` makes RVV code really execute).
"""

from __future__ import annotations

import os
import shutil
import subprocess
import tempfile
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

import numpy as np

from compiler.errors import EmulationError
from compiler.manifest import Manifest

__all__ = ["sysroot_dir", "run_emulated", "elf_info", "ElfInfo", "EM_X86_64", "EM_AARCH64", "EM_RISCV",
           "SYSROOT_ENV", "run_c_runner", "runner_command", "run_c_artifact", "python_command",
           "run_emulated_many"]

REPO_ROOT = Path(__file__).resolve().parent.parent
SYSROOT_ENV = {"aarch64": "FRACTAL_SYSROOT_AARCH64", "riscv64": "FRACTAL_SYSROOT_RISCV64"}
_QEMU = {"aarch64": "qemu-aarch64", "riscv64": "qemu-riscv64"}
# The sysroot's interpreter (aarch64: bookworm + PyPI wheels; riscv64: trixie, numpy only, for
# C-backend artifacts loaded with ctypes) and extra qemu flags (RVV on, 128-bit vectors).
_PYTHON = {"aarch64": "usr/bin/python3.11", "riscv64": "usr/bin/python3.13"}
_QEMU_CPU: dict[str, tuple[str, ...]] = {"riscv64": ("-cpu", "rv64,v=true,vlen=128,vext_spec=v1.0")}
DEFAULT_TIMEOUT = 900.0  # seconds; importing tvm under emulation alone takes ~20 s on 2 cores

# ELF e_machine values (System V ABI)
EM_X86_64 = 62
EM_AARCH64 = 183
EM_RISCV = 243


def sysroot_dir(arch: str = "aarch64") -> Path:
    """Where the ``arch`` sysroot lives: ``$FRACTAL_SYSROOT_AARCH64`` or REPO/.cache/sysroot-aarch64."""
    env = SYSROOT_ENV.get(arch)
    if env and os.environ.get(env):
        return Path(os.environ[env])
    return REPO_ROOT / ".cache" / f"sysroot-{arch}"


def _check_ready(arch: str) -> tuple[str, Path]:
    if arch not in _QEMU:
        raise EmulationError(f"cannot emulate a {arch} artifact", hint="run it on the board")
    qemu = shutil.which(_QEMU[arch])
    if qemu is None:
        raise EmulationError(f"{_QEMU[arch]} is not installed",
                             hint="install qemu-user (apt-get install qemu-user, "
                                  "or bash deploy/install-system-deps.sh)")
    root = sysroot_dir(arch)
    if not (root / ".done").is_file() or not (root / _PYTHON[arch]).exists():
        raise EmulationError(f"no {arch} Python sysroot in {root}",
                             hint=f"run `bash firmware/sysroot.sh {arch} {root}` "
                                  "(`make sysroot` for aarch64)")
    return qemu, root


# qemu-user settings for C-backend runners: the cross toolchain's libc as sysroot, and a CPU with
# every extension a preset may use (RVV with 128-bit vectors; a superset runs rv64gc code too).
_C_QEMU = {"aarch64": ("qemu-aarch64", "/usr/aarch64-linux-gnu", ()),
           "riscv64": ("qemu-riscv64", "/usr/riscv64-linux-gnu", _QEMU_CPU["riscv64"])}


def runner_command(runner: Path, arch: str) -> list[str]:
    """How to start a C-backend ``runner`` built for ``arch`` here: directly, or under qemu-user."""
    from compiler.targets import host_arch

    if arch == host_arch():
        return [str(runner)]
    if arch not in _C_QEMU:
        raise EmulationError(f"cannot run a {arch} program on this machine", hint="run it on the board")
    qemu, libc, cpu = _C_QEMU[arch]
    if shutil.which(qemu) is None:
        raise EmulationError(f"{qemu} is not installed",
                             hint="install qemu-user (bash deploy/install-system-deps.sh)")
    if not Path(libc, "lib").is_dir():
        raise EmulationError(f"no {arch} C library in {libc}",
                             hint=f"install the cross toolchain (apt-get install gcc-{arch}-linux-gnu)")
    return [qemu, "-L", libc, *cpu, str(runner)]


def run_c_runner(runner: Path, arch: str, func: str, arrays: list[np.ndarray], *,
                 timeout: float = DEFAULT_TIMEOUT) -> list[np.ndarray]:
    """Run ``func`` of a C-backend runner on its flattened inputs (written as .npy); its outputs."""
    cmd = runner_command(runner, arch)
    with tempfile.TemporaryDirectory(prefix="fractal-run-") as tmp:
        ind, outd = Path(tmp) / "in", Path(tmp) / "out"
        ind.mkdir()
        outd.mkdir()
        for i, a in enumerate(arrays):
            np.save(ind / f"{i}.npy", np.require(a, requirements="C"))  # (keeps 0-d arrays 0-d)
        _run_emulated([*cmd, func, str(ind), str(outd)], None, None, timeout, f"the {arch} runner",
                      "recompile the artifact; check qemu-user and the cross libc")
        outs = sorted(outd.glob("*.npy"), key=lambda p: int(p.stem))
        return [np.load(p) for p in outs]


def _run_emulated(cmd: list[str], env: dict[str, str] | None, cwd: str | None, timeout: float, what: str,
                  hint: str) -> None:
    """Run an emulated command; EmulationError with its last ``error:`` line when it fails or hangs."""
    try:
        proc = subprocess.run(cmd, env=env, cwd=cwd, capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired:
        raise EmulationError(f"{what} did not finish in {timeout:.0f}s",
                             hint="the machine may be overloaded; retry, or run on the board") from None
    if proc.returncode != 0:
        lines = [ln for ln in proc.stderr.strip().splitlines() if ln.strip()]
        err = next((ln for ln in reversed(lines) if ln.startswith("error:")), lines[-1] if lines else "")
        raise EmulationError(f"{what} failed (exit {proc.returncode}): {err.removeprefix('error: ')[:400]}",
                             hint=hint)


def run_c_artifact(artifact_dir: Path, manifest: Manifest, inputs: dict[str, np.ndarray], *,
                   timeout: float = DEFAULT_TIMEOUT) -> dict[str, np.ndarray]:
    """Inference of a C-backend artifact through its runner, in chunks of the compiled batch."""
    from compiler.artifact import load_params

    arch = manifest.arch
    if manifest.libs.runner is None:
        raise EmulationError(f"artifact {manifest.name!r} has no runner", hint="recompile the artifact")
    runner = artifact_dir / manifest.libs.runner
    _, params = load_params(artifact_dir, manifest)
    specs = list(manifest.inputs)
    names = [d.name for d in manifest.outputs]
    if not manifest.batched:  # exactly the compiled shapes, one run
        chunk = [np.asarray(inputs[s.name], dtype=s.dtype) for s in specs]
        outs = run_c_runner(runner, arch, "main", [*chunk, *params], timeout=timeout)
        got = iter(outs)
        # an output with a zero dim has no compiled code (compiler.importer): answered empty (unless
        # every output is compiled)
        answered = len(outs) < len(manifest.outputs)
        return {d.name: np.empty(d.shape, d.dtype) if answered and 0 in d.shape else next(got)
                for d in manifest.outputs}
    batch = manifest.batch
    n = next(iter(inputs.values())).shape[0] if inputs else batch
    parts: dict[str, list[np.ndarray]] = {k: [] for k in names}
    for start in range(0, n, batch):
        chunk = [np.asarray(inputs[s.name][start:start + batch], dtype=s.dtype) for s in specs]
        if chunk and chunk[0].shape[0] != batch:
            raise EmulationError(f"{n} samples is not a multiple of the compiled batch {batch}",
                                 hint=f"pass a multiple of {batch} samples")
        outs = run_c_runner(runner, arch, "main", [*chunk, *params], timeout=timeout)
        for k, v in zip(names, outs, strict=True):
            parts[k].append(v)
    return {k: np.concatenate(v) for k, v in parts.items()}


def _artifact_arch(artifact_dir: Path) -> str:
    return Manifest.read(artifact_dir).arch


def python_command(arch: str, args: list[str]) -> tuple[list[str], dict[str, str]]:
    """(command, environment) running the ``arch`` sysroot's Python on ``args`` under qemu-user,
    with the sysroot's wheels and this repository importable (e.g. ``["-m",
    "compiler.rpc_server"]``: an emulated board's RPC server). EmulationError when not ready."""
    qemu, root = _check_ready(arch)
    env = {
        "PATH": os.environ.get("PATH", "/usr/bin:/bin"),
        "PYTHONPATH": f"{root / 'wheels'}{os.pathsep}{REPO_ROOT}",
        "PYTHONNOUSERSITE": "1",
        # bytecode cached next to the sysroot, none in the repo: without it every emulated start
        # compiles the stdlib, numpy and TVM sources again under qemu (tens of seconds)
        "PYTHONPYCACHEPREFIX": str(root / ".pycache"),
        "HOME": os.environ.get("HOME", "/tmp"),
        "LANG": "C.UTF-8",
        "CRYPTOGRAPHY_OPENSSL_NO_LEGACY": "1",  # trixie ships the legacy provider apart; unused here
    }
    if "TVM_NUM_THREADS" in os.environ:
        env["TVM_NUM_THREADS"] = os.environ["TVM_NUM_THREADS"]
    return [qemu, "-L", str(root), *_QEMU_CPU.get(arch, ()), str(root / _PYTHON[arch]), *args], env


def run_emulated(artifact_dir: str | Path, inputs: dict[str, np.ndarray], *,
                 timeout: float = DEFAULT_TIMEOUT, python: bool = False) -> dict[str, np.ndarray]:
    """Run ``artifact_dir``'s inference on ``inputs`` under qemu-user; returns its outputs.

    C-backend artifacts run through their native runner; with ``python=True`` through
    ``python -m compiler.runner`` in the arch's Python sysroot instead (the board-side Python path:
    ``load_artifact`` + ctypes). Raises EmulationError when qemu or the sysroot is missing, and when
    the emulated run fails (its error line is relayed) or times out."""
    artifact_dir = Path(artifact_dir).resolve()
    manifest = Manifest.read(artifact_dir)
    if manifest.libs.runtime == "c" and not python:
        return run_c_artifact(artifact_dir, manifest, inputs, timeout=timeout)
    return run_emulated_many([(artifact_dir, inputs)], timeout=timeout)[0]


def run_emulated_many(runs: Sequence[tuple[str | Path, dict[str, np.ndarray]]], *,
                      timeout: float = DEFAULT_TIMEOUT) -> list[dict[str, np.ndarray]]:
    """Several (artifact, inputs) runs of one architecture in one emulated Python process (tvm is
    imported once: under qemu that is most of a run's time); the outputs of each, in order. Every
    artifact runs through ``python -m compiler.runner`` (C-backend ones too, with ctypes)."""
    dirs = [Path(a).resolve() for a, _ in runs]
    arches = {_artifact_arch(d) for d in dirs}
    if len(arches) != 1:
        raise EmulationError(f"one emulated run takes artifacts of one architecture, not {sorted(arches)}",
                             hint="group the artifacts by architecture")
    arch = arches.pop()
    with tempfile.TemporaryDirectory(prefix="fractal-emu-") as tmp:
        args: list[str] = []
        for i, (d, (_, inputs)) in enumerate(zip(dirs, runs, strict=True)):
            arrays: dict[str, Any] = {k: np.ascontiguousarray(v) for k, v in inputs.items()}
            np.savez(Path(tmp) / f"in{i}.npz", **arrays)
            args += [str(d), str(Path(tmp) / f"in{i}.npz"), str(Path(tmp) / f"out{i}.npz")]
        cmd, env = python_command(arch, ["-m", "compiler.runner", *args])
        _run_emulated(cmd, env, tmp, timeout, f"the emulated {arch} run",
                      f"rebuild the sysroot with `make sysroot` if it is broken ({sysroot_dir(arch)})")
        outs = []
        for i in range(len(dirs)):
            with np.load(Path(tmp) / f"out{i}.npz") as npz:
                outs.append({k: npz[k] for k in npz.files})
        return outs


@dataclass(frozen=True)
class ElfInfo:
    """The identifying fields of an ELF header."""

    bits: int  # 32 or 64 (EI_CLASS)
    little_endian: bool  # EI_DATA
    type: int  # e_type: 2 executable, 3 shared object
    machine: int  # e_machine: 62 x86-64, 183 aarch64, 243 RISC-V
    flags: int  # e_flags (RISC-V: float ABI, RVC)

    @property
    def arch(self) -> str:
        return {EM_X86_64: "x86_64", EM_AARCH64: "aarch64", EM_RISCV: "riscv64" if self.bits == 64
                else "riscv32"}.get(self.machine, f"e_machine={self.machine}")

    @property
    def shared_object(self) -> bool:
        return self.type == 3


def elf_info(path: str | Path) -> ElfInfo:
    """Parse the ELF header of ``path`` (no external tools); EmulationError if not ELF."""
    data = Path(path).read_bytes()[:64]
    if len(data) < 52 or data[:4] != b"\x7fELF":
        raise EmulationError(f"{path} is not an ELF file", hint="recompile the artifact")
    bits = {1: 32, 2: 64}.get(data[4], 0)
    little = data[5] == 1
    order: Literal["little", "big"] = "little" if little else "big"
    e_type = int.from_bytes(data[16:18], order)
    e_machine = int.from_bytes(data[18:20], order)
    flags_off = 48 if bits == 64 else 36
    e_flags = int.from_bytes(data[flags_off:flags_off + 4], order)
    return ElfInfo(bits, little, e_type, e_machine, e_flags)
