"""Artifact directories: manifest, sha256-checked loading, inference and the training runtime.

This module imports only the standard library, numpy and tvm (lazily), never onnx or pydantic,
because it is also what runs on a board and inside the aarch64 sysroot under qemu-user.

Layout of an artifact directory::

    manifest.json   format version, model, target, inputs/outputs, files + sha256, tuning, training
    infer.so        inference: main(*inputs, *params) at the compiled batch
    train.so        (with --train) backbone_loss_adjoint(*inputs, *params, targets) and
                    optimizer(params, grads, states, lr)
    params.npz      the initial parameters, keys p0000.. in manifest order
"""

from __future__ import annotations

import hashlib
import json
import math
import platform
import threading
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from compiler.errors import ArtifactError, InputError

__all__ = [
    "FORMAT_VERSION",
    "MANIFEST",
    "TensorSpec",
    "Artifact",
    "Trainer",
    "load_artifact",
    "read_manifest",
    "write_manifest",
    "file_sha256",
    "param_key",
    "aligned_empty",
    "aligned_copy",
]

FORMAT_VERSION = 1
MANIFEST = "manifest.json"
INFER_FUNC = "main"
ADJOINT_FUNC = "backbone_loss_adjoint"
OPTIMIZER_FUNC = "optimizer"


@dataclass(frozen=True)
class TensorSpec:
    """Name, shape (batch dim included, as compiled) and dtype of one model input or output."""

    name: str
    shape: tuple[int, ...]
    dtype: str

    def to_json(self) -> dict[str, Any]:
        return {"name": self.name, "shape": list(self.shape), "dtype": self.dtype}

    @classmethod
    def from_json(cls, d: dict[str, Any]) -> TensorSpec:
        return cls(str(d["name"]), tuple(int(x) for x in d["shape"]), str(d["dtype"]))


def param_key(i: int) -> str:
    """Key of parameter ``i`` in params.npz (names may contain characters npz keys cannot)."""
    return f"p{i:04d}"


