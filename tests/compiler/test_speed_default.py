"""Untuned builds get default CPU schedules (compiler.schedules): correct, recorded, applied.

Speed itself is a benchmark (tests/compiler/speed_compare.py; docs/benchmarks-history.md,
"untuned builds"), not a timed test; these tests check that the schedules are really applied to
the convolutions and dense layers, that the scheduled builds compute what onnxruntime computes
(at batch 1 and batch 2, which keeps the batch loop the rules otherwise see dropped), and that
the manifest says how the kernels were scheduled.
"""

from __future__ import annotations

import json
import shutil

import numpy as np
import onnxruntime as ort
import pytest

from compiler import zoo
from compiler.artifact import load_artifact
from compiler.build import compile_model
from compiler.manifest import MANIFEST, Manifest
from compiler.targets import best_host_preset_name, get_preset, host_preset_name


def _ort(path, x):
    sess = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])
    return sess.run(None, {"x": x})[0]


def _scheduled(mod):
    from tvm import tirx

    funcs = {gv.name_hint: f for gv, f in mod.functions.items() if isinstance(f, tirx.PrimFunc)}
    return {n: bool(f.attrs is not None and f.attrs.get("tirx.is_scheduled")) for n, f in funcs.items()}


@pytest.mark.slow
@pytest.mark.parametrize(("name", "batch"),
                         [("ds-cnn-kws", 2), ("resnet8-cifar10", 1), ("fc-autoencoder", 1)])
def test_default_schedules_match_onnxruntime(tmp_path, name, batch, emulate_onnx, foreign_artifact):
    if (name, batch) == ("ds-cnn-kws", 2):  # the emulation tests' x86 reference: this very build
        onnx_path, out = emulate_onnx, foreign_artifact(host_preset_name())
    else:
        onnx_path = zoo.save(name, tmp_path / f"{name}.onnx", batch=batch)
        out = compile_model(onnx_path, target=host_preset_name(), out_dir=tmp_path / "art", progress=False)
    m = Manifest.read(out)
    assert m.tuning.schedule == "default" and not m.tuning.tuned
    art = load_artifact(out)
    x = np.random.default_rng(3).standard_normal(zoo.input_shape(name, batch=batch)).astype(np.float32)
    got = next(iter(art.infer({"x": x}).values()))
    np.testing.assert_allclose(got, _ort(onnx_path, x), rtol=1e-4, atol=1e-4)


@pytest.mark.slow
@pytest.mark.parametrize("target", ["x86_64", "best"])
def test_channels_last_mobilenet_matches_onnxruntime(tmp_path, target):
    """x86_64 untuned builds convert convolutions to NHWC/HWIO (compiler.layout.channels_last)
    and register-tile them (ChannelsLast): mobilenet exercises strided depthwise convolutions,
    8 output channels (fewer than an AVX-512 vector) and pointwise ones on 3x3 rows; the weight
    transposes go to the per-parameter-set transform. Matches onnxruntime. ``best``: the widest
    vector preset this CPU runs (x86_64-avx512 on an AVX-512 host, x86_64-avx2 on one without),
    since an artifact built for a wider ISA than the host's cannot run here."""
    if target == "best":
        target = best_host_preset_name()
    from compiler import layout, schedules
    from compiler.importer import import_model

    name = "mobilenet-v1-0.25-vww"
    onnx_path = zoo.save(name, tmp_path / f"{name}.onnx")
    # the conversion really happens and every convolution kernel gets the channels-last rule
    converted = layout.channels_last(import_model(zoo.build(name)).mod)
    text = converted["main"].script()
    assert 'data_layout="NHWC"' in text and 'data_layout="NCHW"' not in text
    done = _scheduled(schedules.apply(import_model(zoo.build(name)).mod, get_preset(target).tvm_target(),
                                      measure=False))
    assert all(s for n, s in done.items() if "conv2d" in n), done
    out = compile_model(onnx_path, target=target, out_dir=tmp_path / "art", progress=False)
    art = load_artifact(out)
    x = np.random.default_rng(5).standard_normal(zoo.input_shape(name)).astype(np.float32)
    got = next(iter(art.infer({"x": x}).values()))
    np.testing.assert_allclose(got, _ort(onnx_path, x), rtol=1e-4, atol=1e-4)


def test_every_conv_and_dense_kernel_is_scheduled():
    """Without measuring (as for a board this machine cannot run), every convolution and
    matmul of the CNN and MLP zoo models gets a rule's schedule, not the naive lowering."""
    from compiler import schedules
    from compiler.importer import import_model

    for name in ("ds-cnn-kws", "resnet8-cifar10", "digits-mlp"):
        imported = import_model(zoo.build(name))
        for target in ("x86_64-avx512", "rpi4"):
            done = _scheduled(schedules.apply(imported.mod, get_preset(target).tvm_target(), measure=False))
            heavy = {n: s for n, s in done.items() if "conv2d" in n or "matmul" in n}
            assert heavy and all(heavy.values()), (name, target, heavy)


def test_cross_target_builds_with_default_schedules(foreign_artifact):
    """The rules are target-generic: an aarch64 build (not measured here) compiles with them (the
    emulation tests' rpi4 build of ds-cnn-kws, built once per session)."""
    m = Manifest.read(foreign_artifact("rpi4"))
    assert m.preset == "rpi4" and m.tuning.schedule == "default" and not m.tuning.tuned


def test_manifest_without_schedule_field_reads_as_naive_or_tuned(compiler_digits_artifact, tmp_path):
    art = tmp_path / "art"
    shutil.copytree(compiler_digits_artifact, art)
    data = json.loads((art / MANIFEST).read_text())
    data["tuning"].pop("schedule", None)
    (art / MANIFEST).write_text(json.dumps(data))
    assert Manifest.read(art).tuning.schedule == "naive"
    data["tuning"]["tuned"] = True
    (art / MANIFEST).write_text(json.dumps(data))
    assert Manifest.read(art).tuning.schedule == "tuned"
