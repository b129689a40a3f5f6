"""Makes a Python process behave as a node install (no ``[compiler]`` extra): with this directory
on PYTHONPATH, ``site`` imports it at start-up in every process (the node and its training
worker, which inherits PYTHONPATH), and importing any top-level module named in
``FRACTAL_TEST_BLOCK`` (comma-separated) raises ModuleNotFoundError as if it were not installed.

Each process appends ``loaded PID`` to ``FRACTAL_TEST_BLOCK_LOG`` (so a test knows the guard ran
in it) and ``blocked PID NAME`` plus the importing stack for every attempt (so a test sees an
attempt even when the code caught the ImportError)."""

from __future__ import annotations

import os
import sys
import traceback

_BLOCK = frozenset(filter(None, os.environ.get("FRACTAL_TEST_BLOCK", "").split(",")))
_LOG = os.environ.get("FRACTAL_TEST_BLOCK_LOG")


def _log(text: str) -> None:
    if _LOG:
        with open(_LOG, "a") as f:
            f.write(text)


class _Blocker:
    def find_spec(self, name: str, path: object = None, target: object = None) -> None:
        if name.partition(".")[0] in _BLOCK:
            _log(f"blocked {os.getpid()} {name}\n" + "".join(traceback.format_stack(limit=25)))
            raise ModuleNotFoundError(f"No module named {name!r} (blocked by tests/nocompiler)", name=name)
        return None


if _BLOCK:
    sys.meta_path.insert(0, _Blocker())
    _log(f"loaded {os.getpid()}\n")
