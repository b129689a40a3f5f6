"""The TVM side of an artifact: a loaded library, one VirtualMachine per thread, zero-copy tensors.

Standard library, numpy and tvm (imported lazily) only: this also runs on boards and under qemu-user.
"""

from __future__ import annotations

import math
import threading
from pathlib import Path
from typing import Any

import numpy as np

from compiler.errors import ArtifactError, InputError

__all__ = ["Runtime", "PreparedParams", "aligned_empty", "aligned_copy", "check_params"]


# TVM's kernels may assume 64-byte aligned buffers (tvm.runtime.from_dlpack insists on it).
_ALIGN = 64


def aligned_empty(shape: tuple[int, ...], dtype: Any) -> np.ndarray:
    """An uninitialised C-contiguous array whose data is 64-byte aligned (zero-copy into TVM)."""
    dtype = np.dtype(dtype)
    nbytes = math.prod(shape) * dtype.itemsize
    # an empty array (a length-0 axes input) keeps one element's room: numpy moves the data
    # pointer of a zero-byte view, which TVM then refuses as unaligned
    room = nbytes or dtype.itemsize
    buf = np.empty(room + _ALIGN, dtype=np.uint8)
    off = (-buf.ctypes.data) % _ALIGN
    return buf[off:off + room].view(dtype)[:math.prod(shape)].reshape(shape)


def aligned_copy(arr: np.ndarray) -> np.ndarray:
    """A 64-byte aligned C-contiguous copy of ``arr`` (native byte order)."""
    arr = np.asarray(arr)
    out = aligned_empty(arr.shape, arr.dtype.newbyteorder("="))
    out[...] = arr
    return out


def _flatten(result: Any, out: list[Any]) -> list[Any]:
    """The tensors of a VM result (a tensor or nested arrays of them), depth first."""
    if hasattr(result, "data_ptr"):
        out.append(result)
    else:
        for item in result:
            _flatten(item, out)
    return out