def file_sha256(path: str | Path) -> str:
    """Hex sha256 of a file."""
    h = hashlib.sha256()
    with open(path, "rb") as fh:
        for chunk in iter(lambda: fh.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def _host_arch() -> str:
    machine = platform.machine().lower()
    return {"amd64": "x86_64", "arm64": "aarch64"}.get(machine, machine)


def write_manifest(directory: str | Path, manifest: dict[str, Any]) -> Path:
    """Write ``manifest.json`` (sorted keys, so equal manifests are equal bytes)."""
    path = Path(directory) / MANIFEST
    path.write_text(json.dumps(manifest, indent=2, sort_keys=True) + "\n")
    return path


def read_manifest(directory: str | Path) -> dict[str, Any]:
    """Read and sanity-check ``manifest.json``; ArtifactError when missing or malformed."""
    directory = Path(directory)
    path = directory / MANIFEST
    if not directory.is_dir():
        raise ArtifactError(f"artifact directory {str(directory)!r} does not exist",
                            hint="pass the --out directory of `fractal compile`")
    if not path.is_file():
        raise ArtifactError(f"{str(directory)!r} has no {MANIFEST}; it is not a compiled artifact",
                            hint="pass the --out directory of `fractal compile`")
    try:
        manifest = json.loads(path.read_text())
    except (OSError, ValueError) as exc:
        raise ArtifactError(f"{path} is not valid JSON ({exc})", hint="recompile the artifact") from None
    if not isinstance(manifest, dict) or manifest.get("format_version") != FORMAT_VERSION:
        got = manifest.get("format_version") if isinstance(manifest, dict) else None
        raise ArtifactError(f"{path} has format_version {got!r}, this build reads {FORMAT_VERSION}",
                            hint="recompile the artifact with this version of fractal")
    for key in ("name", "inputs", "outputs", "files", "libs", "params", "target"):
        if key not in manifest:
            raise ArtifactError(f"{path} lacks the {key!r} field", hint="recompile the artifact")
    return manifest


def _verify_files(directory: Path, manifest: dict[str, Any]) -> None:
    for rel, digest in manifest["files"].items():
        path = directory / rel
        if not path.is_file():
            raise ArtifactError(f"artifact file {rel!r} is missing from {str(directory)!r}",
                                hint="copy the whole artifact directory or recompile")
        actual = file_sha256(path)
        if actual != digest:
            raise ArtifactError(f"artifact file {rel!r} fails its sha256 check "
                                f"(manifest {digest[:12]}..., file {actual[:12]}...)",
                                hint="the file is corrupt or was modified; recompile or re-copy the artifact")


def _load_params(directory: Path, manifest: dict[str, Any]) -> tuple[list[str], list[np.ndarray]]:
    meta = manifest["params"]
    names = list(meta["names"])
    with np.load(directory / meta["file"], allow_pickle=False) as npz:
        arrays = []
        for i, (name, shape, dtype) in enumerate(zip(names, meta["shapes"], meta["dtypes"], strict=True)):
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


# TVM's kernels may assume 64-byte aligned buffers (tvm.runtime.from_dlpack insists on it).
_ALIGN = 64


def aligned_empty(shape: tuple[int, ...], dtype: Any) -> np.ndarray:
    """An uninitialised C-contiguous array whose data is 64-byte aligned (zero-copy into TVM)."""
    dtype = np.dtype(dtype)
    nbytes = math.prod(shape) * dtype.itemsize
    buf = np.empty(nbytes + _ALIGN, dtype=np.uint8)
    off = (-buf.ctypes.data) % _ALIGN
    return buf[off:off + nbytes].view(dtype).reshape(shape)


def aligned_copy(arr: np.ndarray) -> np.ndarray:
    """A 64-byte aligned C-contiguous copy of ``arr`` (native byte order)."""
    arr = np.asarray(arr)
    out = aligned_empty(arr.shape, arr.dtype.newbyteorder("="))
    out[...] = arr
    return out


def _flatten(result: Any, out: list[Any]) -> list[Any]:
    """The tensors of a VM result (a tensor or nested arrays of them), depth first."""
    if hasattr(result, "data_ptr"):
        out.append(result)
    else:
        for item in result:
            _flatten(item, out)
    return out


class _Runtime:
    """A loaded library plus one VirtualMachine per calling thread (a VM is not thread-safe)."""

    def __init__(self, lib_path: Path) -> None:
        import tvm
        from tvm import relax

        self._tvm = tvm
        self._relax = relax
        import tvm_ffi  # (installed with tvm, which is built on it)

        self._from_dlpack = tvm_ffi.from_dlpack
        try:
            self.lib = tvm.runtime.load_module(str(lib_path))
        except Exception as exc:
            raise ArtifactError(f"cannot load {lib_path.name}: {' '.join(str(exc).split())[:200]}",
                                hint="the library was built for another machine or is damaged; "
                                     "recompile") from None
        self.device = tvm.cpu()
        self._local = threading.local()
        self._kept: dict[str, frozenset[int]] = {}  # per function: output positions the VM keeps

    def vm(self) -> Any:
        vm = getattr(self._local, "vm", None)
        if vm is None:
            vm = self._relax.VirtualMachine(self.lib, self.device)
            self._local.vm = vm
            self._local.funcs = {}
            self._local.staging = {}
        return vm

    def func(self, name: str) -> Any:
        """This thread's VM function ``name`` (looked up once per thread)."""
        self.vm()
        funcs: dict[str, Any] = self._local.funcs
        f = funcs.get(name)
        if f is None:
            f = funcs[name] = self._local.vm[name]
        return f

    def call(self, name: str, args: tuple[Any, ...], arg_tensors: list[Any]) -> list[np.ndarray]:
        """Run VM function ``name`` on ``args``; its output tensors, flattened, as numpy arrays.

        Outputs cross by DLPack (each array keeps its tensor alive) and are owned by the caller:
        an output the VM keeps (a constant, e.g. the zero gradient of an unused parameter, or
        planned storage), one aliasing an argument in ``arg_tensors`` (an identity) or a sibling
        is copied, so writing to a result can never reach the VM, an argument or another result.
        Which outputs the VM keeps is found on the first call by calling twice: a fresh output
        cannot land at the address of one still alive.
        """
        f = self.func(name)
        flat = _flatten(f(*args), [])
        kept = self._kept.get(name)
        if kept is None:
            again = _flatten(f(*args), [])
            kept = frozenset(i for i, (a, b) in enumerate(zip(flat, again, strict=True))
                             if a.data_ptr() == b.data_ptr())
            self._kept[name] = kept
        seen = {t.data_ptr() for t in arg_tensors}
        out = []
        for i, t in enumerate(flat):
            arr = np.from_dlpack(t)
            ptr = t.data_ptr()
            if i in kept or ptr in seen:
                arr = arr.copy()
            else:
                seen.add(ptr)
            out.append(arr)
        return out

    def tensor(self, arr: np.ndarray, slot: int | None = None) -> Any:
        """A CPU tensor over ``arr``'s memory (DLPack, no copy) when ``arr`` is a C-contiguous,
        writable, native-order ndarray with 64-byte aligned data; otherwise over an aligned copy.
        The tensor keeps the array alive; the VM only reads its arguments (Relax is pure).

        With ``slot`` the copy goes into this thread's staging buffer for that slot instead of a
        new allocation: only for arguments that live no longer than one VM call.
        """
        if type(arr) is np.ndarray and arr.flags.c_contiguous and arr.flags.writeable \
                and arr.dtype.isnative:
            # Alignment is checked on the tensor, not by from_dlpack: its error path costs ~20 us.
            t = self._from_dlpack(arr, require_alignment=0, require_contiguous=True)
            if not t.data_ptr() % _ALIGN:
                return t
        if slot is not None:
            arr = np.asarray(arr)
            self.vm()
            staging: dict[Any, tuple[np.ndarray, Any]] = self._local.staging
            key = (slot, arr.shape, arr.dtype)
            hit = staging.get(key)
            if hit is None:
                buf = aligned_empty(arr.shape, arr.dtype.newbyteorder("="))
                hit = staging[key] = (buf, self._from_dlpack(buf, require_alignment=_ALIGN))
            np.copyto(hit[0], arr)
            return hit[1]
        return self._from_dlpack(aligned_copy(arr), require_alignment=_ALIGN, require_contiguous=True)


def _runtime_for(manifest: dict[str, Any], lib_path: Path) -> Any:
    """The engine for a library: the Relax VM, or ctypes for the C backend (``libs.runtime == "c"``)."""
    if manifest["libs"].get("runtime") == "c":
        from compiler.clib import CRuntime

        return CRuntime(lib_path)
    return _Runtime(lib_path)


class PreparedParams:
    """Parameters converted once to device tensors; pass to ``infer`` to skip per-call copies."""

    def __init__(self, runtime: Any, params: list[np.ndarray]) -> None:
        self.arrays = list(params)
        # Copied once (aligned): the tensors must not change if the caller later writes to its arrays.
        self.tensors = [runtime.tensor(aligned_copy(p)) for p in self.arrays]


def _check_params(params: list[np.ndarray], names: list[str], ref: list[np.ndarray]) -> list[np.ndarray]:
    if len(params) != len(ref):
        raise InputError(f"expected {len(ref)} parameters, got {len(params)}",
                         hint="pass the full parameter list in manifest order")
    out = []
    for name, p, r in zip(names, params, ref, strict=True):
        p = np.asarray(p)
        if p.shape != r.shape or p.dtype != r.dtype:
            raise InputError(f"parameter {name!r} is {p.dtype}{list(p.shape)}, "
                             f"expected {r.dtype}{list(r.shape)}",
                             hint="parameters must keep the compiled shapes and dtypes")
        out.append(p)
    return out


class Artifact:
    """A loaded, verified artifact: inference (thread-safe) and, if compiled, a Trainer."""

    def __init__(self, directory: Path, manifest: dict[str, Any], param_names: list[str],
                 params: list[np.ndarray]) -> None:
        self.directory = directory
        self.manifest = manifest
        self.name: str = manifest["name"]
        self.inputs = [TensorSpec.from_json(d) for d in manifest["inputs"]]
        self.outputs = [TensorSpec.from_json(d) for d in manifest["outputs"]]
        self.param_names = param_names
        self.params = params
        self.batch = int(manifest.get("batch", self.inputs[0].shape[0] if self.inputs else 1))
        self._input_dtypes = [np.dtype(s.dtype) for s in self.inputs]
        self._batched_out = all(o.shape and o.shape[0] == self.batch for o in self.outputs)
        self._infer = _runtime_for(manifest, directory / manifest["libs"]["infer"])
        self._default = PreparedParams(self._infer, params)
        train_lib = manifest["libs"].get("train")
        self._trainer: Trainer | None = None
        if train_lib and manifest.get("training"):
            self._trainer = Trainer(_runtime_for(manifest, directory / train_lib), manifest["training"],
                                    self.inputs, param_names, params)

    @property
    def trainer(self) -> Trainer | None:
        """The training runtime, or None when compiled without ``--train``."""
        return self._trainer

    @property
    def target(self) -> dict[str, Any]:
        return self.manifest["target"]

    def prepare_params(self, params: list[np.ndarray]) -> PreparedParams:
        """Validate and convert a parameter list once, for many ``infer`` calls."""
        return PreparedParams(self._infer, _check_params(params, self.param_names, self.params))

    def _check_inputs(self, inputs: dict[str, np.ndarray]) -> tuple[list[np.ndarray], int]:
        if not isinstance(inputs, dict):
            raise InputError("inputs must be a mapping of input name to array",
                             hint=f"expected keys: {', '.join(s.name for s in self.inputs)}")
        expected = [s.name for s in self.inputs]
        missing = [n for n in expected if n not in inputs]
        extra = [n for n in inputs if n not in expected]
        if missing or extra:
            parts = ([f"missing input(s) {', '.join(map(repr, missing))}"] if missing else []) + \
                    ([f"unknown input(s) {', '.join(map(repr, extra))}"] if extra else [])
            raise InputError("; ".join(parts), hint=f"the model's inputs are: {', '.join(expected)}")
        arrays, n = [], None
        for spec, want_dtype in zip(self.inputs, self._input_dtypes, strict=True):
            arr = inputs[spec.name]
            if type(arr) is not np.ndarray:
                arr = np.asarray(arr)
            if arr.dtype != want_dtype:
                raise InputError(f"input {spec.name!r} has dtype {arr.dtype}, expected {spec.dtype}",
                                 hint=f"convert it, e.g. x.astype('{spec.dtype}')")
            want = spec.shape[1:]
            if arr.ndim != len(spec.shape) or arr.shape[1:] != want or arr.shape[0] < 1:
                raise InputError(f"input {spec.name!r} has shape {list(arr.shape)}, expected [N, "
                                 f"{', '.join(map(str, want))}] with N >= 1",
                                 hint="the leading dimension is the batch")
            if n is not None and arr.shape[0] != n:
                raise InputError(f"inputs disagree on the batch size "
                                 f"({n} vs {arr.shape[0]} for {spec.name!r})",
                                 hint="give every input the same leading dimension")
            n = arr.shape[0]
            arrays.append(arr)
        return arrays, int(n or 1)

    def infer(self, inputs: dict[str, np.ndarray],
              params: list[np.ndarray] | PreparedParams | None = None) -> dict[str, np.ndarray]:
        """Run the model on a batch of any size N >= 1; returns {output name: array [N, ...]}.

        Thread-safe: each calling thread gets its own VM. ``params`` default to the artifact's own.
        """
        arrays, n = self._check_inputs(inputs)
        if params is None:
            prepared = self._default
        elif isinstance(params, PreparedParams):
            prepared = params
        else:
            prepared = self.prepare_params(params)
        b = self.batch
        batched_out = self._batched_out
        if n != b and not batched_out:
            raise InputError(f"this model's outputs have no batch dimension; send exactly {b} sample(s)",
                             hint=f"use batch {b}")
        rt = self._infer
        chunks: list[list[np.ndarray]] = [[] for _ in self.outputs]
        # The library is compiled for batch b: run ceil(n/b) calls, zero-padding the last one.
        # Inputs and outputs cross by DLPack (no copy); see _Runtime.tensor and _Runtime.call.
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
                for spec, c in zip(self.outputs, chunks, strict=True)}


