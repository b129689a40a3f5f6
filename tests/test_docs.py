"""The documentation: the site builds with ``mkdocs build --strict`` (a link to a missing page or
heading fails it), the README stays a short entrance whose links and commands are real, and every
citation of a benchmark section in the code names a section that exists."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"
HISTORY = ROOT / "docs" / "benchmarks-history.md"

# Issue 27: "a README of at most about 15 KB"; the detail lives in docs/.
README_MAX_BYTES = 16_000


def _sh_blocks(text: str) -> list[list[str]]:
    return [[ln for ln in b.splitlines() if ln.strip()] for b in re.findall(r"```sh\n(.*?)```", text, re.S)]


def _section(text: str, heading: str) -> str:
    return text.split(f"\n{heading}\n", 1)[1].split("\n## ", 1)[0]


def test_site_builds_strict(tmp_path):
    proc = subprocess.run([sys.executable, "-m", "mkdocs", "build", "--strict", "--site-dir", str(tmp_path)],
                          cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    # The protocol page is federation/PROTOCOL.md itself (a symlink), the benchmarks page BENCHMARKS.md.
    assert "Training round life cycle" in (tmp_path / "protocol.html").read_text()
    assert "current results" in (tmp_path / "benchmarks.html").read_text()


def test_strict_build_fails_on_a_broken_anchor(tmp_path):
    """The guard works: a copy of the docs with one link to a heading that does not exist fails."""
    docs = tmp_path / "docs"
    docs.mkdir()
    for page in (ROOT / "docs").glob("*.md"):
        (docs / page.name).write_text(page.read_text())
    index = docs / "index.md"
    index.write_text(index.read_text() + "\nSee [nowhere](compile.md#no-such-heading).\n")
    config = (ROOT / "mkdocs.yml").read_text()
    (tmp_path / "mkdocs.yml").write_text(config)
    proc = subprocess.run([sys.executable, "-m", "mkdocs", "build", "--strict", "--site-dir",
                           str(tmp_path / "site")], cwd=tmp_path, capture_output=True, text=True, timeout=120)
    assert proc.returncode != 0
    assert "no-such-heading" in proc.stdout + proc.stderr


def test_readme_is_short_and_its_links_exist():
    text = README.read_text()
    size = len(text.encode())
    assert size <= README_MAX_BYTES, f"README.md is {size} bytes: move the detail to a page of docs/"
    links = re.findall(r"\]\(([^)#\s]+)(?:#[^)]*)?\)", text)
    assert links, "the README links into docs/"
    for link in links:
        if "://" not in link:
            assert (ROOT / link).exists(), f"README.md links to {link}, which does not exist"


def test_quick_start_is_the_same_in_the_readme_and_the_site():
    readme = _sh_blocks(_section(README.read_text(), "## Quick start"))
    index = _sh_blocks(_section((ROOT / "docs" / "index.md").read_text(), "## Quick start"))
    assert [ln.split()[:2] for ln in readme[0]] == [["make", "demo"], ["make", "test"]]
    assert index[0] == readme[0]


def test_readme_tour_quotes_the_tested_walkthrough():
    """The tour's commands are lines of the block tests/test_docs_walkthrough.py runs."""
    walkthrough = set(_sh_blocks(_section((ROOT / "docs" / "compile.md").read_text(),
                                          "## Compile, verify, predict"))[0])
    tour = _sh_blocks(_section(README.read_text(), "## A short tour"))
    assert tour
    for block in tour:
        for line in block:
            assert line in walkthrough, f"README tour line not in docs/compile.md's walkthrough: {line}"


def _headings(path: Path) -> list[str]:
    return [ln.lstrip("#").strip().lower() for ln in path.read_text().splitlines() if ln.startswith("#")]


def test_benchmark_citations_name_existing_sections():
    """`BENCHMARKS.md, "X"` and `docs/benchmarks-history.md, "X"` in code and docs: X is in a heading."""
    targets = {"BENCHMARKS.md": _headings(ROOT / "BENCHMARKS.md"),
               "docs/benchmarks-history.md": _headings(HISTORY)}
    cite = re.compile(r'(BENCHMARKS\.md|docs/benchmarks-history\.md),?\s+\(?"([^"]+)"')
    packages = ("fractal", "compiler", "federation", "edgenode", "api", "firmware", "deploy", "tests")
    files = [p for pkg in packages for p in (ROOT / pkg).rglob("*")
             if p.suffix in (".py", ".c", ".md") and p != Path(__file__).resolve()]
    found = 0
    for path in files:
        for target, section in cite.findall(path.read_text()):
            found += 1
            want = section.lstrip("#").strip().lower()
            assert any(want in h for h in targets[target]), \
                f"{path.relative_to(ROOT)} cites {target} \"{section}\", which has no such heading"
    assert found >= 10, "the code cites benchmark sections in this form"
