"""One Open Inference Protocol datatype table and tensor codec (fractal/oip.py): the node's request
codec, the boot health check (the only OIP client a board runs) and the serving benchmark use it;
no other shipped module spells a datatype name (a second table, or a hard-coded "FP32")."""

from __future__ import annotations

import re
from pathlib import Path

import numpy as np
import pytest

from fractal import oip

ROOT = Path(__file__).resolve().parents[2]
_NAMES = "|".join(oip.DATATYPES)


def test_no_module_but_fractal_oip_spells_a_datatype():
    found = []
    for pkg in ("compiler", "federation", "firmware", "edgenode", "deploy", "api", "bench", "harness"):
        for path in sorted((ROOT / pkg).rglob("*.py")):
            for n, line in enumerate(path.read_text().splitlines(), 1):
                if re.search(rf"[\"']({_NAMES})[\"']", line):
                    found.append(f"{path.relative_to(ROOT)}:{n}: {line.strip()}")
    assert found == [], "use fractal.oip (DATATYPES, json_tensor, decode_json_tensor):\n" + "\n".join(found)


def test_the_codec_round_trips_every_datatype():
    for name, dtype in oip.DATATYPES.items():
        a = np.arange(6).reshape(2, 3).astype(dtype)
        if dtype.kind == "O":  # BYTES: text, in JSON as strings and in binary length-prefixed
            a = np.array([["", "a", "\u00e9"], ["x y", "\u4e2d", "z" * 300]], dtype=object)
            assert np.array_equal(oip.decode_bytes("x", oip.encode_bytes(a), a.shape),
                                  np.vectorize(lambda s: s.encode(), otypes=[object])(a))
        t = oip.json_tensor("x", a)
        assert t["datatype"] == name
        got, b = oip.decode_json_tensor(t, "x")
        assert got == "x" and b.dtype == dtype and np.array_equal(a, b), name


def test_the_codec_round_trips_empty_tensors():
    """An empty tensor (a model compiled with an empty input, compiler/empty.py) has no values, so
    ``[]`` is its data whatever the datatype; a shape with elements still needs them."""
    for name, dtype in oip.DATATYPES.items():
        a = np.empty((2, 0, 3), dtype)
        got, b = oip.decode_json_tensor(oip.json_tensor("x", a), "x")
        assert b.dtype == dtype and b.shape == (2, 0, 3), name
    with pytest.raises(oip.TensorError, match=r"has 0 elements but shape \[1, 3\] needs 3"):
        oip.decode_json_data("x", [], (1, 3), np.dtype(np.int64))
