"""Channels-last conversion of the graph forms 224x224 model-zoo CNNs import as (issue 29).

Every `light` network but ZFNet-512 stayed NCHW on x86_64 (ConvertLayout failed and
compiler.layout kept the original): ResNet's residual Sum (stack + sum, a 5-d tensor), SqueezeNet's
and Inception's inference Dropout (a tuple output), and DenseNet's / Inception v2's BatchNorm as
Mul/Add by [C, 1, 1] initializers left the rest of the network NCHW with transposes around every
convolution. One model with each form at a DenseNet/ResNet stage-2 shape (64 channels, 56x56):
converted with no activation transpose but the graph's edges, and compiled untuned it matches
onnxruntime.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import onnx
import onnxruntime as ort
from onnx import TensorProto, helper, numpy_helper

from compiler import compile_model, host_preset_name, load_artifact

C, H = 64, 56


def _model() -> onnx.ModelProto:
    rng = np.random.default_rng(0)

    def w(*shape: int, scale: float = 0.1) -> np.ndarray:
        return (rng.standard_normal(shape) * scale).astype(np.float32)

    inits = {"w1": w(C, C, 1, 1), "s": w(C, 1, 1, scale=1.0), "b": w(C, 1, 1),
             "w3": w(C, C, 3, 3, scale=0.05)}
    nodes = [
        helper.make_node("Conv", ["x", "w1"], ["c1"]),
        helper.make_node("Mul", ["c1", "s"], ["m"]),  # DenseNet's BatchNorm: x * [C, 1, 1] + [C, 1, 1]
        helper.make_node("Add", ["m", "b"], ["bn"]),
        helper.make_node("Relu", ["bn"], ["a"]),
        helper.make_node("Conv", ["a", "w3"], ["c3"], pads=[1, 1, 1, 1]),
        helper.make_node("Sum", ["a", "c3"], ["r"]),  # ResNet's residual add
        helper.make_node("Dropout", ["r"], ["d"]),  # SqueezeNet's / Inception's (inference: identity)
        helper.make_node("Concat", ["d", "a"], ["y"], axis=1),  # DenseNet / Inception / SqueezeNet
    ]
    graph = helper.make_graph(
        nodes, "light_forms",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, C, H, H])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, 2 * C, H, H])],
        [numpy_helper.from_array(v, k) for k, v in inits.items()])
    m = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 13)], producer_name="test_layout_cnn")
    m.ir_version = 8
    onnx.checker.check_model(m, full_check=True)
    return m


def _activation_transposes(mod: object) -> list[list[int]]:
    """Output shapes of the permute_dims on activations ([1, H, W, C] or [1, C, H, W] with the
    two middle dims > 1; the weight and bias transposes pre-packing moves out are not)."""
    from tvm import relax

    out = []
    for block in mod["main"].body.blocks:  # type: ignore[index]
        for b in block.bindings:
            v = b.value
            if isinstance(v, relax.Call) and getattr(v.op, "name", "") == "relax.permute_dims":
                shape = [int(d) for d in b.var.ty.shape]
                if len(shape) == 4 and shape[0] == 1 and shape[1] > 1 and shape[2] > 1:
                    out.append(shape)
    return out


def test_light_forms_go_channels_last(tmp_path: Path) -> None:
    from compiler import layout
    from compiler import prepack as _prepack
    from compiler.importer import import_model

    model = _model()
    mod = _prepack.fold_batchnorm(import_model(model).mod)
    nhwc = layout.channels_last(mod)
    assert nhwc is not mod, "ConvertLayout refused the graph: it stayed NCHW"
    # the input into NHWC and the output back to NCHW, nothing in between
    assert _activation_transposes(nhwc) == [[1, H, H, C], [1, 2 * C, H, H]]

    path = tmp_path / "forms.onnx"
    onnx.save(model, path)
    x = np.random.default_rng(1).standard_normal((1, C, H, H)).astype(np.float32)
    want = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"]).run(None, {"x": x})[0]
    art = load_artifact(compile_model(path, target=host_preset_name(), out_dir=tmp_path / "art",
                                      progress=False))
    got = art.infer({"x": x})["y"]
    np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-4)
