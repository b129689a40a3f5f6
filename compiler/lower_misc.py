"""Operators TVM's Relax frontend lacks or computes only for floats, rewritten into standard ones in
the preparation stage (found by ONNX's operator suite, issue 29):

* Pow of an integer base (TVM's Pow is float only). An integer exponent: exact square-and-multiply
  in the base's type over the exponent's low 6 bits (a product past the type's range wraps); a base
  of 0 or +-1 is exact for every exponent; otherwise a negative exponent gives 0 and one above 63
  (past any range) the type's lowest value, what onnxruntime's ``std::pow`` converts to on x86. A
  float exponent: the power in float64 truncated to the base's type, as onnxruntime computes it.
* TfIdfVectorizer over integer tokens (no converter): every n-gram window of every skip distance
  is gathered with a constant index table and compared with the pool's n-grams; the matches are
  summed per n-gram and placed at its output index by a constant 0/1 matrix, then weighted (TF,
  IDF, TFIDF). String tokens are refused (string tensors cannot be represented).
"""

from __future__ import annotations

from typing import Any

import numpy as np

from compiler.errors import ModelError
from compiler.graphbuild import node_attr

__all__ = ["MISC_OPS", "lower_misc_node", "wanted_misc"]

MISC_OPS = frozenset({"Pow", "TfIdfVectorizer"})
_INT_BITS = {2: 8, 3: 8, 4: 16, 5: 16, 6: 32, 7: 64, 12: 32, 13: 64}  # onnx TensorProto -> bits
_FLOATS = {1, 10, 11, 16}
_POW_ROUNDS = 6  # exponent bits computed exactly: 2^63 already overflows int64
_POW_ROUNDS_MAX = (1 << _POW_ROUNDS) - 1

_attr = node_attr


def wanted_misc(node: Any, types: dict[str, int]) -> bool:
    if node.op_type == "Pow":
        return types.get(node.input[0]) in _INT_BITS
    return node.op_type in MISC_OPS


def _i64(bld: Any, values: Any, hint: str = "c") -> str:
    return str(bld.const(np.asarray(values, np.int64), hint))


def _reduce(bld: Any, op: str, x: str, axes: list[int], keepdims: int, opset: int) -> str:
    """``op`` over ``axes``: an input from the opset that made it one (ReduceSum 13, others 18)."""
    if opset >= (13 if op == "ReduceSum" else 18):
        return str(bld.op(op, [x, _i64(bld, axes, "axes")], keepdims=keepdims))
    return str(bld.op(op, [x], axes=axes, keepdims=keepdims))


# ------------------------------------------------------------------------------------------- Pow
def _pow_int(bld: Any, node: Any, types: dict[str, int], label: str) -> None:
    from onnx import helper

    base, exp = node.input[:2]
    bt, et = types[base], types.get(exp, 0)
    if et in _FLOATS:
        wide = bld.op("Pow", [bld.op("Cast", [base], to=11), bld.op("Cast", [exp], to=11)])
        bld.op("Cast", [wide], to=bt, out=node.output[0])
        return
    if et not in _INT_BITS or et == 13:
        raise ModelError(f"{label}: an exponent of ONNX type {et}; integer bases take int8..int64 or "
                         "uint8..uint32 exponents, or float ones", hint="Cast the exponent to int64")
    dtype = helper.tensor_dtype_to_np_dtype(bt)

    def const(v: int, hint: str) -> str:
        return str(bld.const(np.array(v, dtype), hint))

    def i64(v: int, hint: str) -> str:
        return _i64(bld, v, hint)

    e = bld.op("Cast", [exp], to=7)
    # broadcast base and exponent to the output shape once
    x = bld.op("Add", [base, bld.op("Cast", [bld.op("Mul", [e, i64(0, "zero")])], to=bt)])
    e = bld.op("Add", [e, bld.op("Cast", [bld.op("Mul", [x, const(0, "zero")])], to=7)])
    # |base| >= 2: square-and-multiply over the exponent's low 6 bits (any larger exponent overflows)
    rest = bld.op("Min", [bld.op("Max", [e, i64(0, "zero")]), i64(_POW_ROUNDS_MAX, "top")])
    result = bld.op("Add", [bld.op("Mul", [x, const(0, "zero")]), const(1, "one")])
    square = x
    for i in range(_POW_ROUNDS):
        odd = bld.op("Equal", [bld.op("Mod", [rest, i64(2, "two")]), i64(1, "one")])
        result = bld.op("Where", [odd, bld.op("Mul", [result, square]), result])
        if i + 1 < _POW_ROUNDS:
            square = bld.op("Mul", [square, square])
            rest = bld.op("Div", [rest, i64(2, "two")])
    lowest = const(int(np.iinfo(dtype).min), "lowest")  # what x86 makes of an out-of-range double
    large = bld.op("Where", [bld.op("Greater", [e, i64(_POW_ROUNDS_MAX, "top")]), lowest, result])
    large = bld.op("Where", [bld.op("Less", [e, i64(0, "zero")]), const(0, "zero"), large])
    # |base| <= 1, every exponent: 1 -> 1, -1 -> +-1 by parity, 0 -> 1 / 0 / lowest (0^-n is infinity)
    odd_e = bld.op("Equal", [bld.op("Mod", [bld.op("Abs", [e]), i64(2, "two")]), i64(1, "one")])
    below = bld.op("Where", [bld.op("Less", [e, i64(0, "zero")]), lowest, const(0, "zero")])
    zero_to = bld.op("Where", [bld.op("Equal", [e, i64(0, "zero")]), const(1, "one"), below])
    small = bld.op("Where", [bld.op("Equal", [x, const(1, "one")]), const(1, "one"),
                             bld.op("Where", [bld.op("Equal", [x, const(-1, "minus")]),
                                              bld.op("Where", [odd_e, const(-1, "minus"), const(1, "one")]),
                                              zero_to])])
    unit = bld.op("LessOrEqual", [bld.op("Abs", [x]), const(1, "one")])
    bld.op("Where", [unit, small, large], out=node.output[0])


