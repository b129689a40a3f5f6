"""The compiler's error tree. Every error says what went wrong and, in ``hint``, how to fix it.

    CompilerError
    ├── ModelError          corrupt / unreadable ONNX, unsupported operator, dynamic shape
    ├── TargetError         unknown preset, missing cross compiler
    ├── ArtifactError       missing file, sha256 mismatch, bad manifest
    ├── InputError          predict/infer inputs with wrong names, shapes or dtypes
    └── EmulationError      qemu-user or sysroot missing, emulated run failed
"""

from __future__ import annotations

from fractal import FractalError

__all__ = [
    "CompilerError",
    "ModelError",
    "TargetError",
    "ArtifactError",
    "InputError",
    "EmulationError",
]


class CompilerError(FractalError):
    """Base of every error the compiler raises on purpose."""


class ModelError(CompilerError):
    pass


class TargetError(CompilerError):
    pass


class ArtifactError(CompilerError):
    pass


class InputError(CompilerError):
    pass


class EmulationError(CompilerError):
    pass
