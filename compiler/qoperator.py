"""QOperator-format quantized models (onnxruntime ``quantize_static(quant_format=QOperator)``, and
the ONNX operators QLinearConv / QLinearMatMul / ConvInteger) rewritten into what the compiler
already takes: each quantized operator becomes its QDQ form ``DequantizeLinear -> float op ->
QuantizeLinear`` (a step of :func:`compiler.prepare.prepare`, before constant folding).

That is the pattern :mod:`compiler.integer` turns into int8 x int8 -> int32 kernels where the
scales, zero points and weights are constants (as every model ``quantize_static`` writes has
them): a QOperator model gets the same integer kernels as its QDQ twin on every target (x86
VNNI / AVX2, Arm ``sdot``, RISC-V vector, the C backend), and what the pattern does not match keeps
the float path, which computes the operator's definition (dequantize, the float op, quantize with
round half to even and saturation). One rewrite instead of a second set of integer kernels.

Rewritten (bias ``B``: int32 at scale ``x_scale * w_scale``, zero point 0):

* QLinearConv -> DQ(x), DQ(w, per output channel), DQ(B) -> Conv -> Q
* QLinearMatMul -> DQ(a), DQ(b, per column) -> MatMul -> Q
* ConvInteger -> (x - x_zero_point), (w - w_zero_point) in int32 -> Conv (int32): exact
* com.microsoft QGemm, QLinearAdd, QLinearMul, QLinearGlobalAveragePool, QLinearAveragePool,
  QLinearConcat, QLinearSigmoid, QLinearLeakyRelu (what ``quantize_static`` emits around the
  convolutions) -> DQ of each input -> the standard op -> Q
* MatMulInteger: TVM converts it itself.

Scales that are not float32 (QLinearMatMul-21's float16) are cast to float32 first. Anything else
of onnxruntime's quantized operators (QLinearSoftmax, ``channels_last`` pooling, ...) is refused
by the importer in one line (``compiler.importer``).
"""

from __future__ import annotations

from typing import Any

import numpy as np

from compiler.errors import ModelError
from compiler.graphbuild import Builder, _const_inputs, _elem_types, _replace_nodes, _static_shapes, node_attr

__all__ = ["MS_DOMAIN", "MS_OPS", "ONNX_OPS", "handled", "qoperator_to_qdq"]

MS_DOMAIN = "com.microsoft"
# default-domain operators rewritten here (MatMulInteger: TVM's frontend converts it)
ONNX_OPS = frozenset({"QLinearConv", "QLinearMatMul", "ConvInteger"})
# onnxruntime's contrib operators rewritten here
MS_OPS = frozenset({"QGemm", "QLinearAdd", "QLinearMul", "QLinearGlobalAveragePool", "QLinearAveragePool",
                     "QLinearConcat", "QLinearSigmoid", "QLinearLeakyRelu"})

_FLOAT = 1
_INT32 = 6


def handled(node: Any) -> bool:
    """Whether :func:`qoperator_to_qdq` rewrites ``node``."""
    if node.domain in ("", "ai.onnx"):
        return node.op_type in ONNX_OPS
    return node.domain == MS_DOMAIN and node.op_type in MS_OPS


