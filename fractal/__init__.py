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

import os as _os
import sys as _sys

__all__ = ["FractalError", "__version__"]


def _installed_version() -> str:
    """The installed distribution's version, read from its ``.dist-info/METADATA`` on ``sys.path``
    (what ``importlib.metadata.version`` returns; that module imports email, zipfile and csv, 3.5 MB
    of resident memory in every node and training worker). ``0.0.0+source`` from a source tree
    that was never installed (a board image's /opt/fractal)."""
    for entry in _sys.path:
        try:
            names = _os.listdir(entry or ".")
        except OSError:
            continue
        for name in names:
            if name.startswith("fractal_edge-") and name.endswith(".dist-info"):
                try:
                    with open(_os.path.join(entry or ".", name, "METADATA"), encoding="utf-8") as fh:
                        for line in fh:
                            if line.startswith("Version:"):
                                return line.split(":", 1)[1].strip()
                            if not line.strip():
                                break  # end of the headers
                except OSError:
                    continue
    return "0.0.0+source"


__version__ = _installed_version()


class FractalError(Exception):
    """Base of every error the project raises on purpose: a message and a ``hint`` (how to fix it)."""

    def __init__(self, message: str, *, hint: str | None = None) -> None:
        super().__init__(message)
        self.hint = hint
