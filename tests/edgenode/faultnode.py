"""A test-only entry point: ``python -m tests.edgenode.faultnode --faults SPEC --config NODE.toml``
serves one node exactly as ``fractal node --config NODE.toml`` does (``api.cli.node.serve_node``),
built with the fault plan ``SPEC`` (``edgenode/faults.py``, e.g. ``kill@vote:r-3,fail@prepare``).

Why here and not a variable or a config table: the plan enters through the object the test builds
(``EdgeNode(config, faults=...)``), so nothing shipped reads a fault switch, and no production
NODE.toml can turn one on by mistake.
"""

from __future__ import annotations

import argparse
import functools
import sys
from pathlib import Path

from api.cli.node import serve_node
from edgenode.errors import NodeError
from edgenode.faults import Faults
from edgenode.node import EdgeNode


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m tests.edgenode.faultnode", description=__doc__)
    ap.add_argument("--faults", required=True, help="ACTION@POINT[:ROUND_ID],... (edgenode/faults.py)")
    ap.add_argument("--config", required=True, type=Path)
    ap.add_argument("--log-level", default="info")
    args = ap.parse_args(argv)
    try:
        faults = Faults.parse(args.faults)
        return serve_node(args.config, log_level=args.log_level,
                          build=functools.partial(EdgeNode, faults=faults))
    except NodeError as exc:
        print(f"error: {exc}" + (f" (help: {exc.hint})" if exc.hint else ""), file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
