"""The artifact manifest: one typed, versioned object, written and read only here.

``manifest.json`` describes an artifact directory (see :mod:`compiler.artifact`): the model, the
target it was compiled for, its inputs/outputs, the files with their sha256, the parameters,
tuning and training settings. ``Manifest.write`` / ``Manifest.read`` are the only code that
touches the JSON; everything else uses the typed fields. A manifest of a format version this
build does not know (a newer ``fractal`` wrote it) is refused with a clear error.

Standard library only (no pydantic): this module also runs on boards and under qemu-user.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeVar

from compiler.errors import ArtifactError

__all__ = [
    "FORMAT_VERSION",
    "MANIFEST",
    "TensorSpec",
    "TargetInfo",
    "ParamsInfo",
    "Libs",
    "TuningInfo",
    "TrainingInfo",
    "QuantSettings",
    "QuantizationInfo",
    "NonFinite",
    "NONFINITE_UNCHECKED",
    "HostInfo",
    "Manifest",
    "file_sha256",
]

# The newest format this build reads. 2: a host stage (``host``: string operators run beside the
# library, whose inputs are then not the model's); a reader of 1 would hand the library strings, so
# only such artifacts are written as 2 and every other artifact stays 1, readable by older fractal.
FORMAT_VERSION = 2
_HOST_FORMAT = 2
MANIFEST = "manifest.json"

T = TypeVar("T")


def file_sha256(path: str | Path) -> str:
    """Hex sha256 of a file (read in 1 MiB chunks)."""
    h = hashlib.sha256()
    with open(path, "rb") as fh:
        for chunk in iter(lambda: fh.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


class _Reader:
    """Typed access to one JSON object of the manifest; every problem is an ArtifactError naming the key."""

    def __init__(self, data: Any, where: str) -> None:
        if not isinstance(data, dict):
            raise _bad(f"{where} is not an object")
        self.data: dict[str, Any] = data
        self.where = where

    def _get(self, key: str, default: Any, required: bool) -> Any:
        if key not in self.data:
            if required:
                raise _bad(f"{self.where} lacks the {key!r} field")
            return default
        return self.data[key]

    def typed(self, key: str, kind: type[T] | tuple[type, ...], default: Any = None,
              required: bool = True) -> Any:
        value = self._get(key, default, required)
        if value is None and not required:
            return value
        # bool is an int in Python; a manifest that says "batch": true is still malformed.
        if isinstance(value, bool) and kind in (int, float, (int, float)):
            raise _bad(f"{self.where}.{key} is a boolean, expected {_kind_name(kind)}")
        if not isinstance(value, kind):
            raise _bad(f"{self.where}.{key} is {type(value).__name__}, expected {_kind_name(kind)}")
        return value

    def text(self, key: str, default: str | None = None, required: bool = True) -> Any:
        return self.typed(key, str, default, required)

    def integer(self, key: str, default: int | None = None, required: bool = True) -> Any:
        return self.typed(key, int, default, required)

    def obj(self, key: str, parse: Callable[[_Reader], T], required: bool = True) -> T | None:
        value = self._get(key, None, required)
        if value is None:
            return None
        return parse(_Reader(value, f"{self.where}.{key}"))

    def seq(self, key: str, parse: Callable[[Any, str], T], required: bool = True) -> tuple[T, ...]:
        value = self._get(key, [], required)
        if not isinstance(value, list):
            raise _bad(f"{self.where}.{key} is {type(value).__name__}, expected a list")
        return tuple(parse(v, f"{self.where}.{key}[{i}]") for i, v in enumerate(value))


def _kind_name(kind: type | tuple[type, ...]) -> str:
    kinds = kind if isinstance(kind, tuple) else (kind,)
    return " or ".join(k.__name__ for k in kinds)


def _bad(message: str) -> ArtifactError:
    return ArtifactError(f"malformed {MANIFEST}: {message}", hint="recompile the artifact with this fractal")


def _shape(value: Any, where: str, dynamic: bool = False) -> tuple[int, ...]:
    low = -1 if dynamic else 0
    if not isinstance(value, list) or not all(isinstance(d, int) and not isinstance(d, bool) and d >= low
                                              for d in value):
        kind = "non-negative integers or -1" if dynamic else "non-negative integers"
        raise _bad(f"{where} is not a shape (a list of {kind})")
    return tuple(value)


def _output_spec(d: Any, where: str) -> TensorSpec:
    return TensorSpec.from_json(d, where, dynamic=True)


def _text(value: Any, where: str) -> str:
    if not isinstance(value, str):
        raise _bad(f"{where} is {type(value).__name__}, expected str")
    return value


@dataclass(frozen=True)
class TensorSpec:
    """Name, shape (batch dim included, as compiled) and dtype of one model input or output.
    An output's dim is -1 when it is decided at run time (:mod:`compiler.dynshape`)."""

    name: str
    shape: tuple[int, ...]
    dtype: str

    def to_json(self) -> dict[str, Any]:
        return {"name": self.name, "shape": list(self.shape), "dtype": self.dtype}

    @classmethod
    def from_json(cls, d: Any, where: str = "tensor", dynamic: bool = False) -> TensorSpec:
        r = _Reader(d, where)
        return cls(r.text("name"), _shape(r.data.get("shape"), f"{where}.shape", dynamic), r.text("dtype"))

    @property
    def dynamic(self) -> bool:
        """Whether a dim is decided at run time (-1)."""
        return any(d < 0 for d in self.shape)