class Runtime:
    """A loaded library plus one VirtualMachine per calling thread (a VM is not thread-safe)."""

    def __init__(self, lib_path: Path) -> None:
        try:
            import tvm
            from tvm import relax
        except ImportError:  # a node install (no `[compiler]` extra) runs C-backend artifacts only
            from fractal.extras import COMPILER_INSTALL

            raise ArtifactError(f"{lib_path.parent.name} was compiled for the TVM runtime, which this "
                                "install lacks",
                                hint=f"{COMPILER_INSTALL}, or compile the model for a C preset "
                                     "(e.g. --target x86_64-c)") from None

        self._tvm = tvm
        self._relax = relax
        import tvm_ffi  # (installed with tvm, which is built on it)

        self._from_dlpack = tvm_ffi.from_dlpack
        try:
            self.lib = tvm.runtime.load_module(str(lib_path))
        except Exception as exc:
            raise ArtifactError(f"cannot load {lib_path.name}: {' '.join(str(exc).split())[:200]}",
                                hint="the library was built for another machine or is damaged; "
                                     "recompile") from None
        self.device = tvm.cpu()
        self._local = threading.local()
        self._kept: dict[str, frozenset[int]] = {}  # per function: output positions the VM keeps

    def vm(self) -> Any:
        vm = getattr(self._local, "vm", None)
        if vm is None:
            vm = self._relax.VirtualMachine(self.lib, self.device)
            self._local.vm = vm
            self._local.funcs = {}
            self._local.staging = {}
        return vm

    def func(self, name: str) -> Any:
        """This thread's VM function ``name`` (looked up once per thread)."""
        self.vm()
        funcs: dict[str, Any] = self._local.funcs
        f = funcs.get(name)
        if f is None:
            f = funcs[name] = self._local.vm[name]
        return f

    def call(self, name: str, args: tuple[Any, ...], arg_tensors: list[Any]) -> list[np.ndarray]:
        """Run VM function ``name`` on ``args``; its output tensors, flattened, as numpy arrays.

        Outputs cross by DLPack (each array keeps its tensor alive) and are owned by the caller:
        an output the VM keeps (a constant, e.g. the zero gradient of an unused parameter, or
        planned storage), one aliasing an argument in ``arg_tensors`` (an identity) or a sibling
        is copied, so writing to a result can never reach the VM, an argument or another result.
        Which outputs the VM keeps is found on the first call by calling twice: a fresh output
        cannot land at the address of one still alive.
        """
        f = self.func(name)
        flat = _flatten(f(*args), [])
        kept = self._kept.get(name)
        if kept is None:
            again = _flatten(f(*args), [])
            kept = frozenset(i for i, (a, b) in enumerate(zip(flat, again, strict=True))
                             if a.data_ptr() == b.data_ptr())
            self._kept[name] = kept
        seen = {t.data_ptr() for t in arg_tensors}
        out = []
        for i, t in enumerate(flat):
            arr = np.from_dlpack(t)
            ptr = t.data_ptr()
            if i in kept or ptr in seen:
                arr = arr.copy()
            else:
                seen.add(ptr)
            out.append(arr)
        return out

    def transform(self, name: str, tensors: list[Any]) -> list[Any]:
        """Run the parameter transform ``name`` (params tuple -> packed params tuple) once.

        The packed tensors are fresh, aliases of ``tensors`` (parameters it passes through), or
        constants the VM holds; inference only reads them, so none is copied."""
        try:
            return _flatten(self.func(name)(list(tensors)), [])
        except Exception as exc:
            raise ArtifactError(f"parameter transform {name} failed: {' '.join(str(exc).split())[:200]}",
                                hint="the library does not match its manifest; recompile") from None

    def tensor(self, arr: np.ndarray, slot: int | None = None) -> Any:
        """A CPU tensor over ``arr``'s memory (DLPack, no copy) when ``arr`` is a C-contiguous,
        writable, native-order ndarray with 64-byte aligned data; otherwise over an aligned copy.
        The tensor keeps the array alive; the VM only reads its arguments (Relax is pure).

        With ``slot`` the copy goes into this thread's staging buffer for that slot instead of a
        new allocation: only for arguments that live no longer than one VM call.
        """
        if arr.size == 0:  # numpy's empty arrays have zero strides; TVM's kernels check for compact ones
            return self._tvm.runtime.empty(arr.shape, str(arr.dtype.newbyteorder("=")))
        if type(arr) is np.ndarray and arr.flags.c_contiguous and arr.flags.writeable \
                and arr.dtype.isnative:
            # Alignment is checked on the tensor, not by from_dlpack: its error path costs ~20 us.
            t = self._from_dlpack(arr, require_alignment=0, require_contiguous=True)
            if not t.data_ptr() % _ALIGN:
                return t
        if slot is not None:
            arr = np.asarray(arr)
            self.vm()
            staging: dict[Any, tuple[np.ndarray, Any]] = self._local.staging
            key = (slot, arr.shape, arr.dtype)
            hit = staging.get(key)
            if hit is None:
                buf = aligned_empty(arr.shape, arr.dtype.newbyteorder("="))
                hit = staging[key] = (buf, self._from_dlpack(buf, require_alignment=_ALIGN))
            np.copyto(hit[0], arr)
            return hit[1]
        return self._from_dlpack(aligned_copy(arr), require_alignment=_ALIGN, require_contiguous=True)


class PreparedParams:
    """Parameters converted once to device tensors; pass to ``infer`` to skip per-call copies.

    With ``transform`` (the artifact's ``main_transform_params``, see :mod:`compiler.prepack`)
    the tensors handed to inference are the packed ones it returns: folded BatchNorm and the
    weight layouts the tuned kernels read, computed once here instead of on every call.
    ``arrays`` stay the original (ONNX-layout) parameters, the ones training and the swarm use.
    """

    def __init__(self, runtime: Runtime, params: list[np.ndarray], transform: str | None = None) -> None:
        self.arrays = list(params)
        # Copied once (aligned): the tensors must not change if the caller later writes to its arrays.
        self.originals = [runtime.tensor(aligned_copy(p)) for p in self.arrays]
        self.tensors = self.originals if transform is None else runtime.transform(transform, self.originals)


def check_params(params: list[np.ndarray], names: list[str], ref: list[np.ndarray]) -> list[np.ndarray]:
    if len(params) != len(ref):
        raise InputError(f"expected {len(ref)} parameters, got {len(params)}",
                         hint="pass the full parameter list in manifest order")
    out = []
    for name, p, r in zip(names, params, ref, strict=True):
        p = np.asarray(p)
        if p.shape != r.shape or p.dtype != r.dtype:
            raise InputError(f"parameter {name!r} is {p.dtype}{list(p.shape)}, "
                             f"expected {r.dtype}{list(r.shape)}",
                             hint="parameters must keep the compiled shapes and dtypes")
        out.append(p)
    return out
