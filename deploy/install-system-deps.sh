#!/usr/bin/env bash
# Debian packages fractal-edge needs: the broker, qemu-user for foreign-arch artifacts, the
# aarch64/riscv64 cross toolchains that link them, Chromium for the dashboard tests and iproute2
# (`ip netns`) for the network-fault tests, gcc and OpenSSL's headers for federation/_gmac.c;
# for board disk images (firmware/osimage): qemu-system for aarch64 and riscv64 (with OpenSBI) and
# x86_64 with OVMF (UEFI firmware), sfdisk, mkfs.fat + mtools, mke2fs, bmaptool, objcopy (the x86
# image's Unified Kernel Image), xz and zstd (--compress), gpgv + Debian's keyring for indexes,
# busybox (the tests run the boards' boot scripts with busybox sh, the shell the boards have);
# postgresql (the fleet's shared store: tests/fixtures_postgres.py starts its own server);
# podman with runc (the compose file under Podman: deploy/compose/podman.yml, whose image
# deploy/podman_image.py imports from a Debian root filesystem), with uidmap, slirp4netns and
# fuse-overlayfs for rootless use.
set -euo pipefail
PKGS=(mosquitto mosquitto-clients qemu-user
      gcc-aarch64-linux-gnu g++-aarch64-linux-gnu gcc-riscv64-linux-gnu g++-riscv64-linux-gnu
      chromium file make python3-venv iproute2 gcc libssl-dev
      qemu-system-arm qemu-system-misc qemu-system-x86 ovmf fdisk dosfstools mtools e2fsprogs
      bmap-tools binutils xz-utils zstd gpgv debian-archive-keyring busybox postgresql
      podman runc uidmap slirp4netns fuse-overlayfs)
missing=()
for p in "${PKGS[@]}"; do dpkg -s "$p" >/dev/null 2>&1 || missing+=("$p"); done
if ((${#missing[@]})); then
  SUDO=""; [ "$(id -u)" = 0 ] || SUDO=sudo
  $SUDO apt-get update -qq
  DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq "${missing[@]}"
fi
# The packaged broker would otherwise hold port 1883; tests start their own on free ports.
# The same for the packaged PostgreSQL (port 5432).
if command -v systemctl >/dev/null 2>&1; then systemctl disable --now mosquitto >/dev/null 2>&1 || true; fi
if command -v systemctl >/dev/null 2>&1; then systemctl disable --now postgresql >/dev/null 2>&1 || true; fi
