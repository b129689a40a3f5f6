"""The host stage (compiler/hoststage.py, compiler/hostsplit.py): string operators against
onnxruntime (whose RegexFullMatch is RE2 itself), the RE2 subset refused outside what Python's ``re``
reads alike, and the cuts it refuses (strings between numeric operators, other operators on strings)."""

from __future__ import annotations

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from onnx import TensorProto, helper

from compiler.artifact import load_artifact
from compiler.build import compile_model
from compiler.errors import InputError, ModelError
from compiler.hostsplit import split_host_stage
from compiler.hoststage import HostNode
from compiler.re2subset import translate_re2

S, I64 = TensorProto.STRING, TensorProto.INT64
ML = "ai.onnx.ml"


def _model(nodes, inputs, outputs, inits=(), ml=False, opset=20):
    ops = [helper.make_opsetid("", opset)] + ([helper.make_opsetid("ai.onnx.ml", 3)] if ml else [])
    g = helper.make_graph(nodes, "m", [helper.make_tensor_value_info(*i) for i in inputs],
                          [helper.make_tensor_value_info(*o) for o in outputs], initializer=list(inits))
    m = helper.make_model(g, opset_imports=ops)
    m.ir_version = 9
    return m


def _ort(model, feeds):
    sess = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
    return sess.run(None, feeds)


def _ours(model, feeds, tmp_path):
    onnx.save(model, tmp_path / "m.onnx")
    art = load_artifact(compile_model(tmp_path / "m.onnx", target="x86_64", out_dir=tmp_path / "art",
                                      progress=False))
    res = art.infer(feeds)
    return [res[o.name] for o in art.outputs]


REGEX_TEXTS = ["abc", "ABC", "abc\n", "a b", "a\vb", "é", "x1_", "", "a.b", "www.x-y.com", "3.14",
               "tab\there"]
PATTERNS = [r"[a-z]+", r"\w+", r"\w*", r"abc$", r"a\sb", r"a\Sb", r"[^a-z]+", r"(a|b)c?\.?b?", r"\d+\.\d{2}",
            r"www\.[\w.-]+\.com", r".*", r"[\s\w]+", r"x\d_?", r"(?:ab)+c", r"\x41BC", r"t[a-c]b\t\w+",
            r"\bx\w*\b", r"[+\-.]|a{1,3}?bc", r"(a|b)?c", r"(\w+){2}", r"(?:ab)*c"]


@pytest.mark.parametrize("pattern", PATTERNS)
def test_regex_matches_re2_as_onnxruntime_runs_it(pattern, tmp_path):
    x = np.array(REGEX_TEXTS, dtype=object)
    m = _model([helper.make_node("RegexFullMatch", ["x"], ["y"], pattern=pattern)],
               [("x", S, [len(x)])], [("y", TensorProto.BOOL, [len(x)])])
    got, = _ours(m, {"x": x}, tmp_path)
    want, = _ort(m, {"x": x})
    assert got.tolist() == want.tolist()


@pytest.mark.parametrize("pattern", [r"a(?=b)", r"(a)\1", r"(?P<n>a)", r"(?i)a", r"\p{L}", r"\Aa\z", r"a{,3}",
                                     r"[[:alpha:]]", r"\Qa.b\E", r"a*+", r"\0", r"[]a]", r"a{2000}",
                                     r"a)", r"(a", r"(a*)*b", r"(a|ab)+", r"((ab)+c)*", r"(x+){2,}"])
def test_regex_outside_the_common_subset_is_refused(pattern):
    with pytest.raises(ValueError):
        translate_re2(pattern)


def test_refused_pattern_is_one_line_at_compile(tmp_path):
    m = _model([helper.make_node("RegexFullMatch", ["x"], ["y"], pattern="a(?!b)")], [("x", S, [2])],
               [("y", TensorProto.BOOL, [2])])
    onnx.save(m, tmp_path / "m.onnx")
    with pytest.raises(ModelError, match=r"RegexFullMatch at node .*outside the RE2 subset") as e:
        compile_model(tmp_path / "m.onnx", target="x86_64", out_dir=tmp_path / "art", progress=False)
    assert "\n" not in str(e.value)


