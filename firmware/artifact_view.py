"""The one place the firmware layer reads a compiled artifact's manifest.

Everything else in ``firmware/`` uses :class:`ArtifactInfo`; when the compiler's manifest
becomes a typed object, only :func:`artifact_info` changes.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

from compiler.artifact import read_manifest

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


def artifact_info(directory: str | Path) -> ArtifactInfo:
    """Read the artifact manifest in ``directory`` (ArtifactError when missing or malformed)."""
    m = read_manifest(directory)
    return ArtifactInfo(
        name=str(m["name"]),
        preset=str(m["target"]["preset"]),
        arch=str(m["target"]["arch"]),
        inputs=list(m["inputs"]),
        outputs=list(m["outputs"]),
        files=dict(m["files"]),
        manifest=m,
    )