class Trainer:
    """The compiled training step: loss + gradients, and the optimizer, callable separately.

    Uses its own VM (and lock), so a training step never blocks inference. Deterministic: the same
    inputs give bit-identical outputs (the swarm compares parameter hashes).
    """

    def __init__(self, runtime: Any, settings: dict[str, Any], inputs: list[TensorSpec],
                 param_names: list[str], params: list[np.ndarray]) -> None:
        self._rt = runtime
        self._lock = threading.Lock()
        self.loss: str = settings["loss"]
        self.optimizer: str = settings["optimizer"]
        self.lr: float = float(settings["lr"])
        self.batch: int = int(settings["batch"])
        self.param_names = param_names
        self._ref = params
        self._inputs = inputs
        self._state_specs = [(tuple(s["shape"]), s["dtype"]) for s in settings["optimizer_state"]]
        self.target_spec = TensorSpec.from_json(settings["targets"])
        self._lr_tensor: tuple[float, Any] | None = None  # (rate, its 0-d tensor), reused while unchanged

    def _inputs_list(self, x: np.ndarray | dict[str, np.ndarray]) -> list[np.ndarray]:
        if not isinstance(x, dict):
            if len(self._inputs) != 1:
                raise InputError("this model has several inputs: pass x as {name: array}",
                                 hint=", ".join(s.name for s in self._inputs))
            x = {self._inputs[0].name: x}
        out = []
        for spec in self._inputs:
            if spec.name not in x:
                raise InputError(f"missing training input {spec.name!r}", hint="pass every model input")
            arr = np.asarray(x[spec.name])
            want = (self.batch, *spec.shape[1:])
            if arr.shape != want or str(arr.dtype) != spec.dtype:
                raise InputError(f"training input {spec.name!r} is {arr.dtype}{list(arr.shape)}, expected "
                                 f"{spec.dtype}{list(want)}",
                                 hint=f"training batches have exactly {self.batch} samples")
            out.append(arr)
        return out

    def _targets(self, y: np.ndarray) -> np.ndarray:
        y = np.asarray(y)
        spec = self.target_spec
        if y.shape != spec.shape:
            raise InputError(f"targets have shape {list(y.shape)}, expected {list(spec.shape)}",
                             hint="ce: int class ids (batch,); mse: float targets shaped like the output")
        if str(y.dtype) != spec.dtype:
            if self.loss == "ce" and np.issubdtype(y.dtype, np.integer):
                y = y.astype(spec.dtype)
            else:
                raise InputError(f"targets have dtype {y.dtype}, expected {spec.dtype}",
                                 hint=f"convert them with .astype('{spec.dtype}')")
        return y

    def loss_and_grad(self, params: list[np.ndarray], x: np.ndarray | dict[str, np.ndarray],
                      y: np.ndarray) -> tuple[float, list[np.ndarray]]:
        """Mean loss over the batch and d(loss)/d(param) for every parameter, in manifest order."""
        params = _check_params(params, self.param_names, self._ref)
        xs = self._inputs_list(x)
        y = self._targets(y)
        t = self._rt.tensor
        with self._lock:
            args = [*[t(a) for a in xs], *[t(p) for p in params], t(y)]
            out = self._rt.call(ADJOINT_FUNC, tuple(args), args)
        return float(out[0]), out[1:]

    def init_state(self, params: list[np.ndarray]) -> list[np.ndarray]:
        """The optimizer state before the first step (a list of arrays; opaque to callers)."""
        _check_params(params, self.param_names, self._ref)
        state = []
        for i, (shape, dtype) in enumerate(self._state_specs):
            # Adam keeps beta1**t and beta2**t in slots 1 and 2; they start at 1.
            fill = 1.0 if self.optimizer == "adam" and i in (1, 2) else 0.0
            arr = aligned_empty(shape, dtype)  # aligned: passed to TVM without a copy
            arr[...] = fill
            state.append(arr)
        return state

    def apply(self, params: list[np.ndarray], grads: list[np.ndarray], state: list[np.ndarray],
              lr: float | None = None) -> tuple[list[np.ndarray], list[np.ndarray]]:
        """One optimizer step: (new params, new state). ``lr`` overrides the compiled default."""
        params = _check_params(params, self.param_names, self._ref)
        grads = _check_params(grads, self.param_names, self._ref)
        if len(state) != len(self._state_specs):
            raise InputError(f"optimizer state has {len(state)} tensors, expected {len(self._state_specs)}",
                             hint="create it with trainer.init_state(params)")
        rate = self.lr if lr is None else float(lr)
        if not np.isfinite(rate) or rate <= 0:
            raise InputError(f"learning rate must be a positive finite number, got {lr!r}",
                             hint="e.g. lr=0.01")
        t = self._rt.tensor
        with self._lock:
            if self._lr_tensor is None or self._lr_tensor[0] != rate:
                self._lr_tensor = (rate, t(aligned_copy(np.asarray(rate, dtype=np.float32))))
            ps, gs = [t(p) for p in params], [t(g) for g in grads]
            ss = [t(np.asarray(s)) for s in state]
            out = self._rt.call(OPTIMIZER_FUNC, (ps, gs, ss, self._lr_tensor[1]), [*ps, *gs, *ss])
        k = len(params)
        return out[:k], out[k:]


