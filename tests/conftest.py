"""Root conftest: shared fixtures live in ``tests/fixtures_*.py`` plugin modules, one per layer,
so that every layer's compiled artifacts and brokers are built once per session and reused."""

from __future__ import annotations

import os
from pathlib import Path

_HERE = Path(__file__).parent
pytest_plugins = sorted(f"tests.{p.stem}" for p in _HERE.glob("fixtures_*.py"))

# The suite starts hundreds of child Pythons (nodes, training workers, the CLI). With
# PYTHONDONTWRITEBYTECODE set (as CI's environment does, to keep the tree free of __pycache__) each
# of them compiled this repository's modules again; they share bytecode under .cache/pycache
# instead (PYTHONPYCACHEPREFIX: still nothing written into the tree).
if os.environ.pop("PYTHONDONTWRITEBYTECODE", None):
    os.environ.setdefault("PYTHONPYCACHEPREFIX", str(_HERE.parent / ".cache" / "pycache"))


import pytest  # noqa: E402


@pytest.fixture(autouse=True)
def _fleet_db(tmp_path_factory: pytest.TempPathFactory, monkeypatch: pytest.MonkeyPatch) -> None:
    """Each test's fleet services (in process or spawned) keep their durable history in a file
    of their own, not in the user's data dir, so no test sees another's rounds."""
    monkeypatch.setenv("FRACTAL_FLEET_DB", str(tmp_path_factory.mktemp("fleetdb") / "fleet.sqlite"))
