"""The one place the firmware layer reads a compiled artifact's manifest.

Everything else in ``firmware/`` uses :class:`ArtifactInfo`, built from the compiler's typed
manifest (``compiler.manifest.Manifest``).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

from compiler.manifest import Manifest

__all__ = ["ArtifactInfo", "artifact_info"]


@dataclass(frozen=True)
class ArtifactInfo:
    name: str
    preset: str
    arch: str
    inputs: list[dict[str, Any]]  # [{name, shape, dtype}]
    outputs: list[dict[str, Any]]
    files: dict[str, str]  # relative path -> sha256
    manifest: dict[str, Any]  # the artifact's manifest as stored, embedded in the image
    runtime: str  # "vm" (TVM's Relax VM on the board) or "c" (the C backend: native library + runner)
    libraries: dict[str, str]  # role (infer, train, runner, train_runner) -> file, as the manifest lists them


def artifact_info(directory: str | Path) -> ArtifactInfo:
    """Read the artifact manifest in ``directory`` and check every file it lists (ArtifactError when
    missing, malformed or damaged: an image must not carry a library its board would refuse)."""
    m = Manifest.read(directory)
    m.verify_files(directory)
    return ArtifactInfo(
        name=m.name,
        preset=m.preset,
        arch=m.arch,
        inputs=[s.to_json() for s in m.inputs],
        outputs=[s.to_json() for s in m.outputs],
        files=dict(m.files),
        manifest=m.to_json(),
        runtime=m.libs.runtime,
        libraries={role: f for role, f in (("infer", m.libs.infer), ("train", m.libs.train),
                                           ("runner", m.libs.runner), ("train_runner", m.libs.train_runner))
                   if f is not None},
    )
