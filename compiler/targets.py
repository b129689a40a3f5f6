"""Board target presets: a TVM target dict plus the (cross) linker and emulator for each board.

TVM 0.27 only accepts targets as JSON dicts (string targets are rejected). The llvm kind takes
``mtriple``, ``mcpu``, ``mattr`` (list), ``mabi``, ``num-cores`` among others. ``num-cores`` is
what MetaSchedule sizes its parallel loops with, so boards get their real core count.
"""

from __future__ import annotations

import os
import platform
import shutil
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from compiler.errors import TargetError

__all__ = [
    "TargetPreset",
    "PRESETS",
    "get_preset",
    "host_preset_name",
    "best_host_preset_name",
    "cpu_flags",
    "cpu_model",
    "host_arch",
    "linker_for",
    "ARCHES",
    "NATIVE_ALIASES",
    "detect_native",
    "native_preset",
    "resolve_target",
]

ARCHES = ("x86_64", "aarch64", "riscv64")

# Cross linkers per architecture, used when the artifact's arch differs from this machine's.
_CROSS_CXX = {
    "x86_64": "x86_64-linux-gnu-g++",
    "aarch64": "aarch64-linux-gnu-g++",
    "riscv64": "riscv64-linux-gnu-g++",
}
_QEMU = {"aarch64": "qemu-aarch64", "riscv64": "qemu-riscv64"}
_AVX512 = ["+avx2", "+fma", "+avx512f", "+avx512cd", "+avx512bw", "+avx512dq", "+avx512vl"]


@dataclass(frozen=True)
class TargetPreset:
    """One board: what TVM generates code for and what links it."""

    name: str
    arch: str  # "x86_64" | "aarch64" | "riscv64"
    description: str
    target: dict[str, Any]
    cross_compiler: str | None  # None: the build machine's own g++ (x86_64 presets here)
    qemu: str | None = None
    link_options: tuple[str, ...] = field(default_factory=tuple)
    # "vm": a TVM library run by the Relax VM (needs the TVM runtime on the board);
    # "c": the C backend (compiler/cbackend.py), a native library + runner needing no TVM runtime.
    runtime: str = "vm"

    def tvm_target(self) -> Any:
        """The ``tvm.target.Target`` of this preset (imports tvm lazily)."""
        import tvm

        return tvm.target.Target(dict(self.target))


def _host_cores() -> int:
    return max(1, os.cpu_count() or 1)


def _riscv(name: str, march: str, extra_mattr: list[str], description: str) -> TargetPreset:
    mattr = ["+64bit", "+m", "+a", "+f", "+d", "+c", *extra_mattr]
    return TargetPreset(
        name=name,
        arch="riscv64",
        description=description,
        # mabi=lp64d: LLVM must emit the double-float ABI, or GNU ld refuses to link the objects
        # with Debian's riscv64 libstdc++ (which is lp64d).
        target={"kind": "llvm", "mtriple": "riscv64-linux-gnu", "mcpu": "generic-rv64",
                "mattr": mattr, "mabi": "lp64d", "num-cores": 4},
        cross_compiler="riscv64-linux-gnu-g++",
        qemu="qemu-riscv64",
        link_options=(f"-march={march}", "-mabi=lp64d"),
        # PyPI has no riscv64 TVM wheel: riscv64 boards run ahead-of-time C, no TVM runtime.
        runtime="c",
    )


