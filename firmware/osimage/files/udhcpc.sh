#!/bin/sh
# udhcpc event script (busybox udhcpc -s): configure eth0 (or the Pi's wlan0) from the lease;
# resolv.conf lives in /run (the root filesystem is read-only; /etc/resolv.conf links to it).
# Ethernet first: its default route has the lower metric, its name servers are listed first.
metric=10
case "$interface" in wl*) metric=20 ;; esac
run=${RUN:-/run}
case "$1" in
  deconfig)
    ip addr flush dev "$interface"
    ip link set "$interface" up
    ;;
  bound|renew)
    ip addr flush dev "$interface"
    ip addr add "$ip/${mask:-24}" ${broadcast:+broadcast $broadcast} dev "$interface"
    for r in $router; do ip route add default via "$r" dev "$interface" metric $metric; break; done
    : > "$run/resolv.conf.$interface"
    for d in $dns; do echo "nameserver $d" >> "$run/resolv.conf.$interface"; done
    cat "$run/resolv.conf.eth0" "$run"/resolv.conf.wl* > "$run/resolv.conf" 2>/dev/null
    echo "udhcpc: $interface $ip/${mask:-24} router ${router:-none}"
    ;;
esac
exit 0
