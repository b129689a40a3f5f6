"""compiler.dynshape: operators whose shape operand is a model input (output shapes decided at run
time, issue 29) compile, run and match onnxruntime on several operand values, including values that
change which dims survive; values onnxruntime rejects stop inference with an InputError (never a
silently different answer); what stays unsupported is refused at compile time in one line."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from onnx import TensorProto
from onnx import helper as oh

from compiler.artifact import load_artifact
from compiler.build import compile_model
from compiler.errors import CompilerError, InputError, TargetError

F, I64 = TensorProto.FLOAT, TensorProto.INT64


def _model(op: str, data_shape: list[int], operand: str, operand_len: int, out_rank: int, opset: int = 18,
           **attrs: Any) -> onnx.ModelProto:
    node = oh.make_node(op, ["x", operand], ["y"], **attrs)
    graph = oh.make_graph([node], f"dyn_{op}", [oh.make_tensor_value_info("x", F, data_shape),
                                                oh.make_tensor_value_info(operand, I64, [operand_len])],
                          [oh.make_tensor_value_info("y", F, [None] * out_rank)])
    model = oh.make_model(graph, opset_imports=[oh.make_opsetid("", opset)])
    model.ir_version = 8
    return model


def _compile(model: onnx.ModelProto, tmp: Path, target: str = "x86_64") -> Any:
    path = tmp / "m.onnx"
    onnx.save(model, path)
    return load_artifact(compile_model(path, target=target, out_dir=tmp / "art", progress=False))


def _check(model: onnx.ModelProto, art: Any, x: np.ndarray, operand: str,
           values: list[list[int]]) -> set[tuple[int, ...]]:
    """Each operand value: the artifact's answer equals onnxruntime's, or it is refused at run time
    where onnxruntime refuses it or the axes repeat (ONNX: invalid; onnxruntime reduces a repeated
    axis once, which can change the output's rank). Returns the output shapes seen."""
    sess = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
    shapes = set()
    for v in values:
        feeds = {"x": x, operand: np.array(v, np.int64)}
        try:
            want = sess.run(None, feeds)[0]
        except Exception:
            want = None
        if want is None or len(set(v)) < len(v):
            with pytest.raises(InputError, match="refused these inputs at run time"):
                art.infer(feeds)
            continue
        got = art.infer(feeds)["y"]
        assert got.shape == want.shape, (v, got.shape, want.shape)
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5, err_msg=str(v))
        shapes.add(got.shape)
    return shapes


@pytest.mark.parametrize("op,keepdims", [("ReduceSum", 0), ("ReduceLogSumExp", 1), ("ReduceL2", 0)])
def test_reduce_with_run_time_axes_matches_onnxruntime(tmp_path: Path, op: str, keepdims: int) -> None:
    """One compile, several axes values: which dims survive changes from call to call (and the
    output's dims are -1 in the manifest); a duplicate or out-of-range axis is refused at run time."""
    out_rank = 4 - 2 * (1 - keepdims)
    model = _model(op, [2, 3, 4, 5], "axes", 2, out_rank, keepdims=keepdims)
    art = _compile(model, tmp_path)
    assert not art.batched and art.outputs[0].shape == (-1,) * out_rank
    manifest = json.loads((tmp_path / "art" / "manifest.json").read_text())
    assert manifest["outputs"][0]["shape"] == [-1] * out_rank
    x = np.random.default_rng(0).standard_normal((2, 3, 4, 5)).astype(np.float32)
    values = [[0, 2], [3, 1], [-1, 0], [1, -2], [2, 3], [1, 1], [0, 4], [-5, 1]]
    shapes = _check(model, art, x, "axes", values)
    assert len(shapes) == 5, shapes  # five different surviving sets of dims


def test_reduce_empty_axes_and_noop(tmp_path: Path) -> None:
    """An axes input of length 0 is known at compile time: reduce everything, or (noop_with_empty_axes)
    pass the data through."""
    x = np.random.default_rng(1).standard_normal((3, 4)).astype(np.float32)
    for noop, rank in ((0, 2), (1, 2)):
        model = _model("ReduceSum", [3, 4], "axes", 0, rank, keepdims=1, noop_with_empty_axes=noop)
        (tmp_path / str(noop)).mkdir()
        art = _compile(model, tmp_path / str(noop))
        _check(model, art, x, "axes", [[]])


def test_run_time_axes_refused_on_the_c_backend(tmp_path: Path) -> None:
    model = _model("ReduceSum", [2, 3], "axes", 1, 1, keepdims=0)
    with pytest.raises(TargetError, match=r"'x86_64-c' \(C backend\) cannot run a model whose output shapes"):
        _compile(model, tmp_path, target="x86_64-c")