class _Rewrite:
    """The QDQ nodes of one quantized operator."""

    def __init__(self, model: Any, node: Any, index: int, consts: dict[str, np.ndarray],
                 types: dict[str, int], shapes: dict[str, list[int]]) -> None:
        self.node, self.consts, self.types, self.shapes = node, consts, types, shapes
        self.label = f"{node.op_type} at node {node.name or f'#{index}'!r}"
        self.bld = Builder(model, f"{node.name or node.op_type}_{index}/qdq")

    def arg(self, i: int) -> str:
        return self.node.input[i] if i < len(self.node.input) else ""

    def rank(self, name: str) -> int | None:
        if name in self.consts:
            return int(self.consts[name].ndim)
        dims = self.shapes.get(name)
        return len(dims) if dims is not None else None

    def scale(self, name: str) -> str:
        """``name`` as a float32 scale (constants converted here, others by a Cast)."""
        if name in self.consts:
            value = self.consts[name]
            return name if value.dtype == np.float32 else self.bld.const(value.astype(np.float32), "scale")
        if self.types.get(name, _FLOAT) == _FLOAT:
            return name
        return self.bld.op("Cast", [name], to=_FLOAT)

    def zero(self, name: str, like: str) -> str:
        """The zero point ``name``, or (absent) a 0 of ``like``'s element type, so that QuantizeLinear
        gives that type rather than its uint8 default."""
        if name:
            return name
        from onnx import helper

        elem = self.types.get(like)
        if elem is None:
            raise ModelError(f"{self.label}: the element type of {like!r} is unknown",
                             hint="give the zero point explicitly, or run onnx shape inference on the model")
        return self.bld.const(np.zeros((), helper.tensor_dtype_to_np_dtype(elem)), "zero_point")

    def dq(self, x: str, scale: str, zero: str, axis: int | None = None) -> str:
        """DequantizeLinear; ``axis`` (per-axis) used only when the scale is a vector."""
        s = self.scale(scale)
        inputs = [x, s, zero] if zero else [x, s]
        per_axis = self._vector(scale)
        if per_axis and axis is not None:
            return self.bld.op("DequantizeLinear", inputs, axis=axis)
        return self.bld.op("DequantizeLinear", inputs)

    def q(self, y: str, scale: str, zero: str, like: str, out: str, axis: int | None = None) -> str:
        s = self.scale(scale)
        inputs = [y, s, self.zero(zero, like)]
        if self._vector(scale) and axis is not None:
            return self.bld.op("QuantizeLinear", inputs, out=out, axis=axis)
        return self.bld.op("QuantizeLinear", inputs, out=out)

    def _vector(self, name: str) -> bool:
        if name in self.consts:
            return self.consts[name].size > 1
        dims = self.shapes.get(name)
        return dims is None or (len(dims) == 1 and dims[0] != 1)

    def bias(self, b: str, x_scale: str, w_scale: str) -> str:
        """DequantizeLinear of an int32 bias at scale ``x_scale * w_scale``, zero point 0."""
        if x_scale in self.consts and w_scale in self.consts:
            s = (np.float32(self.consts[x_scale].astype(np.float32).reshape(-1)[0])
                 * self.consts[w_scale].astype(np.float32).reshape(-1))
            scale = self.bld.const(s.reshape(()) if s.size == 1 else s, "bias_scale")
            zero = self.bld.const(np.zeros(s.shape if s.size > 1 else (), np.int32), "bias_zero_point")
            return self.bld.op("DequantizeLinear", [b, scale, zero], axis=0) if s.size > 1 \
                else self.bld.op("DequantizeLinear", [b, scale, zero])
        scale = self.bld.op("Mul", [self.scale(x_scale), self.scale(w_scale)])
        return self.bld.op("DequantizeLinear", [b, scale], axis=0)

    def attrs(self, *names: str) -> dict[str, Any]:
        out = {}
        for name in names:
            v = node_attr(self.node, name)
            if v is not None:
                out[name] = v
        return out

    def refuse(self, why: str) -> ModelError:
        return ModelError(f"{self.label}: {why}", hint="quantize in QDQ format (quantize_static "
                          "quant_format=QDQ), or compile the float model with --quantize int8")

    # -------------------------------------------------------------------------- the operators
    def QLinearConv(self) -> None:  # noqa: N802  (ONNX operator names)
        x, xs, xz, w, ws, wz, ys, yz = (self.arg(i) for i in range(8))
        conv_in = [self.dq(x, xs, xz), self.dq(w, ws, wz, axis=0)]
        if self.arg(8):
            conv_in.append(self.bias(self.arg(8), xs, ws))
        y = self.bld.op("Conv", conv_in, **self.attrs("auto_pad", "dilations", "group", "kernel_shape",
                                                       "pads", "strides"))
        self.q(y, ys, yz, x, self.node.output[0])

    def QLinearMatMul(self) -> None:  # noqa: N802
        a, a_s, az, b, bs, bz, ys, yz = (self.arg(i) for i in range(8))
        rank_a, rank_b = self.rank(a), self.rank(b)
        row = rank_a - 2 if rank_a is not None and rank_a >= 2 else None  # a per row
        col = rank_b - 1 if rank_b is not None and rank_b >= 2 else None  # b per column
        if (self._vector(a_s) and row is None) or (self._vector(bs) and col is None) \
                or (self._vector(ys) and row is None):
            raise self.refuse("per-row / per-column scales of an input of unknown rank")
        y = self.bld.op("MatMul", [self.dq(a, a_s, az, axis=row), self.dq(b, bs, bz, axis=col)])
        self.q(y, ys, yz, a, self.node.output[0], axis=row)

    def ConvInteger(self) -> None:  # noqa: N802
        x, w, xz, wz = (self.arg(i) for i in range(4))
        xi = self.bld.op("Cast", [x], to=_INT32)
        wi = self.bld.op("Cast", [w], to=_INT32)
        if xz:
            xi = self.bld.op("Sub", [xi, self.bld.op("Cast", [xz], to=_INT32)])
        if wz:
            zw = self.bld.op("Cast", [wz], to=_INT32)
            rank = self.rank(w)
            if rank is None:
                raise self.refuse("the weight's rank is unknown")
            # a scalar or one zero point per output channel: [-1, 1, ..., 1] broadcasts either
            zw = self.bld.op("Reshape", [zw, self.bld.const(np.array([-1] + [1] * (rank - 1), np.int64))])
            wi = self.bld.op("Sub", [wi, zw])
        self.bld.op("Conv", [xi, wi], out=self.node.output[0],
                    **self.attrs("auto_pad", "dilations", "group", "kernel_shape", "pads", "strides"))

    def QGemm(self) -> None:  # noqa: N802
        a, a_s, az, b, bs, bz, c, ys, yz = (self.arg(i) for i in range(9))
        trans_b = int(node_attr(self.node, "transB", 0))
        gemm_in = [self.dq(a, a_s, az), self.dq(b, bs, bz, axis=0 if trans_b else 1)]
        if c:
            gemm_in.append(self.bias(c, a_s, bs))
        if not ys:  # float output
            self.bld.op("Gemm", gemm_in, out=self.node.output[0], **self.attrs("alpha", "transA", "transB"))
            return
        y = self.bld.op("Gemm", gemm_in, **self.attrs("alpha", "transA", "transB"))
        self.q(y, ys, yz, a, self.node.output[0])

    def _binary(self, op: str) -> None:
        a, a_s, az, b, bs, bz, ys, yz = (self.arg(i) for i in range(8))
        y = self.bld.op(op, [self.dq(a, a_s, az), self.dq(b, bs, bz)])
        self.q(y, ys, yz, a, self.node.output[0])

    def QLinearAdd(self) -> None:  # noqa: N802
        self._binary("Add")

    def QLinearMul(self) -> None:  # noqa: N802
        self._binary("Mul")

    def _unary(self, op: str, **attrs: Any) -> None:
        x, xs, xz, ys, yz = (self.arg(i) for i in range(5))
        y = self.bld.op(op, [self.dq(x, xs, xz)], **attrs)
        self.q(y, ys, yz, x, self.node.output[0])

    def _channels_first(self) -> None:
        if node_attr(self.node, "channels_last", 0):
            raise self.refuse("channels_last pooling is not rewritten")

    def QLinearGlobalAveragePool(self) -> None:  # noqa: N802
        self._channels_first()
        self._unary("GlobalAveragePool")

    def QLinearAveragePool(self) -> None:  # noqa: N802
        self._channels_first()
        self._unary("AveragePool", **self.attrs("auto_pad", "ceil_mode", "count_include_pad", "kernel_shape",
                                                "pads", "strides"))

    def QLinearSigmoid(self) -> None:  # noqa: N802
        self._unary("Sigmoid")

    def QLinearLeakyRelu(self) -> None:  # noqa: N802
        self._unary("LeakyRelu", **self.attrs("alpha"))

    def QLinearConcat(self) -> None:  # noqa: N802
        ys, yz = self.arg(0), self.arg(1)
        ins = list(self.node.input[2:])
        if not ins or len(ins) % 3:
            raise self.refuse(f"{len(ins)} inputs after the output's scale and zero point, not triples")
        parts = [self.dq(ins[i], ins[i + 1], ins[i + 2]) for i in range(0, len(ins), 3)]
        y = self.bld.op("Concat", parts, axis=int(node_attr(self.node, "axis", 0)))
        self.q(y, ys, yz, ins[0], self.node.output[0])


def qoperator_to_qdq(model: Any) -> bool:
    """Rewrite every QOperator node (see the module docstring); True if any was."""
    g = model.graph
    if not any(handled(n) for n in g.node):
        return False
    consts = _const_inputs(model)
    types = _elem_types(model)
    shapes = _static_shapes(model)
    new_nodes = []
    for i, node in enumerate(g.node):
        if not handled(node):
            new_nodes.append(node)
            continue
        rw = _Rewrite(model, node, i, consts, types, shapes)
        getattr(rw, node.op_type)()
        new_nodes.extend(rw.bld.nodes)
        g.initializer.extend(rw.bld.inits)
    _replace_nodes(g, new_nodes)
    return True
