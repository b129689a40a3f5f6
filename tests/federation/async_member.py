"""An asynchronous-mode member as its own OS process (tests/federation/test_async_mqtt.py).

Run as ``python -m tests.federation.async_member --url URL --swarm S --id ID --keys DIR
--size L --updates N --until V``: loads its signing key from ``DIR/keys/ID.key`` and the
keyring from ``DIR/keyring.json``, follows the signed versions, and ``N`` times takes the newest
version it has not trained from, "trains" (a seeded step towards its own target vector) and
publishes its signed update. Then it waits for version ``V`` and prints
``COMMITTED <version> <sha256 of its parameters>`` and exits.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import numpy as np

from federation.asyncagg import AsyncMember
from federation.asyncbuf import params_sha256
from federation.mqtt import MqttLink
from federation.signed import load_identity


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--url", required=True)
    ap.add_argument("--swarm", required=True)
    ap.add_argument("--id", required=True)
    ap.add_argument("--keys", required=True)
    ap.add_argument("--size", type=int, required=True)
    ap.add_argument("--updates", type=int, default=1)
    ap.add_argument("--until", type=int, required=True)
    ap.add_argument("--seed", type=int, default=0)
    a = ap.parse_args(argv)

    keys = Path(a.keys)
    ident = load_identity(keys / "keys" / f"{a.id}.key", keys / "keyring.json")
    link = ident.link(MqttLink(a.url, swarm=a.swarm, client_id=f"{a.swarm}-{a.id}"))
    member = AsyncMember(link, a.id, a.size).start()
    target = np.random.default_rng(a.seed).standard_normal(a.size).astype(np.float32)
    last = -1
    for _ in range(a.updates):
        base = member.wait_version(last + 1, timeout=60)
        trained = base.params + np.float32(0.5) * (target - base.params)
        member.publish_update(base, trained, samples=10 + a.seed)
        print(f"SENT {base.version}", flush=True)
        last = base.version
    final = member.wait_version(a.until, timeout=60)
    print(f"COMMITTED {final.version} {params_sha256(final.params)}", flush=True)
    member.close()
    link.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
