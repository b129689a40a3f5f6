"""The host stage: a model's string operators, run with numpy beside the compiled numeric code.

TVM has no string dtype, so the string-typed part of a graph at the model's edges (sklearn-onnx
pipelines map categories with LabelEncoder / CategoryMapper, clean them with StringNormalizer, ...)
runs here, on the host, by this small interpreter written from the ONNX operator specifications:

* ``head``: string operators reading the model's inputs (and each other's outputs); their numeric
  outputs feed the compiled library (``libs.infer``), or are outputs of the model themselves.
* ``tail``: operators turning the library's outputs into strings (LabelEncoder int -> string).

:mod:`compiler.hostsplit` cuts a model into these parts at compile time and refuses string
operators between numeric ones. The stage is stored as ``host.json`` in the artifact (nodes with
JSON attributes, string constants): standard library and numpy only, no onnx, no tvm, as
everything :mod:`compiler.artifact` loads on a board.

Strings are numpy object arrays of Python ``str`` (ONNX's STRING is UTF-8; bytes that are not
UTF-8 are refused where they enter, :func:`as_strings`). Operators and how they follow the spec:

* LabelEncoder (ai.onnx.ml 1-4; string keys or values), CategoryMapper: exact key lookup, the
  default for a missing key; float keys compare as float32, NaN matches a NaN key.
* Equal (strings), StringConcat: elementwise with numpy broadcasting.
* StringSplit: a non-empty ``delimiter`` splits on each occurrence; none or ``""`` splits on runs of
  spaces (leading/trailing runs ignored); ``maxsplit`` limits the splits from the left.
* StringNormalizer: drops the elements equal to a stopword (case-insensitively unless
  ``is_case_sensitive``), then LOWER / UPPER character by character; an empty result is ``[""]``.
  Locales other than English / C are refused (Turkish dotted i and friends).

Where ONNX's reference implementation (Python) and onnxruntime answer differently, the input is
refused with an InputError rather than answered one way (a 400 at the node): StringSplit of text
holding tabs or line breaks, of an empty string at a delimiter, or leaving a remainder that ends in
spaces; StringNormalizer of a character whose case mapping is not one character (sharp s, dotted
I) or of text that matches a stopword in lower case but not in upper case (final sigma, long s).
``tests/compiler/test_hoststage.py`` checks both operators string by string against onnxruntime.
* RegexFullMatch: RE2 syntax; the subset RE2 and Python's ``re`` read alike is translated (ASCII
  classes, ``$`` only at the end, ``\\s`` without ``\\v``), every other construct is refused at
  compile time rather than answered differently (:mod:`compiler.re2subset`).
"""

from __future__ import annotations

import json
import math
import operator
import re
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from compiler.errors import InputError, ModelError
from compiler.re2subset import translate_re2

__all__ = ["STRING", "HOST_FILE", "HostNode", "HostStage", "as_strings", "HOST_OPS"]

STRING = "object"  # a string tensor's dtype in the manifest (numpy's form of ONNX STRING)
HOST_FILE = "host.json"
FORMAT = 1

Kernel = Callable[..., tuple[np.ndarray, ...]]


@dataclass(frozen=True)
class HostNode:
    """One operator of the host stage; ``attrs`` are JSON values (a tensor is
    ``{"dtype", "shape", "data"}``)."""

    op: str
    name: str
    inputs: tuple[str, ...]
    outputs: tuple[str, ...]
    attrs: Mapping[str, Any] = field(default_factory=dict)

    def to_json(self) -> dict[str, Any]:
        return {"op": self.op, "name": self.name, "inputs": list(self.inputs), "outputs": list(self.outputs),
                "attrs": dict(self.attrs)}

    @classmethod
    def from_json(cls, d: Any) -> HostNode:
        if not isinstance(d, dict) or not isinstance(d.get("op"), str):
            raise ModelError(f"malformed host stage node {str(d)[:80]}", hint="recompile the artifact")
        return cls(d["op"], str(d.get("name", "")), tuple(d.get("inputs", ())), tuple(d.get("outputs", ())),
                   dict(d.get("attrs", {})))

    @property
    def label(self) -> str:
        return f"{self.op} at node {self.name or self.outputs[0]!r}"