def _build_presets() -> dict[str, TargetPreset]:
    host = _host_cores()
    presets = [
        TargetPreset("x86_64", "x86_64", "generic x86-64 (SSE2), this machine's family",
                     {"kind": "llvm", "mtriple": "x86_64-linux-gnu", "mcpu": "x86-64", "num-cores": host},
                     None),
        TargetPreset("x86_64-avx2", "x86_64", "x86-64 with AVX2 + FMA (Haswell and newer)",
                     {"kind": "llvm", "mtriple": "x86_64-linux-gnu", "mcpu": "haswell",
                      "mattr": ["+avx2", "+fma"], "num-cores": host},
                     None),
        # LLVM's skylake-avx512 tuning prefers 256-bit vectors (AVX-512 frequency throttling on
        # early parts); "-prefer-256-bit" lets it use zmm registers, which is the point here.
        # The +features double as the CPU flags tuning.can_measure checks before timing on a host.
        TargetPreset("x86_64-avx512", "x86_64",
                     "x86-64 with AVX-512 F/CD/BW/DQ/VL (Skylake-SP, Ice Lake and newer)",
                     {"kind": "llvm", "mtriple": "x86_64-linux-gnu", "mcpu": "skylake-avx512",
                      "mattr": [*_AVX512, "-prefer-256-bit"], "num-cores": host},
                     None),
        # AVX-512 VNNI (Cascade Lake, Ice Lake, Zen 4 and newer): vpdpbusd for the int8 kernels
        # (compiler.int8_x86); also what makes QDQ models default to integer kernels
        TargetPreset("x86_64-avx512-vnni", "x86_64",
                     "x86-64 with AVX-512 and VNNI (Cascade Lake, Ice Lake, Zen 4 and newer)",
                     {"kind": "llvm", "mtriple": "x86_64-linux-gnu", "mcpu": "cascadelake",
                      "mattr": [*_AVX512, "+avx512vnni", "-prefer-256-bit"], "num-cores": host},
                     None),
        TargetPreset("aarch64", "aarch64", "generic 64-bit ARM with NEON",
                     {"kind": "llvm", "mtriple": "aarch64-linux-gnu", "mcpu": "generic",
                      "mattr": ["+neon"], "num-cores": 4},
                     "aarch64-linux-gnu-g++", "qemu-aarch64"),
        TargetPreset("rpi4", "aarch64", "Raspberry Pi 4 (4x Cortex-A72)",
                     {"kind": "llvm", "mtriple": "aarch64-linux-gnu", "mcpu": "cortex-a72",
                      "mattr": ["+neon"], "num-cores": 4},
                     "aarch64-linux-gnu-g++", "qemu-aarch64"),
        TargetPreset("rpi5", "aarch64", "Raspberry Pi 5 (4x Cortex-A76, dotprod)",
                     {"kind": "llvm", "mtriple": "aarch64-linux-gnu", "mcpu": "cortex-a76",
                      "mattr": ["+neon", "+dotprod"], "num-cores": 4},
                     "aarch64-linux-gnu-g++", "qemu-aarch64"),
        # The C backend on the other arches: same kernels, no TVM runtime on the board.
        TargetPreset("x86_64-c", "x86_64", "generic x86-64, ahead-of-time C (no TVM runtime needed)",
                     {"kind": "llvm", "mtriple": "x86_64-linux-gnu", "mcpu": "x86-64", "num-cores": host},
                     None, runtime="c"),
        TargetPreset("aarch64-c", "aarch64", "generic 64-bit ARM with NEON, ahead-of-time C",
                     {"kind": "llvm", "mtriple": "aarch64-linux-gnu", "mcpu": "generic",
                      "mattr": ["+neon"], "num-cores": 4},
                     "aarch64-linux-gnu-g++", "qemu-aarch64", runtime="c"),
        _riscv("riscv64", "rv64gc", [], "64-bit RISC-V rv64gc (lp64d)"),
        _riscv("riscv64-rvv", "rv64gcv", ["+v"], "64-bit RISC-V rv64gcv with the vector extension"),
    ]
    return {p.name: p for p in presets}


PRESETS: dict[str, TargetPreset] = _build_presets()

# Presets that are the host preset plus CPU features (candidates for best_host_preset_name).
_HOST_LADDER = {"x86_64": ("x86_64-avx2", "x86_64-avx512")}


def get_preset(name: str) -> TargetPreset:
    """The preset called ``name``; TargetError naming the known presets otherwise."""
    try:
        return PRESETS[name]
    except KeyError:
        raise TargetError(f"unknown target preset {name!r}",
                          hint=f"choose one of: {', '.join(PRESETS)} (see `fractal targets`)") from None


def host_arch() -> str:
    """This machine's architecture in preset terms (x86_64, aarch64, riscv64)."""
    machine = platform.machine().lower()
    return {"amd64": "x86_64", "arm64": "aarch64"}.get(machine, machine)


def host_preset_name() -> str:
    """The generic preset of this machine's architecture."""
    arch = host_arch()
    if arch not in ARCHES:
        raise TargetError(f"this machine's architecture {arch!r} has no preset",
                          hint=f"supported: {', '.join(ARCHES)}")
    return arch


# /proc/cpuinfo's x86 names that LLVM spells otherwise beyond dropping the underscore
# (avx512_vnni -> avx512vnni, avx_vnni -> avxvnni, avx512_bf16 -> avx512bf16, ...).
_LLVM_X86_NAMES = {"sse4_1": "sse4.1", "sse4_2": "sse4.2", "pni": "sse3", "abm": "lzcnt"}


def feature_names(flags: set[str]) -> set[str]:
    """``flags`` as /proc/cpuinfo spells them plus their LLVM ``-mattr`` spellings, which presets
    and manifests use: the kernel writes ``avx512_vnni`` where LLVM writes ``avx512vnni``."""
    out = set(flags)
    for f in flags:
        out.add(_LLVM_X86_NAMES.get(f, f.replace("_", "")))
    return out


def cpu_flags() -> set[str]:
    """This CPU's feature flags from /proc/cpuinfo (x86 ``flags``, ARM ``Features``) with their
    LLVM spellings (:func:`feature_names`); empty if unknown."""
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return set()
    return feature_names(set(_cpuinfo_field(text, "flags", "features").split()))


