"""Load a C-backend model library with ctypes (board side: standard library + numpy only).

:class:`CLibrary` calls the generated entry points (see compiler/cruntime/fractal_rt.h);
:class:`CRuntime` gives :class:`compiler.artifact.Artifact` and its Trainer the same ``call`` /
``tensor`` interface the Relax VM runtime has, so a C-backend artifact serves and trains through
the same classes.
"""

from __future__ import annotations

import ctypes
import math
import threading
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from compiler.errors import ArtifactError, InputError
from compiler.runtime import aligned_empty  # numpy only at import: tvm stays lazy, boards have none

__all__ = ["CLibrary", "CRuntime", "CSignature", "TensorDesc", "LIB_NAME", "RUNNER_NAME"]

LIB_NAME = "libmodel.so"
RUNNER_NAME = "fractal-run"
_MAX_DIMS = 8


@dataclass(frozen=True)
class TensorDesc:
    """Static shape and dtype of one flattened function input or output."""

    shape: tuple[int, ...]
    dtype: str

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * np.dtype(self.dtype).itemsize


@dataclass(frozen=True)
class CSignature:
    """One generated entry point: flattened inputs, outputs and its workspace size in bytes."""

    name: str
    inputs: tuple[TensorDesc, ...]
    outputs: tuple[TensorDesc, ...]
    workspace: int


class _Desc(ctypes.Structure):
    _fields_ = [("ndim", ctypes.c_int32), ("code", ctypes.c_uint8), ("bits", ctypes.c_uint8),
                ("lanes", ctypes.c_uint16), ("shape", ctypes.c_int64 * _MAX_DIMS)]


_ENTRY = ctypes.CFUNCTYPE(ctypes.c_int, ctypes.POINTER(ctypes.c_void_p), ctypes.POINTER(ctypes.c_void_p),
                          ctypes.c_void_p)


class _Func(ctypes.Structure):
    _fields_ = [("name", ctypes.c_char_p), ("n_in", ctypes.c_int32), ("n_out", ctypes.c_int32),
                ("ins", ctypes.POINTER(_Desc)), ("outs", ctypes.POINTER(_Desc)),
                ("workspace", ctypes.c_uint64), ("fn", _ENTRY)]


_NP_DTYPE = {(0, 8): "int8", (0, 16): "int16", (0, 32): "int32", (0, 64): "int64", (1, 8): "uint8",
             (1, 16): "uint16", (1, 32): "uint32", (1, 64): "uint64", (2, 16): "float16",
             (2, 32): "float32", (2, 64): "float64", (6, 8): "bool"}


def _desc_of(d: _Desc) -> TensorDesc:
    return TensorDesc(tuple(int(d.shape[i]) for i in range(d.ndim)), _NP_DTYPE[(d.code, d.bits)])


