#!/bin/sh
# System start of the board images (busybox init runs it once, before the node's service).
export PATH=/usr/sbin:/usr/bin
mount -t proc proc /proc
mount -t sysfs sys /sys
mount -t devtmpfs dev /dev 2>/dev/null  # already there when the initramfs moved it
mkdir -p /dev/pts /dev/shm
mount -t devpts devpts /dev/pts
mount -t tmpfs -o mode=0755,size=32m run /run
mount -t tmpfs -o mode=1777 tmp /tmp
mount -t tmpfs -o mode=1777 shm /dev/shm
# data: the A/B device directory, the node's samples and parameters (read-write); boot: the
# settings a user edits on any computer (read-only here).
# The data partition fills the card: grown (with its filesystem, online) on the first boot of a
# card larger than the image (/etc/fractal/growdata.sh; a no-op afterwards).
data=$(findfs LABEL=fractal-data)
[ -n "$data" ] && /etc/fractal/growdata.sh "$data"
if mount -t ext4 -o noatime "$data" /data; then
  resize2fs "$data" 2>&1 | sed -n 's/^The filesystem/growdata: the filesystem/p'
else
  echo "rcS: no data partition"
fi
mount -t vfat -o ro "$(findfs LABEL=FRACTALBOOT)" /boot || echo "rcS: no boot partition"
mkdir -p /data/home
# default hostname fractal-<last 3 bytes of the MAC>; the settings' hostname replaces it
# (/etc/fractal/service.sh applies the boot partition's fractal/settings.toml)
mac=$(cat /sys/class/net/eth0/address 2>/dev/null | tr -d ':')
host="fractal-${mac#??????}"
echo "$host" > /run/hostname
hostname "$host"
ip link set lo up
# DHCP on Ethernet (busybox udhcpc, keeps renewing in the background).
ip link set eth0 up 2>/dev/null && udhcpc -b -S -i eth0 -s /etc/fractal/udhcpc.sh -x "hostname:$host"
# Modules the board loads from the root filesystem (the Pi's Wi-Fi driver brcmfmac: its firmware
# is in /usr/lib/firmware here, not in the initramfs), then Wi-Fi when the settings name a network.
mods="/usr/lib/modules/$(uname -r)"
if [ -f "$mods/load-order" ]; then
  while read -r m; do
    insmod "$mods/$m.ko" 2>/dev/null
  done < "$mods/load-order"
fi
[ -x /usr/sbin/wpa_supplicant ] && /etc/fractal/wifi.sh &  # waits for wlan0: not in the way of the node
# Time: the kernel set the clock from the RTC at boot; with ntp_server in the settings, ntpd
# keeps it (signatures and certificates need a correct clock).
echo "rcS: up at $(date -u +%FT%TZ) as $host, kernel $(uname -r)"
