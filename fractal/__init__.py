"""The project's shared bottom: the root error and the version (and ``fractal.files``, the one atomic
file replacement; ``fractal.keyfile``, the one private key file format; ``fractal.heap``;
``fractal.oip``). Imports nothing internal.

Every layer (compiler, federation, firmware, edgenode, api) derives its own errors from
:class:`FractalError`, so the CLI needs one ``isinstance`` to print any of them as one line::

    FractalError                    message + hint (how to fix it)
    ├── compiler.errors.CompilerError     ModelError, TargetError, ArtifactError, InputError, EmulationError
    ├── federation.errors.FederationError TransportError, FrameError, RoundAborted > UpdateRejected
    ├── firmware.errors.FirmwareError     (device images, flashing, boot)
    ├── edgenode.errors.NodeError         ConfigError, InvalidInput, StoreError, NodeBusy, RoundFailed
    ├── deploy.errors.DeployError         (launchers: qemu or a sysroot missing, a node failing to start)
    └── api.fleet.errors.FleetError       (fleet service; HTTP statuses live only in api/)
"""

from __future__ import annotations

from importlib import metadata as _metadata

__all__ = ["FractalError", "__version__"]

try:
    __version__ = _metadata.version("fractal-edge")
except _metadata.PackageNotFoundError:  # running from a source tree that was never installed
    __version__ = "0.0.0+source"


class FractalError(Exception):
    """Base of every error the project raises on purpose: a message and a ``hint`` (how to fix it)."""

    def __init__(self, message: str, *, hint: str | None = None) -> None:
        super().__init__(message)
        self.hint = hint