@dataclass(frozen=True)
class TargetInfo:
    """The target preset the artifact was compiled for (see :mod:`compiler.targets`)."""

    preset: str
    arch: str
    tvm_target: Mapping[str, Any]
    cross_compiler: str | None = None
    description: str = ""

    @property
    def mattr(self) -> tuple[str, ...]:
        """LLVM ``-mattr`` features the code may use (e.g. ``+avx2``)."""
        return tuple(str(f) for f in self.tvm_target.get("mattr", ()))

    def to_json(self) -> dict[str, Any]:
        return {"preset": self.preset, "arch": self.arch, "tvm_target": dict(self.tvm_target),
                "cross_compiler": self.cross_compiler, "description": self.description}

    @classmethod
    def parse(cls, r: _Reader) -> TargetInfo:
        return cls(r.text("preset"), r.text("arch"), r.typed("tvm_target", dict),
                   r.text("cross_compiler", required=False), r.text("description", "", required=False))


@dataclass(frozen=True)
class ParamsInfo:
    """The parameter file and, in order, every parameter's name, shape and dtype."""

    file: str
    names: tuple[str, ...]
    shapes: tuple[tuple[int, ...], ...]
    dtypes: tuple[str, ...]

    def __post_init__(self) -> None:
        if not len(self.names) == len(self.shapes) == len(self.dtypes):
            raise _bad("params: names, shapes and dtypes differ in length")

    def to_json(self) -> dict[str, Any]:
        return {"file": self.file, "names": list(self.names), "shapes": [list(s) for s in self.shapes],
                "dtypes": list(self.dtypes)}

    @classmethod
    def parse(cls, r: _Reader) -> ParamsInfo:
        return cls(r.text("file"), r.seq("names", _text), r.seq("shapes", _shape), r.seq("dtypes", _text))


@dataclass(frozen=True)
class Libs:
    """File names of the compiled libraries (``train`` only with ``--train``; ``infer`` None only
    when a host stage computes every output, see :class:`HostInfo`)."""

    infer: str | None
    train: str | None = None
    # "vm": TVM libraries run by the Relax VM; "c": the C backend (compiler/cbackend.py), a native
    # library called through ctypes plus a standalone runner (``runner``, ``train_runner``).
    runtime: str = "vm"
    runner: str | None = None
    train_runner: str | None = None
    # the inference library's parameter transform (compiler/prepack.py): a VM function taking the
    # parameters (manifest order) and returning the packed ones ``main`` takes; run once per
    # parameter set. None: ``main`` takes the parameters as they are.
    transform: str | None = None

    def to_json(self) -> dict[str, Any]:
        out: dict[str, Any] = {"infer": self.infer, "train": self.train}
        if self.runtime != "vm":  # VM manifests keep their exact bytes
            out.update(runtime=self.runtime, runner=self.runner, train_runner=self.train_runner)
        if self.transform is not None:
            out["transform"] = self.transform
        return out

    @classmethod
    def parse(cls, r: _Reader) -> Libs:
        runtime = r.text("runtime", "vm", required=False)
        if runtime not in ("vm", "c"):
            raise _bad(f"{r.where}.runtime is {runtime!r}, expected 'vm' or 'c'")
        transform = r.text("transform", required=False)
        if transform is not None and runtime != "vm":
            raise _bad(f"{r.where}.transform is only valid for the 'vm' runtime")
        return cls(r.text("infer", required=False), r.text("train", required=False), runtime,
                   r.text("runner", required=False), r.text("train_runner", required=False), transform)


