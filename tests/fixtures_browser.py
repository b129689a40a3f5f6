"""Chromium for the dashboard tests (Playwright, Debian's /usr/bin/chromium): one set of launch
flags, one launcher and one module-scoped ``browser`` fixture (a plugin of tests/conftest.py, as
every tests/fixtures_*.py is)."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest

OUT = Path(__file__).resolve().parents[1] / "test-output"  # screenshots for people to look at
CHROMIUM = "/usr/bin/chromium"
CHROMIUM_ARGS = ["--no-sandbox", "--disable-gpu", "--disable-background-networking",
                 "--disable-component-update", "--no-first-run", "--disable-sync"]


@contextmanager
def chromium() -> Iterator:
    """A headless Chromium for the length of the block (one Playwright per thread at a time)."""
    from playwright.sync_api import sync_playwright

    with sync_playwright() as pw:
        b = pw.chromium.launch(executable_path=CHROMIUM, args=CHROMIUM_ARGS)
        try:
            yield b
        finally:
            b.close()


@pytest.fixture(scope="module")
def browser() -> Iterator:
    with chromium() as b:
        yield b