def test_split_normalize_and_category_map_match_onnxruntime(tmp_path):
    x = np.array(["Monday  a b", "TUESDAY", "a\u3000b c", "\u00e9lan", "monday", "x\x1cy z"], dtype=object)
    nodes = [
        helper.make_node("StringSplit", ["x"], ["parts", "n"], maxsplit=1),
        helper.make_node("StringNormalizer", ["x"], ["norm"], case_change_action="UPPER", is_case_sensitive=0,
                         stopwords=["MONDAY"], locale="C.UTF-8"),
        helper.make_node("CategoryMapper", ["x"], ["code"], domain="ai.onnx.ml",
                         cats_strings=["TUESDAY", "monday"], cats_int64s=[7, 9], default_int64=-5),
        helper.make_node("CategoryMapper", ["code"], ["back"], domain="ai.onnx.ml", cats_strings=["t", "m"],
                         cats_int64s=[7, 9], default_string="none"),
    ]
    m = _model(nodes, [("x", S, [6])], [("parts", S, [6, None]), ("n", I64, [6]), ("norm", S, [None]),
                                        ("code", I64, [6]), ("back", S, [6])], ml=True)
    got = _ours(m, {"x": x}, tmp_path)
    want = _ort(m, {"x": x})
    for g, w in zip(got, want, strict=True):
        assert g.shape == w.shape and g.tolist() == w.tolist()


SPLIT_TEXTS = ["a  b  c  ", "  a b", "a\t\tb\nc", " ", "a\vb", "a\x1cb", "a\u3000b", "a\u00a0b", "", "x",
               " x ", "a b  ", "a  b c", ",", "a,", ",a", "a,b,c", " a , b ", "a,,b", "abab"]


@pytest.mark.parametrize("attrs", [{}, {"maxsplit": 1}, {"maxsplit": 2}, {"maxsplit": 0},
                                   {"delimiter": ","}, {"delimiter": ",", "maxsplit": 1}, {"delimiter": "ab"},
                                   {"delimiter": " "}],
                         ids=str)
def test_split_answers_as_onnxruntime_or_refuses(attrs):
    """Each string alone: onnxruntime's substrings, or an InputError where ONNX's reference and
    onnxruntime disagree (tabs, a remainder ending in spaces, an empty string at a delimiter)."""
    from compiler.hoststage import HOST_OPS

    run = HOST_OPS["StringSplit"](HostNode("StringSplit", "s", ("x",), ("p", "n"), attrs))
    m = _model([helper.make_node("StringSplit", ["x"], ["p", "n"], **attrs)], [("x", S, [1])],
               [("p", S, [1, None]), ("n", I64, [1])])
    sess = ort.InferenceSession(m.SerializeToString(), providers=["CPUExecutionProvider"])
    refused = 0
    for text in SPLIT_TEXTS:
        x = np.array([text], dtype=object)
        p, n = sess.run(None, {"x": x})
        want = p.tolist()[0][:n[0]]
        try:
            gp, gn = run(x)
        except InputError as exc:
            assert "refused rather than answered one way" in str(exc)
            refused += 1
            continue
        assert gp.tolist()[0][:gn[0]] == want, text
    assert refused < len(SPLIT_TEXTS) // 2


NORMALIZER_ROWS = [["", "a"], ["Stra\u00dfe", "\u0130stanbul", "\u01c5", "\u03a9"],
                   ["MONDAY", "monday", "Monday "], ["\u00c9COLE", "\u00e9cole", "\u00c9cole"],
                   ["\u03c2", "\u03a3", "\u017f", "S", "K", "\u212a"]]


@pytest.mark.parametrize("attrs", [{}, {"case_change_action": "UPPER"}, {"case_change_action": "LOWER"},
                                   {"stopwords": ["monday", "\u00e9cole", "\u03c3", "s"]},
                                   {"stopwords": ["monday", "\u00c9COLE"], "is_case_sensitive": 1},
                                   {"stopwords": ["k", "\u03c2"], "case_change_action": "UPPER"}], ids=str)
