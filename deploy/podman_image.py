"""The compose file's image for Podman, built from pinned Debian packages (no registry needed).

``docker compose`` builds ``fractal-edge:latest`` from ``deploy/Dockerfile`` (python:3.11 from a
registry, pip, TVM). Where no registry is reachable, this module makes the same image name from
the x86_64 board image's root filesystem instead (:mod:`firmware.osimage.rootfs`: Debian trixie's
python3.13 and the node's Python dependencies as Debian packages, the project's code, bytecode
compiled at build time), plus Debian's Mosquitto (``deploy/compose/trixie-amd64-broker.lock``) so
the broker service runs from the same image, Debian's PostgreSQL 17 server and client and psycopg
(``deploy/compose/trixie-amd64-postgres.lock``) for the ``postgres`` service and the fleet's store,
and the demo model compiled for ``x86_64-c`` (the C backend: the nodes need no TVM, as on a board).
The tree becomes an image through ``podman import``; ``deploy/compose/podman.yml`` points the
compose services at it.

The image carries a label with the hash of every input (both locks, the project's sources, the
artifact's settings): a rebuild with the same inputs is skipped, so reruns cost one
``podman image inspect``. The compiled artifact is cached under ``.cache/compose`` by the hash of
the compiler's sources.

    python -m deploy.podman_image [--tag fractal-edge:latest] [--force]
"""

from __future__ import annotations

import argparse
import contextlib
import hashlib
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from deploy.errors import DeployError

__all__ = ["TAG", "PG_BIN", "CONTAINERS_CONF", "build_image", "inputs_key", "podman_env", "main"]

REPO = Path(__file__).resolve().parents[1]
TAG = "localhost/fractal-edge:latest"  # what `fractal-edge:latest` in docker-compose.yml resolves to
BROKER_LOCK = REPO / "deploy" / "compose" / "trixie-amd64-broker.lock"
POSTGRES_LOCK = REPO / "deploy" / "compose" / "trixie-amd64-postgres.lock"
PG_BIN = "/usr/lib/postgresql/17/bin"  # initdb, postgres, psql, pg_isready (Debian keeps them per major)
PG_DATA = "var/lib/postgresql/data"  # the postgres service's volume (PGDATA, as in Docker's postgres:17)
POSTGRES_UID = 102
# runc (crun fails on hybrid cgroup v1 hosts) and no default ulimits (raising RLIMIT_NOFILE is refused
# in unprivileged-in-VM setups); passed as CONTAINERS_CONF unless the caller set one
CONTAINERS_CONF = REPO / "deploy" / "compose" / "containers.conf"
LABEL = "org.fractal-edge.inputs"
ARTIFACT = "/opt/fractal/artifacts/digits-mlp"
# what the compose services mount their named volumes on (deploy/compose/node-*.toml)
DATA_DIRS = ("var/lib/fractal/node-1", "var/lib/fractal/node-2", "var/lib/fractal/node-3")
ENV = {
    "PATH": f"/usr/sbin:/usr/bin:{PG_BIN}",
    "LANG": "C.UTF-8",
    "PYTHONPATH": "/opt/fractal",
    "PYTHONNOUSERSITE": "1",
    "PYTHONUNBUFFERED": "1",
    "PYTHONDONTWRITEBYTECODE": "1",  # compiled at build time (rootfs.compile_bytecode)
    "CRYPTOGRAPHY_OPENSSL_NO_LEGACY": "1",  # trixie's legacy provider is a package the image lacks
}
# `fractal` as the compose file's commands call it (the board image runs the same entry point)
FRACTAL_SH = '#!/bin/sh\nexec python3 -c "from api.cli import main; main()" "$@"\n'


def podman_env() -> dict[str, str]:
    """The environment to run ``podman``/``podman-compose`` with: the project's containers.conf
    unless the caller chose one."""
    env = dict(os.environ)
    env.setdefault("CONTAINERS_CONF", str(CONTAINERS_CONF))
    return env


