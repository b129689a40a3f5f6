#!/usr/bin/env bash
# Build a foreign-arch Python 3.11 sysroot for qemu-user: Debian packages unpacked with
# `dpkg -x` (no chroot, no binfmt_misc) plus the PyPI wheels of apache-tvm, apache-tvm-ffi and
# numpy for that arch, unzipped into DEST/wheels. compiler/emulate.py then runs
#   qemu-aarch64 -L DEST DEST/usr/bin/python3.11 -m compiler.runner ...
# with PYTHONPATH=DEST/wheels:REPO.
#
# usage: bash firmware/sysroot.sh ARCH DEST        (ARCH: aarch64 or riscv64)
#
# riscv64: PyPI has no riscv64 TVM wheel and needs none: riscv64 artifacts are C-backend libraries
# loaded with ctypes (compiler/clib.py). The sysroot is Debian trixie riscv64 (python3.13 and
# python3-numpy as Debian packages), fetched with a private apt configuration under
# DEST/.apt (the host's apt sources and dpkg architectures are left untouched; no root needed).
# Idempotent: a finished sysroot has DEST/.done and is left alone. Needs root (or sudo) once
# for `dpkg --add-architecture` + `apt-get update`; downloads go to DEST/.debs and DEST/.wheels.
set -euo pipefail

ARCH=${1:?usage: sysroot.sh ARCH DEST}
DEST=${2:?usage: sysroot.sh ARCH DEST}
REPO=$(cd "$(dirname "$0")/.." && pwd)
PIP=${PIP:-"$REPO/.venv/bin/pip"}
[ -x "$PIP" ] || PIP="python3 -m pip"

case "$ARCH" in
  aarch64) DEBARCH=arm64; WHEELPLAT=(manylinux_2_28_aarch64 manylinux_2_17_aarch64 manylinux2014_aarch64) ;;
  riscv64) DEBARCH=riscv64 ;;
  *) echo "sysroot.sh: unsupported arch '$ARCH' (aarch64 or riscv64)" >&2; exit 2 ;;
esac

# .done records the hash of this script and the arch's lock file: a changed recipe rebuilds, an unchanged one is a no-op
# (touching .done so make sees it newer than the script).
LOCK="$REPO/firmware/sysroot-$ARCH.lock"
RECIPE=("$0"); [ -f "$LOCK" ] && RECIPE+=("$LOCK")
STAMP="recipe $(cat "${RECIPE[@]}" | sha256sum | cut -c1-16)"
if [ -f "$DEST/.done" ]; then
  if grep -qx "$STAMP" "$DEST/.done"; then
    touch "$DEST/.done"
    echo "sysroot $ARCH: already built in $DEST"
    exit 0
  fi
  echo "sysroot $ARCH: recipe changed, rebuilding $DEST"
  rm -rf "$DEST"
fi

