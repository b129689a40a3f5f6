"""No import cycles between the project's modules (module-level AND function-level imports),
and no import from a layer to one above it.

Walks the source with ``ast`` (nothing is imported), builds the module graph and fails on any
strongly connected component of more than one module. Imports under ``if TYPE_CHECKING:`` count
too: a cycle that only type checking sees is still a cycle a reader has to untangle.

Folders are layers (README "Architecture", DESIGN.md), bottom up; a module may import its own
layer's package and the layers below, never a layer above, nor a peer on its own level:

    fractal                  the shared base (root error, version, heap tuning)
    compiler | federation    stand alone, neither imports the other
    firmware                 board images; uses compiler artifacts
    edgenode                 the agent; composes compiler, federation and firmware
    deploy                   configs and launchers (keys, sensors, the demo swarm, qemu nodes)
    api                      the apps: node API, fleet service
    bench                    the benchmarks (they start the apps)
    harness                  the fault / soak harness (it drives the fleet's round manager)
    api.cli                  the console script `fractal`: may import anything, nothing imports it

A process started by command line (``python -c "from api.cli import main; main()"``) is not an
import: launchers start nodes and the fleet that way.
"""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("fractal", "compiler", "federation", "edgenode", "api", "deploy", "firmware", "bench", "harness")
LAYERS: tuple[tuple[str, ...], ...] = (  # bottom up; peers on one level may not import each other
    ("fractal",), ("compiler", "federation"), ("firmware",), ("edgenode",), ("deploy",), ("api",),
    ("bench",), ("harness",), ("api.cli",))


def _modules() -> dict[str, Path]:
    mods: dict[str, Path] = {}
    for pkg in PACKAGES:
        for path in sorted((ROOT / pkg).rglob("*.py")):
            name = ".".join(path.relative_to(ROOT).with_suffix("").parts)
            mods[name.removesuffix(".__init__")] = path
    return mods


def _resolve(name: str, mods: dict[str, Path]) -> str | None:
    while name and name not in mods:
        name = name.rpartition(".")[0]
    return name or None


def import_graph() -> dict[str, set[str]]:
    mods = _modules()
    graph: dict[str, set[str]] = {m: set() for m in mods}
    for mod, path in mods.items():
        pkg = mod if path.name == "__init__.py" else mod.rpartition(".")[0]
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            names: list[str] = []
            if isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    parts = pkg.split(".")[: len(pkg.split(".")) - (node.level - 1)]
                    base = ".".join(parts + ([base] if base else []))
                names = [f"{base}.{a.name}" for a in node.names] + [base]
            for n in names:
                target = _resolve(n, mods)
                # a package importing its own submodules (or a module its parent package) is not a cycle
                if target and target != mod and not target.startswith(mod + ".") and target != pkg:
                    graph[mod].add(target)
    return graph


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components with more than one module (iterative Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []
    counter = 0
    for root in graph:
        if root in index:
            continue
        work = [(root, iter(sorted(graph[root])))]
        index[root] = low[root] = counter
        counter += 1
        stack.append(root)
        on_stack.add(root)
        while work:
            v, children = work[-1]
            for w in children:
                if w not in index:
                    index[w] = low[w] = counter
                    counter += 1
                    stack.append(w)
                    on_stack.add(w)
                    work.append((w, iter(sorted(graph[w]))))
                    break
                if w in on_stack:
                    low[v] = min(low[v], index[w])
            else:
                work.pop()
                if work:
                    low[work[-1][0]] = min(low[work[-1][0]], low[v])
                if low[v] == index[v]:
                    comp = []
                    while True:
                        w = stack.pop()
                        on_stack.discard(w)
                        comp.append(w)
                        if w == v:
                            break
                    if len(comp) > 1:
                        found.append(sorted(comp))
    return found


def layer_of(module: str) -> tuple[int, str]:
    """(level, the layer's package) of ``module``: the longest package prefix in LAYERS."""
    best: tuple[int, str] | None = None
    for level, names in enumerate(LAYERS):
        for name in names:
            inside = module == name or module.startswith(name + ".")
            if inside and (best is None or len(name) > len(best[1])):
                best = (level, name)
    assert best is not None, f"{module} belongs to no layer: add its package to LAYERS"
    return best


def upward_imports(graph: dict[str, set[str]]) -> list[str]:
    """Every import from a layer to one above it, or to a peer on its own level."""
    bad = []
    for mod, targets in graph.items():
        level, name = layer_of(mod)
        for t in sorted(targets):
            t_level, t_name = layer_of(t)
            if t_level > level or (t_level == level and t_name != name):
                bad.append(f"{mod} -> {t} ({name} may not import {t_name})")
    return sorted(bad)


def test_the_checker_finds_a_cycle() -> None:
    assert cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    assert cycles({"a": {"b"}, "b": set()}) == []


def test_the_checker_finds_an_upward_import() -> None:
    graph = {"compiler.a": {"fractal"}, "fractal": set(), "api.fleet.x": {"deploy.swarm"},
             "deploy.swarm": {"api.fleet.errors"}, "api.fleet.errors": set(),
             "api.cli.fleet": {"deploy.swarm"}, "federation.ring": {"compiler.a"},
             "harness.soak": {"bench.host"}, "bench.host": set()}
    assert upward_imports(graph) == ["deploy.swarm -> api.fleet.errors (deploy may not import api)",
                                     "federation.ring -> compiler.a (federation may not import compiler)"]


def test_no_import_from_a_layer_to_one_above() -> None:
    bad = upward_imports(import_graph())
    assert not bad, "imports against the layer order:\n" + "\n".join(bad)


def test_no_import_cycles_between_project_modules() -> None:
    graph = import_graph()
    assert len(graph) > 50  # the walk found the packages
    found = cycles(graph)
    assert not found, "import cycles: " + "; ".join(" <-> ".join(c) for c in found)


def test_deploy_never_imports_the_cli() -> None:
    graph = import_graph()
    bad = sorted(f"{m} -> {t}" for m, ts in graph.items() if m.startswith("deploy") for t in ts
                 if t == "api.cli" or t.startswith("api.cli."))
    assert not bad, bad
