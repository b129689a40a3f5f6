"""The flash fault plan enters through the call a test makes (firmware/faults.py,
tests/firmware/flashkill.py); no shipped code reads a fault switch from the environment."""

from __future__ import annotations

from pathlib import Path

import pytest

from firmware.errors import FirmwareError
from firmware.faults import NO_FLASH_FAULTS, FlashFaults

ROOT = Path(__file__).resolve().parents[2]


def test_the_plan_parses_its_two_points_and_refuses_anything_else():
    assert FlashFaults.parse("switch") == FlashFaults(kill_at_switch=True)
    f = FlashFaults.parse("bytes:4096")
    assert f == FlashFaults(kill_after_bytes=4096)
    assert f.cut(0, b"x" * 4096) is None and f.cut(4000, b"y" * 200) == b"y" * 96
    assert NO_FLASH_FAULTS.cut(10**12, b"z") is None and not NO_FLASH_FAULTS.kill_at_switch
    for bad in ("", "bytes:", "bytes:-1", "bytes:x", "kill"):
        with pytest.raises(FirmwareError, match="unknown flash fault"):
            FlashFaults.parse(bad)


def test_no_shipped_code_reads_a_fault_switch_from_the_environment():
    pkgs = ("fractal", "compiler", "federation", "firmware", "edgenode", "deploy", "api", "bench", "harness")
    for pkg in pkgs:
        for path in (ROOT / pkg).rglob("*.py"):
            text = path.read_text()
            assert "FRACTAL_FLASH_KILL_AT" not in text and "FRACTAL_FAULTS" not in text, path
