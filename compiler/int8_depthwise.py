"""Depthwise int8 convolutions as channels-last kernels with the requantization fused in, for the
targets that have their own int8 kernels (x86 :mod:`compiler.int8_x86`, Arm :mod:`compiler.int8_arm`).

A depthwise convolution has no reduction over channels, so nothing for the dot-product
instructions to sum four bytes at a time; its reduction is the ``KH x KW`` window of one channel.
Generic, it ran as three kernels per layer: the padding copy, an int32 convolution whose epilogue
wrote float32 (bias, scale) and, in the next layer's input conversion, the quantization, with the
activations in memory between them. Here one kernel reads the zero-point-padded NHWC int8
activations, keeps a register tile of a few output columns x ``V`` channels of int32
accumulators while the window is unrolled around it (channels in the vector lanes: one load, a
widening multiply and an add per tap and vector, ``vpmovsxbd``/``vpmulld``/``vpaddd`` on x86,
``smull``/``smlal`` on NEON) and requantizes the tile in registers (bias, one multiply by
``scale / sy``, round half to even, zero point, clamp, ReLU: :func:`requantize`) before one int8
store.

:class:`Int8Kernels` is what both targets' kernel sets share: the depthwise builder, the record
of the PrimFuncs made (``funcs``, for :func:`compiler.integer.integer_kernels` to add to the
module) and the count per kind (``used``, the manifest's ``dot_product_kernels(...)`` step).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import numpy as np

__all__ = ["DEPTHWISE", "ROWS_MATMUL", "DepthwiseKernels", "Int8Kernels", "multiplier", "requantize",
           "worth_parallel"]

DEPTHWISE = "fractal_depthwise_i8"
ROWS_MATMUL = "fractal_matmul_rows_i8"
# A parallel loop pays a thread-pool launch and a barrier per call: ~1-2 us idle, 4-5 us on this
# shared 2-core machine at load 5, and a whole stall when the other worker is descheduled (TVM's
# pool splits the loop statically, so the caller waits for it). MLPerf Tiny's kernels are 1-50 us,
# so a kernel runs its outer loop in parallel only with about this much single-thread work.
PARALLEL_MIN_US = 25.0


def worth_parallel(macs: int, macs_per_us: float) -> bool:
    """Whether a kernel of ``macs`` multiply-adds (at about ``macs_per_us`` on one thread) should
    run its outer loop in parallel (see ``PARALLEL_MIN_US``)."""
    return macs / macs_per_us >= PARALLEL_MIN_US


def multiplier(scale: np.ndarray, sy: float) -> np.ndarray:
    """The per-channel float32 requantization multiplier ``scale[c] / sy`` the kernels apply
    (:func:`requantize`), computed once at compile time in float64."""
    return (np.asarray(scale, np.float64) / float(sy)).astype(np.float32)


def requantize(acc: Any, bias: Any, mult: Any, shape: tuple[int, ...], *, zy: int, out_dtype: str,
               relu: bool) -> Any:
    """The te stage ``round((acc + bias[c]) * mult[c]) + zy`` over ``shape`` (channels last),
    ``mult`` from :func:`multiplier`: float32, round half to even, zero point, clamp, ReLU on
    the quantized grid (``max(q, zy)``). ``R.quantize`` divides the float32 product
    ``(acc + bias) * scale`` by ``sy``; one multiply by ``scale / sy`` instead rounds differently
    only where a value lies within float32 rounding of a half step (one step at most, as the float
    reference's own summation order does), and a ``vdivps`` per 8 outputs was ~10% of
    mobilenet's int8 time on AVX2."""
    from tvm import te, tirx

    lo, hi = (-128, 127) if out_dtype == "int8" else (0, 255)
    lo = max(lo, zy) if relu else lo

    def requant(*idx: Any) -> Any:
        c = idx[-1]
        q = te.round((acc[idx] + bias[c]).astype("float32") * mult[c]) + tirx.const(float(zy), "float32")
        return te.max(te.min(q, tirx.const(float(hi), "float32")),
                      tirx.const(float(lo), "float32")).astype(out_dtype)

    return te.compute(shape, requant, name="requant")


class Int8Kernels:
    """The kernel builders a target's int8 kernel set has in common; subclasses are dataclasses
    with ``funcs`` (global var -> PrimFunc made), ``used`` (count per kind) and ``vector`` (int32
    lanes of one vector register: the depthwise tile's width is 2 of them)."""

    funcs: list[tuple[Any, Any]]
    used: dict[str, int]
    vector: int

    def summary(self) -> str:
        return ", ".join(f"{n} {name}" for name, n in sorted(self.used.items()))

    def conv2d(self, xq: Any, wq: np.ndarray, bias: np.ndarray, scale: np.ndarray, *, zx: int,
               sy: float, zy: int, out_dtype: str, relu: bool, strides: tuple[int, int],
               dilation: tuple[int, int], pads: tuple[int, int, int, int], groups: int) -> Any:
        """``quantize(conv2d(xq - zx, wq) + bias) * scale`` (NCHW in and out) on this target's
        kernel, or None where none applies: here the depthwise one (:meth:`depthwise`)."""
        return self.depthwise(xq, wq, bias, scale, zx=zx, sy=sy, zy=zy, out_dtype=out_dtype, relu=relu,
                              strides=strides, dilation=dilation, pads=pads, groups=groups)

    def matmul(self, xq: Any, w_kn: np.ndarray, bias: np.ndarray, scale: np.ndarray, *, zx: int,
               sy: float, zy: int, out_dtype: str, relu: bool) -> Any:
        return None

    def emit(self, func: Any, kind: str, label: str, args: list[Any], out: Any) -> Any:
        """``call_tir`` of ``func`` (recorded in ``funcs`` as ``fractal_int8_<label>_<i>``, counted
        under ``kind``) on ``args``, returning ``out``."""
        from tvm import relax

        self.used[kind] = self.used.get(kind, 0) + 1
        # (private, like the functions LegalizeOps makes: the build names its symbol after the
        # GlobalVar, so passes that copy functions, as tuning's do, cannot duplicate a symbol;
        # a GlobalVar typed by the function it names: call_tir checks its callee's type)
        func = func.without_attr("global_symbol")
        gv = relax.BlockBuilder().add_func(func, f"fractal_int8_{label}_{len(self.funcs)}")
        self.funcs.append((gv, func))
        return relax.call_tir(gv, args, out)

    def depthwise(self, xq: Any, wq: np.ndarray, bias: np.ndarray, scale: np.ndarray, *, zx: int,
                  sy: float, zy: int, out_dtype: str, relu: bool, strides: tuple[int, int],
                  dilation: tuple[int, int], pads: tuple[int, int, int, int], groups: int) -> Any:
        """The depthwise convolution (``groups`` = input = output channels, ``wq`` ``[C, 1, KH,
        KW]`` int8) on the fused channels-last kernel, or None (another convolution, a channel
        count that is no multiple of 4, int32 overflow of the bias, dynamic shapes)."""
        from tvm import relax, tirx

        shape = xq.ty.shape
        if shape is None or not all(isinstance(d, tirx.IntImm) for d in shape) or len(shape) != 4:
            return None
        n, c, h, w = (int(d) for d in shape)
        if wq.ndim != 4 or groups != c or wq.shape[:2] != (c, 1) or str(xq.ty.dtype) != "int8" \
                or wq.dtype != np.int8 or c % 4:
            return None
        if np.abs(bias).max(initial=0) >= 2**31:
            return None
        kh, kw = int(wq.shape[2]), int(wq.shape[3])
        hp, wp = h + pads[0] + pads[2], w + pads[1] + pads[3]
        oh = (hp - dilation[0] * (kh - 1) - 1) // strides[0] + 1
        ow = (wp - dilation[1] * (kw - 1) - 1) // strides[1] + 1
        if oh < 1 or ow < 1:
            return None
        x = relax.op.permute_dims(xq, [0, 2, 3, 1])
        if any(pads):
            x = relax.op.nn.pad(x, [0, 0, pads[0], pads[2], pads[1], pads[3], 0, 0], pad_value=float(zx))
        func = self._depthwise_func((n, hp, wp, c), (kh, kw), (oh, ow), strides, dilation, sy=sy, zy=zy,
                                    out_dtype=out_dtype, relu=relu)
        w_hwc = np.ascontiguousarray(wq.reshape(c, kh, kw).transpose(1, 2, 0))
        args = [x, relax.const(w_hwc), relax.const(bias.astype(np.int32)),
                relax.const(multiplier(scale, sy))]
        out = self.emit(func, DEPTHWISE, "depthwise", args, relax.TensorType([n, oh, ow, c], out_dtype))
        return relax.op.permute_dims(out, [0, 3, 1, 2])

    def _depthwise_func(self, shape: tuple[int, int, int, int], window: tuple[int, int],
                        out_hw: tuple[int, int], strides: tuple[int, int], dilation: tuple[int, int], *,
                        sy: float, zy: int, out_dtype: str, relu: bool) -> Any:
        from tvm import s_tir, te

        n, hp, wp, c = shape
        kh, kw = window
        oh, ow = out_hw
        (sh, sw), (dh, dw) = strides, dilation
        X = te.placeholder((n, hp, wp, c), "int8", name="x")
        W = te.placeholder((kh, kw, c), "int8", name="w")
        B = te.placeholder((c,), "int32", name="bias")
        S = te.placeholder((c,), "float32", name="scale")
        rh, rw = te.reduce_axis((0, kh), "rh"), te.reduce_axis((0, kw), "rw")
        acc = te.compute(
            (n, oh, ow, c),
            lambda b, y, x, ch: te.sum(X[b, y * sh + rh * dh, x * sw + rw * dw, ch].astype("int32")
                                       * W[rh, rw, ch].astype("int32"), axis=[rh, rw]),
            name="acc")
        out = requantize(acc, B, S, (n, oh, ow, c), zy=zy, out_dtype=out_dtype, relu=relu)
        sch = s_tir.Schedule(te.create_prim_func([X, W, B, S, out]))
        # channels in the lanes: two vector registers of int32 where the channels fill them
        lanes = next(v for v in (2 * self.vector, self.vector, 4) if c % v == 0)
        cols = max(d for d in range(1, min(ow, 6) + 1) if ow % d == 0)
        blk, req = sch.get_sblock("acc"), sch.get_sblock("requant")
        b, y, x, ch, r_h, r_w = sch.get_loops(blk)
        c_o, c_i = sch.split(ch, factors=[None, lanes])
        x_o, x_i = sch.split(x, factors=[None, cols])
        row = sch.fuse(b, y)
        sch.reorder(row, x_o, c_o, r_h, r_w, x_i, c_i)
        tile = sch.fuse(x_o, c_o)
        # (the depthwise tile: ~10 multiply-adds per ns on one AVX2 core)
        if n * oh >= 2 and worth_parallel(n * oh * ow * c * kh * kw, 10_000):
            sch.parallel(row)
        sch.reverse_compute_at(req, tile, preserve_unit_loops=True)
        # (vectorized while the block still has its init: the update alone is no "local
        # reduction block" and vectorize refuses it)
        sch.vectorize(c_i)
        sch.decompose_reduction(blk, r_h)
        # (the accumulator tile stays in "global" scope: TVM lowers that small buffer to a stack
        # array LLVM keeps in registers; in "local" scope it became a TVMBackendAllocWorkspace
        # call per tile inside the parallel body, 4x slower)
        for loop in (r_h, r_w, x_i):
            sch.unroll(loop)
        q = sch.get_loops(req)
        sch.unroll(q[-2])
        sch.vectorize(q[-1])
        return sch.mod["main"].with_attr("tirx.is_scheduled", True).with_attr("op_pattern", 8)


@dataclass
class DepthwiseKernels(Int8Kernels):
    """A target's int8 kernel set that is the depthwise one plus, with ``rows_matmul`` (Arm
    ``+dotprod``), ``[K, N]`` matmuls as ``[N, K]`` row dot products (:meth:`matmul`). The other
    convolutions are left to the generic path, where LLVM finds ``sdot`` by itself
    (:mod:`compiler.int8_arm`)."""

    vector: int = 4
    rows_matmul: bool = False
    funcs: list[tuple[Any, Any]] = field(default_factory=list)
    used: dict[str, int] = field(default_factory=dict)

    def matmul(self, xq: Any, w_kn: np.ndarray, bias: np.ndarray, scale: np.ndarray, *, zx: int,
               sy: float, zy: int, out_dtype: str, relu: bool) -> Any:
        """``quantize(matmul(xq - zx, w_kn) + bias) * scale`` with the weights stored ``[N, K]``
        (transposed at compile time) so each output is a dot product of two contiguous int8 rows:
        the reduction LLVM's loop vectoriser turns into ``sdot`` partial sums, 4 outputs
        accumulated side by side; requantized in the same kernel. None for dynamic or non-2-d
        activations."""
        from tvm import relax, s_tir, te, tirx

        shape = xq.ty.shape
        if not self.rows_matmul or shape is None or len(shape) != 2 or w_kn.dtype != np.int8 \
                or str(xq.ty.dtype) != "int8" or not all(isinstance(d, tirx.IntImm) for d in shape):
            return None
        if np.abs(bias).max(initial=0) >= 2**31:
            return None
        m, k = (int(d) for d in shape)
        n = int(w_kn.shape[1])
        X = te.placeholder((m, k), "int8", name="x")
        W = te.placeholder((n, k), "int8", name="w")
        B = te.placeholder((n,), "int32", name="bias")
        S = te.placeholder((n,), "float32", name="scale")
        rk = te.reduce_axis((0, k), "rk")
        acc = te.compute((m, n), lambda i, j: te.sum(X[i, rk].astype("int32") * W[j, rk].astype("int32"),
                                                     axis=[rk]), name="acc")
        out = requantize(acc, B, S, (m, n), zy=zy, out_dtype=out_dtype, relu=relu)
        sch = s_tir.Schedule(te.create_prim_func([X, W, B, S, out]))
        blk, req = sch.get_sblock("acc"), sch.get_sblock("requant")
        i, j, r = sch.get_loops(blk)
        tile = max(d for d in range(1, min(n, 4) + 1) if n % d == 0)
        j_o, j_i = sch.split(j, factors=[None, tile])
        sch.reorder(i, j_o, r, j_i)
        sch.reverse_compute_at(req, j_o, preserve_unit_loops=True)
        sch.decompose_reduction(blk, r)
        sch.unroll(j_i)
        func = sch.mod["main"].with_attr("tirx.is_scheduled", True).with_attr("op_pattern", 8)
        w_nk = np.ascontiguousarray(w_kn.T)
        args = [xq, relax.const(w_nk), relax.const(bias.astype(np.int32)),
                relax.const(multiplier(scale, sy))]
        return self.emit(func, ROWS_MATMUL, "matmul", args, relax.TensorType([m, n], out_dtype))
