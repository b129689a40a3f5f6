# Environment of the node's processes (sourced by /etc/fractal/service.sh).
export PATH=/usr/sbin:/usr/bin
export HOME=/data/home
export LANG=C.UTF-8
export PYTHONPATH=/opt/fractal
export PYTHONNOUSERSITE=1
export PYTHONUNBUFFERED=1
# the root filesystem is read-only; its bytecode was compiled when the image was built
export PYTHONDONTWRITEBYTECODE=1
# trixie splits OpenSSL's legacy provider into a package the image does not carry; the node's
# signatures (ed25519, HMAC-SHA256) need no legacy algorithm.
export CRYPTOGRAPHY_OPENSSL_NO_LEGACY=1
export FRACTAL_PORT=8080