def tensor_to_json(arr: np.ndarray) -> dict[str, Any]:
    """A constant as JSON: dtype, shape and the flat values (strings as str)."""
    dtype = STRING if arr.dtype.kind in "OUS" else arr.dtype.name
    return {"dtype": dtype, "shape": list(arr.shape), "data": arr.ravel().tolist()}


def tensor_from_json(d: Mapping[str, Any]) -> np.ndarray:
    dtype = np.dtype(object) if d["dtype"] == STRING else np.dtype(d["dtype"])
    return np.array(d["data"], dtype=dtype).reshape(d["shape"])


@dataclass(frozen=True)
class HostStage:
    """The host stage of one model (see the module docstring). ``run`` evaluates ``head`` or
    ``tail`` into a dict of named values."""

    head: tuple[HostNode, ...]
    tail: tuple[HostNode, ...]
    constants: Mapping[str, np.ndarray] = field(default_factory=dict)

    def kernels(self) -> dict[str, Kernel]:
        """Every node's kernel by node label: the attributes checked and prepared once (a
        ModelError names a node the stage cannot run)."""
        out: dict[str, Kernel] = {}
        for node in (*self.head, *self.tail):
            make = HOST_OPS.get(node.op)
            if make is None:
                raise ModelError(f"{node.label}: not an operator of the host stage",
                                 hint="recompile the artifact with this fractal")
            out[node.label] = make(node)
        return out

    def run(self, nodes: Sequence[HostNode], env: dict[str, np.ndarray],
            kernels: Mapping[str, Kernel]) -> None:
        """Evaluate ``nodes`` in order, reading and adding values in ``env``."""
        for node in nodes:
            args = [env[i] if i in env else self.constants[i] for i in node.inputs]
            outs = kernels[node.label](*args)
            env.update(zip(node.outputs, outs, strict=False))

    def to_json(self) -> dict[str, Any]:
        return {"format": FORMAT, "head": [n.to_json() for n in self.head],
                "tail": [n.to_json() for n in self.tail],
                "constants": {k: tensor_to_json(v) for k, v in self.constants.items()}}

    @classmethod
    def from_json(cls, data: Any) -> HostStage:
        if not isinstance(data, dict) or data.get("format") != FORMAT:
            raise ModelError("the host stage file is not of a format this fractal reads",
                             hint="recompile the artifact with this fractal")
        return cls(tuple(HostNode.from_json(n) for n in data.get("head", [])),
                   tuple(HostNode.from_json(n) for n in data.get("tail", [])),
                   {k: tensor_from_json(v) for k, v in data.get("constants", {}).items()})

    def write(self, path: Path) -> None:
        path.write_text(json.dumps(self.to_json(), indent=1, sort_keys=True, ensure_ascii=False) + "\n",
                        encoding="utf-8")

    @classmethod
    def read(cls, path: Path) -> HostStage:
        return cls.from_json(json.loads(path.read_text(encoding="utf-8")))


# ------------------------------------------------------------------------------------ strings in
def as_strings(name: str, arr: Any) -> np.ndarray:
    """``arr`` as an object array of str: str and numpy str as they are, bytes decoded as UTF-8
    (InputError when they are not UTF-8, or when an element is not text)."""
    a = np.asarray(arr, dtype=object) if not isinstance(arr, np.ndarray) else arr
    if a.dtype.kind not in "OUS":
        raise InputError(f"input {name!r} has dtype {a.dtype}, expected strings",
                         hint="send text (the BYTES datatype over the Open Inference Protocol)")
    out = np.empty(a.shape, dtype=object)
    flat = out.reshape(-1)
    for i, v in enumerate(a.reshape(-1).tolist()):
        if isinstance(v, bytes):
            try:
                v = v.decode("utf-8")
            except UnicodeDecodeError:
                raise InputError(f"input {name!r} holds bytes that are not UTF-8 text (element {i})",
                                 hint="send UTF-8 encoded strings") from None
        elif not isinstance(v, str):
            raise InputError(f"input {name!r} holds a {type(v).__name__} where a string belongs "
                             f"(element {i})",
                             hint="send text (the BYTES datatype over the Open Inference Protocol)")
        flat[i] = v
    return out


