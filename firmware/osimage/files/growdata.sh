#!/bin/sh
# growdata.sh PARTITION: grow the data partition (the disk's last) and its ext4 filesystem to the
# end of the disk, as on a card larger than the image (run by /etc/init.d/rcS at every boot; a
# no-op once it fills the disk). GPT keeps its backup header at the disk's end, so on a larger
# card it first moves there (sfdisk --relocate), then the partition grows (sfdisk -N). The kernel
# does not re-read the table of a disk in use (root is mounted from it: sfdisk's re-read fails
# with EBUSY), so the board reboots once and reads the new table at boot (as Raspberry Pi OS's
# first-boot resize did); /etc/init.d/rcS then grows the mounted filesystem online (resize2fs).
export PATH=/usr/sbin:/usr/bin
part=$1
sys=/sys/class/block/${part##*/}
[ -e "$sys/partition" ] || { echo "growdata: $part is not a partition"; exit 0; }
diskdir=$(cd -P "$sys/.." && pwd)
disk=/dev/${diskdir##*/}
num=$(cat "$sys/partition")
start=$(cat "$sys/start")
size=$(cat "$sys/size")
total=$(cat "$diskdir/size")
# room after the partition beyond GPT's 33 backup sectors and the 1 MiB alignment: grow
if [ $((total - start - size)) -gt 4096 ]; then
  echo "growdata: $disk has $(((total - start - size) / 2048)) MiB after $part; growing it"
  if sfdisk --dump "$disk" 2>/dev/null | grep -q '^label: gpt'; then
    sfdisk --no-reread --relocate gpt-bak-std "$disk" || echo "growdata: sfdisk --relocate failed"
  fi
  echo ", +" | sfdisk --no-reread --quiet -N "$num" "$disk" || echo "growdata: sfdisk -N $num failed"
  if [ "$(cat "$sys/size")" = "$size" ]; then
    # the kernel kept the old size (it cannot re-read the table of a disk in use): reboot
    echo "growdata: the kernel still has the old size of $part; rebooting to read the new table"
    sync
    reboot -f
  fi
fi
echo "growdata: $part sectors $start+$(cat "$sys/size") of $disk ($total sectors)"
