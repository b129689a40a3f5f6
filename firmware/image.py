"""The device image: one file, a signed manifest and the members it lists.

Layout (all integers big-endian)::

    b"FRCTIMG1"            8 bytes magic (format version 1)
    u32 manifest length    at most MAX_MANIFEST
    u16 signature length   64 (ed25519)
    manifest               UTF-8 JSON (sorted keys), see build_image
    signature              ed25519 over SIG_CONTEXT + manifest
    members                concatenated in manifest order, sizes and sha256 in the manifest

The reader checks, in this order and before trusting anything: the magic, bounded lengths,
the exact file size (truncated or padded files are refused), the signature against the
trusted keys, the manifest schema (safe member names: relative, no ``..``, no leading dot,
no symlinks since members are plain byte ranges), then the sha256 of every member.
"""

from __future__ import annotations

import hashlib
import json
import struct
import time
from collections.abc import Iterator
from dataclasses import dataclass, replace
from pathlib import Path
from typing import IO, Any

import numpy as np
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PublicKey

from firmware import keys as keymod
from firmware.artifact_view import ArtifactInfo, artifact_info
from firmware.boards import get_board
from firmware.errors import FirmwareError, ImageError
from firmware.manifest import (
    IMAGE_FORMAT,
    NODE_TEMPLATE_MEMBER,
    ImageManifest,
    member_name_ok,
    parse_manifest,
    parse_version,
)
from fractal.files import atomic_open

__all__ = [
    "MAGIC",
    "IMAGE_FORMAT",
    "Image",
    "build_image",
    "open_image",
    "read_unverified",
    "parse_version",
    "member_name_ok",
    "NODE_TEMPLATE",
    "HEALTH_ATOL",
    "Member",
    "load_trusted",
]

MAGIC = b"FRCTIMG1"
_HEADER = struct.Struct(">8sIH")
MAX_MANIFEST = 1 << 20
SIG_LEN = 64
MAX_IMAGE = 4 << 30
HEALTH_ATOL = 1e-4
_CHUNK = 1 << 20

# Filled by the boot supervisor (firmware.boot.node_config); @X@ tokens, never str.format braces.
NODE_TEMPLATE = """\
# fractal node config, generated at boot from the image's template
node_id = @NODE_ID@
artifact = @ARTIFACT@
data_dir = @DATA_DIR@
host = @HOST@
port = @PORT@
board = @BOARD@
"""

# What a board needs to run the node from a slot, per architecture, for artifacts run by the
# Relax VM (``libs.runtime == "vm"``) ...
_RUNTIME = {
    "x86_64": {
        "python": "3.11+",
        "packages": ["fractal-edge", "apache-tvm (runtime)", "numpy"],
        "launcher": [],
    },
    "aarch64": {
        "python": "3.11 (aarch64)",
        "packages": ["fractal-edge", "apache-tvm aarch64 wheel", "numpy"],
        "launcher": [],
        "emulate": "qemu-aarch64 with the sysroot of `make sysroot`",
    },
}
# ... and for C-backend artifacts (``libs.runtime == "c"``, every riscv64 one): the model is a
# native library loaded with ctypes (plus a standalone runner); no TVM on the board.
_C_RUNTIME = {
    "riscv64": {
        "python": "3.13 (riscv64, Debian trixie)",
        "packages": ["fractal-edge", "python3-numpy", "the node's Python dependencies as Debian packages"],
        "launcher": [],
        "emulate": "qemu-riscv64 -cpu rv64,v=true,vlen=128 with the sysroot of `make sysroot-riscv64`",
    },
}
_C_DEFAULT = {"python": "3.11+", "packages": ["fractal-edge", "numpy"], "launcher": []}


def _runtime(art: ArtifactInfo, board_arch: str) -> dict[str, Any]:
    """The image manifest's ``runtime`` section: what the board needs, and for a C-backend
    artifact which members are its native library and runner."""
    if art.runtime != "c":
        return {"arch": board_arch, "kind": "vm", **_RUNTIME.get(board_arch, {})}
    native = {role: f"artifact/{f}" for role, f in art.libraries.items()}
    return {"arch": board_arch, "kind": "c", **_C_RUNTIME.get(board_arch, _C_DEFAULT), "native": native}


@dataclass(frozen=True)
class Member:
    name: str
    size: int
    sha256: str
    offset: int  # in the image file
    executable: bool = False  # flashed with mode 0755 (a C artifact's runners), else 0644


@dataclass(frozen=True)
class Image:
    """An image whose signature and every member have been verified."""

    path: Path
    spec: ImageManifest  # the validated manifest (firmware.manifest)
    manifest_bytes: bytes
    signature: bytes
    signer: str  # key id
    members: tuple[Member, ...]

    @property
    def manifest(self) -> dict[str, Any]:
        """The whole signed manifest as JSON (what ``image info`` shows)."""
        return self.spec.raw

    @property
    def version(self) -> str:
        return self.spec.version

    @property
    def board(self) -> str:
        return self.spec.board

    @property
    def rollback_index(self) -> int:
        return self.spec.rollback_index

    def iter_member(self, fh: IO[bytes], m: Member) -> Iterator[bytes]:
        fh.seek(m.offset)
        left = m.size
        while left:
            chunk = fh.read(min(_CHUNK, left))
            if not chunk:
                raise ImageError(
                    f"{self.path} changed while being read", hint="do not modify the image while flashing"
                )
            left -= len(chunk)
            yield chunk