def _objects(values: list[Any], shape: tuple[int, ...]) -> np.ndarray:
    out = np.empty(len(values), dtype=object)
    out[:] = values
    return out.reshape(shape)


# ------------------------------------------------------------------------------------ operators
def _seq(a: Mapping[str, Any], stem: str) -> np.ndarray | None:
    """LabelEncoder's / CategoryMapper's ``{stem}_strings|int64s|floats|tensor`` attribute as an array."""
    for suffix, dtype in (("strings", object), ("int64s", np.int64), ("floats", np.float32)):
        if f"{stem}_{suffix}" in a:
            return np.array(a[f"{stem}_{suffix}"], dtype=dtype)
    if f"{stem}_tensor" in a:
        return tensor_from_json(a[f"{stem}_tensor"]).reshape(-1)
    return None


def _lookup(keys: np.ndarray, values: np.ndarray, default: Any, out_dtype: np.dtype, label: str) -> Kernel:
    """A kernel mapping each element through ``keys -> values`` (``default`` when absent)."""
    kl = keys.tolist()
    plain = [k for k in kl if not (isinstance(k, float) and math.isnan(k))]
    if len(set(plain)) != len(plain) or len(kl) - len(plain) > 1:  # (0.0 and -0.0 are one key)
        raise ModelError(f"{label}: duplicate keys", hint="give every key once")
    table = dict(zip(kl, values.tolist(), strict=True))
    nan_value = next((v for k, v in table.items() if isinstance(k, float) and math.isnan(k)), default)
    floats = keys.dtype.kind == "f"
    want = keys.dtype.kind if keys.dtype.kind != "O" else "O"

    def run(x: np.ndarray) -> tuple[np.ndarray, ...]:
        if (x.dtype.kind == "O") != (want == "O"):
            raise InputError(f"{label}: input of dtype {x.dtype} for keys of dtype {keys.dtype}",
                             hint="send the key type the model maps")
        if floats:
            got = [nan_value if math.isnan(v) else table.get(v, default)
                   for v in x.astype(np.float32).ravel().tolist()]
        else:
            got = [table.get(v, default) for v in x.ravel().tolist()]
        if out_dtype.kind == "O":
            return (_objects(got, x.shape),)
        return (np.array(got, dtype=out_dtype).reshape(x.shape),)

    return run


def _label_encoder(node: HostNode) -> Kernel:
    a = node.attrs
    keys, values = _seq(a, "keys"), _seq(a, "values")
    if keys is None or values is None or keys.size != values.size:
        raise ModelError(f"{node.label}: keys and values must be given and of the same length",
                         hint="fix the model's LabelEncoder attributes")
    kind = values.dtype.kind
    if "default_tensor" in a:
        default = tensor_from_json(a["default_tensor"]).reshape(-1).tolist()[0]
    elif kind == "O":
        default = a.get("default_string", "_Unused")
    elif kind in "iu":
        default = a.get("default_int64", -1)
    else:
        default = a.get("default_float", -0.0)
    return _lookup(keys, values, default, values.dtype, node.label)


def _category_mapper(node: HostNode) -> Kernel:
    a = node.attrs
    strings = np.array(a.get("cats_strings", []), dtype=object)
    ints = np.array(a.get("cats_int64s", []), dtype=np.int64)
    if strings.size != ints.size:
        raise ModelError(f"{node.label}: cats_strings and cats_int64s differ in length",
                         hint="fix the model's CategoryMapper attributes")
    to_int = _lookup(strings, ints, a.get("default_int64", -1), np.dtype(np.int64), node.label)
    to_str = _lookup(ints, strings, a.get("default_string", "_Unused"), np.dtype(object), node.label)
    return lambda x: to_int(x) if x.dtype.kind == "O" else to_str(x)


