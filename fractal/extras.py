"""What the ``[compiler]`` extra adds to a node install. Imports nothing internal.

``pip install fractal-edge`` is a node: it serves and trains a C-backend artifact and never
imports TVM or the compiler (issue 25). ``pip install 'fractal-edge[compiler]'`` is the
workstation: compile, tune, verify, the benchmarks and the demo swarm. A command that reaches
for one of these modules on a node install gets :func:`missing_compiler`'s one-line error.
"""

from __future__ import annotations

from fractal import FractalError

__all__ = ["COMPILER_EXTRA", "COMPILER_MODULES", "COMPILER_INSTALL", "MissingCompiler", "missing_compiler"]

COMPILER_EXTRA = "compiler"
COMPILER_INSTALL = "pip install 'fractal-edge[compiler]'"

# top-level module -> the distribution of the `[compiler]` extra (pyproject.toml) that provides it
# (torch is a dev extra, the train benchmark's baseline, and is refused the same way).
COMPILER_MODULES: dict[str, str] = {
    "tvm": "apache-tvm",
    "tvm_ffi": "apache-tvm-ffi",
    "psutil": "psutil",
    "cloudpickle": "cloudpickle",
    "tornado": "tornado",
    "xgboost": "xgboost",
    "onnx": "onnx",
    "onnxruntime": "onnxruntime",
    "sklearn": "scikit-learn",
    "amqtt": "amqtt",
    "httpx": "httpx",
    "torch": "torch",
}


class MissingCompiler(FractalError):
    """A command needs the ``[compiler]`` extra, which this install lacks."""


def missing_compiler(exc: BaseException) -> MissingCompiler | None:
    """The one-line error for an ImportError of a ``[compiler]`` module, else None."""
    if not isinstance(exc, ImportError) or not exc.name:
        return None
    top = exc.name.partition(".")[0]
    if top not in COMPILER_MODULES:
        return None
    return MissingCompiler(f"this needs the compiler packages, and {top} ({COMPILER_MODULES[top]}) is not "
                           "installed (a node install serves and trains C-backend artifacts only)",
                           hint=COMPILER_INSTALL)