@dataclass(frozen=True)
class TuningInfo:
    """Whether MetaSchedule tuned the module, with which database and how many trials."""

    tuned: bool = False
    db_id: str | None = None
    trials: int = 0
    trials_run: int = 0
    seconds: float = 0.0
    reused: bool = False
    db_dir: str | None = None
    # how the kernels were scheduled: "naive" (TVM's default lowering; artifacts before the
    # default schedules), "default" (compiler.schedules), "tuned" (MetaSchedule records)
    schedule: str = "naive"
    time_budget: float | None = None  # --time-budget seconds, if tuning had one
    measured_on: str | None = None  # --rpc HOST:PORT of the board that timed the candidates
    database: str | None = None  # which database tuning used: "user" (--db / user cache) or "shipped"
    applied: int | None = None  # kernels that got a tuned schedule from the database
    # kernels whose record lost to the default schedule when both were timed at compile time
    kept_default: int | None = None

    def to_json(self) -> dict[str, Any]:
        out = {"tuned": self.tuned, "db_id": self.db_id, "trials": self.trials,
               "trials_run": self.trials_run,
               "seconds": self.seconds, "reused": self.reused, "db_dir": self.db_dir,
               "schedule": self.schedule}
        if self.time_budget is not None:
            out["time_budget"] = self.time_budget
        if self.measured_on is not None:
            out["measured_on"] = self.measured_on
        if self.database is not None:
            out["database"] = self.database
        if self.applied is not None:
            out["applied"] = self.applied
        if self.kept_default is not None:
            out["kept_default"] = self.kept_default
        return out

    @classmethod
    def parse(cls, r: _Reader) -> TuningInfo:
        budget = r.typed("time_budget", (int, float), None, required=False)
        return cls(r.typed("tuned", bool), r.text("db_id", required=False),
                   r.integer("trials", 0, required=False),
                   r.integer("trials_run", 0, required=False),
                   float(r.typed("seconds", (int, float), 0.0, required=False)),
                   bool(r.typed("reused", bool, False, required=False)), r.text("db_dir", required=False),
                   r.text("schedule", "tuned" if r.typed("tuned", bool) else "naive", required=False),
                   None if budget is None else float(budget), r.text("measured_on", required=False),
                   r.text("database", required=False), r.integer("applied", None, required=False),
                   r.integer("kept_default", None, required=False))


@dataclass(frozen=True)
class TrainingInfo:
    """What ``--train`` compiled: loss, optimizer, default lr, batch, and the step's tensors."""

    loss: str
    optimizer: str
    lr: float
    batch: int
    inputs: tuple[TensorSpec, ...]
    targets: TensorSpec
    optimizer_state: tuple[tuple[tuple[int, ...], str], ...]
    tuning: TuningInfo = field(default_factory=TuningInfo)

    @property
    def tuned(self) -> bool:
        return self.tuning.tuned

    def to_json(self) -> dict[str, Any]:
        return {"loss": self.loss, "optimizer": self.optimizer, "lr": self.lr, "batch": self.batch,
                "inputs": [s.to_json() for s in self.inputs], "targets": self.targets.to_json(),
                "optimizer_state": [{"shape": list(s), "dtype": d} for s, d in self.optimizer_state],
                "lr_input": True, "tuned": self.tuned, "tuning": self.tuning.to_json()}

    @classmethod
    def parse(cls, r: _Reader) -> TrainingInfo:
        def state(v: Any, where: str) -> tuple[tuple[int, ...], str]:
            s = _Reader(v, where)
            return _shape(s.data.get("shape"), f"{where}.shape"), s.text("dtype")

        return cls(r.text("loss"), r.text("optimizer"), float(r.typed("lr", (int, float))),
                   r.integer("batch"),
                   r.seq("inputs", TensorSpec.from_json), TensorSpec.from_json(r.data.get("targets"),
                                                                                f"{r.where}.targets"),
                   r.seq("optimizer_state", state),
                   r.obj("tuning", TuningInfo.parse, required=False) or TuningInfo())


