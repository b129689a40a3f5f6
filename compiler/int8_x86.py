"""int8 dot-product kernels for x86_64: the integer convolutions and matmuls of
:mod:`compiler.integer` as channels-last ``uint8 x int8 -> int32`` kernels tensorized with
``vpmaddubsw`` + ``vpmaddwd`` (AVX2) or ``vpdpbusd`` (AVX-512 VNNI), requantized in registers.

Compiled the generic way (``relax.nn.conv2d`` with ``out_dtype="int32"``), an int8 convolution
ran LLVM's auto-vectorised int32 arithmetic (sign-extend, ``vpmulld``, ``vpaddd``: 8 products per
three instructions) and was slower than the float32 QDQ import. x86's int8 dot products multiply
*unsigned* bytes by *signed* bytes and add adjacent products: per 256-bit ``vpmaddubsw`` 32
products summed in pairs to int16, then ``vpmaddwd`` by ones sums those pairs to int32 (8 lanes,
each the dot product of 4 consecutive bytes); ``vpdpbusd`` does both and accumulates. That is
what onnxruntime's MLAS kernels use, and it fixes the data layout:

- activations uint8: ``quantize_static`` makes int8 ones, so ``xu = xq + 128`` and the zero point
  becomes ``zx + 128``; the ``-128 * sum(w)`` term joins the int32 bias next to the
  ``-zx * sum(w)`` :mod:`compiler.integer` already folds. Channels-last (NHWC), the spatial
  padding done with the zero point.
- the reduction: a row of the kernel window is ``KW * I`` consecutive bytes of a channels-last
  input row, taken in groups of 4 (the last one padded with zero weights), so a first layer with
  1 or 3 input channels is no special case.
- weights packed at compile time (they are constants of the QDQ graph: a numpy transpose, no
  per-call work) as ``[O / L, KH, ROW / 4, L, 4]``, ``L`` the int32 lanes (8 for AVX2, 16 for
  AVX-512), output channels padded with zero weights.
- the kernel: a register tile of ``L`` (or ``2L``) output channels x a few output columns of int32
  accumulators while the reduction runs (one intrinsic call per group), then bias, one float32
  multiply by ``scale[c] / sy`` (:func:`compiler.int8_depthwise.requantize`), rounding half to
  even, zero point, clamp (and ReLU) on the tile before one int8 store: the generic integer
  kernels' ``R.quantize`` divides by ``sy`` instead, so the two round apart (one step) only where
  a value lies within float32 rounding of a half step. The outer loop of tiles runs in parallel
  only where the kernel has enough work (:func:`compiler.int8_depthwise.worth_parallel`).

``vpmaddubsw`` saturates its int16 pair sums (``255 * 127 * 2`` > 32767). MLAS's AVX2 u8s8 kernels
accept that (onnxruntime's documentation names it and suggests ``reduce_range``), and so moved
outputs 3-12 steps from onnxruntime's reference on the zoo models. Here the weights decide per
layer: where no pair can leave int16 (each pair's positive weights sum to at most 128 and its
negative ones to at least -128) the u8 quads run; elsewhere an exact int16 pair kernel
(``vpmaddwd`` on sign-extended activations and int16 weights, groups of 2, no shift) does, as many
multiply-adds per multiplier instruction as the quads on AVX2. VNNI's ``vpdpbusd`` sums in int32:
always the quads.

Depthwise convolutions (no reduction over channels to put in the 4-byte groups) run the fused
channels-last kernel of :mod:`compiler.int8_depthwise`; other grouped ones the generic integer
kernels. :func:`kernels` picks the instruction for a target; the builders
return ``None`` where they do not apply, and :mod:`compiler.integer` then emits its generic ops.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import numpy as np

from compiler.int8_depthwise import Int8Kernels, multiplier, requantize, worth_parallel

__all__ = ["AVX2_DOT_8X4", "AVX2_PAIR_8X2", "AVX512_PAIR_16X2", "VNNI_DOT_16X4", "DotKernels", "kernels"]

AVX2_DOT_8X4 = "fractal_dot_8x4_u8i8i32_avx2"
AVX2_PAIR_8X2 = "fractal_dot_8x2_i16i16i32_avx2"
AVX512_PAIR_16X2 = "fractal_dot_16x2_i16i16i32_avx512"
# TVM 0.27's own dot_16x4_vnni passes vpdpbusd <16 x i32> operands, which its LLVM refuses
# ("Call parameter type does not match function signature": the intrinsic takes <64 x i8> now)
VNNI_DOT_16X4 = "fractal_dot_16x4_u8i8i32_vnni"
_AVX512_DOT_16X4 = "dot_16x4_avx512"  # TVM's: vpmaddubsw + vpmaddwd on zmm registers
_registered: list[str] = []


def _register() -> None:
    """The project's intrinsics (:func:`_quad_intrin`, :func:`_pair_intrin`), once."""
    if _registered:
        return
    from tvm.s_tir import TensorIntrin

    TensorIntrin.register(AVX2_DOT_8X4, *_quad_intrin(8, vnni=False))
    TensorIntrin.register(VNNI_DOT_16X4, *_quad_intrin(16, vnni=True))
    TensorIntrin.register(AVX2_PAIR_8X2, *_pair_intrin(8, "llvm.x86.avx2.pmadd.wd"))
    TensorIntrin.register(AVX512_PAIR_16X2, *_pair_intrin(16, "llvm.x86.avx512.pmaddw.d.512"))
    _registered.append(AVX2_DOT_8X4)


