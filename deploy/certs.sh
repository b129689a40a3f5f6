#!/usr/bin/env bash
# Self-signed CA + a broker certificate for Mosquitto's TLS listener (deploy/mosquitto/mosquitto.conf).
#
#   bash deploy/certs.sh OUT_DIR BROKER_HOST [EXTRA_SAN ...]
#   e.g. bash deploy/certs.sh /etc/mosquitto/certs broker.local IP:192.168.1.10
#
# Writes ca.key (keep it offline), ca.crt (give it to nodes: mqtts:// + tls ca), server.key and
# server.crt (Mosquitto). Idempotent per file: existing keys are kept.
set -euo pipefail
OUT=${1:?usage: certs.sh OUT_DIR BROKER_HOST [EXTRA_SAN ...]}
HOST=${2:?usage: certs.sh OUT_DIR BROKER_HOST [EXTRA_SAN ...]}
shift 2
DAYS=${DAYS:-825}
mkdir -p "$OUT"
cd "$OUT"
umask 077

if [ ! -f ca.key ]; then
  openssl req -x509 -newkey rsa:3072 -sha256 -nodes -days 3650 \
    -keyout ca.key -out ca.crt -subj "/CN=fractal-edge CA"
fi

SAN="DNS:$HOST,DNS:localhost,IP:127.0.0.1"
for extra in "$@"; do SAN="$SAN,$extra"; done

[ -f server.key ] || openssl genrsa -out server.key 3072 2>/dev/null
openssl req -new -key server.key -out server.csr -subj "/CN=$HOST"
printf 'subjectAltName=%s\nextendedKeyUsage=serverAuth\nbasicConstraints=CA:FALSE\n' "$SAN" > server.ext
openssl x509 -req -in server.csr -CA ca.crt -CAkey ca.key -CAcreateserial \
  -days "$DAYS" -sha256 -extfile server.ext -out server.crt 2>/dev/null
rm -f server.csr server.ext
chmod 644 ca.crt server.crt
echo "wrote $OUT/ca.crt, $OUT/server.crt, $OUT/server.key (SAN: $SAN)"
