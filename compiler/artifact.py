"""Artifact directories: sha256-checked loading, input validation, inference and the trainer.

Standard library, numpy and tvm (lazily) only, never onnx or pydantic: this is also what runs on
a board and inside the aarch64 sysroot under qemu-user.

Layout of an artifact directory::

    manifest.json   format version, model, target, inputs/outputs, files + sha256, tuning, training
                    (typed and versioned by compiler.manifest.Manifest, its only reader and writer)
    infer.so        inference: main(*inputs, *params) at the compiled batch; with
                    ``libs.transform`` main takes the packed parameters that
                    main_transform_params(params) returns (compiler/prepack.py)
    train.so        (with --train) backbone_loss_adjoint(*inputs, *params, targets) and
                    optimizer(params, grads, states, lr)
    params.npz      the initial parameters, keys p0000.. in manifest order

The pieces live in small modules: :mod:`compiler.manifest` (the manifest), :mod:`compiler.runtime`
(VMs and zero-copy tensors), :mod:`compiler.trainstep` (the training step); this module loads and
checks an artifact and validates inference inputs, the one place that does.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from compiler.errors import ArtifactError, InputError
from compiler.hoststage import STRING, HostStage, as_strings
from compiler.manifest import (
    FORMAT_VERSION,
    MANIFEST,
    NONFINITE_UNCHECKED,
    Manifest,
    NonFinite,
    TargetInfo,
    TensorSpec,
    file_sha256,
)
from compiler.runtime import PreparedParams, Runtime, aligned_copy, aligned_empty, check_params
from compiler.targets import cpu_flags, host_arch
from compiler.trainstep import Trainer

__all__ = [
    "FORMAT_VERSION",
    "MANIFEST",
    "Manifest",
    "TensorSpec",
    "Artifact",
    "PreparedParams",
    "Trainer",
    "check_inputs",
    "load_params",
    "load_artifact",
    "file_sha256",
    "param_key",
    "aligned_empty",
    "aligned_copy",
]

INFER_FUNC = "main"


def param_key(i: int) -> str:
    """Key of parameter ``i`` in params.npz (names may contain characters npz keys cannot)."""
    return f"p{i:04d}"


def load_params(directory: Path, manifest: Manifest) -> tuple[list[str], list[np.ndarray]]:
    meta = manifest.params
    names = list(meta.names)
    with np.load(directory / meta.file, allow_pickle=False) as npz:
        arrays = []
        for i, (name, shape, dtype) in enumerate(zip(names, meta.shapes, meta.dtypes, strict=True)):
            key = param_key(i)
            if key not in npz:
                raise ArtifactError(f"params file lacks parameter {name!r} ({key})",
                                    hint="recompile the artifact")
            arr = npz[key]
            if tuple(arr.shape) != tuple(shape) or str(arr.dtype) != dtype:
                raise ArtifactError(f"parameter {name!r} is {arr.dtype}{list(arr.shape)}, manifest says "
                                    f"{dtype}{list(shape)}", hint="recompile the artifact")
            arrays.append(aligned_copy(arr))  # aligned: passed to TVM zero-copy
    return names, arrays


_IEEE = NonFinite(nan="", inf="")  # every non-finite value taken (a caller without a manifest)


def _nonfinite(name: str, arr: np.ndarray, policy: NonFinite) -> None:
    """InputError for NaN / infinity the model's operators would not answer as ONNX does."""
    if np.isfinite(arr).all():
        return
    for what, blocker, hit in (("NaN", policy.nan, np.isnan), ("infinity", policy.inf, np.isinf)):
        if blocker and hit(arr).any():
            why = (f"its {blocker} would not give ONNX's result for it" if blocker != NONFINITE_UNCHECKED
                   else "the artifact was compiled before fractal checked which operators take it")
            raise InputError(f"input {name!r} holds {what}, which this model refuses: {why}",
                             hint="send finite numbers, or recompile a model whose operators take them "
                                  "(docs/serving.md, non-finite inputs)")


