#!/bin/sh
# /init of the board's initramfs (firmware/osimage/initramfs.py): load the modules that reach the
# disks, mount the root partition read-only, hand over to its /sbin/init (busybox init).
export PATH=/bin
mount -t proc proc /proc
mount -t sysfs sys /sys
mount -t devtmpfs dev /dev
echo "initramfs: loading $(wc -l < /lib/modules/load-order) modules"
while read -r m; do
  insmod "/lib/modules/$m.ko" || echo "initramfs: insmod $m failed"
done < /lib/modules/load-order
# PARTUUID=<MBR disk id>-<partition number, hex> (what the Pi's cmdline.txt names): busybox's
# findfs knows only LABEL/UUID, so read each disk's id (4 bytes at 440, little-endian) here.
partuuid_dev() {
  for p in /sys/class/block/*; do
    [ -f "$p/partition" ] || continue
    disk=$(basename "$(dirname "$(readlink -f "$p")")")
    id=$(dd if="/dev/$disk" bs=1 skip=440 count=4 2>/dev/null | od -An -tx4 | tr -d ' \n')
    [ "$id-$(printf %02x "$(cat "$p/partition")")" = "$1" ] && echo "/dev/${p##*/}" && return
  done
}
root=""
for arg in $(cat /proc/cmdline); do
  case "$arg" in root=*) root="${arg#root=}" ;; esac
done
case "$root" in
  LABEL=*|PARTLABEL=*|UUID=*) spec="$root" ;;
  *) spec="" ;;
esac
# The block device appears asynchronously after virtio_blk loads: poll for it (10 s at most).
i=0
while [ $i -lt 100 ]; do
  case "$root" in
    PARTUUID=*) dev=$(partuuid_dev "${root#PARTUUID=}") ;;
    *) if [ -n "$spec" ]; then dev=$(findfs "$spec" 2>/dev/null); else dev="$root"; fi ;;
  esac
  [ -n "$dev" ] && [ -b "$dev" ] && break
  sleep 0.1
  i=$((i + 1))
done
if ! mount -t ext4 -o ro "$dev" /newroot; then
  echo "initramfs: cannot mount root ($root); dropping to a shell"
  exec sh
fi
mount --move /dev /newroot/dev
umount /proc /sys
exec switch_root /newroot /sbin/init
