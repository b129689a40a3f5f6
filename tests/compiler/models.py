"""Tiny ONNX models built with onnx.helper for the compiler tests (ir_version 10, opset 17).

``small_cnn`` covers the ops the training module must differentiate: Conv, depthwise Conv,
BatchNormalization (inference form), Relu, MaxPool, GlobalAveragePool, Flatten, Gemm.
Each builder also returns its weights so tests can rebuild the same network in PyTorch.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

IR_VERSION = 10
OPSET = 17


def _model(nodes, inputs, outputs, weights: dict[str, np.ndarray], name: str) -> onnx.ModelProto:
    graph = helper.make_graph(
        nodes, name, inputs, outputs, [numpy_helper.from_array(v, k) for k, v in weights.items()]
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", OPSET)], producer_name="tests")
    model.ir_version = IR_VERSION
    onnx.checker.check_model(model)
    return model


def mlp(
    *, batch: int | str = 1, sizes=(8, 16, 4), seed: int = 0
) -> tuple[onnx.ModelProto, dict[str, np.ndarray]]:
    """x [batch, sizes[0]] -> Gemm/Relu stack -> y [batch, sizes[-1]]."""
    rng = np.random.default_rng(seed)
    weights: dict[str, np.ndarray] = {}
    nodes = []
    cur = "x"
    for i, (a, b) in enumerate(zip(sizes[:-1], sizes[1:], strict=False)):
        weights[f"w{i}"] = (rng.standard_normal((a, b)) / np.sqrt(a)).astype(np.float32)
        weights[f"b{i}"] = (0.1 * rng.standard_normal(b)).astype(np.float32)
        out = "y" if i == len(sizes) - 2 else f"h{i}"
        nodes.append(
            helper.make_node(
                "Gemm", [cur, f"w{i}", f"b{i}"], [out if out == "y" else f"g{i}"], name=f"gemm{i}"
            )
        )
        if out != "y":
            nodes.append(helper.make_node("Relu", [f"g{i}"], [out], name=f"relu{i}"))
        cur = out
    x = helper.make_tensor_value_info("x", TensorProto.FLOAT, [batch, sizes[0]])
    y = helper.make_tensor_value_info("y", TensorProto.FLOAT, [batch, sizes[-1]])
    return _model(nodes, [x], [y], weights, "mlp"), weights


def small_cnn(*, batch: int = 1, seed: int = 0) -> tuple[onnx.ModelProto, dict[str, np.ndarray]]:
    """x [batch, 3, 8, 8] -> conv/bn/relu -> depthwise/relu -> maxpool -> 1x1 -> GAP -> gemm -> [batch, 4]."""
    rng = np.random.default_rng(seed)
    f = np.float32
    w = {
        "c1_w": (rng.standard_normal((8, 3, 3, 3)) * 0.3).astype(f),
        "c1_b": (rng.standard_normal(8) * 0.1).astype(f),
        "bn_scale": (1.0 + 0.1 * rng.standard_normal(8)).astype(f),
        "bn_bias": (0.1 * rng.standard_normal(8)).astype(f),
        "bn_mean": (0.1 * rng.standard_normal(8)).astype(f),
        "bn_var": (1.0 + 0.2 * rng.random(8)).astype(f),
        "dw_w": (rng.standard_normal((8, 1, 3, 3)) * 0.3).astype(f),
        "dw_b": (rng.standard_normal(8) * 0.1).astype(f),
        "pw_w": (rng.standard_normal((16, 8, 1, 1)) * 0.3).astype(f),
        "pw_b": (rng.standard_normal(16) * 0.1).astype(f),
        "fc_w": (rng.standard_normal((4, 16)) * 0.3).astype(f),
        "fc_b": (rng.standard_normal(4) * 0.1).astype(f),
    }
    n = helper.make_node
    nodes = [
        n("Conv", ["x", "c1_w", "c1_b"], ["c1"], pads=[1, 1, 1, 1], name="conv1"),
        n(
            "BatchNormalization",
            ["c1", "bn_scale", "bn_bias", "bn_mean", "bn_var"],
            ["bn"],
            epsilon=1e-5,
            name="bn1",
        ),
        n("Relu", ["bn"], ["r1"], name="relu1"),
        n("Conv", ["r1", "dw_w", "dw_b"], ["dw"], pads=[1, 1, 1, 1], group=8, name="dwconv"),
        n("Relu", ["dw"], ["r2"], name="relu2"),
        n("MaxPool", ["r2"], ["mp"], kernel_shape=[2, 2], strides=[2, 2], name="pool"),
        n("Conv", ["mp", "pw_w", "pw_b"], ["pw"], name="pwconv"),
        n("Relu", ["pw"], ["r3"], name="relu3"),
        n("GlobalAveragePool", ["r3"], ["gap"], name="gap"),
        n("Flatten", ["gap"], ["flat"], name="flatten"),
        n("Gemm", ["flat", "fc_w", "fc_b"], ["logits"], transB=1, name="fc"),
    ]
    x = helper.make_tensor_value_info("x", TensorProto.FLOAT, [batch, 3, 8, 8])
    y = helper.make_tensor_value_info("logits", TensorProto.FLOAT, [batch, 4])
    return _model(nodes, [x], [y], w, "small_cnn"), w


def save(model: onnx.ModelProto, path: str | Path) -> Path:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    onnx.save(model, str(path))
    return path