def _equal(node: HostNode) -> Kernel:
    def run(x: np.ndarray, y: np.ndarray) -> tuple[np.ndarray, ...]:
        return (np.asarray(np.frompyfunc(operator.eq, 2, 1)(x, y), dtype=bool),)

    return run


def _string_concat(node: HostNode) -> Kernel:
    def run(x: np.ndarray, y: np.ndarray) -> tuple[np.ndarray, ...]:
        return (np.asarray(np.frompyfunc(operator.add, 2, 1)(x, y), dtype=object),)

    return run


# Where ONNX's reference (Python's str.split) and onnxruntime split differently, the input is
# refused rather than answered one way: tabs and line breaks (whitespace to the reference and the
# spec's text, not to onnxruntime, which splits at spaces only), a remainder ending in spaces after
# maxsplit (kept by the reference, trimmed by onnxruntime), an empty string split at a delimiter
# (one empty substring for the reference, none for onnxruntime).
_OTHER_SPACE = re.compile(r"[\t\n\r\f\v]")
_SPACES = re.compile(r" +")


def _split_space(s: str, maxsplit: int | None) -> list[str] | str:
    """``s`` split at runs of spaces (ends ignored), or why the input is contested."""
    if _OTHER_SPACE.search(s):
        return "holds a tab or line break (whitespace to ONNX's reference, not to onnxruntime)"
    body = s.lstrip(" ")
    if not body:
        return []
    if maxsplit == 0:
        parts = [body]
    else:  # (re.split's maxsplit 0 means no limit)
        parts = _SPACES.split(body, maxsplit or 0)
        if not parts[-1]:  # the string ended in spaces before maxsplit was reached
            parts.pop()
    if maxsplit is not None and parts[-1].endswith(" "):
        return ("leaves a remainder ending in spaces after maxsplit (kept by ONNX's reference, trimmed by "
                "onnxruntime)")
    return parts


def _string_split(node: HostNode) -> Kernel:
    delim = node.attrs.get("delimiter") or None
    maxsplit = node.attrs.get("maxsplit")
    if maxsplit is not None and maxsplit < 0:
        raise ModelError(f"{node.label}: maxsplit {maxsplit} is negative", hint="give maxsplit >= 0")

    def split(i: int, s: str) -> list[str]:
        if delim is None:
            got = _split_space(s, maxsplit)
        elif not s:
            got = "is empty (one empty substring to ONNX's reference, none to onnxruntime)"
        else:
            got = s.split(delim, -1 if maxsplit is None else maxsplit)
        if isinstance(got, str):
            raise InputError(f"{node.label}: string {i} {got}; refused rather than answered one way",
                             hint="normalize such strings before the model")
        return got

    def run(x: np.ndarray) -> tuple[np.ndarray, ...]:
        parts = [split(i, s) for i, s in enumerate(x.ravel().tolist())]
        n = max((len(p) for p in parts), default=0)
        subs = np.full((len(parts), n), "", dtype=object)
        for i, p in enumerate(parts):
            subs[i, :len(p)] = p
        lengths = np.array([len(p) for p in parts], dtype=np.int64)
        return subs.reshape(*x.shape, n), lengths.reshape(x.shape)

    return run


_LOCALES = {"", "C", "C.UTF-8", "POSIX", "en_US", "en_US.UTF-8", "en_US.utf8", "en_GB", "en_GB.UTF-8"}


def _per_char(fn: Callable[[str], str]) -> Callable[[str], str | None]:
    """A case mapping character by character, or None when a character's mapping is not one
    character (German sharp s to "SS", Turkish dotted I): Python's full mapping (ONNX's reference)
    and C's ``towupper`` / ``towlower`` (onnxruntime) answer those differently."""
    def apply(s: str) -> str | None:
        if s.isascii():
            return fn(s)
        out = [fn(c) for c in s]
        return "".join(out) if all(len(m) == 1 for m in out) else None

    return apply