def test_normalizer_answers_as_onnxruntime_or_refuses(attrs):
    """Each row: onnxruntime's answer (its C.UTF-8 locale's towupper / towlower), or an InputError
    where it and ONNX's reference (Python's full case mapping) disagree."""
    from compiler.hoststage import HOST_OPS

    attrs = {**attrs, "locale": "C.UTF-8"}
    run = HOST_OPS["StringNormalizer"](HostNode("StringNormalizer", "n", ("x",), ("y",), attrs))
    answered = 0
    for row in NORMALIZER_ROWS:
        m = _model([helper.make_node("StringNormalizer", ["x"], ["y"], **attrs)], [("x", S, [len(row)])],
                   [("y", S, [None])], opset=10)
        x = np.array(row, dtype=object)
        sess = ort.InferenceSession(m.SerializeToString(), providers=["CPUExecutionProvider"])
        want = sess.run(None, {"x": x})
        try:
            got = run(x)
        except InputError as exc:
            assert "refused" in str(exc)
            continue
        assert got[0].tolist() == want[0].tolist(), row
        answered += 1
    assert answered >= 3


def test_normalizer_takes_one_row_only():
    from compiler.hoststage import HOST_OPS

    run = HOST_OPS["StringNormalizer"](HostNode("StringNormalizer", "n", ("x",), ("y",), {}))
    with pytest.raises(InputError, match=r"\[1, C\]"):
        run(np.array([["a"], ["b"]], dtype=object))


def test_strings_between_numeric_operators_are_refused():
    nodes = [
        helper.make_node("LabelEncoder", ["x"], ["i"], domain=ML, keys_strings=["a"], values_int64s=[1]),
        helper.make_node("Neg", ["i"], ["j"]),
        helper.make_node("LabelEncoder", ["j"], ["s"], domain=ML, keys_int64s=[-1], values_strings=["b"]),
        helper.make_node("LabelEncoder", ["s"], ["k"], domain=ML, keys_strings=["b"], values_int64s=[2]),
        helper.make_node("Neg", ["k"], ["y"]),
    ]
    m = _model(nodes, [("x", S, [2])], [("y", I64, [2])], ml=True, opset=17)
    with pytest.raises(ModelError, match="works on strings between numeric operators"):
        split_host_stage(m)
    other = _model([helper.make_node("Identity", ["x"], ["y"])], [("x", S, [2])], [("y", S, [2])])
    with pytest.raises(ModelError, match="Identity at node .* takes or gives a string tensor"):
        split_host_stage(other)


def test_inputs_must_be_text(tmp_path):
    m = _model([helper.make_node("StringConcat", ["x", "x"], ["y"])], [("x", S, [2])], [("y", S, [2])])
    onnx.save(m, tmp_path / "m.onnx")
    art = load_artifact(compile_model(tmp_path / "m.onnx", target="x86_64", out_dir=tmp_path / "art",
                                      progress=False))
    assert art.manifest.libs.infer is None and art.manifest.host is not None
    # format 2: an older fractal refuses it by name instead of handing strings to a library
    assert '"format_version": 2' in (art.directory / "manifest.json").read_text()
    assert art.infer({"x": [b"ab", "\u00e9"]})["y"].tolist() == ["abab", "\u00e9\u00e9"]
    with pytest.raises(InputError, match="expected strings"):
        art.infer({"x": np.zeros(2, np.float32)})
    with pytest.raises(InputError, match="not UTF-8"):
        art.infer({"x": np.array([b"\xff", b"a"], dtype=object)})
    with pytest.raises(InputError, match="shape"):
        art.infer({"x": np.array(["a", "b", "c"], dtype=object)})


def test_string_constants_feed_the_compiled_rest(tmp_path):
    """Equal against a string initializer and StringConcat with a string Constant at the inputs,
    their numbers through a compiled Mul, at any batch size (the library's batch is 1)."""
    red = helper.make_tensor("red", S, [1], [b"red"])
    nodes = [helper.make_node("Constant", [], ["suffix"], value=helper.make_tensor("v", S, [], [b"!"])),
             helper.make_node("Equal", ["x", "red"], ["is_red"]),
             helper.make_node("Cast", ["is_red"], ["f"], to=TensorProto.FLOAT),
             helper.make_node("Mul", ["f", "w"], ["y"]),
             helper.make_node("StringConcat", ["x", "suffix"], ["loud"])]
    w = helper.make_tensor("w", TensorProto.FLOAT, [1], [2.5])
    m = _model(nodes, [("x", S, ["N"])], [("y", TensorProto.FLOAT, ["N"]), ("loud", S, ["N"])],
               inits=[red, w])
    x = np.array(["red", "blue", "", "red"], dtype=object)
    got = _ours(m, {"x": x}, tmp_path)
    want = _ort(m, {"x": x})
    np.testing.assert_array_equal(got[0], want[0])
    assert got[1].tolist() == want[1].tolist() == ["red!", "blue!", "!", "red!"]


