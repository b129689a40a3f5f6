#!/bin/sh
# busybox init's shutdown action: stop the node (SIGTERM to the supervisor, which forwards it),
# flush and unmount the read-write data partition.
killall -TERM python3 2>/dev/null
i=0
while [ $i -lt 50 ] && pidof python3 >/dev/null; do sleep 0.2; i=$((i + 1)); done
sync
umount /data 2>/dev/null || mount -o remount,ro /data
