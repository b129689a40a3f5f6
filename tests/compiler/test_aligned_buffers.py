"""One 64-byte aligned allocator (compiler.runtime.aligned_empty) for the TVM runtime and the
C-backend loader; the board side (compiler.clib) imports it without pulling in TVM."""

from __future__ import annotations

import ast
import os
import subprocess
import sys
from pathlib import Path

import numpy as np

from compiler import clib, runtime

ROOT = Path(__file__).resolve().parents[2]


def test_the_c_loader_and_the_tvm_runtime_share_one_aligned_allocator():
    assert clib.aligned_empty is runtime.aligned_empty
    defs = [f"{p.name}:{n.name}" for p in sorted((ROOT / "compiler").glob("*.py"))
            for n in ast.walk(ast.parse(p.read_text()))
            if isinstance(n, ast.FunctionDef) and "aligned" in n.name and "empty" in n.name]
    assert defs == ["runtime.py:aligned_empty"], defs
    for shape, dtype in (((3, 5), np.float32), ((1,), np.uint8), ((7, 1, 9), np.int64)):
        a = runtime.aligned_empty(shape, dtype)
        assert a.shape == shape and a.dtype == dtype and a.ctypes.data % 64 == 0 and a.flags.c_contiguous


def test_the_board_side_loader_imports_no_tvm():
    code = "import sys, compiler.clib; print('tvm' in sys.modules)"
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
                       env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert r.returncode == 0 and r.stdout.strip() == "False", r.stderr
