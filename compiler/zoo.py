"""Model zoo: the MLPerf Tiny architectures and two small MLPs, built as ONNX from scratch.

Weights are random (seeded, He-scaled so activations stay O(1)); the models are for compile,
speed and training work, not for accuracy. Every model is NCHW float32 with a static batch,
``ir_version`` 10 and opset 17 (onnxruntime 1.31 rejects newer IR versions).

    ds-cnn-kws             x [N,1,49,10]  -> logits [N,12]   DS-CNN (S) keyword spotting
    mobilenet-v1-0.25-vww  x [N,3,96,96]  -> logits [N,2]    MobileNetV1 alpha 0.25, visual wake words
    resnet8-cifar10        x [N,3,32,32]  -> logits [N,10]   ResNet-8 (3 stacks 16/32/64)
    fc-autoencoder         x [N,640]      -> recon [N,640]   anomaly-detection FC autoencoder
    sensor-mlp             x [N,16]       -> logits [N,3]
    digits-mlp             x [N,64]       -> logits [N,10]   sklearn digits (8x8) classifier

The classifiers end in logits, not Softmax (MLPerf's references do end in Softmax): training
with a cross-entropy loss wants logits, and Softmax costs nothing next to the convolutions.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

from compiler.errors import ModelError

__all__ = ["NAMES", "IR_VERSION", "OPSET", "build", "save", "input_shape"]

IR_VERSION = 10
OPSET = 17


class _Builder:
    """Accumulates nodes and seeded random initializers; names are unique by counter."""

    def __init__(self, seed: int) -> None:
        self.rng = np.random.default_rng(seed)
        self.nodes: list[onnx.NodeProto] = []
        self.inits: list[onnx.TensorProto] = []
        self._n = 0

    def _name(self, prefix: str) -> str:
        self._n += 1
        return f"{prefix}_{self._n}"

    def const(self, prefix: str, arr: np.ndarray) -> str:
        name = self._name(prefix)
        self.inits.append(numpy_helper.from_array(np.ascontiguousarray(arr), name))
        return name

    def op(self, op_type: str, inputs: list[str], **attrs) -> str:
        out = self._name(op_type.lower())
        self.nodes.append(helper.make_node(op_type, inputs, [out], name=out, **attrs))
        return out

    # -- layers -----------------------------------------------------------------------------
    def conv(self, x: str, cin: int, cout: int, k: tuple[int, int], stride: int = 1,
             group: int = 1, bias: bool = False) -> str:
        kh, kw = k
        fan_in = (cin // group) * kh * kw
        w = self.rng.normal(0.0, np.sqrt(2.0 / fan_in), (cout, cin // group, kh, kw)).astype(np.float32)
        ins = [x, self.const("w", w)]
        if bias:
            ins.append(self.const("b", self.rng.normal(0, 0.05, cout).astype(np.float32)))
        # explicit "same" padding (extra row/col at the end, as TF does): SAME_UPPER is less
        # portable across importers
        pads = [(kh - 1) // 2, (kw - 1) // 2, kh // 2, kw // 2]
        return self.op("Conv", ins, kernel_shape=[kh, kw], strides=[stride, stride],
                       pads=pads, group=group)

    def bn(self, x: str, c: int) -> str:
        r = self.rng
        scale = r.uniform(0.8, 1.2, c).astype(np.float32)
        beta = r.normal(0.0, 0.05, c).astype(np.float32)
        mean = r.normal(0.0, 0.05, c).astype(np.float32)
        var = r.uniform(0.8, 1.2, c).astype(np.float32)
        ins = [x] + [self.const(n, a) for n, a in
                     (("gamma", scale), ("beta", beta), ("mean", mean), ("var", var))]
        return self.op("BatchNormalization", ins, epsilon=1e-3)

    def relu(self, x: str) -> str:
        return self.op("Relu", [x])

    def conv_bn_relu(self, x: str, cin: int, cout: int, k: tuple[int, int], stride: int = 1,
                     group: int = 1, act: bool = True) -> str:
        y = self.bn(self.conv(x, cin, cout, k, stride, group), cout)
        return self.relu(y) if act else y

    def gemm(self, x: str, fin: int, fout: int, gain: float = 2.0) -> str:
        w = self.rng.normal(0.0, np.sqrt(gain / fin), (fin, fout)).astype(np.float32)
        b = self.rng.normal(0.0, 0.05, fout).astype(np.float32)
        return self.op("Gemm", [x, self.const("w", w), self.const("b", b)])

    def pool_flatten(self, x: str) -> str:
        return self.op("Flatten", [self.op("GlobalAveragePool", [x])], axis=1)

    def model(self, name: str, x_shape: list[int], out: str, out_name: str, out_shape: list[int],
              doc: str) -> onnx.ModelProto:
        # rename the last node's output to the public output name
        self.nodes[-1].output[0] = out_name
        graph = helper.make_graph(
            self.nodes, name,
            [helper.make_tensor_value_info("x", TensorProto.FLOAT, x_shape)],
            [helper.make_tensor_value_info(out_name, TensorProto.FLOAT, out_shape)],
            initializer=self.inits,
        )
        m = helper.make_model(graph, producer_name="fractal-edge.zoo", doc_string=doc,
                              opset_imports=[helper.make_opsetid("", OPSET)])
        m.ir_version = IR_VERSION
        m.model_version = 1
        return m


def _ds_cnn(b: _Builder, n: int) -> onnx.ModelProto:
    # MLPerf Tiny DS-CNN (S): conv 64 10x4 /2, 4 depthwise-separable blocks of 64, avg pool, FC 12.
    c = 64
    y = b.conv_bn_relu("x", 1, c, (10, 4), stride=2)
    for _ in range(4):
        y = b.conv_bn_relu(y, c, c, (3, 3), group=c)
        y = b.conv_bn_relu(y, c, c, (1, 1))
    y = b.gemm(b.pool_flatten(y), c, 12, gain=1.0)
    return b.model("ds_cnn_kws", [n, 1, 49, 10], y, "logits", [n, 12], "MLPerf Tiny DS-CNN KWS")


def _mobilenet(b: _Builder, n: int) -> onnx.ModelProto:
    # MobileNetV1 alpha=0.25 at 96x96: channels 32*0.25=8 ... 1024*0.25=256; 2 classes (person or not).
    y = b.conv_bn_relu("x", 3, 8, (3, 3), stride=2)
    cin = 8
    for cout, stride in [(16, 1), (32, 2), (32, 1), (64, 2), (64, 1), (128, 2), (128, 1), (128, 1),
                         (128, 1), (128, 1), (128, 1), (256, 2), (256, 1)]:
        y = b.conv_bn_relu(y, cin, cin, (3, 3), stride=stride, group=cin)
        y = b.conv_bn_relu(y, cin, cout, (1, 1))
        cin = cout
    y = b.gemm(b.pool_flatten(y), cin, 2, gain=1.0)
    return b.model("mobilenet_v1_025_vww", [n, 3, 96, 96], y, "logits", [n, 2],
                   "MobileNetV1 0.25 visual wake words 96x96")


def _resnet8(b: _Builder, n: int) -> onnx.ModelProto:
    # MLPerf Tiny ResNet-8: conv 16, then 3 residual stacks (16, 32/2, 64/2), avg pool, FC 10.
    y = b.conv_bn_relu("x", 3, 16, (3, 3))
    cin = 16
    for cout, stride in [(16, 1), (32, 2), (64, 2)]:
        h = b.conv_bn_relu(y, cin, cout, (3, 3), stride=stride)
        h = b.conv_bn_relu(h, cout, cout, (3, 3), act=False)
        short = y if (stride == 1 and cin == cout) else b.conv(y, cin, cout, (1, 1), stride, bias=True)
        y = b.relu(b.op("Add", [h, short]))
        cin = cout
    y = b.gemm(b.pool_flatten(y), cin, 10, gain=1.0)
    return b.model("resnet8_cifar10", [n, 3, 32, 32], y, "logits", [n, 10], "MLPerf Tiny ResNet-8 CIFAR-10")


def _autoencoder(b: _Builder, n: int) -> onnx.ModelProto:
    # MLPerf Tiny anomaly detection: 640 -> 128x4 -> 8 -> 128x4 -> 640, Dense+BN+ReLU each.
    y, fin = "x", 640
    for fout in [128, 128, 128, 128, 8, 128, 128, 128, 128]:
        y = b.relu(b.bn(b.gemm(y, fin, fout), fout))
        fin = fout
    y = b.gemm(y, fin, 640, gain=1.0)
    return b.model("fc_autoencoder", [n, 640], y, "recon", [n, 640], "MLPerf Tiny FC autoencoder (ToyADMOS)")


def _mlp(sizes: list[int], gname: str, doc: str) -> Callable[[_Builder, int], onnx.ModelProto]:
    def make(b: _Builder, n: int) -> onnx.ModelProto:
        y = "x"
        for i, (fin, fout) in enumerate(zip(sizes[:-1], sizes[1:], strict=True)):
            last = i == len(sizes) - 2
            y = b.gemm(y, fin, fout, gain=1.0 if last else 2.0)
            if not last:
                y = b.relu(y)
        return b.model(gname, [n, sizes[0]], y, "logits", [n, sizes[-1]], doc)
    return make


_MAKERS: dict[str, Callable[[_Builder, int], onnx.ModelProto]] = {
    "ds-cnn-kws": _ds_cnn,
    "mobilenet-v1-0.25-vww": _mobilenet,
    "resnet8-cifar10": _resnet8,
    "fc-autoencoder": _autoencoder,
    "sensor-mlp": _mlp([16, 32, 3], "sensor_mlp", "sensor MLP 16-32-3"),
    "digits-mlp": _mlp([64, 64, 10], "digits_mlp", "sklearn digits MLP 64-64-10"),
}

NAMES: tuple[str, ...] = tuple(_MAKERS)

_INPUT_SHAPES: dict[str, tuple[int, ...]] = {
    "ds-cnn-kws": (1, 49, 10),
    "mobilenet-v1-0.25-vww": (3, 96, 96),
    "resnet8-cifar10": (3, 32, 32),
    "fc-autoencoder": (640,),
    "sensor-mlp": (16,),
    "digits-mlp": (64,),
}


def _check_name(name: str) -> None:
    if name not in _MAKERS:
        raise ModelError(f"unknown zoo model {name!r}", hint=f"choose one of: {', '.join(NAMES)}")


def input_shape(name: str, *, batch: int = 1) -> tuple[int, ...]:
    """The shape of input ``x`` of zoo model ``name`` at the given batch size."""
    _check_name(name)
    return (batch, *_INPUT_SHAPES[name])


def build(name: str, *, batch: int = 1, seed: int = 0) -> onnx.ModelProto:
    """Build zoo model ``name`` with a static batch and seeded random weights."""
    _check_name(name)
    if batch < 1:
        raise ModelError(f"batch must be >= 1, got {batch}", hint="pass batch=1 or more")
    return _MAKERS[name](_Builder(seed), batch)


def save(name: str, path: str | Path, **kw) -> Path:
    """Build zoo model ``name`` (``batch``/``seed`` as in :func:`build`) and write it to ``path``."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    onnx.save(build(name, **kw), str(path))
    return path
