"""The typed manifest: one owner reads and writes manifest.json; newer or malformed ones are refused."""

from __future__ import annotations

import json
import shutil

import pytest

from compiler import load_artifact
from compiler.errors import ArtifactError
from compiler.manifest import FORMAT_VERSION, MANIFEST, Manifest


def _copy(src, tmp_path):
    dst = tmp_path / "art"
    shutil.copytree(src, dst)
    return dst, json.loads((dst / MANIFEST).read_text())


def test_round_trip_is_byte_identical(compiler_digits_artifact, tmp_path):
    m = Manifest.read(compiler_digits_artifact)
    assert m.preset == m.target.preset and m.arch == m.target.arch
    assert m.training is not None and m.training.loss == "ce" and m.training.targets.shape == (32,)
    assert m.params.names and len(m.params.names) == len(m.params.shapes) == 4
    m.write(tmp_path)
    assert (tmp_path / MANIFEST).read_bytes() == (compiler_digits_artifact / MANIFEST).read_bytes()
    assert Manifest.read(tmp_path) == m


def test_newer_format_version_is_refused(compiler_digits_artifact, tmp_path):
    art, data = _copy(compiler_digits_artifact, tmp_path)
    data["format_version"] = FORMAT_VERSION + 1
    (art / MANIFEST).write_text(json.dumps(data))
    newer = rf"format version {FORMAT_VERSION + 1}; this fractal reads up to"
    with pytest.raises(ArtifactError, match=newer):
        load_artifact(art)


@pytest.mark.parametrize("edit, message", [
    (lambda d: d.pop("target"), "lacks the 'target' field"),
    (lambda d: d["target"].update(arch=7), r"target.arch is int, expected str"),
    (lambda d: d.update(batch=True), "batch is a boolean"),
    (lambda d: d["inputs"][0].update(shape=[1, -64]), r"inputs\[0\].shape is not a shape"),
    # -1 (a dim decided at run time, compiler.dynshape) is an output's only negative dim
    (lambda d: d["inputs"][0].update(shape=[1, -1]), r"inputs\[0\].shape is not a shape .*integers\)"),
    (lambda d: d["outputs"][0].update(shape=[1, -2]), r"outputs\[0\].shape is not a shape .*or -1\)"),
    (lambda d: d["params"].update(names=["only-one"]), "differ in length"),
    (lambda d: d["files"].update({"../escape": "0" * 64}), "leaves the artifact directory"),
    (lambda d: d.update(format_version="1"), "format_version is '1'"),
    (lambda d: d.update(training=[]), "training is not an object"),
])
def test_malformed_fields_are_named(compiler_digits_artifact, tmp_path, edit, message):
    art, data = _copy(compiler_digits_artifact, tmp_path)
    edit(data)
    (art / MANIFEST).write_text(json.dumps(data))
    with pytest.raises(ArtifactError, match=message) as info:
        load_artifact(art)
    assert info.value.hint


def test_artifact_from_before_the_nonfinite_field_refuses_nan_and_inf(compiler_digits_artifact, tmp_path):
    """A manifest without ``nonfinite`` was compiled when inference refused every non-finite input;
    it still does (its operators were never checked), while the recompiled one names its Relu."""
    import numpy as np

    from compiler.errors import InputError

    assert Manifest.read(compiler_digits_artifact).nonfinite.nan == "Relu"
    art, data = _copy(compiler_digits_artifact, tmp_path)
    data.pop("nonfinite")
    (art / MANIFEST).write_text(json.dumps(data))
    old = load_artifact(art)
    x = np.zeros((1, *old.inputs[0].shape[1:]), np.float32)
    old.infer({old.inputs[0].name: x})
    for bad, what in ((np.inf, "infinity"), (np.nan, "NaN")):
        x[0, 0] = bad
        with pytest.raises(InputError, match=f"holds {what}, which this model refuses: the artifact was "
                                             "compiled before"):
            old.infer({old.inputs[0].name: x})