def _check_cpu_features(manifest: dict[str, Any]) -> None:
    """Refuse an x86_64 artifact built for instructions this CPU lacks (e.g. AVX-512 on an
    AVX2 machine), which would otherwise die of SIGILL mid-request instead of a clear error.

    LLVM's x86 feature names match /proc/cpuinfo's ``flags``; other arches are not checked
    (qemu-user shows the host's cpuinfo, and ARM feature names differ).
    """
    if manifest["target"].get("arch") != "x86_64":
        return
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return
    flags = next((set(line.split(":", 1)[1].split()) for line in text.splitlines()
                  if line.startswith("flags")), None)
    if not flags:
        return
    mattr = manifest["target"].get("tvm_target", {}).get("mattr", [])
    missing = sorted(f[1:] for f in mattr if f.startswith("+") and f[1:] not in flags)
    if missing:
        raise ArtifactError(
            f"artifact {manifest['name']!r} (preset {manifest['target'].get('preset')!r}) needs CPU "
            f"features this machine lacks: {', '.join(missing)}",
            hint="compile it for a preset this CPU runs (`fractal targets`; e.g. --target x86_64)")


def load_artifact(directory: str | Path, *, verify: bool = True) -> Artifact:
    """Load an artifact directory, checking every file's sha256 and the target architecture."""
    directory = Path(directory)
    manifest = read_manifest(directory)
    arch = manifest["target"].get("arch")
    host = _host_arch()
    if arch != host:
        raise ArtifactError(f"artifact {manifest['name']!r} was compiled for {arch} "
                            f"(preset {manifest['target'].get('preset')!r}); this machine is {host}",
                            hint=f"run it on a {arch} board, under qemu (`fractal verify --emulate`), "
                                 f"or compile with --target {host}")
    _check_cpu_features(manifest)
    if verify:
        _verify_files(directory, manifest)
    names, params = _load_params(directory, manifest)
    return Artifact(directory, manifest, names, params)
