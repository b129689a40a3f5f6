"""A test-only entry point: ``python -m tests.firmware.flashkill --at POINT IMAGE --device DEV
[--pubkey PUB]`` flashes exactly as ``fractal image flash`` does (``firmware.device.flash``), built
with the flash fault plan ``POINT`` (firmware/faults.py: ``bytes:N`` or ``switch``), so the process
SIGKILLs itself there.

Why here and not a variable: the plan enters through the call this script makes, so nothing
shipped reads a fault switch (as tests/edgenode/faultnode.py does for node faults).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from firmware.device import flash
from firmware.errors import FirmwareError
from firmware.faults import FlashFaults


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m tests.firmware.flashkill", description=__doc__)
    ap.add_argument("image", type=Path)
    ap.add_argument("--at", required=True, help="bytes:N or switch (firmware/faults.py)")
    ap.add_argument("--device", required=True, type=Path)
    ap.add_argument("--pubkey", action="append", default=[], type=Path)
    args = ap.parse_args(argv)
    try:
        r = flash(args.image, args.device, args.pubkey, faults=FlashFaults.parse(args.at))
    except FirmwareError as exc:
        print(f"error: {exc}" + (f" (help: {exc.hint})" if exc.hint else ""), file=sys.stderr)
        return 1
    print(f"flashed version {r['version']} into slot {r['slot']} (the fault at {args.at} never fired)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
