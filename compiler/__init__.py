"""compiler: ONNX -> TVM artifacts for x86-64, aarch64 and riscv64 boards, with a training module.

Imports are lazy on purpose: ``compiler.artifact`` must load inside a minimal aarch64 sysroot
that has only tvm, tvm_ffi and numpy, so importing this package pulls in nothing heavy.
"""

from __future__ import annotations

from typing import Any

from fractal.lazy import LazyNames

__all__ = [
    "compile_model",
    "TrainSettings",
    "load_artifact",
    "Artifact",
    "Trainer",
    "TensorSpec",
    "PRESETS",
    "TargetPreset",
    "get_preset",
    "host_preset_name",
    "verify_artifact",
    "CompilerError",
    "ModelError",
    "TargetError",
    "ArtifactError",
    "InputError",
    "EmulationError",
]

_LAZY = {
    "compile_model": "compiler.build",
    "TrainSettings": "compiler.trainbuild",
    "load_artifact": "compiler.artifact",
    "Artifact": "compiler.artifact",
    "Trainer": "compiler.artifact",
    "TensorSpec": "compiler.artifact",
    "PRESETS": "compiler.targets",
    "TargetPreset": "compiler.targets",
    "get_preset": "compiler.targets",
    "host_preset_name": "compiler.targets",
    "verify_artifact": "compiler.verify",
    "CompilerError": "compiler.errors",
    "ModelError": "compiler.errors",
    "TargetError": "compiler.errors",
    "ArtifactError": "compiler.errors",
    "InputError": "compiler.errors",
    "EmulationError": "compiler.errors",
}


_names = LazyNames(__name__, _LAZY, globals())


def __getattr__(name: str) -> Any:
    return _names.get(name)


def __dir__() -> list[str]:
    return _names.dir(__all__)