def cpu_model() -> str:
    """This CPU's model name from /proc/cpuinfo (else ``platform.machine()``)."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.machine()


def best_host_preset_name() -> str:
    """The most specific preset this CPU runs: the generic host preset plus every ``+feature``
    it names in /proc/cpuinfo (x86_64-avx512 > x86_64-avx2 > x86_64 here; board presets, whose
    mcpu differs from the host's, are never picked)."""
    host = host_preset_name()
    flags = cpu_flags()
    best, best_n = host, 0
    for name in _HOST_LADDER.get(host, ()):
        need = [f[1:] for f in PRESETS[name].target.get("mattr", []) if f.startswith("+")]
        if flags and all(f in flags for f in need) and len(need) > best_n:
            best, best_n = name, len(need)
    return best


def linker_for(preset: TargetPreset) -> str | None:
    """The C++ driver that links ``preset``'s objects; None means TVM's default (host g++).

    Raises TargetError when a needed cross compiler is not installed.
    """
    if preset.arch == host_arch():
        return None
    cxx = preset.cross_compiler or _CROSS_CXX[preset.arch]
    if shutil.which(cxx) is None:
        raise TargetError(f"cross compiler {cxx!r} for target {preset.name!r} not found on PATH",
                          hint=f"install it (Debian: apt-get install g++-{preset.arch.replace('_', '-')}"
                               "-linux-gnu) or compile for the host preset")
    return cxx


# ------------------------------------------------------------------------------ --target native
NATIVE_ALIASES = ("native", "host")  # like -march=native: the preset of the machine compiling


def _cpuinfo_field(text: str, *keys: str) -> str:
    """The first ``key : value`` of /proc/cpuinfo text whose key is one of ``keys`` ('' if none)."""
    for line in text.splitlines():
        key, sep, value = line.partition(":")
        if sep and key.strip().lower() in keys:
            return value.strip()
    return ""


def detect_native(cpuinfo: str, machine: str) -> tuple[str, str]:
    """(preset name, why) for a machine whose /proc/cpuinfo reads ``cpuinfo`` and whose
    ``platform.machine()`` is ``machine``. Pure, so tests give it other machines' texts.

    x86_64: AVX-512 F/CD/BW/DQ/VL + VNNI -> x86_64-avx512-vnni, without VNNI -> x86_64-avx512,
    AVX2 + FMA -> x86_64-avx2, else x86_64. aarch64: NEON + dotprod (asimddp) -> rpi5 (Cortex-A76
    tuning), else aarch64. riscv64: the V extension in ``isa`` -> riscv64-rvv, else riscv64."""
    arch = {"amd64": "x86_64", "arm64": "aarch64"}.get(machine.lower(), machine.lower())
    if arch == "x86_64":
        flags = feature_names(set(_cpuinfo_field(cpuinfo, "flags").split()))  # LLVM's names, as presets'
        avx512 = [f[1:] for f in _AVX512 if f.startswith("+")]
        if all(f in flags for f in avx512):
            if "avx512vnni" in flags:
                return "x86_64-avx512-vnni", "AVX-512 F/CD/BW/DQ/VL + VNNI"
            return "x86_64-avx512", "AVX-512 F/CD/BW/DQ/VL, no VNNI"
        if {"avx2", "fma"} <= flags:
            return "x86_64-avx2", "AVX2 + FMA, no AVX-512"
        return "x86_64", "no AVX2 + FMA: generic x86-64"
    if arch == "aarch64":
        feats = set(_cpuinfo_field(cpuinfo, "features").split())
        if {"asimd", "asimddp"} <= feats:
            return "rpi5", "NEON + dotprod (Cortex-A76 class)"
        return "aarch64", "NEON" + ("" if "asimd" in feats else " (assumed: no asimd flag)") + ", no dotprod"
    if arch == "riscv64":
        isa = _cpuinfo_field(cpuinfo, "isa").lower()
        base = isa.split("_", 1)[0]  # rv64imafdcv_zicsr_...: single-letter extensions before the first _
        if base.startswith("rv64") and "v" in base[4:]:
            return "riscv64-rvv", f"vector extension V ({base})"
        return "riscv64", f"no vector extension ({base or 'no isa line'})"
    raise TargetError(f"--target native: this machine's architecture {machine!r} has no preset",
                      hint=f"supported: {', '.join(ARCHES)}; name a preset with --target "
                           "(see `fractal targets`)")


def native_preset() -> tuple[str, str]:
    """(preset name, why) for the machine running this: ``detect_native`` on /proc/cpuinfo."""
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        text = ""
    return detect_native(text, platform.machine())


def resolve_target(name: str) -> tuple[str, str | None]:
    """``name`` itself, or for ``native``/``host`` the detected preset and a line saying why."""
    if name.lower() not in NATIVE_ALIASES:
        return name, None
    preset, why = native_preset()
    return preset, f"--target {name}: {preset} ({why})"