@dataclass(frozen=True)
class QuantSettings:
    """How a float model is quantized (``compiler.quantize.quantize_int8``, onnxruntime's
    ``quantize_static``, QDQ format): the defaults are what ``--quantize int8`` uses."""

    per_channel: bool = True  # weights: one scale per output channel
    activation_type: str = "int8"
    weight_type: str = "int8"
    activation_symmetric: bool = False  # activations asymmetric (a zero point), weights symmetric
    weight_symmetric: bool = True
    calibrate_method: str = "minmax"

    def to_json(self) -> dict[str, Any]:
        return {"per_channel": self.per_channel, "activation_type": self.activation_type,
                "weight_type": self.weight_type, "activation_symmetric": self.activation_symmetric,
                "weight_symmetric": self.weight_symmetric, "calibrate_method": self.calibrate_method}

    @classmethod
    def parse(cls, r: _Reader) -> QuantSettings:
        d = cls()
        return cls(r.typed("per_channel", bool, d.per_channel, required=False),
                   r.text("activation_type", d.activation_type, required=False),
                   r.text("weight_type", d.weight_type, required=False),
                   r.typed("activation_symmetric", bool, d.activation_symmetric, required=False),
                   r.typed("weight_symmetric", bool, d.weight_symmetric, required=False),
                   r.text("calibrate_method", d.calibrate_method, required=False))


@dataclass(frozen=True)
class QuantizationInfo:
    """A training artifact that also serves int8 (``fractal compile --train --quantize int8``):
    training stays float, inference may run the int8 library, and after every committed round a
    node rebuilds that library from the new float parameters (``compiler.requantize``). So the
    artifact carries what a rebuild needs: the float model (``float_onnx``: graph and shipped
    weights; the trained parameters replace its initializers by name), the quantization settings,
    the calibration size, and the compile settings (integer kernels; the preset and the input
    shapes are the manifest's own)."""

    mode: str  # "int8" (compiler.quantize.MODES)
    library: str  # the int8 inference artifact: a complete artifact directory inside this one
    float_onnx: str  # the float model file in this directory
    settings: QuantSettings = field(default_factory=QuantSettings)
    calibration_samples: int = 0  # how many samples the shipped library was calibrated on
    integer: bool = False  # integer kernels (compiler.integer) or dequantize -> float ops

    def to_json(self) -> dict[str, Any]:
        return {"mode": self.mode, "library": self.library, "float_onnx": self.float_onnx,
                "settings": self.settings.to_json(), "calibration_samples": self.calibration_samples,
                "integer": self.integer}

    @classmethod
    def parse(cls, r: _Reader) -> QuantizationInfo:
        library, float_onnx = r.text("library"), r.text("float_onnx")
        for key, rel in (("library", library), ("float_onnx", float_onnx)):
            if not rel or Path(rel).is_absolute() or ".." in Path(rel).parts:
                raise _bad(f"{r.where}.{key} {rel!r} leaves the artifact directory")
        return cls(r.text("mode"), library, float_onnx,
                   r.obj("settings", QuantSettings.parse, required=False) or QuantSettings(),
                   r.integer("calibration_samples", 0, required=False),
                   r.typed("integer", bool, False, required=False))


@dataclass(frozen=True)
class HostInfo:
    """The model's string operators run on the host (compiler/hoststage.py): the stage's file, and
    the compiled library's own inputs and outputs (the manifest's ``inputs`` and ``outputs`` are the
    model's, strings with dtype ``object``; no library when ``libs.infer`` is None)."""

    file: str
    library_inputs: tuple[TensorSpec, ...] = ()
    library_outputs: tuple[TensorSpec, ...] = ()

    def to_json(self) -> dict[str, Any]:
        return {"file": self.file, "library_inputs": [s.to_json() for s in self.library_inputs],
                "library_outputs": [s.to_json() for s in self.library_outputs]}

    @classmethod
    def parse(cls, r: _Reader) -> HostInfo:
        file = r.text("file")
        if not file or Path(file).is_absolute() or ".." in Path(file).parts:
            raise _bad(f"{r.where}.file {file!r} leaves the artifact directory")
        return cls(file, r.seq("library_inputs", TensorSpec.from_json, required=False),
                   r.seq("library_outputs", _output_spec, required=False))