# ------------------------------------------------------------------------------- TfIdfVectorizer
def _ngrams(node: Any) -> dict[int, dict[tuple[int, ...], int]]:
    """size -> {n-gram: id (0-based)} of the n-grams counted (sizes in [min, max]); a repeated
    n-gram counts once, under its last id (as onnxruntime's trie keeps it)."""
    pool = list(_attr(node, "pool_int64s", []))
    counts = list(_attr(node, "ngram_counts", []))
    lo, hi = int(_attr(node, "min_gram_length", 1)), int(_attr(node, "max_gram_length", 1))
    out: dict[int, dict[tuple[int, ...], int]] = {}
    gid = 0
    for i, start in enumerate(counts):
        size = i + 1
        end = counts[i + 1] if i + 1 < len(counts) else len(pool)
        grams = [tuple(pool[j:j + size]) for j in range(start, start + (end - start) // size * size, size)]
        if lo <= size <= hi:
            for g in grams:
                out.setdefault(size, {})[g] = gid
                gid += 1
        else:
            gid += len(grams)
    return out


def _tfidf(bld: Any, node: Any, shapes: dict[str, list[int]], opset: int, label: str) -> None:
    if _attr(node, "pool_strings") is not None:
        raise ModelError(f"{label}: string n-grams (string tensors cannot be represented by the compiled "
                         "float/integer code)", hint="map the tokens to integer ids before the model")
    dims = shapes.get(node.input[0])
    if dims is None or len(dims) not in (1, 2) or any(d <= 0 for d in dims):
        raise ModelError(f"{label}: input of shape {dims}; TfIdfVectorizer takes a static [C] or [B, C]",
                         hint="fix the input shapes with --shape NAME=D0,D1,...")
    mode = _attr(node, "mode", "TF")
    indexes = list(_attr(node, "ngram_indexes", []))
    weights = list(_attr(node, "weights", []))
    width = max(indexes) + 1 if indexes else 0
    length, skips = dims[-1], int(_attr(node, "max_skip_count", 0))
    rows = 1 if len(dims) == 1 else dims[0]
    x = bld.op("Reshape", [bld.op("Cast", [node.input[0]], to=7), _i64(bld, [rows, length], "rows")])
    freq = None
    for size, grams in sorted(_ngrams(node).items()):
        starts = [(d, s) for d in range(1, (skips + 1 if size > 1 else 1) + 1)
                  for s in range(length - d * (size - 1))]
        if not starts:
            continue
        table = np.array([[s + j * d for j in range(size)] for d, s in starts], np.int64)
        pool = np.array(list(grams), np.int64).reshape(len(grams), size)
        place = np.zeros((len(grams), width), np.float32)
        for row, gid in enumerate(grams.values()):
            place[row, indexes[gid]] = 1.0
        seen = bld.op("Unsqueeze", [bld.op("Gather", [x, _i64(bld, table, "windows")], axis=1),
                                    _i64(bld, [2], "ax")])  # [B, W, 1, n]
        hit = bld.op("Cast", [bld.op("Equal", [seen, _i64(bld, pool, "pool")])], to=1)  # [B, W, G, n]
        found = _reduce(bld, "ReduceSum", _reduce(bld, "ReduceMin", hit, [3], 0, opset), [1], 0, opset)
        counts = bld.op("MatMul", [found, bld.const(place, "place")])  # [B, width]
        freq = counts if freq is None else bld.op("Add", [freq, counts])
    if freq is None:
        freq = bld.const(np.zeros((rows, width), np.float32), "none")
    if mode == "IDF":
        seen_any = bld.op("Cast", [bld.op("Greater", [freq, bld.const(np.array(0, np.float32), "z")])], to=1)
        freq = bld.op("Mul", [seen_any, bld.const(np.array(weights, np.float32), "w")]) if weights \
            else seen_any
    elif mode == "TFIDF" and weights:
        freq = bld.op("Mul", [freq, bld.const(np.array(weights, np.float32), "w")])
    bld.op("Reshape", [freq, _i64(bld, [width] if len(dims) == 1 else [rows, width], "shape")],
           out=node.output[0])


def lower_misc_node(bld: Any, node: Any, shapes: dict[str, list[int]], types: dict[str, int],
                    opset: int, label: str) -> None:
    """Emit ``node``'s replacement into ``bld`` (``node`` is one :func:`wanted_misc` accepts)."""
    if node.op_type == "Pow":
        _pow_int(bld, node, types, label)
    else:
        _tfidf(bld, node, shapes, opset, label)
