"""Root conftest: shared fixtures live in ``tests/fixtures_*.py`` plugin modules, one per layer,
so that every layer's compiled artifacts and brokers are built once per session and reused."""

from __future__ import annotations

from pathlib import Path

_HERE = Path(__file__).parent
pytest_plugins = sorted(f"tests.{p.stem}" for p in _HERE.glob("fixtures_*.py"))
