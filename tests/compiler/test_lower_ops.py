"""compiler.lower_ops: ScatterElements, EyeLike with a dtype, ReverseSequence, SpaceToDepth in CRD mode,
ConvTranspose with output_shape and BatchNormalization in training mode, rewritten into operators TVM
imports correctly, match onnxruntime on the original model."""

from __future__ import annotations

from typing import Any

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from onnx import TensorProto
from onnx import helper as oh
from onnx import numpy_helper as nh

from compiler.errors import ModelError
from compiler.prepare import prepare

F = TensorProto.FLOAT


def _model(node: Any, feeds: dict[str, np.ndarray], outputs: list[Any], opset: int) -> onnx.ModelProto:
    inputs = [
        oh.make_tensor_value_info(k, oh.np_dtype_to_tensor_dtype(v.dtype), list(v.shape))
        for k, v in feeds.items()
    ]
    model = oh.make_model(
        oh.make_graph([node], "op", inputs, outputs), opset_imports=[oh.make_opsetid("", opset)]
    )
    model.ir_version = 8
    return model


def _same_as_onnxruntime(model: onnx.ModelProto, feeds: dict[str, np.ndarray], gone: str) -> None:
    onnx.checker.check_model(model)

    def run(m: onnx.ModelProto) -> list[np.ndarray]:
        sess = ort.InferenceSession(m.SerializeToString(), providers=["CPUExecutionProvider"])
        return sess.run(None, feeds)

    want = run(model)
    prepared, steps = prepare(model)
    assert "lower_ops" in steps
    assert not any(n.op_type == gone for n in prepared.graph.node) or gone == "ConvTranspose"
    got = run(prepared)
    for g, w in zip(got, want, strict=True):
        assert g.shape == w.shape and g.dtype == w.dtype
        np.testing.assert_allclose(g, w, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize(("axis", "reduction"), [(0, "none"), (1, "add"), (-1, "max"), (0, "mul")])
def test_scatter_elements_matches_onnxruntime(axis: int, reduction: str) -> None:
    rng = np.random.default_rng(0)
    feeds = {
        "data": rng.standard_normal((3, 4)).astype(np.float32),
        "indices": rng.integers(-3, 3, (2, 3)).astype(np.int64),
        "updates": rng.standard_normal((2, 3)).astype(np.float32),
    }
    if reduction == "none":  # distinct targets: duplicates are undefined without a reduction
        feeds["indices"] = np.array([[0, 1, 2], [2, 0, 1]], np.int64)
    node = oh.make_node(
        "ScatterElements",
        ["data", "indices", "updates"],
        ["y"],
        axis=axis,
        **({"reduction": reduction} if reduction != "none" else {}),
    )
    _same_as_onnxruntime(
        _model(node, feeds, [oh.make_tensor_value_info("y", F, [3, 4])], 18), feeds, "ScatterElements"
    )


def test_reverse_sequence_matches_onnxruntime() -> None:
    rng = np.random.default_rng(1)
    for batch_axis, time_axis in ((1, 0), (0, 1)):
        shape = [4, 3, 2] if time_axis == 0 else [3, 4, 2]
        feeds = {"x": rng.standard_normal(shape).astype(np.float32), "lens": np.array([4, 1, 3], np.int64)}
        node = oh.make_node(
            "ReverseSequence", ["x", "lens"], ["y"], batch_axis=batch_axis, time_axis=time_axis
        )
        _same_as_onnxruntime(
            _model(node, feeds, [oh.make_tensor_value_info("y", F, shape)], 17), feeds, "ReverseSequence"
        )


def test_eye_like_space_to_depth_and_conv_transpose_output_shape_match_onnxruntime() -> None:
    rng = np.random.default_rng(2)
    x = {"x": rng.standard_normal((3, 5)).astype(np.int32)}
    eye = oh.make_node("EyeLike", ["x"], ["y"], dtype=TensorProto.FLOAT, k=1)
    _same_as_onnxruntime(_model(eye, x, [oh.make_tensor_value_info("y", F, [3, 5])], 17), x, "EyeLike")
    img = {"x": rng.standard_normal((1, 2, 4, 6)).astype(np.float32)}
    s2d = oh.make_node("SpaceToDepth", ["x"], ["y"], blocksize=2, mode="CRD")
    _same_as_onnxruntime(
        _model(s2d, img, [oh.make_tensor_value_info("y", F, [1, 8, 2, 3])], 28), img, "SpaceToDepth"
    )
    feeds = {
        "x": rng.standard_normal((1, 1, 3, 3)).astype(np.float32),
        "w": rng.standard_normal((1, 2, 3, 3)).astype(np.float32),
    }
    for out_shape in ([10, 8], [9, 7]):  # 10: one more row than pads can give (output_padding)
        conv = oh.make_node("ConvTranspose", ["x", "w"], ["y"], strides=[3, 2], output_shape=out_shape)
        _same_as_onnxruntime(
            _model(conv, feeds, [oh.make_tensor_value_info("y", F, [1, 2, *out_shape])], 17),
            feeds,
            "ConvTranspose",
        )


@pytest.mark.parametrize("opset", [15, 18])
def test_batch_normalization_training_mode_matches_onnxruntime(opset: int) -> None:
    rng = np.random.default_rng(3)
    feeds = {
        "x": rng.standard_normal((2, 3, 4, 5)).astype(np.float32),
        "scale": rng.standard_normal(3).astype(np.float32),
        "bias": rng.standard_normal(3).astype(np.float32),
        "mean": rng.standard_normal(3).astype(np.float32),
        "var": rng.random(3).astype(np.float32),
    }
    node = oh.make_node(
        "BatchNormalization",
        ["x", "scale", "bias", "mean", "var"],
        ["y", "running_mean", "running_var"],
        training_mode=1,
        momentum=0.8,
        epsilon=1e-3,
    )
    outs = [
        oh.make_tensor_value_info("y", F, [2, 3, 4, 5]),
        oh.make_tensor_value_info("running_mean", F, [3]),
        oh.make_tensor_value_info("running_var", F, [3]),
    ]
    _same_as_onnxruntime(_model(node, feeds, outs, opset), feeds, "BatchNormalization")


def test_a_dynamic_shape_is_refused_by_name() -> None:
    feeds = {"x": np.zeros((4, 3), np.float32), "lens": np.array([4, 1, 3], np.int64)}
    model = _model(
        oh.make_node("ReverseSequence", ["x", "lens"], ["y"]),
        feeds,
        [oh.make_tensor_value_info("y", F, None)],
        17,
    )
    model.graph.input[0].type.tensor_type.shape.dim[1].dim_param = "B"
    with pytest.raises(ModelError, match=r"ReverseSequence at node '#0': the input 'x' has no static shape"):
        prepare(model)


@pytest.mark.parametrize(
    ("op", "attrs", "states"),
    [
        ("Adagrad", {"decay_factor": 0.1, "epsilon": 1e-5, "norm_coefficient": 1e-3}, ["H"]),
        (
            "Adam",
            {
                "alpha": 0.95,
                "beta": 0.1,
                "epsilon": 1e-7,
                "norm_coefficient": 1e-3,
                "norm_coefficient_post": 0.01,
            },
            ["V", "H"],
        ),
        ("Momentum", {"alpha": 0.95, "beta": 0.1, "mode": "standard", "norm_coefficient": 1e-3}, ["V"]),
        ("Momentum", {"alpha": 0.9, "beta": 1.0, "mode": "nesterov", "norm_coefficient": 1e-2}, ["V"]),
    ],
)
@pytest.mark.parametrize("step", [0, 3])
def test_training_optimizers_match_onnx_reference(
    op: str, attrs: dict[str, Any], states: list[str], step: int
) -> None:
    """ai.onnx.preview.training's optimizers (onnxruntime's CPU build has none: onnx's reference is
    the comparison), two tensors updated by one node, the model importing no default opset."""
    from onnx.reference import ReferenceEvaluator

    rng = np.random.default_rng(4)
    names = ["X", "G", *states]
    feeds: dict[str, np.ndarray] = {"R": np.array(0.1, np.float32), "T": np.array(step, np.int64)}
    for name in names:
        for k, shape in ((1, [2]), (2, [3, 2])):
            feeds[f"{name}{k}"] = (rng.random(shape) if name == "H" else rng.standard_normal(shape)).astype(
                np.float32
            )
    ins = ["R", "T", *[f"{name}{k}" for name in names for k in (1, 2)]]
    outs = [f"{name}{k}_new" for name in ["X", *states] for k in (1, 2)]
    node = oh.make_node(op, ins, outs, domain="ai.onnx.preview.training", **attrs)
    inputs = [
        oh.make_tensor_value_info(k, oh.np_dtype_to_tensor_dtype(feeds[k].dtype), list(feeds[k].shape))
        for k in ins
    ]
    model = oh.make_model(
        oh.make_graph([node], "opt", inputs, [oh.make_tensor_value_info(o, F, None) for o in outs]),
        opset_imports=[oh.make_opsetid("ai.onnx.preview.training", 1)],
    )
    model.ir_version = 8
    want = ReferenceEvaluator(model).run(None, feeds)
    prepared, steps = prepare(model)
    assert "lower_training" in steps
    got = ort.InferenceSession(prepared.SerializeToString(), providers=["CPUExecutionProvider"]).run(
        None, feeds
    )
    for g, w in zip(got, want, strict=True):
        np.testing.assert_allclose(g, w, rtol=1e-5, atol=1e-6)


def test_gradient_is_refused_by_name() -> None:
    node = oh.make_node("Gradient", ["x"], ["dx"], domain="ai.onnx.preview.training", xs=["x"], y="x")
    model = oh.make_model(
        oh.make_graph(
            [node], "g", [oh.make_tensor_value_info("x", F, [2])], [oh.make_tensor_value_info("dx", F, [2])]
        ),
        opset_imports=[oh.make_opsetid("", 17), oh.make_opsetid("ai.onnx.preview.training", 1)],
    )
    with pytest.raises(ModelError, match=r"ai.onnx.preview.training::Gradient at node '#0' is not supported"):
        prepare(model)


@pytest.mark.parametrize(
    ("complex_in", "inverse", "onesided", "length"),
    [
        (False, False, False, None),
        (True, False, False, None),
        (False, False, True, None),
        (True, True, False, None),
        (True, True, True, None),
        (True, False, False, 6),
        (False, False, True, 12),
        (True, True, True, 9),
    ],
    ids=["real", "complex", "rfft", "inverse", "irfft", "truncated", "zero-padded-rfft", "odd-irfft"],
)
def test_dft_matches_numpy(complex_in: bool, inverse: bool, onesided: bool, length: int | None) -> None:
    """DFT as cosine / sine table products along axis 2 of [batch, 3, n, 4, 1|2], against numpy.fft."""
    rng = np.random.default_rng(5)
    n = 5 if inverse and onesided else 8
    z = rng.standard_normal((2, 3, n, 4)) + (1j * rng.standard_normal((2, 3, n, 4)) if complex_in else 0)
    x = np.stack([z.real, z.imag], -1) if complex_in else z.real[..., None]
    feeds = {"x": x.astype(np.float32)}
    ins = ["x"]
    inits = []
    if length is not None:
        ins.append("len")
        inits.append(nh.from_array(np.array(length, np.int64), "len"))
    node = oh.make_node("DFT", ins, ["y"], axis=2, inverse=int(inverse), onesided=int(onesided))
    model = _model(node, feeds, [oh.make_tensor_value_info("y", F, None)], 17)
    model.graph.initializer.extend(inits)
    if inverse and onesided:
        want = np.fft.irfft(z, n=length, axis=2)[..., None]
    elif inverse:
        want = np.fft.ifft(z, n=length, axis=2)
    else:
        want = (np.fft.rfft if onesided else np.fft.fft)(z, n=length, axis=2)
    if want.shape[-1] != 1:
        want = np.stack([want.real, want.imag], -1)
    prepared, steps = prepare(model)
    assert "lower_ops" in steps and not any(nd.op_type == "DFT" for nd in prepared.graph.node)
    got = ort.InferenceSession(prepared.SerializeToString(), providers=["CPUExecutionProvider"]).run(
        None, feeds
    )[0]
    np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize(("mode", "writes"), [("linear", True), ("circular", True), ("linear", False)])
def test_tensor_scatter_matches_onnxruntime(mode: str, writes: bool) -> None:
    """A KV cache [B, H, max_seq, D] written at per-batch positions (wrapping in circular mode)."""
    rng = np.random.default_rng(6)
    feeds = {
        "cache": rng.standard_normal((3, 2, 5, 4)).astype(np.float32),
        "update": rng.standard_normal((3, 2, 2, 4)).astype(np.float32),
    }
    if writes:
        feeds["at"] = np.array([0, 3, 4 if mode == "circular" else 2], np.int64)
    node = oh.make_node("TensorScatter", list(feeds), ["y"], mode=mode)
    model = _model(node, feeds, [oh.make_tensor_value_info("y", F, [3, 2, 5, 4])], 24)
    _same_as_onnxruntime(model, feeds, "TensorScatter")


def _with_constants(model: onnx.ModelProto, **values: np.ndarray) -> onnx.ModelProto:
    """``model`` with these initializers, its outputs typed by shape inference."""
    model.graph.initializer.extend(nh.from_array(v, k) for k, v in values.items())
    typed = onnx.shape_inference.infer_shapes(model, data_prop=True)
    del model.graph.output[:]
    model.graph.output.extend(typed.graph.output)
    return model


@pytest.mark.parametrize(
    ("image", "block", "attrs"),
    [
        ([5, 5], [2, 2], {}),
        ([6, 7], [3, 2], {"strides": [2, 1], "pads": [1, 0, 1, 2], "dilations": [1, 2]}),
        ([3, 4, 5], [2, 1, 2], {"strides": [1, 2, 1]}),
    ],
    ids=["plain", "strided-padded-dilated", "3d"],
)
def test_col2im_with_constant_shapes_matches_onnxruntime(
    image: list[int], block: list[int], attrs: dict[str, Any]
) -> None:
    """Col2Im with constant image_shape / block_shape (the suite gives them at run time, which is
    refused): ScatterND with reduction add of the columns that land inside the image."""
    rank = len(image)
    strides, dil = attrs.get("strides", [1] * rank), attrs.get("dilations", [1] * rank)
    pads = attrs.get("pads", [0] * 2 * rank)
    blocks = [
        (image[i] + pads[i] + pads[i + rank] - dil[i] * (block[i] - 1) - 1) // strides[i] + 1
        for i in range(rank)
    ]
    feeds = {
        "x": np.random.default_rng(7)
        .standard_normal((2, 3 * int(np.prod(block)), int(np.prod(blocks))))
        .astype(np.float32)
    }
    node = oh.make_node("Col2Im", ["x", "image", "block"], ["y"], **attrs)
    model = _model(node, feeds, [oh.make_tensor_value_info("y", F, [2, 3, *image])], 18)
    model = _with_constants(model, image=np.array(image, np.int64), block=np.array(block, np.int64))
    _same_as_onnxruntime(model, feeds, "Col2Im")


@pytest.mark.parametrize(
    ("window", "onesided", "complex_in"), [(True, 1, False), (False, 0, False), (False, 0, True)]
)
def test_stft_with_constant_step_matches_onnxruntime(window: bool, onesided: int, complex_in: bool) -> None:
    """STFT with a constant frame_step (the suite gives it at run time, which is refused): frames
    gathered by a constant table, windowed, then DFT's cosine / sine tables."""
    rng = np.random.default_rng(8)
    feeds = {"signal": rng.standard_normal((2, 50, 2 if complex_in else 1)).astype(np.float32)}
    consts = {"step": np.array(6, np.int64)}
    if window:
        consts["window"] = np.hanning(10).astype(np.float32)
        ins = ["signal", "step", "window"]
    else:
        consts["length"] = np.array(10, np.int64)
        ins = ["signal", "step", "", "length"]
    node = oh.make_node("STFT", ins, ["y"], onesided=onesided)
    model = _model(node, feeds, [oh.make_tensor_value_info("y", F, None)], 17)
    _same_as_onnxruntime(_with_constants(model, **consts), feeds, "STFT")


@pytest.mark.parametrize(
    "attrs",
    [
        {"kernel_shape": [3, 3], "ceil_mode": 1, "strides": [2, 2]},
        {"kernel_shape": [2, 3], "auto_pad": "SAME_LOWER", "strides": [2, 1]},
        {"kernel_shape": [2, 3], "pads": [1, 1, 0, 1], "dilations": [2, 1]},
        {"kernel_shape": [3, 2], "pads": [1, 0, 0, 1], "storage_order": 1},
        {"kernel_shape": [2, 2, 2], "strides": [2, 1, 2]},
    ],
    ids=["ceil", "same-lower", "dilated", "column-major", "3d"],
)
def test_maxpool_indices_match_onnxruntime(attrs: dict[str, Any]) -> None:
    """MaxPool's Indices output (flat, per storage order) beyond the suite's two 2-D cases; integer
    inputs make ties, where the first maximum wins as in onnxruntime."""
    shape = [2, 3, 5, 6, 4][: 2 + len(attrs["kernel_shape"])]
    feeds = {"x": np.random.default_rng(9).integers(0, 4, shape).astype(np.float32)}
    node = oh.make_node("MaxPool", ["x"], ["y", "i"], **attrs)
    outs = [oh.make_tensor_value_info("y", F, None), oh.make_tensor_value_info("i", TensorProto.INT64, None)]
    _same_as_onnxruntime(_with_constants(_model(node, feeds, outs, 22)), feeds, "MaxPool")


@pytest.mark.parametrize("dtype", [np.int32, np.int64])
def test_integer_pow_with_negative_exponents_matches_onnxruntime(dtype: Any) -> None:
    """Exact integer powers by square-and-multiply; negative exponents truncate as onnxruntime's
    std::pow does (0, or +-1 for a base of +-1)."""
    feeds = {"x": np.array([[2, -3, 1, -1, 0, 7]], dtype), "e": np.array([[0], [1], [5], [-1], [-2]], dtype)}
    node = oh.make_node("Pow", ["x", "e"], ["y"])
    model = _model(
        node,
        feeds,
        [oh.make_tensor_value_info("y", oh.np_dtype_to_tensor_dtype(np.dtype(dtype)), [5, 6])],
        15,
    )
    _same_as_onnxruntime(model, feeds, "Pow")


@pytest.mark.parametrize(
    ("op", "inputs", "operand"),
    [
        (
            "Col2Im",
            {"x": ((1, 4, 4), np.float32), "image": ((2,), np.int64), "block": ((2,), np.int64)},
            "image",
        ),
        (
            "STFT",
            {"x": ((1, 16, 1), np.float32), "step": ((), np.int64), "window": ((4,), np.float32)},
            "step",
        ),
        (
            "MaxUnpool",
            {"x": ((1, 1, 2, 2), np.float32), "i": ((1, 1, 2, 2), np.int64), "shape": ((4,), np.int64)},
            "shape",
        ),
    ],
)
def test_a_run_time_shape_operand_is_refused_by_name(
    op: str, inputs: dict[str, tuple[tuple[int, ...], Any]], operand: str
) -> None:
    feeds = {k: np.ones(shape, dt) for k, (shape, dt) in inputs.items()}
    node = oh.make_node(op, list(inputs), ["y"], **({"kernel_shape": [2, 2]} if op == "MaxUnpool" else {}))
    model = _model(node, feeds, [oh.make_tensor_value_info("y", F, None)], 18)
    with pytest.raises(ModelError, match=rf"{op} at node '#0': \w+ '{operand}' is known only at run time"):
        prepare(model)


def test_run_time_block_shapes_are_compiled_picked_and_checked(tmp_path: Any) -> None:
    """Col2Im's block_shape given as a model input: the static shapes allow [1, 4] and [4, 1]; both
    are compiled and the one the input holds is picked (each answers as onnxruntime), any other
    value stops inference with an InputError (the value guard) instead of an answer."""
    from compiler.artifact import load_artifact
    from compiler.build import compile_model
    from compiler.errors import InputError

    node = oh.make_node("Col2Im", ["x", "image", "block"], ["y"])
    graph = oh.make_graph(
        [node],
        "col2im",
        [
            oh.make_tensor_value_info("x", F, [1, 4, 4]),
            oh.make_tensor_value_info("image", TensorProto.INT64, [2]),
            oh.make_tensor_value_info("block", TensorProto.INT64, [2]),
        ],
        [oh.make_tensor_value_info("y", F, [1, 1, 4, 4])],
    )
    model = oh.make_model(graph, opset_imports=[oh.make_opsetid("", 18)])
    model.ir_version = 8
    onnx.save(model, tmp_path / "m.onnx")
    art = load_artifact(
        compile_model(tmp_path / "m.onnx", target="x86_64", out_dir=tmp_path / "art", progress=False)
    )
    x = np.random.default_rng(10).standard_normal((1, 4, 4)).astype(np.float32)
    sess = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
    for block in ([1, 4], [4, 1]):
        feeds = {"x": x, "image": np.array([4, 4], np.int64), "block": np.array(block, np.int64)}
        np.testing.assert_allclose(art.infer(feeds)["y"], sess.run(None, feeds)[0], rtol=1e-5, atol=1e-5)
    for image, block in (([1, 7], [1, 4]), ([7, 1], [4, 1])):  # valid for onnxruntime, not compiled
        sess.run(None, {"x": x, "image": np.array(image, np.int64), "block": np.array(block, np.int64)})
        with pytest.raises(InputError, match="refused these inputs at run time"):
            art.infer({"x": x, "image": np.array(image, np.int64), "block": np.array(block, np.int64)})
