#!/bin/sh
# Wi-Fi at boot (boards whose image has wpa_supplicant: the Raspberry Pi), run by
# /etc/init.d/rcS after Ethernet. The boot partition's settings (wifi_ssid, wifi_psk,
# wifi_country; `fractal image configure`) become /run/wpa_supplicant.conf, mode 0600, SSID and
# PSK in hex (firmware/osimage/settings.py; the PSK is never printed); then wpa_supplicant on
# wlan0 and DHCP on it. Ethernet keeps priority: its default route has the lower metric and its
# name servers come first (/etc/fractal/udhcpc.sh).
# The paths can be moved (FRACTAL_ENV, BOOT, CONF, SYSFS, RUN) to run this against a fake root.
. "${FRACTAL_ENV:-/etc/fractal/env}"
boot=${BOOT:-/boot}
conf=${CONF:-/run/wpa_supplicant.conf}
sysfs=${SYSFS:-/sys}
run=${RUN:-/run}
iface=wlan0
python3 -m firmware.osimage.settings wifi --boot "$boot" --conf "$conf"
case $? in
  0) ;;
  3) exit 0 ;;  # no Wi-Fi in the settings
  *) echo "wifi: not started" >&2; exit 1 ;;
esac
# brcmfmac loads its firmware in the background: wait up to 20 s for the interface
i=0
while [ ! -e "$sysfs/class/net/$iface" ] && [ $i -lt 200 ]; do
  sleep 0.1
  i=$((i + 1))
done
if [ ! -e "$sysfs/class/net/$iface" ]; then
  echo "wifi: no $iface (kernel log: dmesg | grep brcmfmac)" >&2
  exit 1
fi
ip link set "$iface" up
wpa_supplicant -B -i "$iface" -D nl80211 -c "$conf" -P "$run/wpa_supplicant.pid" || {
  echo "wifi: wpa_supplicant failed on $iface" >&2
  exit 1
}
# DHCP once associated (udhcpc keeps trying and renewing in the background)
udhcpc -b -S -i "$iface" -s /etc/fractal/udhcpc.sh -x "hostname:$(hostname)"