def _convert(name: str, arr: np.ndarray, want: np.dtype, typed: bool,
             policy: NonFinite = _IEEE) -> np.ndarray:
    """The one dtype rule. A typed array (a numpy array, or a tensor whose protocol datatype was
    given) must have the model's dtype exactly, as onnxruntime demands. Untyped data (Python or
    JSON numbers) is converted when that cannot change a value's meaning: bool/int/float -> float,
    bool/int -> int within range; float -> int, complex, strings and objects are refused.

    Float inputs are IEEE values, NaN and infinities included (IsNaN, IsInf, a -inf attention mask,
    Cast and Mod define results for them; onnxruntime takes them too), as far as ``policy`` (the
    manifest's ``nonfinite``: which of the model's operators would not give ONNX's result) allows.
    They cannot poison anyone else's answer: :meth:`Artifact.infer` runs a request in library calls
    of its own (the rows of a short last call are zeros, never another request's samples). Data
    that trains stays finite: the sample store, a round's samples and ``Trainer`` refuse them."""
    have = arr.dtype
    if have != want and typed:
        raise InputError(f"input {name!r} has dtype {have}, expected {want}",
                         hint=f"convert it, e.g. x.astype('{want}')")
    if have != want:
        ok = (want.kind == "f" and have.kind in "biuf") or (want.kind in "iu" and have.kind in "biu") \
            or (want.kind == "b" and have.kind == "b")
        if not ok:
            raise InputError(f"input {name!r} has dtype {have}, expected {want}",
                             hint=f"send {want} values (e.g. x.astype('{want}'))")
        if want.kind in "iu" and have.kind in "iu" and arr.size:
            info = np.iinfo(want)
            if arr.min() < info.min or arr.max() > info.max:
                raise InputError(f"input {name!r} has values outside the {want} range",
                                 hint=f"send values in [{info.min}, {info.max}]")
        with np.errstate(over="ignore", invalid="ignore"):
            out = arr.astype(want)
        if want.kind == "f" and have.kind in "iuf" and arr.size \
                and (np.isfinite(arr) & ~np.isfinite(out)).any():  # 1e39 -> float32 inf
            raise InputError(f"input {name!r} has numbers outside the {want} range",
                             hint=f"send {want} values")
        arr = out
    if want.kind == "f" and arr.size:
        _nonfinite(name, arr, policy)
    return arr


def _runtime_for(manifest: Manifest, lib_path: Path) -> Runtime:
    """The engine for a library: the Relax VM, or ctypes for the C backend (``libs.runtime == "c"``)."""
    if manifest.libs.runtime == "c":
        from compiler.clib import CRuntime

        return CRuntime(lib_path)  # type: ignore[return-value]  # same call/tensor surface
    return Runtime(lib_path)


def check_inputs(specs: Sequence[TensorSpec], inputs: Mapping[str, Any], *,
                 batched: bool = True, nonfinite: NonFinite = _IEEE) -> tuple[list[np.ndarray], int]:
    """Validate a batch of inputs against the model's specs: names, shapes ([N, *spec.shape[1:]] with
    the same N >= 1 for every input) and dtypes (numpy arrays exactly; lists converted, see
    :func:`_convert`). Returns the arrays in spec
    order and N. The only place the project checks inference inputs; InputError names the problem."""
    if not isinstance(inputs, Mapping):
        raise InputError("inputs must be a mapping of input name to array",
                         hint=f"expected keys: {', '.join(s.name for s in specs)}")
    expected = [s.name for s in specs]
    missing = [n for n in expected if n not in inputs]
    extra = [n for n in inputs if n not in expected]
    if missing or extra:
        parts = ([f"missing input(s) {', '.join(map(repr, missing))}"] if missing else []) + \
                ([f"unknown input(s) {', '.join(map(repr, extra))}"] if extra else [])
        raise InputError("; ".join(parts), hint=f"the model's inputs are: {', '.join(expected)}")
    arrays: list[np.ndarray] = []
    n: int | None = None
    for spec in specs:
        arr = inputs[spec.name]
        typed = isinstance(arr, np.ndarray)
        if spec.dtype == STRING:  # text for the host stage (compiler/hoststage.py)
            arr = as_strings(spec.name, arr)
        elif not typed:
            try:
                arr = np.asarray(arr)
            except (ValueError, TypeError) as exc:
                raise InputError(f"input {spec.name!r} is not a rectangular array of numbers ({exc})",
                                 hint="send a nested list or array of the model's shape") from None
        if not batched:  # a model without a batch dimension takes exactly its compiled shapes
            if arr.shape != tuple(spec.shape):
                raise InputError(f"input {spec.name!r} has shape {list(arr.shape)}, expected "
                                 f"{list(spec.shape)}",
                                 hint="this model's inputs have no batch dimension: send exactly "
                                      "the shapes of its metadata")
            arrays.append(arr if spec.dtype == STRING else
                          _convert(spec.name, arr, np.dtype(spec.dtype), typed, nonfinite))
            n = 1
            continue
        want = spec.shape[1:]
        if arr.ndim != len(spec.shape) or arr.shape[1:] != want or arr.shape[0] < 1:
            raise InputError(f"input {spec.name!r} has shape {list(arr.shape)}, expected [N, "
                             f"{', '.join(map(str, want))}] with N >= 1",
                             hint="the leading dimension is the batch")
        if n is not None and arr.shape[0] != n:
            raise InputError(f"inputs disagree on the batch size ({n} vs {arr.shape[0]} for {spec.name!r})",
                             hint="give every input the same leading dimension")
        n = arr.shape[0]
        arrays.append(arr if spec.dtype == STRING else
                      _convert(spec.name, arr, np.dtype(spec.dtype), typed, nonfinite))
    return arrays, int(n or 1)


