"""Operators whose output length depends on the input values (compiler.dataops, issue 29): NonZero,
Unique, Compress and NonMaxSuppression compile for exactly their input shapes, answer in the shape
the values ask for (dims -1 in the manifest, static dims kept) and equal onnxruntime's answer on
many inputs, including empty answers; an iou_threshold onnxruntime refuses stops inference with an
InputError; the C backend and a batch are refused in one line."""

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

F, B, I64 = TensorProto.FLOAT, TensorProto.BOOL, TensorProto.INT64


def _model(nodes: list[Any], ins: list[tuple[str, int, list[int]]], outs: dict[str, tuple[int, int]],
           opset: int = 13) -> onnx.ModelProto:
    graph = oh.make_graph(nodes, "data_dependent", [oh.make_tensor_value_info(n, t, s) for n, t, s in ins],
                          [oh.make_tensor_value_info(k, t, [None] * r) for k, (t, r) in outs.items()])
    model = oh.make_model(graph, opset_imports=[oh.make_opsetid("", opset)])
    model.ir_version = 8
    return model


def _compile(model: onnx.ModelProto, tmp: Path, target: str = "x86_64") -> Any:
    onnx.save(model, tmp / "m.onnx")
    return load_artifact(compile_model(tmp / "m.onnx", target=target, out_dir=tmp / "art", progress=False))


def _same(art: Any, sess: Any, names: list[str], feeds: dict[str, np.ndarray]) -> set[tuple[int, ...]]:
    want = dict(zip(names, sess.run(names, feeds), strict=True))
    got = art.infer(feeds)
    for name in names:
        assert got[name].shape == want[name].shape, (name, feeds, got[name], want[name])
        assert got[name].dtype == want[name].dtype, name
        np.testing.assert_array_equal(got[name], want[name], err_msg=f"{name} {feeds}")
    return {got[n].shape for n in names}


def test_nonzero_unique_compress_match_onnxruntime(tmp_path: Path) -> None:
    """One compile; inputs with repeats, all zeros (empty answers), all equal, and a Compress
    condition longer than its axis (onnxruntime ignores the extra entries)."""
    nodes = [oh.make_node("NonZero", ["x"], ["nz"]),
             oh.make_node("Unique", ["x"], ["u_y", "u_i", "u_inv", "u_c"], sorted=0),
             oh.make_node("Unique", ["x"], ["ua_y", "ua_i", "ua_inv", "ua_c"], sorted=1, axis=0),
             oh.make_node("Unique", ["x"], ["ub_y"], sorted=1, axis=-1),
             oh.make_node("Unique", ["m"], ["um_y", "um_i"], sorted=1),
             oh.make_node("Compress", ["x", "c0"], ["c_0"], axis=0),
             oh.make_node("Compress", ["x", "c1"], ["c_1"], axis=-1),
             oh.make_node("Compress", ["x", "c0"], ["c_flat"]),
             oh.make_node("Compress", ["x", "long"], ["c_long"], axis=0)]
    outs = dict(nz=(I64, 2), u_y=(F, 1), u_i=(I64, 1), u_inv=(I64, 1), u_c=(I64, 1), ua_y=(F, 2),
                ua_i=(I64, 1), ua_inv=(I64, 1), ua_c=(I64, 1), ub_y=(F, 2), um_y=(I64, 1), um_i=(I64, 1),
                c_0=(F, 2), c_1=(F, 2), c_flat=(F, 1), c_long=(F, 2))
    ins = [("x", F, [4, 3]), ("c0", B, [3]), ("c1", B, [3]), ("m", I64, [2, 5]), ("long", B, [6])]
    model = _model(nodes, ins, outs)
    art = _compile(model, tmp_path)
    assert not art.batched
    shapes = {o.name: list(o.shape) for o in art.outputs}
    assert shapes["nz"] == [2, -1] and shapes["ua_y"] == [-1, 3] and shapes["u_inv"] == [12]
    assert shapes["c_1"] == [4, -1] and shapes["u_y"] == [-1]
    manifest = json.loads((tmp_path / "art" / "manifest.json").read_text())
    assert {o["name"]: o["shape"] for o in manifest["outputs"]} == shapes
    sess = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
    rng = np.random.default_rng(0)
    seen = set()
    for i in range(10):
        x = rng.integers(-1, 2, (4, 3)).astype(np.float32)
        x[1] = x[3]  # a repeated row
        if i == 0:
            x[:] = 0  # NonZero: no index; Compress below: nothing selected
        if i == 1:
            x[:] = 2.5
        c0, c1 = rng.random(3) < 0.5, rng.random(3) < 0.5
        if i == 0:
            c0[:] = False
        feeds = {"x": x, "c0": c0, "c1": c1, "m": rng.integers(-3, 3, (2, 5)).astype(np.int64),
                 "long": rng.random(6) < 0.6}
        seen |= _same(art, sess, list(outs), feeds)
    assert (2, 0) in seen and (0, 3) in seen and len(seen) > 15