# --------------------------------------------------------------------------- build


def _reference(
    art: ArtifactInfo, directory: Path
) -> tuple[dict[str, np.ndarray], dict[str, np.ndarray]] | None:
    """A deterministic input and the artifact's own output for it (None: no runtime for this arch here)."""
    from compiler.targets import host_arch

    rng = np.random.default_rng(0)
    inputs = {}
    for spec in art.inputs:
        dtype = np.dtype(spec["dtype"])
        shape = tuple(int(s) for s in spec["shape"])
        if dtype.kind == "f":
            inputs[spec["name"]] = rng.random(shape).astype(dtype)
        else:
            inputs[spec["name"]] = np.zeros(shape, dtype)
    if art.arch == host_arch():
        from compiler.artifact import load_artifact

        return inputs, load_artifact(directory).infer(inputs)
    if art.arch == "aarch64" or art.runtime == "c":  # a C artifact: its own runner under qemu-user
        from compiler.emulate import run_emulated

        return inputs, run_emulated(directory, inputs)
    return None  # no way to run this artifact here: the health check is readiness only


def _npy(arrays: dict[str, np.ndarray]) -> bytes:
    import io

    buf = io.BytesIO()
    np.savez(buf, **arrays)  # type: ignore[arg-type]  # numpy stubs type **kwds badly
    return buf.getvalue()


def build_image(
    artifact_dir: str | Path,
    *,
    board: str,
    key: str | Path,
    out: str | Path,
    version: str,
    rollback_index: int = 0,
    add_keys: list[str | Path] = (),  # type: ignore[assignment]
    reference: tuple[dict[str, np.ndarray], dict[str, np.ndarray]] | None = None,
) -> Path:
    """Build and sign an image of ``artifact_dir`` for ``board``; refuses artifacts the board cannot run.

    ``reference`` overrides the health-check input/expected output (tests build failing images with it).
    """
    artifact_dir = Path(artifact_dir)
    b = get_board(board)
    parse_version(version)
    if not 0 <= rollback_index < 1 << 31:
        raise ImageError(f"rollback index {rollback_index} is out of range", hint="use 0 <= index < 2**31")
    priv = keymod.load_private(key)
    new_keys = [keymod.public_pem(keymod.load_public(p)).decode() for p in add_keys]
    art = artifact_info(artifact_dir)
    if not b.accepts(art.preset) or art.arch != b.arch:
        raise ImageError(
            f"the artifact is compiled for {art.preset} ({art.arch}); board {b.name} ({b.arch}) "
            f"runs only {b.name} or {b.arch} artifacts",
            hint=f"recompile with `fractal compile --target {b.name}` or choose a matching --board",
        )
    missing = sorted(f for f in art.libraries.values() if f not in art.files)
    if missing:  # the image must carry what the board runs (library, runner), checked like every file
        raise ImageError(f"the artifact's manifest names {', '.join(missing)} but lists no sha256 for it",
                         hint="recompile the artifact")
    files: list[tuple[str, bytes | Path]] = [("artifact/manifest.json", artifact_dir / "manifest.json")]
    for rel in sorted(art.files):
        if not member_name_ok(rel):
            raise ImageError(
                f"artifact file name {rel!r} is not allowed in an image", hint="recompile the artifact"
            )
        files.append((f"artifact/{rel}", artifact_dir / rel))
    ref = reference if reference is not None else _reference(art, artifact_dir)
    if ref is not None:
        files += [("health/input.npz", _npy(ref[0])), ("health/expected.npz", _npy(ref[1]))]
    files.append((NODE_TEMPLATE_MEMBER, NODE_TEMPLATE.encode()))

    # The runners are programs the board starts: their members say so (signed like the rest), and
    # flashing gives them mode 0755. Readers before this key ignore it.
    runners = {f"artifact/{art.libraries[r]}" for r in ("runner", "train_runner") if r in art.libraries}
    members = []
    for name, src in files:
        data_sha, size = _digest(src)
        members.append({"name": name, "size": size, "sha256": data_sha, **({"exec": True} if name in runners
                                                                            else {})})
    manifest = {
        "format": "fractal-image",
        "format_version": IMAGE_FORMAT,
        "board": b.name,
        "arch": b.arch,
        "version": version,
        "rollback_index": rollback_index,
        "created": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "signer": keymod.key_id(priv.public_key()),
        "artifact": art.manifest,
        "artifact_name": art.name,
        "artifact_preset": art.preset,
        "node_template": NODE_TEMPLATE_MEMBER,
        "runtime": _runtime(art, b.arch),
        "health": {
            "ready": "/v2/health/ready",
            "model": art.name,
            "input": "health/input.npz" if ref else None,
            "expected": "health/expected.npz" if ref else None,
            "atol": HEALTH_ATOL,
        },
        "trust": {"add_keys": new_keys},
        "members": members,
    }
    mbytes = json.dumps(manifest, sort_keys=True, separators=(",", ":")).encode()
    if len(mbytes) > MAX_MANIFEST:
        raise ImageError(
            "the image manifest is too large", hint="the artifact manifest must stay under 1 MiB"
        )
    sig = keymod.sign(priv, mbytes)
    out = Path(out)
    with atomic_open(out) as fh:
        fh.write(_HEADER.pack(MAGIC, len(mbytes), len(sig)))
        fh.write(mbytes)
        fh.write(sig)
        for _name, src in files:
            if isinstance(src, bytes):
                fh.write(src)
            else:
                with open(src, "rb") as sf:
                    while chunk := sf.read(_CHUNK):
                        fh.write(chunk)
    return out