class Artifact:
    """A loaded, verified artifact: inference (thread-safe) and, if compiled, a Trainer."""

    def __init__(self, directory: Path, manifest: Manifest, param_names: list[str],
                 params: list[np.ndarray]) -> None:
        self.directory = directory
        self.manifest = manifest
        self.name: str = manifest.name
        self.inputs = list(manifest.inputs)
        self.outputs = list(manifest.outputs)
        self.param_names = param_names
        self.params = params
        self.batch = manifest.batch
        self.batched = manifest.batched
        # string operators run on the host around the library (compiler/hoststage.py), whose own
        # inputs and outputs are then the host stage's numeric values
        host = manifest.host
        self._host = HostStage.read(directory / host.file) if host is not None else None
        self._kernels = self._host.kernels() if self._host is not None else {}
        self._lib_inputs = list(host.library_inputs) if host is not None else self.inputs
        self._lib_outputs = list(host.library_outputs) if host is not None else self.outputs
        lib_outs = self._lib_outputs
        self._dynamic = any(o.dynamic for o in lib_outs)  # dims decided at run time (-1)
        self._empty = {i for i, o in enumerate(lib_outs) if 0 in o.shape}  # answered, not computed
        self._batched_out = manifest.batched and all(o.shape and o.shape[0] == self.batch for o in lib_outs)
        self._transform = manifest.libs.transform  # packed parameters (compiler/prepack.py) or None
        self._infer: Runtime | None = None
        self._default: PreparedParams | None = None
        if manifest.libs.infer is not None:  # (None: the host stage computes every output)
            self._infer = _runtime_for(manifest, directory / manifest.libs.infer)
            self._default = PreparedParams(self._infer, params, self._transform)
        self._trainer: Trainer | None = None
        if manifest.libs.train and manifest.training is not None:
            train_rt = _runtime_for(manifest, directory / manifest.libs.train)
            classes = (int(self.outputs[0].shape[-1]) if manifest.training.loss == "ce" and self.outputs
                       and self.outputs[0].shape else None)
            self._trainer = Trainer(train_rt, manifest.training, self.inputs, param_names, params,
                                    classes=classes)

    @property
    def trainer(self) -> Trainer | None:
        """The training runtime, or None when compiled without ``--train``."""
        return self._trainer

    @property
    def target(self) -> TargetInfo:
        """The preset this artifact was compiled for (name, arch, TVM target)."""
        return self.manifest.target

    def prepare_params(self, params: list[np.ndarray]) -> PreparedParams | None:
        """Validate and convert a parameter list once, for many ``infer`` calls (None: the model
        has no compiled library, hence no parameters)."""
        checked = check_params(params, self.param_names, self.params)
        return None if self._infer is None else PreparedParams(self._infer, checked, self._transform)

    def infer(self, inputs: dict[str, np.ndarray],
              params: list[np.ndarray] | PreparedParams | None = None) -> dict[str, np.ndarray]:
        """Run the model on a batch of any size N >= 1; returns {output name: array [N, ...]}.
        A model without a batch dimension (``manifest.batched`` False) takes exactly its compiled
        shapes.

        Thread-safe: each calling thread gets its own VM. ``params`` default to the artifact's own.
        A model with string operators runs them on the host before and after the library.
        """
        arrays, n = check_inputs(self.inputs, inputs, batched=self.batched,
                                 nonfinite=self.manifest.nonfinite)
        if self._host is None:
            return self._run_library(arrays, n, params)
        env = {spec.name: arr for spec, arr in zip(self.inputs, arrays, strict=True)}
        self._host.run(self._host.head, env, self._kernels)
        if self._infer is not None:
            lib_in = {s.name: env[s.name] for s in self._lib_inputs}
            lib_arrays, lib_n = check_inputs(self._lib_inputs, lib_in, batched=self.batched)
            env.update(self._run_library(lib_arrays, lib_n, params))
        self._host.run(self._host.tail, env, self._kernels)
        return {spec.name: env[spec.name] for spec in self.outputs}

    def _run_library(self, arrays: list[np.ndarray], n: int,
                     params: list[np.ndarray] | PreparedParams | None) -> dict[str, np.ndarray]:
        """The compiled library on checked inputs (a batch of ``n``): its outputs by name."""
        assert self._infer is not None and self._default is not None
        if params is None:
            prepared = self._default
        elif isinstance(params, PreparedParams):
            prepared = params
        else:
            prepared = self.prepare_params(params) or self._default
        rt = self._infer
        if not self.batched:  # exactly the compiled shapes, one call
            ins = [rt.tensor(arr, i) for i, arr in enumerate(arrays)]
            try:
                outs = rt.call(INFER_FUNC, (*ins, *prepared.tensors), [*ins, *prepared.tensors])
            except Exception as exc:
                if not self._dynamic:
                    raise
                # compiler.dynshape's / dataops' run-time checks (and the VM's own) on the input values
                detail = " ".join(str(exc).split())[:200]
                from compiler.dynshape_ops import MAX_RUNTIME_ELEMENTS

                why = (f"a shape operand out of range or making a tensor over {MAX_RUNTIME_ELEMENTS:,} "
                       f"elements, a duplicate axis, an iou_threshold outside [0, 1], "
                       "or shapes that do not fit")
                raise InputError(f"the model refused these inputs at run time ({why}): {detail}",
                                 hint="check the values of the model's shape and threshold inputs") from None
            # outputs with a zero dim have no compiled code (compiler.importer), unless every output
            # is compiled (a run-time shape operand's outputs: the VM's own empty arrays)
            if self._empty and len(outs) < len(self.outputs):
                it = iter(outs)
                return {spec.name: np.empty(spec.shape, spec.dtype) if i in self._empty else next(it)
                        for i, spec in enumerate(self._lib_outputs)}
            return {spec.name: o for spec, o in zip(self._lib_outputs, outs, strict=True)}
        b = self.batch
        batched_out = self._batched_out
        if n != b and not batched_out:
            raise InputError(f"this model's outputs have no batch dimension; send exactly {b} sample(s)",
                             hint=f"use batch {b}")
        chunks: list[list[np.ndarray]] = [[] for _ in self._lib_outputs]
        # The library is compiled for batch b: run ceil(n/b) calls, zero-padding the last one.
        # Inputs and outputs cross by DLPack (no copy); see Runtime.tensor and Runtime.call.
        for start in range(0, n, b):
            part: list[Any] = []
            for arr in arrays:
                piece = arr[start:start + b] if n != b else arr
                if piece.shape[0] < b:
                    padded = aligned_empty((b, *piece.shape[1:]), piece.dtype)
                    padded[:piece.shape[0]] = piece
                    padded[piece.shape[0]:] = 0
                    piece = padded
                part.append(rt.tensor(piece, len(part)))
            outs = rt.call(INFER_FUNC, (*part, *prepared.tensors), [*part, *prepared.tensors])
            for i, o in enumerate(outs):
                chunks[i].append(o)
        return {spec.name: (c[0][:n] if len(c) == 1 else np.concatenate(c)[:n]) if batched_out else c[0]
                for spec, c in zip(self._lib_outputs, chunks, strict=True)}