class CLibrary:
    """A native model library loaded with ctypes: ``call(name, arrays) -> arrays``.

    Thread-safe: each thread has its own workspace per function."""

    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)
        try:
            self._lib = ctypes.CDLL(str(self.path))
        except OSError as exc:
            raise ArtifactError(f"cannot load {self.path.name}: {exc}",
                                hint="the library was built for another machine or is damaged; "
                                     "recompile") from None
        self._lib.fr_num_functions.restype = ctypes.c_int32
        self._lib.fr_get_function.restype = ctypes.POINTER(_Func)
        self._lib.fr_get_function.argtypes = [ctypes.c_int32]
        self._lib.fr_last_error.restype = ctypes.c_char_p
        self.functions: dict[str, tuple[_Func, CSignature]] = {}
        for i in range(self._lib.fr_num_functions()):
            f = self._lib.fr_get_function(i).contents
            sig = CSignature(f.name.decode(), tuple(_desc_of(f.ins[k]) for k in range(f.n_in)),
                             tuple(_desc_of(f.outs[k]) for k in range(f.n_out)), int(f.workspace))
            self.functions[sig.name] = (f, sig)
        self._local = threading.local()

    def signature(self, name: str) -> CSignature:
        return self._get(name)[1]

    @property
    def threads(self) -> int:
        """Threads the library's parallel loops run on (1 for libraries built before the pool)."""
        get = getattr(self._lib, "fr_get_num_threads", None)
        return int(get()) if get is not None else 1

    def set_threads(self, n: int) -> int:
        """Run parallel loops on ``n`` threads (0: the default, see fractal_rt.h); the count now in
        force. Process-wide for this library; outputs do not depend on it (bit-identical)."""
        fn = getattr(self._lib, "fr_set_num_threads", None)
        if fn is None:
            return 1
        fn.restype = ctypes.c_int
        fn.argtypes = [ctypes.c_int]
        return int(fn(int(n)))

    def _get(self, name: str) -> tuple[_Func, CSignature]:
        try:
            return self.functions[name]
        except KeyError:
            raise ArtifactError(f"{self.path.name} has no function {name!r}",
                                hint=f"it has: {', '.join(self.functions)}") from None

    def call(self, name: str, arrays: list[np.ndarray]) -> list[np.ndarray]:
        """Run function ``name`` on its flattened inputs; fresh output arrays (owned by the caller)."""
        f, sig = self._get(name)
        if len(arrays) != len(sig.inputs):
            raise InputError(f"{name} takes {len(sig.inputs)} tensors, got {len(arrays)}",
                             hint="pass inputs then parameters in manifest order")
        # Per thread and function: the pointer arrays, the workspace and the arrays of the last
        # call. An argument that is the very same array object as last time (parameters, staged
        # inputs) keeps its pointer: it is held in `last`, so its memory cannot have moved.
        st = self._local.__dict__.setdefault("state", {}).get(name)
        if st is None:
            st = self._local.state[name] = (
                (ctypes.c_void_p * max(1, len(sig.inputs)))(), (ctypes.c_void_p * max(1, len(sig.outputs)))(),
                aligned_empty((max(1, sig.workspace),), np.uint8), [None] * len(sig.inputs),
                [np.dtype(d.dtype) for d in sig.inputs])
        ins, outp, ws, last, dtypes = st
        for i, (a, d) in enumerate(zip(arrays, sig.inputs, strict=True)):
            if a is last[i]:
                continue
            if type(a) is not np.ndarray:
                a = np.asarray(a)
            if a.shape != d.shape or a.dtype != dtypes[i]:
                raise InputError(f"{name} input {i} is {a.dtype}{list(a.shape)}, "
                                 f"expected {d.dtype}{list(d.shape)}",
                                 hint="pass arrays with the compiled shapes and dtypes")
            if not (a.flags.c_contiguous and a.dtype.isnative):
                a = np.require(a, a.dtype.newbyteorder("="), requirements="C")
            last[i] = a
            ins[i] = a.ctypes.data
        outs = [aligned_empty(d.shape, d.dtype) for d in sig.outputs]
        for i, o in enumerate(outs):
            outp[i] = o.ctypes.data
        if f.fn(ins, outp, ctypes.c_void_p(ws.ctypes.data)) != 0:
            msg = (self._lib.fr_last_error() or b"").decode(errors="replace")
            raise InputError(f"{name} failed in {self.path.name}: {msg[:300]}",
                             hint="check the inputs; recompile if the library is damaged")
        return outs


def _leaves(v: Any, out: list[np.ndarray]) -> list[np.ndarray]:
    if isinstance(v, (tuple, list)):
        for x in v:
            _leaves(x, out)
    else:
        out.append(v)
    return out


class CRuntime:
    """The Relax VM runtime's interface (``call``, ``tensor``) over a C-backend library."""

    def __init__(self, lib_path: Path) -> None:
        self.lib = CLibrary(lib_path)

    def tensor(self, arr: np.ndarray, slot: int | None = None) -> np.ndarray:
        """Arguments stay numpy arrays (CLibrary passes their memory without a copy)."""
        del slot
        return np.asarray(arr)

    def call(self, name: str, args: tuple[Any, ...], arg_tensors: list[Any]) -> list[np.ndarray]:
        """Run ``name`` on ``args`` (tuples flattened depth first); fresh output arrays."""
        del arg_tensors  # outputs are always fresh arrays: nothing can alias an argument
        return self.lib.call(name, _leaves(args, []))