def _dot_desc(lanes: int, k: int, a_dtype: str, b_dtype: str) -> Any:
    """The semantics both kinds of intrinsic implement: ``C[i] += sum_k A[k] * B[i, k]`` over
    ``lanes`` int32 lanes, ``k`` operands each (``a_dtype`` broadcast, ``b_dtype`` per lane)."""
    from tvm.script import tirx as T

    @T.prim_func(s_tir=True)
    def desc(a: T.handle, b: T.handle, c: T.handle) -> None:
        A = T.match_buffer(a, (k,), a_dtype, offset_factor=1)
        B = T.match_buffer(b, (lanes, k), b_dtype, offset_factor=1)
        C = T.match_buffer(c, (lanes,), "int32", offset_factor=1)
        with T.sblock("root"):
            T.reads(C[0:lanes], A[0:k], B[0:lanes, 0:k])
            T.writes(C[0:lanes])
            for i in T.serial(0, lanes):
                for j in T.serial(0, k):
                    with T.sblock("update"):
                        vi, vj = T.axis.remap("SR", [i, j])
                        C[vi] = C[vi] + T.cast(A[vj], "int32") * T.cast(B[vi, vj], "int32")

    return desc


def _quad_intrin(lanes: int, *, vnni: bool) -> tuple[Any, Any]:
    """``C[i] += sum_k u8(A[k]) * s8(B[i, k])`` for ``lanes`` int32 lanes, 4 bytes each, the 4
    activation bytes broadcast to every lane. ``vnni``: one ``vpdpbusd`` (16 lanes, the products
    summed in int32); else AVX2's ``vpmaddubsw`` (u8 x s8 products summed in pairs to int16,
    saturating) then ``vpmaddwd`` by ones (the pairs summed to int32), 8 lanes."""
    from tvm.script import tirx as T

    nbytes = 4 * lanes

    desc = _dot_desc(lanes, 4, "uint8", "int8")

    @T.prim_func(s_tir=True)
    def vnni_impl(a: T.handle, b: T.handle, c: T.handle) -> None:
        A = T.match_buffer(a, (4,), "uint8", offset_factor=1)
        B = T.match_buffer(b, (lanes, 4), "int8", offset_factor=1)
        C = T.match_buffer(c, (lanes,), "int32", offset_factor=1)
        with T.sblock("root"):
            T.reads(C[0:lanes], A[0:4], B[0:lanes, 0:4])
            T.writes(C[0:lanes])
            a4 = T.reinterpret(A.vload([0], "uint8x4"), dtype="int32")
            C[T.ramp(T.int32(0), 1, lanes)] = T.call_llvm_pure_intrin(
                T.llvm_lookup_intrinsic_id("llvm.x86.avx512.vpdpbusd.512"),
                C.vload([0], dtype=f"int32x{lanes}"),
                T.reinterpret(T.broadcast(a4, lanes), dtype=f"uint8x{nbytes}"),
                B.vload([0, 0], dtype=f"int8x{nbytes}"),
                dtype=f"int32x{lanes}",
            )

    @T.prim_func(s_tir=True)
    def avx2_impl(a: T.handle, b: T.handle, c: T.handle) -> None:
        A = T.match_buffer(a, (4,), "uint8", offset_factor=1)
        B = T.match_buffer(b, (lanes, 4), "int8", offset_factor=1)
        C = T.match_buffer(c, (lanes,), "int32", offset_factor=1)
        with T.sblock("root"):
            T.reads(C[0:lanes], A[0:4], B[0:lanes, 0:4])
            T.writes(C[0:lanes])
            a4 = T.reinterpret(A.vload([0], "uint8x4"), dtype="int32")
            pairs = T.call_llvm_pure_intrin(
                T.llvm_lookup_intrinsic_id("llvm.x86.avx2.pmadd.ub.sw"),
                T.reinterpret(T.broadcast(a4, lanes), dtype=f"uint8x{nbytes}"),
                B.vload([0, 0], dtype=f"int8x{nbytes}"),
                dtype=f"int16x{2 * lanes}",
            )
            C[T.ramp(T.int32(0), 1, lanes)] += T.call_llvm_pure_intrin(
                T.llvm_lookup_intrinsic_id("llvm.x86.avx2.pmadd.wd"),
                pairs,
                T.broadcast(T.int16(1), 2 * lanes),
                dtype=f"int32x{lanes}",
            )

    return desc, vnni_impl if vnni else avx2_impl