def _digest(src: bytes | Path) -> tuple[str, int]:
    if isinstance(src, bytes):
        return hashlib.sha256(src).hexdigest(), len(src)
    h = hashlib.sha256()
    size = 0
    with open(src, "rb") as fh:
        while chunk := fh.read(_CHUNK):
            h.update(chunk)
            size += len(chunk)
    return h.hexdigest(), size


# --------------------------------------------------------------------------- read


def _not_image(path: Path, why: str) -> ImageError:
    return ImageError(
        f"{path} is not a fractal device image ({why})", hint="pass a file written by `fractal image build`"
    )


def read_unverified(path: str | Path) -> tuple[dict[str, Any], bytes, bytes, int]:
    """Header, manifest and signature WITHOUT checking the signature (for ``image info`` only)."""
    path = Path(path)
    if not path.is_file() or path.is_symlink():
        raise ImageError(
            f"image {str(path)!r} does not exist or is not a regular file",
            hint="pass the path of a file written by `fractal image build`",
        )
    size = path.stat().st_size
    with open(path, "rb") as fh:
        head = fh.read(_HEADER.size)
        if len(head) < _HEADER.size:
            raise _not_image(path, "too short")
        magic, mlen, slen = _HEADER.unpack(head)
        if magic != MAGIC:
            raise _not_image(path, "bad magic")
        if not 0 < mlen <= MAX_MANIFEST or slen != SIG_LEN:
            raise _not_image(path, "bad header lengths")
        mbytes = fh.read(mlen)
        sig = fh.read(slen)
    if len(mbytes) != mlen or len(sig) != slen:
        raise ImageError(
            f"{path} is truncated (the manifest or signature is cut off)",
            hint="copy the image again; the download or copy was incomplete",
        )
    try:
        manifest = json.loads(mbytes)
    except ValueError:
        raise ImageError(f"{path} has a corrupt manifest", hint="rebuild or re-copy the image") from None
    if not isinstance(manifest, dict):
        raise ImageError(f"{path} has a corrupt manifest", hint="rebuild or re-copy the image")
    return manifest, mbytes, sig, size


def _members(spec: ImageManifest) -> tuple[Member, ...]:
    """The members with their offsets relative to the first one (open_image adds the header size)."""
    out, offset = [], 0
    for m in spec.members:
        out.append(Member(m.name, m.size, m.sha256, offset, m.executable))
        offset += m.size
    return tuple(out)


def open_image(path: str | Path, trusted: list[Ed25519PublicKey]) -> Image:
    """Fully verify the image at ``path`` against ``trusted`` keys: size, signature, schema, every member."""
    path = Path(path)
    manifest, mbytes, sig, size = read_unverified(path)
    spec = parse_manifest(manifest, str(path))  # the whole manifest first: sizes decide truncation
    members = _members(spec)
    base = _HEADER.size + len(mbytes) + len(sig)
    total = base + sum(m.size for m in members)
    if total > MAX_IMAGE:
        raise ImageError(f"{path} is larger than {MAX_IMAGE >> 30} GiB", hint="images are limited to 4 GiB")
    if size < total:
        raise ImageError(
            f"{path} is truncated ({size} of {total} bytes)",
            hint="copy the image again; the download or copy was incomplete",
        )
    if size > total:
        raise ImageError(
            f"{path} has {size - total} unexpected trailing bytes", hint="rebuild or re-copy the image"
        )
    signer = keymod.verify_with(trusted, mbytes, sig)
    members = tuple(replace(m, offset=base + m.offset) for m in members)
    img = Image(path, spec, mbytes, sig, keymod.key_id(signer), members)
    with open(path, "rb") as fh:
        for m in members:
            h = hashlib.sha256()
            for chunk in img.iter_member(fh, m):
                h.update(chunk)
            if h.hexdigest() != m.sha256:
                raise ImageError(
                    f"image member {m.name!r} fails its sha256 check (tampered or corrupt)",
                    hint="do not flash it; rebuild or re-download the image",
                )
    return img


def load_trusted(paths: list[str | Path]) -> list[Ed25519PublicKey]:
    if not paths:
        raise FirmwareError("no public key given", hint="pass --pubkey KEY.pub")
    return [keymod.load_public(p) for p in paths]