def _nms_model() -> onnx.ModelProto:
    ins = [("boxes", F, [2, 12, 4]), ("scores", F, [2, 3, 12]), ("k", I64, [1]), ("iou", F, [1]),
           ("thr", F, [1])]
    nodes = [oh.make_node("NonMaxSuppression", ["boxes", "scores", "k", "iou", "thr"], ["corners"]),
             oh.make_node("NonMaxSuppression", ["boxes", "scores", "k", "iou", "thr"], ["centers"],
                          center_point_box=1),
             oh.make_node("NonMaxSuppression", ["boxes", "scores", "k", "iou"], ["no_thr"])]
    return _model(nodes, ins, {"corners": (I64, 2), "centers": (I64, 2), "no_thr": (I64, 2)}, opset=11)


def test_non_max_suppression_matches_onnxruntime(tmp_path: Path) -> None:
    """Run-time max_output_boxes_per_class (0, negative, below and above the box count),
    iou_threshold and score_threshold, both box formats, flipped corners and duplicate boxes, with
    and without a score threshold: the selected rows equal onnxruntime's; an iou_threshold outside
    [0, 1] is refused at run time, as onnxruntime does."""
    model = _nms_model()
    art = _compile(model, tmp_path)
    assert [o.shape for o in art.outputs] == [(-1, 3)] * 3 and not art.batched
    sess = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
    rng = np.random.default_rng(7)
    names = ["corners", "centers", "no_thr"]
    counts = set()
    for k, iou, thr in [(3, 0.5, 0.2), (100, 0.3, 0.0), (0, 0.5, 0.0), (-2, 0.5, 0.0), (1, 0.0, 0.5),
                        (5, 1.0, -1.0), (12, 0.6, 0.9), (2, 0.45, 0.35)]:
        corner = rng.random((2, 12, 2)).astype(np.float32)
        size = rng.random((2, 12, 2)).astype(np.float32) * 0.5
        boxes = np.concatenate([corner, corner + size], axis=2)
        boxes[:, ::3] = boxes[:, ::3][..., [2, 3, 0, 1]]  # flipped corners
        boxes[:, 5] = boxes[:, 4]  # a duplicate box
        scores = rng.random((2, 3, 12)).astype(np.float32)
        feeds = {"boxes": boxes, "scores": scores, "k": np.array([k], np.int64),
                 "iou": np.array([iou], np.float32), "thr": np.array([thr], np.float32)}
        got = art.infer(feeds)
        _same(art, sess, names, feeds)
        counts |= {got[n].shape[0] for n in names}
    assert 0 in counts and len(counts) > 5, counts
    feeds["iou"] = np.array([1.5], np.float32)
    with pytest.raises(ort.capi.onnxruntime_pybind11_state.Fail, match="iou_threshold must be in range"):
        sess.run(names, feeds)
    with pytest.raises(InputError, match="refused these inputs at run time"):
        art.infer(feeds)


def test_data_dependent_output_refused_on_the_c_backend_and_with_a_batch(tmp_path: Path) -> None:
    model = _model([oh.make_node("NonZero", ["x"], ["y"])], [("x", F, [1, 3])], {"y": (I64, 2)})
    with pytest.raises(TargetError, match=r"'x86_64-c' \(C backend\) cannot run a model whose output shapes "
                                          r"are decided at run time .*NonZero"):
        _compile(model, tmp_path, target="x86_64-c")
    from compiler.importer import import_model

    with pytest.raises(CompilerError, match=r"NonZero at node '#0' has an output whose length depends on the "
                                            r"data .* not for batch 4"):
        import_model(model, batch=4)