def _check_cpu_features(manifest: Manifest) -> None:
    """Refuse an x86_64 artifact built for instructions this CPU lacks (e.g. AVX-512 on an
    AVX2 machine), which would otherwise die of SIGILL mid-request instead of a clear error.

    LLVM's x86 feature names match /proc/cpuinfo's ``flags``; other arches are not checked
    (qemu-user shows the host's cpuinfo, and ARM feature names differ).
    """
    if manifest.arch != "x86_64":
        return
    flags = cpu_flags()
    if not flags:
        return
    missing = sorted(f[1:] for f in manifest.target.mattr if f.startswith("+") and f[1:] not in flags)
    if missing:
        raise ArtifactError(
            f"artifact {manifest.name!r} (preset {manifest.preset!r}) needs CPU "
            f"features this machine lacks: {', '.join(missing)}",
            hint="compile it for a preset this CPU runs (`fractal targets`; e.g. --target x86_64)")


def load_artifact(directory: str | Path, *, verify: bool = True) -> Artifact:
    """Load an artifact directory, checking every file's sha256 and the target architecture."""
    directory = Path(directory)
    manifest = Manifest.read(directory)
    arch = manifest.arch
    host = host_arch()
    if arch != host:
        raise ArtifactError(f"artifact {manifest.name!r} was compiled for {arch} "
                            f"(preset {manifest.preset!r}); this machine is {host}",
                            hint=f"run it on a {arch} board, under qemu (`fractal verify --emulate`), "
                                 f"or compile with --target {host}")
    _check_cpu_features(manifest)
    if verify:
        manifest.verify_files(directory)
    names, params = load_params(directory, manifest)
    return Artifact(directory, manifest, names, params)