def test_a_strings_only_artifact_runs_without_tvm_or_onnx(tmp_path):
    """No library: loading and inference import neither TVM nor onnx (what a board's node has)."""
    import subprocess
    import sys
    from pathlib import Path

    m = _model([helper.make_node("StringSplit", ["x"], ["parts", "n"], delimiter=",")], [("x", S, [2])],
               [("parts", S, [2, None]), ("n", I64, [2])])
    onnx.save(m, tmp_path / "m.onnx")
    art = compile_model(tmp_path / "m.onnx", target="x86_64", out_dir=tmp_path / "art", progress=False)
    code = ("import sys; from compiler.artifact import load_artifact; "
            f"out = load_artifact({str(art)!r}).infer({{'x': ['a,b,c', 'd']}}); "
            "print(out['parts'].tolist(), out['n'].tolist(), "
            "sorted({m.split('.')[0] for m in sys.modules} & {'tvm', 'tvm_ffi', 'onnx', 'onnxruntime'}))")
    root = Path(__file__).resolve().parents[2]
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=root, timeout=120,
                         env={"PYTHONPATH": str(root), "PATH": "/usr/bin:/bin"})
    assert res.returncode == 0, res.stderr
    assert res.stdout.strip() == "[['a', 'b', 'c'], ['d', '', '']] [3, 1] []"


def _le_cases():
    from onnx import numpy_helper as nh

    strings = helper.make_tensor("v", S, [2], [b"p", b"q"])
    return [
        ({"keys_floats": [1.0, float("nan"), -0.0], "values_strings": ["one", "nan", "zero"]},
         TensorProto.FLOAT, np.array([1, np.nan, 0.0, -0.0, 2], np.float32), S),
        ({"keys_int64s": [3, -1], "values_strings": ["a", "b"], "default_string": "?"}, I64,
         np.array([3, -1, 7], np.int64), S),
        ({"keys_strings": ["a", "b"], "values_floats": [0.5, -1.5]}, S, np.array(["a", "b", "c"], object),
         TensorProto.FLOAT),
        ({"keys_strings": ["a", "b"], "values_strings": ["x", "y"]}, S, np.array(["a", "b", "c", ""], object),
         S),
        ({"keys_tensor": nh.from_array(np.array([1, 2], np.int64), "k"), "values_tensor": strings}, I64,
         np.array([1, 2, 3], np.int64), S),
        ({"keys_strings": ["a"], "values_tensor": nh.from_array(np.array([2.5], np.float64), "v")}, S,
         np.array(["a", "b"], object), TensorProto.DOUBLE),
    ]


@pytest.mark.parametrize("case", range(6))
def test_label_encoder_with_strings_matches_onnxruntime(case):
    """Keys and values of every kind with strings on one side (NaN and -0.0 keys, the defaults)."""
    from compiler.hostsplit import _attr_json
    from compiler.hoststage import HOST_OPS

    attrs, in_type, x, out_type = _le_cases()[case]
    node = helper.make_node("LabelEncoder", ["x"], ["y"], domain=ML, **attrs)
    m = _model([node], [("x", in_type, [len(x)])], [("y", out_type, [len(x)])], ml=True, opset=17)
    m.opset_import[1].version = 4
    want, = _ort(m, {"x": x})
    got, = HOST_OPS["LabelEncoder"](HostNode("LabelEncoder", "y", ("x",), ("y",), _attr_json(node)))(x)
    assert got.dtype == want.dtype and [str(v) for v in got.tolist()] == [str(v) for v in want.tolist()]
