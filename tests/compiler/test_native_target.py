"""`--target native` (alias host): the preset of the machine compiling, from /proc/cpuinfo texts.

The real compile on this machine is in tests/compiler/test_prepare_ml.py (the scikit-learn pipeline
compiled with --target native)."""

from __future__ import annotations

import pytest

from compiler.errors import TargetError
from compiler.targets import PRESETS, detect_native, resolve_target

_X86 = "processor\t: 0\nvendor_id\t: GenuineIntel\nflags\t\t: fpu sse sse2 {extra}\nbugs\t\t: spectre_v1\n"
_ARM = ("processor\t: 0\nBogoMIPS\t: 108.00\nFeatures\t: fp asimd evtstrm {extra} cpuid\n"
        "CPU implementer\t: 0x41\n")
_RV = "processor\t: 0\nhart\t\t: 0\nisa\t\t: {isa}\nmmu\t\t: sv39\n"


@pytest.mark.parametrize(("text", "machine", "want", "says"), [
    (_X86.format(extra="avx avx2 fma avx512f avx512cd avx512bw avx512dq avx512vl avx512_vnni"), "x86_64",
     "x86_64-avx512-vnni", "AVX-512 F/CD/BW/DQ/VL + VNNI"),
    (_X86.format(extra="avx avx2 fma avx512f avx512cd avx512bw avx512dq avx512vl"), "x86_64",
     "x86_64-avx512", "AVX-512 F/CD/BW/DQ/VL, no VNNI"),
    (_X86.format(extra="avx avx2 fma avx512f"), "x86_64", "x86_64-avx2", "AVX2 + FMA, no AVX-512"),  # F only
    (_X86.format(extra="avx avx2 fma"), "AMD64", "x86_64-avx2", "AVX2 + FMA"),
    (_X86.format(extra="avx"), "x86_64", "x86_64", "generic"),
    (_ARM.format(extra="aes pmull sha1 sha2 crc32 atomics fphp asimdhp asimdrdm lrcpc dcpop asimddp"),
     "aarch64", "rpi5", "dotprod"),
    (_ARM.format(extra="aes pmull crc32"), "aarch64", "aarch64", "no dotprod"),
    (_ARM.format(extra="asimddp"), "arm64", "rpi5", "dotprod"),
    (_RV.format(isa="rv64imafdcv_zicbom_zicboz_zicntr_zicsr_zifencei"), "riscv64", "riscv64-rvv",
     "rv64imafdcv"),
    (_RV.format(isa="rv64imafdc_zicntr_zicsr_zifencei_zihpm_zvl128b"), "riscv64", "riscv64", "no vector"),
])
def test_detect_native(text: str, machine: str, want: str, says: str) -> None:
    name, why = detect_native(text, machine)
    assert (name, name in PRESETS) == (want, True)
    assert says in why and "\n" not in why


def test_unknown_machine_refused() -> None:
    with pytest.raises(TargetError, match="'s390x' has no preset"):
        detect_native("", "s390x")


def test_resolve_target_aliases() -> None:
    assert resolve_target("x86_64-avx2") == ("x86_64-avx2", None)
    for alias in ("native", "host", "Native"):
        name, line = resolve_target(alias)
        assert name in PRESETS and line is not None and line.startswith(f"--target {alias}: {name} (")
