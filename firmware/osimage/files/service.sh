#!/bin/sh
# The node's service (busybox init respawns it): `fractal boot` on the data partition's device
# directory, which picks the A/B slot, starts `fractal node` from it and health-checks it.
. /etc/fractal/env
if [ ! -d /data/device ]; then
  echo "fractal: no device directory on the data partition" >&2
  exec sleep 3600
fi
# the boot partition's settings (fractal image configure) -> device settings, hostname
python3 -m firmware.osimage.settings apply --boot /boot --device /data/device
echo "fractal: starting the boot supervisor as $(hostname)"
python3 -c "from api.cli import main; main()" boot --device /data/device --host 0.0.0.0 \
  --port "$FRACTAL_PORT" --node-id "$(hostname)" --health-timeout 900 --exit-on-reboot
rc=$?
if [ "$rc" = 75 ]; then
  # the node staged an over-the-air update (or a rollback): reboot the board into it, as a
  # board does (busybox init runs /etc/fractal/shutdown.sh, then the kernel restarts the machine)
  echo "fractal: the node asked for a reboot; rebooting the board"
  sync
  reboot
  exec sleep 3600  # not respawned while init shuts down
fi
exit "$rc"
