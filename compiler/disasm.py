"""Which instructions a compiled library's kernels use, from the disassembly (GNU objdump).

What proves that a build uses a CPU's int8 dot product (Arm ``sdot``) or vector unit (RISC-V
``vwmacc``...) is the machine code itself, not the target flags it was built with. The objdump of
the library's architecture (Debian's cross binutils, installed with the cross compilers by
``deploy/install-system-deps.sh``) is read per function: TVM's kernels are the functions named
``<kernel>_compute_`` (the bodies; ``__tvm_ffi_<kernel>`` are their argument-unpacking wrappers).
"""

from __future__ import annotations

import shutil
import subprocess
from collections import Counter
from pathlib import Path

from compiler.errors import TargetError

__all__ = ["OBJDUMP", "function_instructions", "kernel_instructions"]

OBJDUMP = {"x86_64": "objdump", "aarch64": "aarch64-linux-gnu-objdump",
           "riscv64": "riscv64-linux-gnu-objdump"}
_BODY = "_compute_"


def function_instructions(lib: str | Path, arch: str) -> dict[str, Counter[str]]:
    """Mnemonic counts of every function in ``lib`` (an ELF object or library for ``arch``)."""
    tool = OBJDUMP.get(arch)
    if tool is None or shutil.which(tool) is None:
        raise TargetError(f"no objdump for {arch} ({tool or 'unknown arch'})",
                          hint="install the cross binutils (bash deploy/install-system-deps.sh)")
    proc = subprocess.run([tool, "-d", "--no-show-raw-insn", str(lib)], capture_output=True, text=True)
    if proc.returncode != 0:
        raise TargetError(f"{tool} could not read {lib}: {' '.join(proc.stderr.split())[:200]}",
                          hint="recompile the artifact")
    out: dict[str, Counter[str]] = {}
    current: Counter[str] | None = None
    for line in proc.stdout.splitlines():
        if line.endswith(">:") and "<" in line:  # "0000000000000c40 <name>:"
            current = out.setdefault(line[line.index("<") + 1:-2], Counter())
        elif current is not None and "\t" in line:
            fields = line.split("\t")  # "   c44:\tsdot\tv0.4s, v1.16b, v2.16b"
            if len(fields) > 1 and fields[1].strip():
                current[fields[1].split()[0]] += 1
    return out


def kernel_instructions(lib: str | Path, arch: str) -> dict[str, Counter[str]]:
    """Mnemonic counts of the TVM kernel bodies in ``lib``, keyed by kernel name (``fused_...``)."""
    return {name.removesuffix(_BODY): c for name, c in function_instructions(lib, arch).items()
            if name.endswith(_BODY)}