def _pair_intrin(lanes: int, llvm: str) -> tuple[Any, Any]:
    """``C[i] += sum_k s16(A[k]) * s16(B[i, k])`` for ``lanes`` int32 lanes, 2 int16 each: one
    ``vpmaddwd`` (int16 products summed in pairs to int32: exact for int8 operands)."""
    from tvm.script import tirx as T

    desc = _dot_desc(lanes, 2, "int16", "int16")

    @T.prim_func(s_tir=True)
    def impl(a: T.handle, b: T.handle, c: T.handle) -> None:
        A = T.match_buffer(a, (2,), "int16", offset_factor=1)
        B = T.match_buffer(b, (lanes, 2), "int16", offset_factor=1)
        C = T.match_buffer(c, (lanes,), "int32", offset_factor=1)
        with T.sblock("root"):
            T.reads(C[0:lanes], A[0:2], B[0:lanes, 0:2])
            T.writes(C[0:lanes])
            a2 = T.reinterpret(A.vload([0], "int16x2"), dtype="int32")
            C[T.ramp(T.int32(0), 1, lanes)] += T.call_llvm_pure_intrin(
                T.llvm_lookup_intrinsic_id(llvm),
                T.reinterpret(T.broadcast(a2, lanes), dtype=f"int16x{2 * lanes}"),
                B.vload([0, 0], dtype=f"int16x{2 * lanes}"),
                dtype=f"int32x{lanes}",
            )

    return desc, impl


def kernels(target: Any) -> DotKernels | None:
    """The dot-product kernels for ``target`` (a ``tvm.target.Target``): VNNI where its features
    include ``+avx512vnni`` (or its CPU has it), AVX-512 BW's ``vpmaddubsw`` on zmm registers,
    else AVX2; None for other targets (and for the C backend: its C has no LLVM intrinsics)."""
    if target is None or target.kind.name != "llvm" or "x86_64" not in str(target.attrs.get("mtriple", "")):
        return None
    mattr = {str(a) for a in (target.attrs.get("mattr") or [])}
    mcpu = str(target.attrs.get("mcpu", ""))
    if "+avx512vnni" in mattr or mcpu in _VNNI_CPUS:
        _register()
        return DotKernels(16, VNNI_DOT_16X4, None, 24)
    if "+avx512bw" in mattr:
        import tvm.s_tir.tensor_intrin.x86  # noqa: F401 - registers dot_16x4_avx512

        _register()
        return DotKernels(16, _AVX512_DOT_16X4, AVX512_PAIR_16X2, 24)
    if "+avx2" in mattr or mcpu in _AVX2_CPUS:
        _register()
        return DotKernels(8, AVX2_DOT_8X4, AVX2_PAIR_8X2, 10)
    return None


