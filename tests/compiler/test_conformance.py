"""Conformance: ONNX's backend test data (shipped in the onnx wheel) through prepare + compile + infer.

Runs every case through ``fractal``'s pipeline (x86_64, untuned, input shapes from the test data),
onnxruntime, and plain TVM import (see tests/compiler/conformance.py; results are cached under
.cache/conformance keyed by the case and the compiler's source). Pins the exact set of passing
cases: a case that stops passing fails the test; a case that starts passing is printed so it can
be added. Every case that does not pass must be refused at compile time with one clear line.

Measure by hand: ``PYTHONPATH=. python -m tests.compiler.conformance report``.
"""

from __future__ import annotations

import pytest

from tests.compiler import conformance as cf

# Cases the project passes (suite/name). Keep sorted; add a case when the test reports it newly passing.
PASSING: frozenset[str] = frozenset()

# Cases refused at compile time, each with the cause (the test checks the refusal line contains it).
REFUSED: dict[str, str] = {}

BAD = ("wrong", "error", "crash", "refused-at-run")


def _check(suites: tuple[str, ...]) -> None:
    selected = cf.cases(suites)
    assert selected, f"no ONNX backend test data found under {cf.data_root()}"
    res = cf.results(selected)
    ids = set(res)
    passed = {c for c, r in res.items() if r["project"]["status"] == "pass"}
    ort = {c for c, r in res.items() if r["ort"]["status"] == "pass"}
    tvm = {c for c, r in res.items() if r["tvm"]["status"] == "pass"}
    n = len(ids)
    print(f"\nconformance {'+'.join(suites)}: project {len(passed)}/{n}, onnxruntime {len(ort)}/{n}, "
          f"plain TVM import {len(tvm)}/{len(ids)}; of onnxruntime's {len(ort)}: project passes "
          f"{len(ort & passed)}")
    for c in sorted(ort - passed):
        print(f"  onnxruntime passes, project refuses: {c}: {res[c]['project'].get('detail', '')[:160]}")
    bad = {c: f"{r['project']['status']}: {r['project'].get('detail', '')}" for c, r in res.items()
           if r["project"]["status"] in BAD}
    assert not bad, f"cases neither passing nor cleanly refused: {bad}"
    for c, r in res.items():
        if r["project"]["status"] == "refused":
            line = r["project"]["detail"]
            assert line and "\n" not in line and "Traceback" not in line, (c, line)
            if c in REFUSED:
                assert REFUSED[c] in line, (c, line)
    pinned = {c for c in PASSING if c in ids}
    newly_failing = pinned - passed
    assert not newly_failing, f"cases that passed before and fail now: {sorted(newly_failing)}"
    newly_passing = passed - pinned
    if newly_passing:
        print(f"NEWLY PASSING (add to PASSING in {__file__}): {sorted(newly_passing)}")


@pytest.mark.slow
def test_backend_test_data() -> None:
    _check(("simple", "pytorch-operator", "pytorch-converted"))


@pytest.mark.slow
def test_light_model_zoo() -> None:
    """The `light` model-zoo networks (ResNet-50, DenseNet-121, VGG-19, ...): a few minutes to compile."""
    _check(("light",))
