#!/bin/sh
# udhcpc event script (busybox udhcpc -s): configure eth0 from the lease; resolv.conf lives in
# /run (the root filesystem is read-only; /etc/resolv.conf links to it).
case "$1" in
  deconfig)
    ip addr flush dev "$interface"
    ip link set "$interface" up
    ;;
  bound|renew)
    ip addr flush dev "$interface"
    ip addr add "$ip/${mask:-24}" ${broadcast:+broadcast $broadcast} dev "$interface"
    for r in $router; do ip route add default via "$r" dev "$interface"; break; done
    : > /run/resolv.conf
    for d in $dns; do echo "nameserver $d" >> /run/resolv.conf; done
    echo "udhcpc: $interface $ip/${mask:-24} router ${router:-none}"
    ;;
esac
exit 0