_VNNI_CPUS = {"cascadelake", "cooperlake", "icelake-server", "icelake-client", "tigerlake",
              "sapphirerapids", "znver4", "znver5"}
_AVX2_CPUS = {"haswell", "broadwell", "skylake", "znver1", "znver2", "znver3", *_VNNI_CPUS,
              "skylake-avx512"}


@dataclass
class DotKernels(Int8Kernels):
    """Builders of tensorized int8 kernels for one target: ``lanes`` int32 outputs per intrinsic
    call; ``quad`` the u8 x s8 4-byte dot product's intrinsic; ``pair`` the exact int16 pair
    one (``vpmaddwd``) used where ``quad`` would saturate (None: ``quad`` cannot, VNNI);
    ``registers`` accumulator vectors per tile (16 ymm registers on AVX2 leave 10 after the
    operands; 32 zmm on AVX-512). The PrimFuncs it made are in ``funcs`` (global var ->
    function), for the caller to add to the module; ``used`` counts them per intrinsic."""

    lanes: int
    quad: str
    pair: str | None
    registers: int
    funcs: list[tuple[Any, Any]] = field(default_factory=list)
    used: dict[str, int] = field(default_factory=dict)

    @property
    def vector(self) -> int:  # type: ignore[override]
        return self.lanes

    def conv2d(self, xq: Any, wq: np.ndarray, bias: np.ndarray, scale: np.ndarray, *, zx: int,
               sy: float, zy: int, out_dtype: str, relu: bool, strides: tuple[int, int],
               dilation: tuple[int, int], pads: tuple[int, int, int, int], groups: int) -> Any:
        """``quantize(conv2d(xq - zx, wq) + bias) * scale`` (NCHW in and out, like the op it
        replaces) on the dot-product kernel, or None where it does not apply. ``wq``: OIHW int8;
        ``bias``: int32 per output channel with ``-zx * sum(w)`` folded in (as
        :mod:`compiler.integer` makes it)."""
        from tvm import relax

        if groups != 1:
            return self.depthwise(xq, wq, bias, scale, zx=zx, sy=sy, zy=zy, out_dtype=out_dtype, relu=relu,
                                  strides=strides, dilation=dilation, pads=pads, groups=groups)
        if wq.dtype != np.int8 or str(xq.ty.dtype) != "int8" or wq.ndim != 4:
            return None
        if not _static(xq):
            return None
        n, c, h, w = (int(d) for d in xq.ty.shape)
        x_nhwc = relax.op.permute_dims(xq, [0, 2, 3, 1])
        out = self._conv_nhwc(x_nhwc, (n, h, w, c), wq.transpose(0, 2, 3, 1), bias, scale, zx=zx, sy=sy,
                              zy=zy, out_dtype=out_dtype, relu=relu, strides=strides, dilation=dilation,
                              pads=pads)
        return None if out is None else relax.op.permute_dims(out, [0, 3, 1, 2])

    def matmul(self, xq: Any, w_kn: np.ndarray, bias: np.ndarray, scale: np.ndarray, *, zx: int,
               sy: float, zy: int, out_dtype: str, relu: bool) -> Any:
        """The same for ``matmul(xq [M, K], w_kn [K, N])`` (2-d activations only, else None): a
        1 x 1 convolution over ``M`` columns."""
        from tvm import relax

        if not _static(xq) or len(xq.ty.shape) != 2 or w_kn.dtype != np.int8 \
                or str(xq.ty.dtype) != "int8":
            return None
        m, k = (int(d) for d in xq.ty.shape)
        x4 = relax.op.reshape(xq, [1, 1, m, k])
        w = w_kn.T.reshape(w_kn.shape[1], 1, 1, w_kn.shape[0])  # [N, 1, 1, K]
        out = self._conv_nhwc(x4, (1, 1, m, k), w, bias, scale, zx=zx, sy=sy, zy=zy, out_dtype=out_dtype,
                              relu=relu, strides=(1, 1), dilation=(1, 1), pads=(0, 0, 0, 0))
        return None if out is None else relax.op.reshape(out, [m, w_kn.shape[1]])

    def _conv_nhwc(self, x: Any, shape: tuple[int, int, int, int], w_ohwi: np.ndarray, bias: np.ndarray,
                   scale: np.ndarray, *, zx: int, sy: float, zy: int, out_dtype: str, relu: bool,
                   strides: tuple[int, int], dilation: tuple[int, int],
                   pads: tuple[int, int, int, int]) -> Any:
        """The kernel on NHWC ``x`` (``shape``) and OHWI weights. A row of the kernel window reads
        ``kw * ci`` consecutive bytes of a channels-last input row (unit horizontal dilation), so
        the reduction runs over that merged axis in groups of 4: a first layer with 1 or 3 input
        channels wastes nothing but the last group's tail."""
        from tvm import relax

        n, h, wd, ci = shape
        co, kh, kw, _ = w_ohwi.shape
        if dilation[1] != 1:
            return None
        L = self.lanes
        row, co_l = kw * ci, -(-co // L) * L
        quad = self.pair is None or _cannot_saturate(w_ohwi.reshape(co, kh, row))
        g, act, wdt = (4, "uint8", "int8") if quad else (2, "int16", "int16")
        rowg = -(-row // g) * g
        zu = int(zx) + 128 if quad else int(zx)  # the activations' zero point (uint8: shifted)
        hp, wp = h + pads[0] + pads[2], wd + pads[1] + pads[3]
        oh = (hp - dilation[0] * (kh - 1) - 1) // strides[0] + 1
        ow = (wp - kw) // strides[1] + 1
        if oh < 1 or ow < 1:
            return None
        # the last window's rounded-up row may read past the input row: padded columns (zero weights)
        extra = -(-max(0, (ow - 1) * strides[1] * ci + rowg - wp * ci) // ci)
        xu = relax.op.astype(x, "int16")
        if quad:
            xu = relax.op.astype(relax.op.add(xu, relax.const(128, "int16")), "uint8")
        if any(pads) or extra:
            xu = relax.op.nn.pad(xu, [0, 0, pads[0], pads[2], pads[1], pads[3] + extra, 0, 0],
                                 pad_value=float(zu))
        wp += extra
        xu = relax.op.reshape(xu, [n, hp, wp * ci])
        packed = np.zeros((co_l, kh, rowg), wdt)
        packed[:co, :, :row] = w_ohwi.reshape(co, kh, row)
        w_sum = w_ohwi.astype(np.int64).reshape(co, -1).sum(axis=1)
        b = np.zeros(co_l, np.int64)
        b[:co] = bias.astype(np.int64) - (128 * w_sum if quad else 0)
        if np.abs(b).max(initial=0) >= 2**31:
            return None
        s = np.zeros(co_l, np.float32)
        s[:co] = multiplier(scale, sy)
        # [O/L, KH, ROW/g, L, g]: the L x g values one intrinsic call reads are contiguous
        w_pack = packed.reshape(co_l // L, L, kh, rowg // g, g).transpose(0, 2, 3, 1, 4)
        intrin = self.quad if quad else str(self.pair)
        func = self._prim_func(n, hp, wp * ci, ci, co, co_l, kh, rowg, oh, ow, strides, dilation[0],
                               (g, act, wdt, intrin), sy=sy, zy=zy, out_dtype=out_dtype, relu=relu)
        return self.emit(func, intrin, "conv", [xu, relax.const(np.ascontiguousarray(w_pack)),
                                                relax.const(b.astype(np.int32)), relax.const(s)],
                         relax.TensorType([n, oh, ow, co], out_dtype))

    def _prim_func(self, n: int, hp: int, width: int, ci: int, co: int, co_l: int, kh: int, rowg: int,
                   oh: int, ow: int, strides: tuple[int, int], dh: int, kind: tuple[int, str, str, str], *,
                   sy: float, zy: int, out_dtype: str, relu: bool) -> Any:
        from tvm import te

        L = self.lanes
        g, act, wdt, intrin = kind
        X = te.placeholder((n, hp, width), act, name="x")
        W = te.placeholder((co_l // L, kh, rowg // g, L, g), wdt, name="w")
        B = te.placeholder((co_l,), "int32", name="bias")
        S = te.placeholder((co_l,), "float32", name="scale")
        rh = te.reduce_axis((0, kh), "rh")
        rm, rk = te.reduce_axis((0, rowg // g), "rm"), te.reduce_axis((0, g), "rk")
        sh, sw = strides
        acc = te.compute(
            (n, oh, ow, co_l),
            lambda b, y, x, c: te.sum(
                X[b, y * sh + rh * dh, x * (sw * ci) + rm * g + rk].astype("int32")
                * W[c // L, rh, rm, c % L, rk].astype("int32"), axis=[rh, rm, rk]),
            name="acc")
        out = requantize(acc, B, S, (n, oh, ow, co), zy=zy, out_dtype=out_dtype, relu=relu)
        func = te.create_prim_func([X, W, B, S, out])
        return self._schedule(func, intrin, n * oh, ow, co_l, co, n * oh * ow * co_l * kh * rowg)

    def _schedule(self, func: Any, intrin: str, rows: int, ow: int, co_l: int, co: int, macs: int) -> Any:
        from tvm import s_tir

        L = self.lanes
        sch = s_tir.Schedule(func)
        acc, out = sch.get_sblock("acc"), sch.get_sblock("requant")
        b, y, x, c, rh, rm, rk = sch.get_loops(acc)
        vecs = 2 if (co_l // L) % 2 == 0 else 1
        cols = max(d for d in range(1, min(ow, max(1, self.registers // vecs)) + 1) if ow % d == 0)
        co_o, co_v, co_i = sch.split(c, factors=[None, vecs, L])
        x_o, x_i = sch.split(x, factors=[None, cols])
        row = sch.fuse(b, y)
        sch.reorder(row, x_o, co_o, rh, rm, x_i, co_v, co_i, rk)
        tile = sch.fuse(row, x_o, co_o)
        # (the dot-product tile: ~40 multiply-adds per ns on one AVX2 core)
        if rows * (ow // cols) * (co_l // (L * vecs)) >= 4 and worth_parallel(macs, 40_000):
            sch.parallel(tile)
        sch.reverse_compute_at(out, tile, preserve_unit_loops=True)
        init = sch.decompose_reduction(acc, rh)
        sch.tensorize(co_i, intrin)
        # (the accumulator tile is left in "global" scope, which TVM lowers to a stack array for a
        # tile this small; in "local" scope it was a TVMBackendAllocWorkspace + Free call pair per
        # tile inside the parallel body: 1.3-1.4x the kernel's time)
        sch.unroll(co_v)
        sch.unroll(x_i)
        for blk in (init, out):
            loops = sch.get_loops(blk)
            inner = loops[-1]
            ext = sch.get(inner).extent
            if blk == out and co % L:
                continue  # (a ragged channel tail: LLVM vectorises what it can)
            if blk == out and int(ext) > L:
                _, inner = sch.split(inner, factors=[None, L])
            sch.vectorize(inner)
        return sch.mod["main"].with_attr("tirx.is_scheduled", True).with_attr("op_pattern", 8)


def _cannot_saturate(w: np.ndarray) -> bool:
    """Whether no ``vpmaddubsw`` pair sum can leave int16 with these weights (``[O, KH, ROW]``, the
    reduction's pairs adjacent along ROW from an even offset): with uint8 activations up to 255,
    each pair's positive weights must sum to at most 128 and its negative ones to at least -128."""
    ww = np.zeros((*w.shape[:-1], -(-w.shape[-1] // 2) * 2), np.int64)
    ww[..., : w.shape[-1]] = w
    pairs = ww.reshape(*w.shape[:-1], -1, 2)
    return bool(np.clip(pairs, 0, None).sum(-1).max(initial=0) <= 128
                and np.clip(pairs, None, 0).sum(-1).min(initial=0) >= -128)


def _static(x: Any) -> bool:
    from tvm import tirx

    shape = x.ty.shape
    return shape is not None and all(isinstance(d, tirx.IntImm) for d in shape)