# An artifact from before the per-operator check: it refused every non-finite input, and still does.
NONFINITE_UNCHECKED = "?"
_LEGACY = NONFINITE_UNCHECKED


@dataclass(frozen=True)
class NonFinite:
    """Which non-finite float inputs inference takes (compiler/nonfinite.py): for NaN and for
    infinities, ``""`` (taken: every operator gives ONNX's IEEE result) or the operator that would
    not, which makes inference refuse them. A manifest without it refuses both
    (``NONFINITE_UNCHECKED``)."""

    nan: str = _LEGACY
    inf: str = _LEGACY

    def to_json(self) -> dict[str, Any]:
        return {"nan": self.nan, "inf": self.inf}

    @classmethod
    def parse(cls, r: _Reader) -> NonFinite:
        return cls(r.text("nan", _LEGACY, required=False), r.text("inf", _LEGACY, required=False))


def _shapes_map(value: dict[Any, Any], where: str) -> dict[str, tuple[int, ...]]:
    out: dict[str, tuple[int, ...]] = {}
    for k, v in value.items():
        if not isinstance(k, str):
            raise _bad(f"compiled_shapes keys must be input names, got {k!r}")
        out[k] = _shape(v, f"{where}: compiled_shapes[{k!r}]")
    return out


@dataclass(frozen=True)
class Manifest:
    """The typed content of ``manifest.json``."""

    name: str
    target: TargetInfo
    batch: int
    inputs: tuple[TensorSpec, ...]
    outputs: tuple[TensorSpec, ...]
    params: ParamsInfo
    libs: Libs
    files: Mapping[str, str]
    onnx_sha256: str
    onnx_file: str = ""
    tvm_version: str = ""
    created: str = ""
    tuning: TuningInfo = field(default_factory=TuningInfo)
    training: TrainingInfo | None = None
    compile_seconds: float = 0.0
    compiled_shapes: Mapping[str, tuple[int, ...]] = field(default_factory=dict)  # --shape result per input
    prepared_steps: tuple[str, ...] = ()  # ONNX preparation steps that changed the graph
    # False: the inputs share no leading batch dimension; inference takes exactly the compiled
    # shapes in one call (no batch chunking), and there is no training module.
    batched: bool = True
    # --train --quantize int8: the int8 inference library and what rebuilding it takes (None: float only)
    quantization: QuantizationInfo | None = None
    nonfinite: NonFinite = field(default_factory=NonFinite)  # NaN / inf inputs taken or refused
    host: HostInfo | None = None  # string operators run on the host (None: the library does everything)
    format_version: int = 1

    @property
    def preset(self) -> str:
        return self.target.preset

    @property
    def arch(self) -> str:
        return self.target.arch

    def to_json(self) -> dict[str, Any]:
        return {
            "format_version": max(self.format_version, _HOST_FORMAT if self.host is not None else 1),
            "name": self.name, "created": self.created,
            "onnx_file": self.onnx_file, "onnx_sha256": self.onnx_sha256, "tvm_version": self.tvm_version,
            "target": self.target.to_json(), "batch": self.batch,
            "inputs": [s.to_json() for s in self.inputs], "outputs": [s.to_json() for s in self.outputs],
            "params": self.params.to_json(), "libs": self.libs.to_json(), "files": dict(self.files),
            "tuning": self.tuning.to_json(),
            "training": self.training.to_json() if self.training is not None else None,
            "compile_seconds": self.compile_seconds,
            "compiled_shapes": {k: list(v) for k, v in self.compiled_shapes.items()},
            "prepared_steps": list(self.prepared_steps),
            "batched": self.batched,
            "nonfinite": self.nonfinite.to_json(),
            **({"quantization": self.quantization.to_json()} if self.quantization is not None else {}),
            **({"host": self.host.to_json()} if self.host is not None else {}),
        }

    @classmethod
    def from_json(cls, data: Any, where: str = MANIFEST) -> Manifest:
        r = _Reader(data, where)
        version = r.data.get("format_version")
        if not isinstance(version, int) or isinstance(version, bool) or version < 1:
            raise _bad(f"format_version is {version!r}")
        if version > FORMAT_VERSION:
            raise ArtifactError(f"{where} has format version {version}; this fractal reads up to "
                                f"{FORMAT_VERSION}",
                                hint="upgrade fractal, or recompile the artifact with this one")
        files = r.typed("files", dict)
        if not all(isinstance(k, str) and isinstance(v, str) for k, v in files.items()):
            raise _bad("files must map file names to sha256 strings")
        target = r.obj("target", TargetInfo.parse)
        params = r.obj("params", ParamsInfo.parse)
        libs = r.obj("libs", Libs.parse)
        assert target is not None and params is not None and libs is not None  # (required=True)
        inputs = r.seq("inputs", TensorSpec.from_json)
        host = r.obj("host", HostInfo.parse, required=False)
        if libs.infer is None and host is None:
            raise _bad(f"{where}.libs lacks the 'infer' library")
        batch = r.integer("batch", inputs[0].shape[0] if inputs and inputs[0].shape else 1, required=False)
        return cls(
            name=r.text("name"), target=target, batch=batch, inputs=inputs,
            outputs=r.seq("outputs", _output_spec), params=params, libs=libs, files=files,
            onnx_sha256=r.text("onnx_sha256", "", required=False),
            onnx_file=r.text("onnx_file", "", required=False),
            tvm_version=r.text("tvm_version", "", required=False),
            created=r.text("created", "", required=False),
            tuning=r.obj("tuning", TuningInfo.parse, required=False) or TuningInfo(),
            training=r.obj("training", TrainingInfo.parse, required=False),
            compile_seconds=float(r.typed("compile_seconds", (int, float), 0.0, required=False)),
            compiled_shapes=_shapes_map(r.typed("compiled_shapes", dict, {}, required=False), where),
            prepared_steps=r.seq("prepared_steps", _text, required=False),
            batched=r.typed("batched", bool, True, required=False),
            quantization=r.obj("quantization", QuantizationInfo.parse, required=False),
            nonfinite=r.obj("nonfinite", NonFinite.parse, required=False) or NonFinite(),
            host=host,
            format_version=version,
        )

    def write(self, directory: str | Path) -> Path:
        """Write ``manifest.json`` into ``directory`` (sorted keys: equal manifests are equal bytes)."""
        path = Path(directory) / MANIFEST
        path.write_text(json.dumps(self.to_json(), indent=2, sort_keys=True) + "\n")
        return path

    @classmethod
    def read(cls, directory: str | Path) -> Manifest:
        """Read and validate ``DIR/manifest.json``; ArtifactError (with a hint) when missing or malformed."""
        directory = Path(directory)
        path = directory / MANIFEST
        if not directory.is_dir():
            raise ArtifactError(f"artifact directory {str(directory)!r} does not exist",
                                hint="pass the --out directory of `fractal compile`")
        if not path.is_file():
            raise ArtifactError(f"{str(directory)!r} has no {MANIFEST}; it is not a compiled artifact",
                                hint="pass the --out directory of `fractal compile`")
        try:
            data = json.loads(path.read_text())
        except (OSError, ValueError) as exc:
            raise ArtifactError(f"{path} is not valid JSON ({exc})", hint="recompile the artifact") from None
        return cls.from_json(data, str(path))

    def verify_files(self, directory: str | Path) -> None:
        """Check that every file the manifest lists exists in ``directory`` with its sha256."""
        directory = Path(directory)
        for rel, digest in self.files.items():
            path = directory / rel
            if Path(rel).is_absolute() or ".." in Path(rel).parts:
                raise _bad(f"file name {rel!r} leaves the artifact directory")
            if not path.is_file():
                raise ArtifactError(f"artifact file {rel!r} is missing from {str(directory)!r}",
                                    hint="copy the whole artifact directory or recompile")
            actual = file_sha256(path)
            if actual != digest:
                raise ArtifactError(f"artifact file {rel!r} fails its sha256 check "
                                    f"(manifest {digest[:12]}..., file {actual[:12]}...)",
                                    hint="the file is corrupt or was modified; "
                                         "recompile or re-copy the artifact")