def _podman(*args: str, stdin: Path | None = None, check: bool = True) -> subprocess.CompletedProcess[str]:
    try:
        with stdin.open("rb") if stdin is not None else contextlib.nullcontext() as f:
            res = subprocess.run(["podman", *args], stdin=f, capture_output=True, text=True, errors="replace",
                                 env=podman_env(), check=False)
    except FileNotFoundError:
        raise DeployError("podman is not installed", hint="run deploy/install-system-deps.sh") from None
    if check and res.returncode != 0:
        raise DeployError(f"podman {args[0]} failed: {res.stderr.strip()[-300:]}")
    return res


def _hash_tree(h: hashlib._Hash, root: Path) -> None:
    for p in sorted(root.rglob("*")):
        if p.is_file() and "__pycache__" not in p.parts and p.suffix not in (".pyc", ".so", ".o"):
            h.update(str(p.relative_to(REPO)).encode() + b"\0" + p.read_bytes() + b"\0")


def inputs_key() -> str:
    """sha256 over everything the image is made from: a change in any of them rebuilds it."""
    from firmware.osimage import rootfs
    from firmware.osimage.boards import get_os_board

    h = hashlib.sha256(b"fractal-edge podman image 1\n")
    h.update(get_os_board("x86_64").lock.read_bytes())
    h.update(BROKER_LOCK.read_bytes())
    h.update(POSTGRES_LOCK.read_bytes())
    h.update(Path(__file__).read_bytes())
    for pkg in rootfs.NODE_PACKAGES:
        _hash_tree(h, REPO / pkg)
    return h.hexdigest()[:32]


def image_key(tag: str = TAG) -> str | None:
    """The inputs label of the image ``tag`` (None when there is no such image)."""
    r = _podman("image", "inspect", "--format", f'{{{{index .Labels "{LABEL}"}}}}', tag, check=False)
    return r.stdout.strip() if r.returncode == 0 else None


def _artifact() -> Path:
    """digits-mlp for x86_64-c with the Dockerfile's training settings, cached by the compiler's hash."""
    h = hashlib.sha256(b"digits-mlp x86_64-c ce sgd 0.1 32\n")
    _hash_tree(h, REPO / "compiler")
    out = REPO / ".cache" / "compose" / f"digits-mlp-c-{h.hexdigest()[:16]}"
    if (out / "manifest.json").is_file():
        return out
    from compiler import TrainSettings, compile_model, zoo

    with tempfile.TemporaryDirectory() as tmp:
        onnx = zoo.save("digits-mlp", Path(tmp) / "digits-mlp.onnx")
        staged = Path(tmp) / "art"
        compile_model(onnx, target="x86_64-c", out_dir=staged, progress=False,
                      train=TrainSettings(loss="ce", optimizer="sgd", lr=0.1, batch=32))
        out.parent.mkdir(parents=True, exist_ok=True)
        shutil.rmtree(out, ignore_errors=True)
        shutil.copytree(staged, out)
    return out