def test_run_time_shape_operand_with_a_batch_is_refused(tmp_path: Path) -> None:
    """A shape operand is not a batch of samples: --batch/--train are refused in one line."""
    model = _model("ReduceSum", [1, 3], "axes", 1, 1, keepdims=0)  # leading dims agree: 1 and 1
    path = tmp_path / "m.onnx"
    onnx.save(model, path)
    from compiler.importer import import_model, load_onnx

    with pytest.raises(CompilerError, match="compiles for exactly its input shapes, not for batch 4"):
        import_model(load_onnx(path), batch=4)


def test_shape_operators_with_run_time_operands_match_onnxruntime(tmp_path: Path) -> None:
    """Reshape, Expand, Squeeze, Unsqueeze, Slice, Tile and ConstantOfShape, each with its shape
    operand a model input, in one model (one compile): several operand values agree with
    onnxruntime; a value onnxruntime refuses (a size that does not fit, a non-unit squeezed axis,
    a repeated or out-of-range axis, a zero step, a negative dim) is refused at run time."""
    from onnx import numpy_helper as nh

    ins = [("x", F, [2, 3, 4]), ("s", I64, [3]), ("z", F, [3, 1]), ("e", I64, [3]), ("q", I64, [2]),
           ("w", F, [2, 1, 4]), ("sq", I64, [1]), ("st", I64, [2]), ("en", I64, [2]), ("sp", I64, [2]),
           ("r", I64, [3]), ("c", I64, [2])]
    nodes = [oh.make_node("Reshape", ["x", "s"], ["reshaped"]),
             oh.make_node("Expand", ["z", "e"], ["expanded"]),
             oh.make_node("Unsqueeze", ["x", "q"], ["unsqueezed"]),
             oh.make_node("Squeeze", ["w", "sq"], ["squeezed"]),
             oh.make_node("Slice", ["x", "st", "en", "ax", "sp"], ["sliced"]),
             oh.make_node("Tile", ["x", "r"], ["tiled"]),
             oh.make_node("ConstantOfShape", ["c"], ["filled"], value=oh.make_tensor("v", F, [1], [2.5]))]
    ranks = {"reshaped": 3, "expanded": 3, "unsqueezed": 5, "squeezed": 2, "sliced": 3, "tiled": 3,
             "filled": 2}
    graph = oh.make_graph(nodes, "dyn_shape_ops", [oh.make_tensor_value_info(n, t, s) for n, t, s in ins],
                          [oh.make_tensor_value_info(o, F, [None] * k) for o, k in ranks.items()],
                          [nh.from_array(np.array([2, 0], np.int64), "ax")])
    model = oh.make_model(graph, opset_imports=[oh.make_opsetid("", 18)])
    model.ir_version = 8
    art = _compile(model, tmp_path)
    assert not art.batched and all(o.dynamic for o in art.outputs)
    sess = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
    rng = np.random.default_rng(3)
    base = {name: rng.standard_normal(shape).astype(np.float32) for name, t, shape in ins if t == F}
    low = -(2**63)
    good = [dict(s=[4, 0, -1], e=[2, 1, 5], q=[0, 4], sq=[1], st=[1, 0], en=[4, 2], sp=[2, 1], r=[1, 2, 1],
                 c=[2, 3]),
            dict(s=[-1, 2, 2], e=[1, 3, 1], q=[-1, 1], sq=[-2], st=[-1, -1], en=[low, low], sp=[-1, -1],
                 r=[2, 1, 3], c=[1, 1]),
            dict(s=[0, 0, 4], e=[3, 3, 1], q=[2, 3], sq=[1], st=[0, 1], en=[100, 2], sp=[1, 1], r=[1, 1, 1],
                 c=[4, 2])]
    first = good[0]
    bad = [dict(first, s=[5, 5, 1]), dict(first, e=[2, 2, 5]), dict(first, q=[0, 0]), dict(first, sq=[0]),
           dict(first, sp=[0, 1]), dict(first, q=[0, 9]), dict(first, r=[1, -1, 1]), dict(first, c=[2, -3])]
    shapes = set()
    for values in [*good, *bad]:
        feeds = {**base, **{k: np.array(v, np.int64) for k, v in values.items()}}
        try:
            want = dict(zip(ranks, sess.run(list(ranks), feeds), strict=True))
        except Exception:
            with pytest.raises(InputError, match="refused these inputs at run time"):
                art.infer(feeds)
            assert values in bad
            continue
        assert values in good
        got = art.infer(feeds)
        for name, w in want.items():
            assert got[name].shape == w.shape, (name, values)
            np.testing.assert_allclose(got[name], w, rtol=1e-6, atol=1e-6, err_msg=f"{name} {values}")
        shapes.add(tuple(got[n].shape for n in ranks))
    assert len(shapes) == len(good)
    # Over the run-time size bound (MAX_RUNTIME_ELEMENTS), refused before anything is allocated:
    # dims whose product wraps int64 to a small number (Expand, Tile, ConstantOfShape: that corrupted
    # the heap, "malloc(): corrupted top size", and killed the process), and a plain 268 MB fill.
    from compiler.dynshape_ops import MAX_RUNTIME_ELEMENTS

    side = int(MAX_RUNTIME_ELEMENTS**0.5) + 1
    for values in [dict(first, c=[2**32, 2**32]), dict(first, e=[2**31, 3, 2**33]),
                   dict(first, r=[2**40, 1, 2**30]), dict(first, c=[side, side]),
                   dict(first, e=[1, 3, MAX_RUNTIME_ELEMENTS // 2])]:
        feeds = {**base, **{k: np.array(v, np.int64) for k, v in values.items()}}
        with pytest.raises(InputError, match=f"over {MAX_RUNTIME_ELEMENTS:,} elements"):
            art.infer(feeds)
    again = art.infer({**base, **{k: np.array(v, np.int64) for k, v in first.items()}})
    assert again["filled"].shape == (2, 3)  # and the artifact goes on serving


@pytest.mark.slow
def test_resize_pad_split_topk_grid_with_run_time_operands(tmp_path: Path) -> None:
    """Resize (scales and sizes), Pad (reflect, constant with a crop), Split, TopK, CenterCropPad
    and AffineGrid with their shape operand a model input, in one model (one compile): values the
    suite's cases do not try agree with onnxruntime (a downscale by a non-integer factor, negative
    pads, k = 0 and k = dim, an odd crop); each value ONNX / onnxruntime forbids (a zero scale, a
    negative size, a reflect pad as long as the axis, split lengths that do not sum to the dim, k
    past the dim, a grid batch other than theta's, an aligned grid of one position: onnxruntime and
    ONNX's reference disagree there) is refused at run time."""
    ins = [("x", F, [1, 2, 4, 5]), ("scales", F, [4]), ("sizes", I64, [2]), ("pads", I64, [8]),
           ("cpads", I64, [4]), ("t", F, [2, 6]), ("split", I64, [3]), ("k", I64, [1]), ("crop", I64, [2]),
           ("theta", F, [2, 2, 3]), ("size", I64, [4])]
    nodes = [oh.make_node("Resize", ["x", "", "scales"], ["by_scales"], mode="cubic"),
             oh.make_node("Resize", ["x", "", "", "sizes"], ["by_sizes"], mode="nearest", axes=[2, 3],
                          coordinate_transformation_mode="asymmetric", nearest_mode="ceil"),
             oh.make_node("Pad", ["x", "pads"], ["reflected"], mode="reflect"),
             oh.make_node("Pad", ["t", "cpads", "v"], ["padded"], mode="constant"),
             oh.make_node("Split", ["t", "split"], ["s0", "s1", "s2"], axis=1),
             oh.make_node("TopK", ["t", "k"], ["top", "top_i"], largest=0),
             oh.make_node("CenterCropPad", ["x", "crop"], ["cropped"], axes=[2, 3]),
             oh.make_node("AffineGrid", ["theta", "size"], ["grid"], align_corners=1)]
    outs = {"by_scales": (F, 4), "by_sizes": (F, 4), "reflected": (F, 4), "padded": (F, 2), "s0": (F, 2),
            "s1": (F, 2), "s2": (F, 2), "top": (F, 2), "top_i": (I64, 2), "cropped": (F, 4), "grid": (F, 4)}
    from onnx import numpy_helper as nh

    graph = oh.make_graph(nodes, "dyn_more", [oh.make_tensor_value_info(n, t, s) for n, t, s in ins],
                          [oh.make_tensor_value_info(o, t, [None] * k) for o, (t, k) in outs.items()],
                          [nh.from_array(np.array(1.5, np.float32), "v")])
    model = oh.make_model(graph, opset_imports=[oh.make_opsetid("", 20)])
    model.ir_version = 9
    art = _compile(model, tmp_path)
    assert all(o.dynamic for o in art.outputs)
    sess = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
    rng = np.random.default_rng(5)
    base = {name: rng.standard_normal(shape).astype(np.float32) for name, t, shape in ins if t == F}
    base["t"][0, 1] = base["t"][0, 4]  # a tie for TopK (the lower index first)
    good = [dict(scales=[1, 1, 0.7, 1.3], sizes=[3, 9], pads=[0, 0, 2, 1, 0, 1, 1, 3], cpads=[1, -2, 0, 2],
                 split=[2, 1, 3], k=[1], crop=[3, 8], size=[2, 1, 3, 4]),
            dict(scales=[1, 1, 2.5, 0.4], sizes=[1, 2], pads=[0, 0, 3, 0, 0, 0, 0, 4], cpads=[0, 0, 0, 0],
                 split=[1, 1, 4], k=[6], crop=[4, 1], size=[2, 3, 2, 3]),
            dict(scales=[1, 1, 1, 1], sizes=[8, 5], pads=[0, 0, -1, -2, 0, 0, -1, 1], cpads=[0, 3, 1, -5],
                 split=[4, 1, 1], k=[3], crop=[7, 5], size=[2, 1, 5, 2])]
    first = good[0]
    bad = [dict(first, scales=[1, 1, 0, 1]), dict(first, sizes=[3, -1]),
           dict(first, pads=[0, 0, 4, 0, 0, 0, 0, 0]), dict(first, split=[2, 1, 4]),
           dict(first, split=[3, -1, 4]), dict(first, k=[7]),
           dict(first, size=[1, 1, 3, 4]), dict(first, cpads=[0, -4, 0, -3])]
    ambiguous = dict(first, size=[2, 1, 1, 4])  # onnxruntime answers, unlike ONNX's reference
    shapes = set()
    for values in [*good, *bad, ambiguous]:
        operands = {k: np.array(v, np.float32 if k == "scales" else np.int64) for k, v in values.items()}
        feeds = {**base, **operands}
        if values is ambiguous:
            with pytest.raises(InputError, match="refused these inputs at run time"):
                art.infer(feeds)
            continue
        try:
            want = dict(zip(outs, sess.run(list(outs), feeds), strict=True))
        except Exception:
            with pytest.raises(InputError, match="refused these inputs at run time"):
                art.infer(feeds)
            assert values in bad, values
            continue
        assert values in good, values
        got = art.infer(feeds)
        for name, w in want.items():
            assert got[name].shape == w.shape, (name, values, got[name].shape, w.shape)
            np.testing.assert_allclose(got[name], w, rtol=1e-5, atol=1e-5, err_msg=f"{name} {values}")
        shapes.add(tuple(got[n].shape for n in outs))
    assert len(shapes) == len(good)


def test_upsample_keeps_its_asymmetric_coordinates(tmp_path: Path) -> None:
    """Upsample (opset 9) reaches the compiler as Resize-13 through onnx's version converter, which
    leaves Resize-11's default half_pixel coordinates on it (another answer for linear); the upgrade
    keeps Upsample's asymmetric coordinates and floor rounding. Run-time scales (linear) and
    constant scales (nearest, non-integer) both agree with onnxruntime's Upsample."""
    from onnx import numpy_helper as nh

    nodes = [oh.make_node("Upsample", ["x", "s"], ["lin"], mode="linear"),
             oh.make_node("Upsample", ["x", "c"], ["near"], mode="nearest")]
    graph = oh.make_graph(nodes, "upsample9", [oh.make_tensor_value_info("x", F, [1, 1, 4, 4]),
                                               oh.make_tensor_value_info("s", F, [4])],
                          [oh.make_tensor_value_info(o, F, [None] * 4) for o in ("lin", "near")],
                          [nh.from_array(np.array([1, 1, 2.5, 1.5], np.float32), "c")])
    model = oh.make_model(graph, opset_imports=[oh.make_opsetid("", 9)])
    model.ir_version = 5
    art = _compile(model, tmp_path)
    sess = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
    x = np.random.default_rng(7).standard_normal((1, 1, 4, 4)).astype(np.float32)
    for scales in ([1, 1, 2, 2], [1, 1, 3, 1.5]):
        feeds = {"x": x, "s": np.array(scales, np.float32)}
        want = dict(zip(("lin", "near"), sess.run(None, feeds), strict=True))
        got = art.infer(feeds)
        for name, w in want.items():
            assert got[name].shape == w.shape, (name, scales)
            np.testing.assert_allclose(got[name], w, rtol=1e-5, atol=1e-5, err_msg=f"{name} {scales}")
