"""The image manifest as one typed, validated object: :func:`parse_manifest` is its only reader.

Every field a board acts on is checked here, before anything is written (flash) or run (boot):
the format, board and arch, the semantic version, the anti-rollback index (``0 <= i < 2**31``,
the range ``fractal image build`` accepts), the members (safe relative names, no duplicates,
no member that is also another member's folder, none that shadows the slot's own
``image.manifest.json`` / ``image.sig``, bounded sizes, sha256 digests), the health check (its
input and expected output are members of the image, never another path), and the keys the
image asks the device to trust (ed25519 PEM public keys). A manifest that fails any of these is
an :class:`ImageError` naming the field, whoever signed it.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass
from typing import Any

from firmware import keys as keymod
from firmware.boards import get_board
from firmware.errors import FirmwareError, ImageError

__all__ = [
    "IMAGE_FORMAT",
    "MAX_MEMBERS",
    "MAX_MEMBER",
    "MAX_ADD_KEYS",
    "MAX_ROLLBACK_INDEX",
    "NODE_TEMPLATE_MEMBER",
    "RESERVED_NAMES",
    "HealthSpec",
    "ImageManifest",
    "MemberSpec",
    "member_name_ok",
    "parse_manifest",
    "parse_version",
]

IMAGE_FORMAT = 1
MAX_MEMBERS = 256
MAX_MEMBER = 2 << 30
MAX_ADD_KEYS = 16
MAX_ROLLBACK_INDEX = (1 << 31) - 1
NODE_TEMPLATE_MEMBER = "node.toml.in"
# Written into a slot beside the members (firmware.device): no member may take their place.
RESERVED_NAMES = frozenset({"image.manifest.json", "image.sig"})
_NAME = re.compile(r"[A-Za-z0-9_][A-Za-z0-9_.+-]{0,99}")
_SEMVER = re.compile(r"(0|[1-9]\d{0,8})\.(0|[1-9]\d{0,8})\.(0|[1-9]\d{0,8})(?:-([0-9A-Za-z.-]{1,40}))?")
_SHA256 = re.compile(r"[0-9a-f]{64}")
_CRAFTED = "the image was crafted or corrupted; do not flash it (rebuild it with `fractal image build`)"


def parse_version(text: str) -> tuple[int, int, int, int, str]:
    """Sort key of a semantic version ``MAJOR.MINOR.PATCH[-PRE]`` (a release sorts after its pre-releases)."""
    m = _SEMVER.fullmatch(text) if isinstance(text, str) else None
    if m is None:
        raise ImageError(f"{text!r} is not a semantic version", hint="use MAJOR.MINOR.PATCH, e.g. 1.2.0")
    return int(m[1]), int(m[2]), int(m[3]), 0 if m[4] else 1, m[4] or ""


def member_name_ok(name: object) -> bool:
    """Relative POSIX path of safe components: no '..', no absolute path, no hidden files, no backslash."""
    if not isinstance(name, str) or not 0 < len(name) <= 200:
        return False
    return all(_NAME.fullmatch(part) for part in name.split("/"))


@dataclass(frozen=True)
class MemberSpec:
    name: str
    size: int
    sha256: str
    executable: bool = False  # flashed with mode 0755 (a C artifact's runners), else 0644


@dataclass(frozen=True)
class HealthSpec:
    """The boot health check: readiness, then (when ``input`` is set) one reference inference."""

    model: str
    input: str | None
    expected: str | None
    atol: float


@dataclass(frozen=True)
class ImageManifest:
    """What a board acts on, validated; ``raw`` keeps the whole signed JSON object (``image info``,
    the artifact's own manifest)."""

    board: str
    arch: str
    version: str
    rollback_index: int
    artifact_name: str
    members: tuple[MemberSpec, ...]
    health: HealthSpec
    add_keys: tuple[str, ...]  # PEM public keys the device trusts once this image booted good
    raw: dict[str, Any]


class _Check:
    def __init__(self, source: str) -> None:
        self.source = source

    def bad(self, what: str, hint: str = _CRAFTED) -> ImageError:
        return ImageError(f"{self.source} has an invalid manifest: {what}", hint=hint)

    def field(self, m: dict[str, Any], key: str, kind: type) -> Any:
        v = m.get(key)
        if not isinstance(v, kind) or isinstance(v, bool) and kind is not bool:
            raise self.bad(f"{key!r} must be a {kind.__name__}")
        return v


def _members(c: _Check, raw: object) -> tuple[MemberSpec, ...]:
    if not isinstance(raw, list) or not 0 < len(raw) <= MAX_MEMBERS:
        raise c.bad(f"'members' must be a list of 1 to {MAX_MEMBERS} entries")
    out: list[MemberSpec] = []
    names: set[str] = set()
    for e in raw:
        if not isinstance(e, dict):
            raise c.bad("each member must be an object")
        name, size, digest, executable = e.get("name"), e.get("size"), e.get("sha256"), e.get("exec", False)
        if not isinstance(name, str) or not member_name_ok(name):
            raise ImageError(f"{c.source} lists an unsafe member name {name!r}", hint=_CRAFTED)
        if name.lower() in RESERVED_NAMES:
            raise ImageError(f"{c.source} lists a member {name!r} that would replace the slot's own file",
                             hint=_CRAFTED)
        if name.lower() in names:
            raise c.bad(f"member {name!r} is listed twice")
        if not isinstance(size, int) or isinstance(size, bool) or not 0 <= size <= MAX_MEMBER:
            raise c.bad(f"member {name!r} has size {size!r}, expected 0..{MAX_MEMBER}")
        if not isinstance(digest, str) or not _SHA256.fullmatch(digest):
            raise c.bad(f"member {name!r} has no sha256 of 64 lowercase hex digits")
        if not isinstance(executable, bool):
            raise c.bad(f"member {name!r}: 'exec' must be true or false")
        names.add(name.lower())
        out.append(MemberSpec(name, size, digest, executable))
    folders = {"/".join(parts[:i]) for parts in (n.split("/") for n in names) for i in range(1, len(parts))}
    clash = sorted(names & folders)
    if clash:  # a file and a folder of the same path cannot both be written
        raise c.bad(f"member {clash[0]!r} is both a file and the folder of other members")
    return tuple(out)


def _health(c: _Check, raw: object, members: dict[str, MemberSpec]) -> HealthSpec:
    if not isinstance(raw, dict):
        raise c.bad("'health' must be an object")
    model = raw.get("model")
    if not isinstance(model, str) or not 0 < len(model) <= 200 or not model.isprintable():
        raise c.bad("health.model must be the model's name")
    files: list[str | None] = []
    for key in ("input", "expected"):
        v = raw.get(key)
        if v is not None and (not isinstance(v, str) or v not in members or not v.endswith(".npz")):
            raise c.bad(f"health.{key} {v!r} is not an .npz member of the image")
        files.append(v)
    if (files[0] is None) != (files[1] is None):
        raise c.bad("health.input and health.expected go together")
    atol = raw.get("atol", 1e-4)
    number = isinstance(atol, (int, float)) and not isinstance(atol, bool)
    if not number or not (math.isfinite(atol) and atol >= 0):
        raise c.bad(f"health.atol {atol!r} must be a finite number >= 0")
    return HealthSpec(model, files[0], files[1], float(atol))


def _add_keys(c: _Check, trust: object) -> tuple[str, ...]:
    if not isinstance(trust, dict):
        raise c.bad("'trust' must be an object")
    keys = trust.get("add_keys", [])
    if not isinstance(keys, list) or len(keys) > MAX_ADD_KEYS:
        raise c.bad(f"trust.add_keys must be a list of at most {MAX_ADD_KEYS} PEM public keys")
    for i, pem in enumerate(keys):
        if not isinstance(pem, str):
            raise c.bad(f"trust.add_keys[{i}] is not a PEM public key")
        try:
            keymod.public_from_pem(pem.encode(), f"trust.add_keys[{i}]")
        except FirmwareError as exc:
            raise c.bad(str(exc)) from None
    return tuple(keys)


def parse_manifest(raw: object, source: str) -> ImageManifest:
    """The validated manifest of ``raw`` (a parsed JSON value); ImageError naming the first problem."""
    c = _Check(source)
    if not isinstance(raw, dict):
        raise c.bad("not a JSON object")
    if raw.get("format") != "fractal-image" or raw.get("format_version") != IMAGE_FORMAT:
        raise ImageError(
            f"{source} has image format {raw.get('format_version')!r}, this build reads {IMAGE_FORMAT}",
            hint="rebuild the image with this version of fractal",
        )
    board = c.field(raw, "board", str)
    arch = c.field(raw, "arch", str)
    version = c.field(raw, "version", str)
    parse_version(version)
    b = get_board(board)
    if arch != b.arch:
        raise c.bad(f"arch {arch!r} is not board {b.name}'s ({b.arch})")
    index = raw.get("rollback_index")
    if not isinstance(index, int) or isinstance(index, bool) or not 0 <= index <= MAX_ROLLBACK_INDEX:
        raise c.bad(f"rollback_index {index!r} is not an integer in 0..{MAX_ROLLBACK_INDEX}")
    c.field(raw, "artifact", dict)
    artifact_name = c.field(raw, "artifact_name", str)
    members = _members(c, raw.get("members"))
    by_name = {m.name: m for m in members}
    template = raw.get("node_template", NODE_TEMPLATE_MEMBER)
    if template != NODE_TEMPLATE_MEMBER or NODE_TEMPLATE_MEMBER not in by_name:
        raise c.bad(f"the image carries no {NODE_TEMPLATE_MEMBER} node template")
    health = _health(c, raw.get("health"), by_name)
    add_keys = _add_keys(c, raw.get("trust"))
    return ImageManifest(board, arch, version, index, artifact_name, members, health, add_keys, raw)