if [ "$ARCH" = riscv64 ]; then
  # Python 3.13 + numpy (reference BLAS/LAPACK) and the libraries they link, from Debian trixie.
  RV_DEBS=(
    python3.13-minimal libpython3.13-minimal libpython3.13-stdlib python3-numpy
    libc6 libgcc-s1 libstdc++6 libgfortran5 libblas3 liblapack3 zlib1g libffi8 libexpat1 libssl3t64
    libbz2-1.0 liblzma5 libzstd1 libsqlite3-0 libuuid1 libncursesw6 libtinfo6 libreadline8t64
    libdb5.3t64 libmpdec4 media-types tzdata
    # the node (`fractal node`): its Python dependencies as Debian packages, closure from
    # `apt-cache depends --recurse` (zlib-ng and amqtt are optional imports and not packaged)
    libuv1t64 python3-annotated-types python3-anyio python3-bcrypt python3-certifi python3-cffi-backend
    python3-click python3-cryptography python3-decorator python3-dnspython python3-dotenv
    python3-email-validator python3-exceptiongroup python3-fastapi python3-h11 python3-httpcore
    python3-httpx python3-idna python3-linkify-it python3-markdown-it python3-mdurl python3-paho-mqtt
    python3-platformdirs python3-prometheus-client python3-pydantic python3-pydantic-core
    python3-pydantic-settings python3-pygments python3-rich python3-shellingham python3-sniffio
    python3-starlette python3-typer python3-typing-extensions python3-uc-micro python3-uvicorn
    python3-uvloop python3-wsproto python3-multipart
  )
  mkdir -p "$DEST/.apt/lists/partial" "$DEST/.apt/cache/archives/partial" "$DEST/.debs"
  DEST=$(cd "$DEST" && pwd)
  A="$DEST/.apt"
  echo "deb [arch=riscv64 signed-by=/usr/share/keyrings/debian-archive-keyring.gpg] http://deb.debian.org/debian trixie main" > "$A/sources.list"
  : > "$A/status"
  APTOPTS=(-o "Dir::Etc::SourceList=$A/sources.list" -o Dir::Etc::SourceParts=/nonexistent
           -o "Dir::State::Lists=$A/lists" -o "Dir::Cache=$A/cache" -o "Dir::State::Status=$A/status"
           -o APT::Architecture=riscv64 -o APT::Architectures::=riscv64)
  # First the pinned files (firmware/sysroot-riscv64.lock: pool path, size, sha256 of each
  # package; no index needed, so a mirror mid-sync cannot break the build). A pin Debian has
  # since removed from the pool falls back to apt's index, retried a few times.
  echo "sysroot riscv64: fetching ${#RV_DEBS[@]} pinned Debian riscv64 packages ($LOCK)"
  if ! python3 "$REPO/firmware/debs.py" fetch --lock "$LOCK" --dest "$DEST/.debs" \
      --packages "${RV_DEBS[@]}"; then
    echo "sysroot riscv64: pinned download failed, falling back to apt (trixie riscv64, private lists in $A)"
    rm -f "$DEST"/.debs/*.deb
    ok=0
    for attempt in 1 2 3; do
      if apt-get "${APTOPTS[@]}" update -qq; then ok=1; break; fi
      echo "sysroot riscv64: apt update failed (attempt $attempt of 3)" >&2
      sleep $((attempt * 20))  # back-off for a mirror that is mid-sync
    done
    [ "$ok" = 1 ] || { echo "sysroot riscv64: error: Debian trixie riscv64 index unavailable" >&2; exit 1; }
    ( cd "$DEST/.debs" && apt-get "${APTOPTS[@]}" download -qq "${RV_DEBS[@]}" )
  fi
  for deb in "$DEST"/.debs/*.deb; do
    dpkg -x "$deb" "$DEST"
  done
  # dpkg -x runs no maintainer scripts: make the links update-alternatives would have made.
  ML="$DEST/usr/lib/riscv64-linux-gnu"
  ln -sf blas/libblas.so.3 "$ML/libblas.so.3"
  ln -sf lapack/liblapack.so.3 "$ML/liblapack.so.3"
  ln -sf python3.13 "$DEST/usr/bin/python3"
  # trixie is merged-/usr and base-files (not unpacked) owns the /lib -> usr/lib link
  [ -e "$DEST/lib" ] || ln -s usr/lib "$DEST/lib"
  if command -v qemu-riscv64 >/dev/null 2>&1; then
    # bytecode into DEST/.pycache (even where PYTHONDONTWRITEBYTECODE is set, as in CI), where
    # compiler/emulate.py and deploy/riscvnode.py look for it: the first emulated run of the tests
    # then does not compile numpy, fastapi, ... again (~17 s of CPU under qemu)
    env -u PYTHONDONTWRITEBYTECODE PYTHONPYCACHEPREFIX="$DEST/.pycache" qemu-riscv64 -L "$DEST" "$DEST/usr/bin/python3.13" -c \
      "import numpy, ctypes, fastapi, uvicorn, pydantic; print('sysroot ok: numpy', numpy.__version__)"
  else
    echo "sysroot riscv64: warning: qemu-riscv64 not installed, skipped the smoke test" >&2
  fi
  rm -rf "$DEST/.debs" "$A"
  { echo "$STAMP"; date -u +%FT%TZ; } > "$DEST/.done"
  echo "sysroot riscv64: done in $DEST"
  exit 0
fi

# Python 3.11 and the shared libraries it, its stdlib extensions, numpy and libtvm link against.
DEBS=(
  python3.11-minimal libpython3.11-minimal libpython3.11-stdlib
  libc6 libstdc++6 libgcc-s1 zlib1g libffi8 libexpat1 libssl3
  libbz2-1.0 liblzma5 libcrypt1 libuuid1 libsqlite3-0 libzstd1
  libncursesw6 libtinfo6 libreadline8 libnsl2 libtirpc3 libgssapi-krb5-2 libkrb5-3 libk5crypto3
  libkrb5support0 libcom-err2 libkeyutils1 libdb5.3
)
# Exact pins: the aarch64 wheels must match the host's (artifacts carry the TVM version).
WHEELS=(apache-tvm==0.27.0.post1 apache-tvm-ffi==0.1.14.post0 "numpy>=1.26" ml_dtypes typing_extensions)

SUDO=""; [ "$(id -u)" = 0 ] || SUDO=sudo
mkdir -p "$DEST/.debs" "$DEST/.wheels" "$DEST/wheels"
DEST=$(cd "$DEST" && pwd)

if ! dpkg --print-foreign-architectures | grep -qx "$DEBARCH"; then
  echo "sysroot $ARCH: enabling dpkg architecture $DEBARCH"
  $SUDO dpkg --add-architecture "$DEBARCH"
  $SUDO apt-get update -qq
elif ! apt-cache show "python3.11-minimal:$DEBARCH" >/dev/null 2>&1; then
  $SUDO apt-get update -qq
fi

echo "sysroot $ARCH: downloading ${#DEBS[@]} Debian $DEBARCH packages"
(
  cd "$DEST/.debs"
  pkgs=()
  for p in "${DEBS[@]}"; do pkgs+=("$p:$DEBARCH"); done
  # as root apt warns that the download is unsandboxed: harmless here
  apt-get download -qq "${pkgs[@]}"
)
for deb in "$DEST"/.debs/*.deb; do
  dpkg -x "$deb" "$DEST"
done

echo "sysroot $ARCH: downloading wheels ${WHEELS[*]}"
plat=()
for p in "${WHEELPLAT[@]}"; do plat+=(--platform "$p"); done
$PIP download -q --no-deps --only-binary=:all: --python-version 3.11 --implementation cp \
  "${plat[@]}" -d "$DEST/.wheels" "${WHEELS[@]}"
for whl in "$DEST"/.wheels/*.whl; do
  python3 -m zipfile -e "$whl" "$DEST/wheels"
done

# Smoke test under qemu: the interpreter starts and imports tvm + numpy.
QEMU="qemu-$ARCH"
if command -v "$QEMU" >/dev/null 2>&1; then
  # bytecode into DEST/.pycache (even where PYTHONDONTWRITEBYTECODE is set, as in CI), as
  # compiler/emulate.py and deploy/armnode.py run it: ~15 s of CPU under qemu saved at the first
  # emulated run of the tests
  env -u PYTHONDONTWRITEBYTECODE PYTHONPATH="$DEST/wheels" PYTHONPYCACHEPREFIX="$DEST/.pycache" "$QEMU" -L "$DEST" "$DEST/usr/bin/python3.11" -c \
    "import numpy, tvm, tvm.runtime; print('sysroot ok: numpy', numpy.__version__, 'tvm', tvm.__version__)"
else
  echo "sysroot $ARCH: warning: $QEMU not installed, skipped the smoke test" >&2
fi

rm -rf "$DEST/.debs" "$DEST/.wheels"
{ echo "$STAMP"; date -u +%FT%TZ; } > "$DEST/.done"
echo "sysroot $ARCH: done in $DEST"
