"""The untuned default schedules' measured choices are made once per workload (issue 29).

compiler.schedules times schedule variants of each kernel on a machine that runs the target;
compiler.schedule_cache keeps the choices by workload, so identical kernels in one compile are
timed once and a second compile (of the same model, or of another one with the same layer
shapes, through ``compile_model`` too) times nothing and gets the same schedules; kernels that read
parameters only (weight layout transposes, run once per parameter set) are never timed. A small CNN
of two identical 3x3 convolutions (one workload: Relax shares the kernel) plus a renamed copy of
a timed kernel, so the module really holds two functions with one workload.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from onnx import TensorProto, helper, numpy_helper

from compiler import compile_model, host_preset_name, load_artifact, schedules
from compiler.schedule_cache import Decisions, workload_key

C, H = 16, 12  # (rows of 12: the layout transposes are timed, not given the Elementwise schedule)


def _model() -> onnx.ModelProto:
    rng = np.random.default_rng(0)
    inits = {f"w{i}": (rng.standard_normal((C, C, 3, 3)) * 0.1).astype(np.float32) for i in (1, 2)}
    nodes = [
        helper.make_node("Conv", ["x", "w1"], ["c1"], pads=[1, 1, 1, 1]),
        helper.make_node("Relu", ["c1"], ["a1"]),
        helper.make_node("Conv", ["a1", "w2"], ["c2"], pads=[1, 1, 1, 1]),  # the same workload
        helper.make_node("Relu", ["c2"], ["y"]),
    ]
    graph = helper.make_graph(nodes, "twin_convs",
                              [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, C, H, H])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, C, H, H])],
                              [numpy_helper.from_array(v, k) for k, v in inits.items()])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 10
    return model


def _spy(monkeypatch: pytest.MonkeyPatch) -> list[list[str]]:
    """The kernels of every timing run (``schedules._time_all``), which still runs for real."""
    calls: list[list[str]] = []
    real = schedules._time_all

    def spy(funcs: dict[str, Any], target: Any, **kw: Any) -> dict[str, float]:
        calls.append(sorted(funcs))
        return real(funcs, target, **kw)

    monkeypatch.setattr(schedules, "_time_all", spy)
    return calls


def test_identical_workloads_timed_once_then_cached(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from tvm import tirx

    from compiler.importer import import_model
    from compiler.targets import get_preset
    from compiler.tuning import can_measure, prepare

    target = get_preset(host_preset_name()).tvm_target()
    assert can_measure(target)[0]  # the host preset runs here: the choices are measured
    prepared = prepare(import_model(_model()).mod, target)
    convs = [gv for gv, f in prepared.functions.items()
             if isinstance(f, tirx.PrimFunc) and "conv2d" in gv.name_hint]
    assert len(convs) == 1, [gv.name_hint for gv in prepared.functions]  # Relax shares the twin kernel
    # a kernel whose variants are timed (the layout transposes at the graph's edges; untuned
    # builds keep the register-tiled convolutions unmeasured where vectors are 256 bits or less)
    base = next(gv.name_hint for gv, f in prepared.functions.items()
                if isinstance(f, tirx.PrimFunc) and gv.name_hint.startswith("transpose"))
    twin = f"{base}_twin"
    prepared = prepared.clone()
    prepared[twin] = prepared[base]  # (the IRModule names the new function by this string)
    kernels = {gv.name_hint: f for gv, f in prepared.functions.items() if isinstance(f, tirx.PrimFunc)}
    workloads = {workload_key(f) for f in kernels.values()}
    assert len(workloads) == len(kernels) - 1

    cache = tmp_path / "cache"
    calls = _spy(monkeypatch)
    first = Decisions(target, cache)
    out1 = schedules.schedule_prepared(prepared, target, decisions=first)
    first.save()
    timed = {n for call in calls for n in call}
    assert base in timed or twin in timed, calls  # the transpose's variants were timed ...
    assert not {base, twin} <= timed  # ... once for its two kernels
    assert first.hits == 0 and 0 < first.timed <= len(workloads)
    # the weights' layout transposes read parameters only (pre-packing runs them once per
    # parameter set): neither timed nor recorded
    weights = schedules._parameter_only(prepared)
    assert weights and all(n.startswith("transpose") for n in weights) and base not in weights, weights
    assert not weights & timed, calls
    assert out1[twin].script() == out1[base].script()  # the choice applies to both

    calls.clear()
    second = Decisions(target, cache)  # another compile: reads the file the first one wrote
    out2 = schedules.schedule_prepared(prepared, target, decisions=second)
    assert calls == [] and second.timed == 0 and second.hits == len(kernels) - len(weights)
    for name in kernels:  # the same schedules, replayed without timing
        assert out2[name].script() == out1[name].script(), name

    # compile_model (untuned) reads the same cache: its kernels are these workloads, none timed
    monkeypatch.setenv("FRACTAL_SCHEDULE_CACHE", str(cache))
    model = tmp_path / "twin.onnx"
    onnx.save(_model(), model)
    out = compile_model(model, target=host_preset_name(), out_dir=tmp_path / "art", progress=False)
    assert calls == []
    x = (np.arange(C * H * H, dtype=np.float32).reshape(1, C, H, H) / (C * H * H))
    want = ort.InferenceSession(str(model), providers=["CPUExecutionProvider"]).run(None, {"x": x})[0]
    got = next(iter(load_artifact(out).infer({"x": x}).values()))
    np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-4)


def test_untuned_builds_skip_the_timings_whose_outcome_is_known(tmp_path: Path,
                                                                monkeypatch: pytest.MonkeyPatch) -> None:
    """A dense layer (one big reduction) is not timed in its naive lowering, a softmax (two
    reductions, where the naive loop won by 1000x) is; an elementwise kernel is timed in two
    variants (naive, its one rule schedule), not four."""
    from tvm import tirx

    from compiler.importer import import_model
    from compiler.targets import get_preset
    from compiler.tuning import prepare

    rng = np.random.default_rng(0)
    w = numpy_helper.from_array((rng.standard_normal((256, 64)) * 0.1).astype(np.float32), "w")
    nodes = [helper.make_node("MatMul", ["x", "w"], ["h"]), helper.make_node("Softmax", ["h"], ["s"]),
             helper.make_node("Transpose", ["s"], ["y"], perm=[1, 0])]
    graph = helper.make_graph(nodes, "dense_softmax",
                              [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 256])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, [64, 1])], [w])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 10
    target = get_preset(host_preset_name()).tvm_target()
    prepared = prepare(import_model(model).mod, target)
    kernels = [gv.name_hint for gv, f in prepared.functions.items() if isinstance(f, tirx.PrimFunc)]
    dense = next(n for n in kernels if "matmul" in n)
    softmax = next(n for n in kernels if "softmax" in n)
    elementwise = next(n for n in kernels if n.startswith("transpose"))

    runs: list[dict[str, bool]] = []  # per timing run: kernel -> whether it ran its naive lowering
    real = schedules._time_all

    def spy(funcs: dict[str, Any], target: Any, **kw: Any) -> dict[str, float]:
        runs.append({n: f.same_as(prepared[n]) for n, f in funcs.items()})
        return real(funcs, target, **kw)

    monkeypatch.setattr(schedules, "_time_all", spy)
    decisions = Decisions(target, tmp_path / "cache")
    schedules.schedule_prepared(prepared, target, decisions=decisions)
    naive = {n for run in runs for n, is_naive in run.items() if is_naive}
    timed = [n for run in runs for n in run]
    assert dense in timed and dense not in naive, runs  # only its rule variants
    assert softmax in naive, runs
    assert timed.count(elementwise) == 2 and elementwise in naive, runs