def _rootfs(root: Path) -> None:
    from firmware import debs
    from firmware.osimage import rootfs
    from firmware.osimage.boards import get_os_board

    board = get_os_board("x86_64")
    names = {*rootfs.PACKAGES, *board.extra_packages}
    pins = [p for p in debs.read_lock(board.lock) if p.package in names]
    extra = debs.read_lock(BROKER_LOCK) + debs.read_lock(POSTGRES_LOCK)
    cache = rootfs.cache_dir() / "debs" / f"{board.suite}-{board.debarch}"
    try:
        files = debs.fetch(pins + extra, rootfs.MIRROR, cache)
    except debs.DebsError as exc:
        raise DeployError(f"Debian packages for the compose image: {exc}", hint="check the network, or "
                          "regenerate the lock if Debian removed a pinned version") from None
    by_name = {p.package: f for p, f in zip(pins + extra, files, strict=True)}
    rootfs.make_rootfs(board, by_name, root)  # the board's tree, then what a container differs in
    for pin in extra:
        rootfs.unpack(by_name[pin.package], root)
    # the broker's and PostgreSQL's docs (make_rootfs dropped the others'), and PostgreSQL's JIT:
    # LLVM is 100 MB more and a fleet's queries are far too small for it (the server runs jit=off)
    pg_lib = root / PG_BIN.lstrip("/") / ".." / "lib"
    for tree in (root / "usr/share/doc", root / "usr/share/man", pg_lib / "bitcode",
                 root / "usr/share/postgresql/17/man"):
        shutil.rmtree(tree, ignore_errors=True)
    for so in pg_lib.glob("llvmjit*"):
        so.unlink()
    etc = root / "etc"
    (etc / "passwd").write_text("root:x:0:0:root:/root:/bin/sh\n"
                                "mosquitto:x:101:101::/var/lib/mosquitto:/bin/false\n"
                                f"postgres:x:{POSTGRES_UID}:{POSTGRES_UID}::/var/lib/postgresql:/bin/sh\n")
    (etc / "group").write_text(f"root:x:0:\nmosquitto:x:101:\npostgres:x:{POSTGRES_UID}:\n")
    for name in ("resolv.conf", "hostname", "hosts"):  # podman bind-mounts its own over these
        (etc / name).unlink()
        (etc / name).write_text("")
    (root / "root").mkdir(exist_ok=True)
    for d in ("var/lib/mosquitto", "mosquitto/config", *DATA_DIRS):
        (root / d).mkdir(parents=True, exist_ok=True)
    # PostgreSQL refuses to run as root: its data and socket directories belong to postgres (a
    # fresh named volume mounted on PG_DATA takes this owner, as Docker's does)
    for d in (PG_DATA, "run/postgresql"):
        (root / d).mkdir(parents=True, exist_ok=True)
        (root / d).chmod(0o700 if d == PG_DATA else 0o2775)
    for d in ("var/lib/postgresql", PG_DATA, "run/postgresql"):
        os.chown(root / d, POSTGRES_UID, POSTGRES_UID)
    # libpq's default socket directory (pg_isready in the compose file's healthcheck, psql)
    (root / "var/run").symlink_to("/run")
    (root / "var/tmp").unlink()
    (root / "var/tmp").mkdir()
    fractal = root / "usr/bin/fractal"
    fractal.write_text(FRACTAL_SH)
    fractal.chmod(0o755)
    shutil.copytree(_artifact(), root / ARTIFACT.lstrip("/"))


def build_image(tag: str = TAG, *, force: bool = False) -> tuple[bool, float]:
    """Build and tag the image unless one with the same inputs exists: (built, seconds)."""
    t0 = time.monotonic()
    key = inputs_key()
    if not force and image_key(tag) == key:
        return False, time.monotonic() - t0
    old = _podman("image", "inspect", "--format", "{{.Id}}", tag, check=False).stdout.strip()
    with tempfile.TemporaryDirectory(prefix="fractal-podman-") as tmp:
        root = Path(tmp) / "root"
        root.mkdir()
        _rootfs(root)
        tar = Path(tmp) / "rootfs.tar"
        r = subprocess.run(["tar", "-C", str(root), "--numeric-owner", "-cf", str(tar), "."],
                           capture_output=True, text=True, check=False)
        if r.returncode != 0:
            raise DeployError(f"tar of the root filesystem failed: {r.stderr.strip()[-300:]}")
        changes = [f"ENV {k}={v}" for k, v in ENV.items()]
        changes += [f"LABEL {LABEL}={key}", "WORKDIR /opt/fractal", 'CMD ["fractal", "--help"]']
        args = ["import", "--quiet"]
        for c in changes:
            args += ["--change", c]
        new = _podman(*args, "-", tag, stdin=tar).stdout.strip()
    if old and not new.endswith(old) and not old.endswith(new):
        # the previous build, now untagged: 160 MB per rebuild otherwise (kept if a container uses it)
        _podman("rmi", old, check=False)
    return True, time.monotonic() - t0


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m deploy.podman_image", description=__doc__.splitlines()[0])
    ap.add_argument("--tag", default=TAG)
    ap.add_argument("--force", action="store_true", help="rebuild even when the inputs did not change")
    a = ap.parse_args(argv)
    try:
        built, secs = build_image(a.tag, force=a.force)
    except DeployError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    print(f"{a.tag}: {'built' if built else 'up to date'} in {secs:.1f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