_LOWER, _UPPER = _per_char(str.lower), _per_char(str.upper)
_CONTESTED = "; ONNX's reference and onnxruntime answer it differently, so it is refused"


def _string_normalizer(node: HostNode) -> Kernel:
    a = node.attrs
    action = a.get("case_change_action", "NONE")
    if action not in ("NONE", "LOWER", "UPPER"):
        raise ModelError(f"{node.label}: case_change_action {action!r} is not NONE, LOWER or UPPER",
                         hint="fix the attribute")
    locale = a.get("locale", "")
    if locale not in _LOCALES:
        raise ModelError(f"{node.label}: locale {locale!r} is not supported (its case rules are not "
                         "English ones)", hint="use locale en_US, or normalize the text before the model")
    sensitive = bool(a.get("is_case_sensitive", 0))
    words = list(a.get("stopwords", []))

    def case(fn: Callable[[str], str | None], text: str, what: str) -> str:
        got = fn(text)
        if got is None:
            raise InputError(f"{node.label}: {what} has a character whose case mapping is not one "
                             f"character (such as \u00df or \u0130){_CONTESTED}",
                             hint="normalize such text before the model")
        return got

    fold = bool(words) and not sensitive  # stopwords compared case-insensitively
    try:
        lows = {case(_LOWER, w, "a stopword") for w in words} if fold else set()
        ups = {case(_UPPER, w, "a stopword") for w in words} if fold else set()
    except InputError as exc:
        raise ModelError(str(exc.args[0]), hint="give stopwords without such characters") from None
    stops = set(words)
    change = {"NONE": (lambda t, what: t), "LOWER": lambda t, what: case(_LOWER, t, what),
              "UPPER": lambda t, what: case(_UPPER, t, what)}[action]

    def is_stop(text: str, what: str) -> bool:
        if not fold:
            return text in stops
        # compared in lower case and in upper case (final sigma, long s): where the two differ, contested
        low, up = case(_LOWER, text, what) in lows, case(_UPPER, text, what) in ups
        if low != up:
            raise InputError(f"{node.label}: {what} matches a stopword in one case but not the other"
                             f"{_CONTESTED}", hint="normalize such text before the model")
        return low

    def run(x: np.ndarray) -> tuple[np.ndarray, ...]:
        if not (x.ndim == 1 or (x.ndim == 2 and x.shape[0] == 1)) or x.size == 0:
            raise InputError(f"{node.label}: input of shape {list(x.shape)}; StringNormalizer takes [C] or "
                             "[1, C] with C >= 1", hint="send one row of strings")
        texts = x.ravel().tolist()
        kept = [change(t, f"string {i}") for i, t in enumerate(texts)
                if not is_stop(t, f"string {i}")] or [""]
        return (_objects(kept, (len(kept),) if x.ndim == 1 else (1, len(kept))),)

    return run


def _regex_full_match(node: HostNode) -> Kernel:
    pattern = node.attrs.get("pattern")
    if not isinstance(pattern, str):
        raise ModelError(f"{node.label}: no pattern", hint="give the pattern attribute")
    try:
        rx = re.compile(translate_re2(pattern), re.ASCII)
    except (ValueError, re.error) as exc:
        raise ModelError(f"{node.label}: pattern {pattern!r} is outside the RE2 subset fractal runs ({exc})",
                         hint="use classes, groups, alternation and repeats only (docs/compile.md)") from None
    full = np.frompyfunc(lambda s: rx.fullmatch(s) is not None, 1, 1)

    def run(x: np.ndarray) -> tuple[np.ndarray, ...]:
        return (np.asarray(full(x), dtype=bool).reshape(x.shape),)

    return run


# op_type -> kernel factory (the attributes checked once)
HOST_OPS: dict[str, Callable[[HostNode], Kernel]] = {
    "LabelEncoder": _label_encoder,
    "CategoryMapper": _category_mapper,
    "Equal": _equal,
    "StringConcat": _string_concat,
    "StringSplit": _string_split,
    "StringNormalizer": _string_normalizer,
    "RegexFullMatch": _regex_full_match,
}
