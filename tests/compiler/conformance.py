"""ONNX backend test data (shipped in the onnx wheel) through three pipelines, one case at a time.

Suites: the data folders ``simple``, ``pytorch-operator``, ``pytorch-converted`` and ``light``, and
``node``: ONNX's operator suite (1,884 one-operator cases). The wheel ships no data files for it,
only the case definitions (``onnx.backend.test.case.node.collect_testcases``); they are written once
per onnx version under ``.cache/conformance/node-<version>/`` (``model.onnx`` with ``ir_version``
lowered to 10, which onnxruntime requires, and ``data.pkl``: the first data set and the case's
tolerances). A node case passes within max(case rtol, 1e-3) and max(case atol, 1e-4); it does not
run the plain-TVM pipeline.

* ``project``: ``compile_model`` (prepare + TVM, x86_64, untuned, input shapes from the test data)
  -> ``load_artifact`` -> ``infer``. A ``CompilerError`` at compile time is a clean *refusal*.
* ``ort``:     onnxruntime on the unmodified model (what a user would compare against).
* ``tvm``:     plain ``tvm.relax.frontend.onnx.from_onnx`` on the unmodified model -> build -> VM.
  A comparison for the report only (nothing asserts on it, and it costs almost as much as the
  project's own compile): ``make test`` passes ``plain_tvm=False`` and records it as ``not-run``;
  the report computes it for any case cached without it.

Results per case are cached as JSON under ``.cache/conformance/`` keyed by the case's bytes and a
hash of the compiler's source, so a second run costs nothing; the cases run in child processes
(``python -m tests.compiler.conformance VERSION --claims DIR MODEL...``; two by default, taking
cases from one queue) so that a crash in TVM is recorded as a crash of that case instead of
killing the caller.

Statuses: pass | refused (one clear line) | wrong (outputs differ) | error (unexpected exception) |
crash (the process died) | skipped (no test data).
"""

from __future__ import annotations

import functools
import hashlib
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

ROOT = Path(__file__).resolve().parents[2]
CACHE = Path(os.environ.get("CONFORMANCE_CACHE") or ROOT / ".cache" / "conformance")
SUITES = ("simple", "pytorch-operator", "pytorch-converted", "light")
NODE = "node"
RTOL, ATOL = 1e-3, 1e-7  # onnx.backend.test.case.model defaults
NODE_RTOL, NODE_ATOL = 1e-3, 1e-4  # floors for the node suite (its cases carry their own, often tighter)
PIPELINES = ("project", "ort", "tvm")
NOT_RUN = "not-run"  # the plain-TVM status of a case computed with plain_tvm=False


@dataclass(frozen=True)
class Case:
    suite: str
    name: str
    model: Path
    # test_data_set_0 (None for light: dummy inputs, expected output beside the model; a data.pkl
    # file for the node suite)
    data: Path | None

    @property
    def id(self) -> str:
        return f"{self.suite}/{self.name}"


def data_root() -> Path:
    import onnx

    return Path(onnx.__file__).parent / "backend" / "test" / "data"


NODE_FORMAT = "r2"  # bump when _write_node_cases changes what it writes


def node_root() -> Path:
    import onnx

    return CACHE / f"node-{onnx.__version__}-{NODE_FORMAT}"


def _write_node_cases(root: Path) -> None:
    """Materialise the node suite's case definitions as files (once per onnx version)."""
    import pickle
    import warnings

    import onnx
    from onnx import numpy_helper
    from onnx.backend.test.case.node import collect_testcases

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        found = collect_testcases(None)
    tmp = root.with_name(root.name + f".tmp{os.getpid()}")
    tmp.mkdir(parents=True, exist_ok=True)
    names = []
    for tc in found:
        d = tmp / tc.name
        d.mkdir(exist_ok=True)
        model = onnx.ModelProto()
        model.CopyFrom(tc.model)
        model.ir_version = min(model.ir_version, 10)  # onnxruntime refuses newer IR versions
        (d / "model.onnx").write_bytes(model.SerializeToString())
        inputs, outputs = tc.data_sets[0] if tc.data_sets else ([], [])
        # float8/int4 values come as TensorProtos: numpy arrays of ml_dtypes' types
        inputs, outputs = ([numpy_helper.to_array(v) if isinstance(v, onnx.TensorProto) else v for v in vs]
                           for vs in (inputs, outputs))
        (d / "data.pkl").write_bytes(pickle.dumps({"inputs": list(inputs), "outputs": list(outputs),
                                                   "rtol": tc.rtol, "atol": tc.atol}))
        names.append(tc.name)
    (tmp / "index.json").write_text(json.dumps(names))
    try:
        tmp.replace(root)
    except OSError:  # another process won the race
        import shutil

        shutil.rmtree(tmp, ignore_errors=True)


def node_cases() -> list[Case]:
    root = node_root()
    if not (root / "index.json").is_file():
        root.parent.mkdir(parents=True, exist_ok=True)
        _write_node_cases(root)
    names = json.loads((root / "index.json").read_text())
    return [Case(NODE, n, root / n / "model.onnx", root / n / "data.pkl") for n in names]


def cases(suites: tuple[str, ...] = SUITES) -> list[Case]:
    out = []
    root = data_root()
    for suite in suites:
        if suite == NODE:
            out.extend(node_cases())
            continue
        base = root / suite
        if suite == "light":
            for m in sorted(base.glob("light_*.onnx")):
                out.append(Case(suite, m.stem, m, None))
            continue
        for d in sorted(p for p in base.iterdir() if (p / "model.onnx").is_file()):
            out.append(Case(suite, d.name, d / "model.onnx", d / "test_data_set_0"))
    return out


def _read_tensor(path: Path) -> np.ndarray:
    import onnx
    from onnx import numpy_helper

    t = onnx.TensorProto()
    t.ParseFromString(path.read_bytes())
    return numpy_helper.to_array(t)


def _graph_inputs(model: Any) -> list[Any]:
    inits = {t.name for t in model.graph.initializer}
    return [i for i in model.graph.input if i.name not in inits]


def node_data(case: Case) -> dict[str, Any]:
    import pickle

    assert case.data is not None
    data: dict[str, Any] = pickle.loads(case.data.read_bytes())  # written by _write_node_cases
    return data


def tolerances(case: Case) -> tuple[float, float]:
    if case.suite != NODE:
        return RTOL, ATOL
    d = node_data(case)
    return max(d["rtol"], NODE_RTOL), max(d["atol"], NODE_ATOL)


def load_data(case: Case, model: Any) -> tuple[dict[str, Any], list[Any]]:
    """(inputs by name, expected outputs in order)."""
    ins = _graph_inputs(model)
    if case.suite == NODE:
        d = node_data(case)
        return {x.name: v for x, v in zip(ins, d["inputs"], strict=False)}, d["outputs"]
    if case.data is None:  # light: the runner's dummy data (arange / n), expected output beside the model
        feeds = {}
        for x in ins:
            shape = tuple(d.dim_value if d.HasField("dim_value") else 1 for d in x.type.tensor_type.shape.dim)
            n = int(np.prod(shape))
            feeds[x.name] = (np.arange(n).reshape(shape) / n).astype(np.float32)
        out = case.model.with_name(case.model.stem + "_output_0.pb")
        return feeds, [_read_tensor(out)]
    in_files = sorted(case.data.glob("input_*.pb"), key=lambda p: int(p.stem.split("_")[1]))
    out_files = sorted(case.data.glob("output_*.pb"), key=lambda p: int(p.stem.split("_")[1]))
    feeds = {x.name: _read_tensor(f) for x, f in zip(ins, in_files, strict=False)}
    return feeds, [_read_tensor(f) for f in out_files]


def _compare(got: list[Any], want: list[Any], rtol: float = RTOL, atol: float = ATOL) -> str | None:
    if len(got) != len(want):
        return f"{len(got)} outputs, expected {len(want)}"
    for i, (g, w) in enumerate(zip(got, want, strict=True)):
        if isinstance(w, list) or isinstance(g, list):  # a sequence output
            if not isinstance(w, list) or not isinstance(g, list) or len(g) != len(w):
                return f"output {i}: sequence differs"
            bad = _compare(g, w, rtol, atol)
            if bad:
                return f"output {i}: sequence element {bad}"
            continue
        if w is None or g is None:  # an optional output
            if (w is None) != (g is None):
                return f"output {i}: optional differs"
            continue
        g, w = np.asarray(g), np.asarray(w)
        if w.dtype.kind not in "biufcO" or g.dtype.kind not in "biufcO":  # float8, int4 (ml_dtypes)
            g, w = g.astype(np.float64), w.astype(np.float64)
        if g.shape != w.shape:
            return f"output {i} has shape {list(g.shape)}, expected {list(w.shape)}"
        if w.dtype == object or g.dtype == object:
            if not np.array_equal(g, w):
                return f"output {i} differs"
            continue
        try:
            np.testing.assert_allclose(g.astype(np.float64) if g.dtype == bool else g,
                                       w.astype(np.float64) if w.dtype == bool else w, rtol=rtol, atol=atol)
        except AssertionError:
            err = float(np.max(np.abs(g.astype(np.float64) - w.astype(np.float64))))
            return f"output {i} differs (max abs error {err:.3g})"
    return None


def _one_line(exc: BaseException) -> str:
    return f"{type(exc).__name__}: {' '.join(str(exc).split())[:240]}"


def run_project(case: Case, work: Path) -> dict[str, Any]:
    import onnx

    from compiler.artifact import load_artifact
    from compiler.build import compile_model
    from compiler.errors import CompilerError
    from compiler.manifest import Manifest

    model = onnx.load(str(case.model))
    feeds, want = load_data(case, model)
    shapes = {k: list(v.shape) for k, v in feeds.items() if isinstance(v, np.ndarray) and v.ndim > 0}
    out = work / "artifact"
    t0 = time.perf_counter()
    try:
        compile_model(case.model, target="x86_64", out_dir=out, input_shapes=shapes, progress=False)
    except CompilerError as exc:
        return {"status": "refused", "detail": exc.message if hasattr(exc, "message") else str(exc),
                "compile_s": round(time.perf_counter() - t0, 2)}
    except Exception as exc:
        return {"status": "error", "detail": "compile: " + _one_line(exc)}
    compile_s = round(time.perf_counter() - t0, 2)
    steps = list(Manifest.read(out).prepared_steps)
    try:
        art = load_artifact(out)
        res = art.infer(feeds)
        got = [res[o.name] for o in art.outputs]
    except CompilerError as exc:
        return {"status": "refused-at-run", "detail": str(exc), "compile_s": compile_s}
    except Exception as exc:
        return {"status": "error", "detail": "infer: " + _one_line(exc), "compile_s": compile_s}
    bad = _compare(got, want, *tolerances(case))
    return {"status": "wrong" if bad else "pass", "detail": bad or "", "compile_s": compile_s, "steps": steps}


def run_ort(case: Case) -> dict[str, Any]:
    import onnx
    import onnxruntime as ort

    model = onnx.load(str(case.model))
    feeds, want = load_data(case, model)
    try:
        opts = ort.SessionOptions()
        opts.log_severity_level = 4
        sess = ort.InferenceSession(case.model.read_bytes(), opts, providers=["CPUExecutionProvider"])
        # a rank-0 input comes as a numpy scalar, which onnxruntime's binding rejects ("Unable to
        # handle object of type numpy.float32"): given as the 0-d array it is
        got = sess.run(None, {k: np.asarray(v) if isinstance(v, np.generic) else v for k, v in feeds.items()})
    except Exception as exc:
        return {"status": "error", "detail": _one_line(exc)}
    bad = _compare(got, want, *tolerances(case))
    return {"status": "wrong" if bad else "pass", "detail": bad or ""}


def run_tvm(case: Case) -> dict[str, Any]:
    import warnings

    if case.suite == NODE:
        return {"status": "skipped", "detail": "not run on the node suite"}
    import onnx
    import tvm
    from tvm import relax
    from tvm.relax.frontend.onnx import from_onnx

    model = onnx.load(str(case.model))
    feeds, want = load_data(case, model)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            mod = from_onnx(model, shape_dict={k: list(v.shape) for k, v in feeds.items()})
        ex = relax.build(mod, target="llvm")
        vm = relax.VirtualMachine(ex, tvm.cpu())
        args = [tvm.runtime.tensor(feeds[x.name]) for x in _graph_inputs(model) if x.name in feeds]
        out = vm["main"](*args)
        got = [o.numpy() for o in out] if isinstance(out, tvm.ir.Array | list | tuple) else [out.numpy()]
    except Exception as exc:
        return {"status": "error", "detail": _one_line(exc)}
    bad = _compare(got, want)
    return {"status": "wrong" if bad else "pass", "detail": bad or ""}


# ------------------------------------------------------------------------------------------ caching
HARNESS_REV = "4"  # bump when this file changes how a result is obtained or judged
# The modules a compile + infer goes through (benchmark, zoo, inspect, emulation code does not count).
def code_version() -> str:
    """Hash of what decides a result: the pipeline's compiler sources, the harness revision, TVM,
    onnx and onnxruntime versions."""
    import onnx
    import onnxruntime
    import tvm

    versions = f"{HARNESS_REV} {tvm.__version__} {onnx.__version__} {onnxruntime.__version__}"
    h = hashlib.sha256(versions.encode())
    # every compiler module: a listed subset once missed compiler/schedules.py and kept stale results
    for p in sorted((ROOT / "compiler").glob("*.py")):
        h.update(p.name.encode())
        h.update(p.read_bytes())
    return h.hexdigest()[:16]


@functools.cache
def case_key(case: Case, version: str) -> str:
    h = hashlib.sha256(version.encode())
    h.update(case.id.encode())
    h.update(case.model.read_bytes())
    if case.data is not None and case.data.is_file():
        h.update(case.data.read_bytes())
    elif case.data is not None:
        for f in sorted(case.data.glob("*.pb")):
            h.update(f.read_bytes())
    return h.hexdigest()[:24]


_NO_PLAIN_TVM = "--no-plain-tvm"  # the worker's flag for plain_tvm=False
_CLAIMS = "--claims"  # the worker's option: the directory of this run's claim files


def _cache_file(case: Case, version: str) -> Path:
    return CACHE / f"{case_key(case, version)}.json"


def _guarded(run: Any, *args: Any) -> dict[str, Any]:
    """A pipeline's result; an exception the pipeline did not classify (e.g. while preparing the
    case's inputs) is an error of that pipeline, not the end of the worker."""
    try:
        result: dict[str, Any] = run(*args)
    except Exception as exc:
        return {"status": "error", "detail": "harness: " + _one_line(exc)}
    return result


def _claim(claims: Path, case: Case, version: str) -> Path:
    return claims / case_key(case, version)


def _try_claim(path: Path, pid: int) -> bool:
    """Take a case for process ``pid`` (the first to create its claim file wins)."""
    try:
        fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_WRONLY)
    except FileExistsError:
        return False
    with os.fdopen(fd, "w") as fh:
        fh.write(str(pid))
    return True


def _owner(path: Path) -> int | None:
    try:
        return int(path.read_text() or 0) or None
    except (OSError, ValueError):
        return None


def _worker(paths: list[str], version: str, claims: Path, plain_tvm: bool = True) -> None:
    """Child process: take the cases of ``paths`` in order that no other worker of this run has
    taken (a claim file each under ``claims``), run every pipeline on each (the plain-TVM one only
    with ``plain_tvm``) and write its cache file as it finishes."""
    # the node suite's definitions only when asked for (in a fresh cache, writing them costs each
    # worker ~10 s of CPU before its first case)
    node = any(Path(p).is_relative_to(node_root()) for p in paths)
    by_model = {str(c.model): c for c in cases((*SUITES, NODE) if node else SUITES)}
    CACHE.mkdir(parents=True, exist_ok=True)
    for p in paths:
        case = by_model[p]
        if _cache_file(case, version).is_file() or not _try_claim(_claim(claims, case, version), os.getpid()):
            continue
        res: dict[str, Any] = {"case": case.id}
        with tempfile.TemporaryDirectory(prefix="conformance-") as tmp:
            t0 = time.perf_counter()
            res["project"] = _guarded(run_project, case, Path(tmp))
            res["project"]["seconds"] = round(time.perf_counter() - t0, 2)
        res["ort"] = _guarded(run_ort, case)
        res["tvm"] = (_guarded(run_tvm, case) if plain_tvm else
                      {"status": NOT_RUN, "detail": "plain TVM import not asked for (make test)"})
        dest = _cache_file(case, version)
        tmpf = dest.with_suffix(f".tmp{os.getpid()}")
        tmpf.write_text(json.dumps(res))
        tmpf.replace(dest)  # atomic: parallel runs never see half a file


def _run_batch(batch: list[Case], version: str, timeout: float, claims: Path, plain_tvm: bool = True) -> None:
    """Run the cases of ``batch`` that no other worker takes first in a child process, restarting
    it after a crash; a crashed case is recorded. ``timeout`` applies to each case (the child's
    claim file says which case it is working on)."""
    todo = list(batch)
    env = {**os.environ, "PYTHONPATH": f"{ROOT}{os.pathsep}{os.environ.get('PYTHONPATH', '')}",
           "TVM_NUM_THREADS": "1", "OMP_NUM_THREADS": "1"}

    def working_on(pid: int) -> Case | None:
        return next((c for c in todo if not _cache_file(c, version).is_file()
                     and _owner(_claim(claims, c, version)) == pid), None)

    while todo:
        with tempfile.TemporaryFile("w+") as err:
            proc = subprocess.Popen([sys.executable, "-m", "tests.compiler.conformance", version,
                                     _CLAIMS, str(claims), *([] if plain_tvm else [_NO_PLAIN_TVM]),
                                     *[str(c.model) for c in todo]], cwd=ROOT, env=env,
                                    stdout=subprocess.DEVNULL, stderr=err, text=True)
            code: int | str | None = None
            current, since = None, time.monotonic()
            while code is None:
                try:
                    code = proc.wait(timeout=5)
                except subprocess.TimeoutExpired:
                    running = working_on(proc.pid)
                    if running != current:
                        current, since = running, time.monotonic()
                    elif time.monotonic() - since > timeout:
                        proc.kill()
                        proc.wait()
                        code = "timeout"
            err.seek(0)
            tail = (err.read().strip().splitlines() or [""])[-1][:200]
        if code == "timeout":
            tail = f"no result within {timeout:.0f}s"
        culprit = working_on(proc.pid)
        if culprit is None and code != 0:  # died before taking a case: blame the next one, as before
            culprit = next((c for c in todo if not _cache_file(c, version).is_file()
                            and _try_claim(_claim(claims, c, version), proc.pid)), None)
        if culprit is not None:
            crash = {"status": "crash", "detail": f"exit {code}: {tail}"}
            _cache_file(culprit, version).write_text(json.dumps({"case": culprit.id, "project": crash,
                                                                 "ort": crash, "tvm": crash}))
        # what is left for this thread: cases nobody has taken (another worker's are its own)
        todo = [c for c in todo if not _cache_file(c, version).is_file()
                and not _claim(claims, c, version).exists()]


def _cached_enough(case: Case, version: str, plain_tvm: bool) -> bool:
    f = _cache_file(case, version)
    if not f.is_file():
        return False
    return not plain_tvm or json.loads(f.read_text())["tvm"]["status"] != NOT_RUN


def results(selected: list[Case] | None = None, workers: int = 2, timeout: float = 900.0,
            plain_tvm: bool = True) -> dict[str, dict[str, Any]]:
    """{case id: {"project": {...}, "ort": {...}, "tvm": {...}}}, computing what is not cached.
    ``plain_tvm=False``: a case not cached yet gets no plain-TVM run (its status is ``not-run``).

    The ``workers`` child processes share one queue (largest model first, each takes the next case
    nobody has taken), so none sits idle while the other still has a list of its own to finish."""
    selected = selected if selected is not None else cases()
    version = code_version()
    CACHE.mkdir(parents=True, exist_ok=True)
    missing = [c for c in selected if not _cached_enough(c, version, plain_tvm)]
    for c in missing:  # a case cached without plain TVM is run again in full
        _cache_file(c, version).unlink(missing_ok=True)
    if missing:
        # the model's size stands for its compile time: the long ones start first, the short ones
        # fill in at the end
        missing.sort(key=lambda c: c.model.stat().st_size, reverse=True)
        claims = Path(tempfile.mkdtemp(prefix="claims-", dir=CACHE))
        try:
            with ThreadPoolExecutor(workers) as pool:
                list(pool.map(lambda _: _run_batch(missing, version, timeout, claims, plain_tvm),
                              range(workers)))
        finally:
            shutil.rmtree(claims, ignore_errors=True)
    return {c.id: json.loads(_cache_file(c, version).read_text()) for c in selected}


def totals(res: dict[str, dict[str, Any]]) -> dict[str, int]:
    return {p: sum(1 for r in res.values() if r[p]["status"] == "pass") for p in PIPELINES}


# ------------------------------------------------------------------------------- node suite report
# How a result counts in the node-suite table: a refusal is an error from the compiler's error
# tree (for onnxruntime: any error); anything else that is not pass/wrong is a crash.
# An InputError at inference (the node refuses NaN/inf inputs by design) is a refusal too.
_KIND = {"pass": "pass", "wrong": "wrong", "refused": "refused", "refused-at-run": "refused",
         "skipped": "refused"}


def kind(status: str, pipeline: str = "project") -> str:
    if pipeline == "ort" and status == "error":
        return "refused"
    return _KIND.get(status, "crash")


def operator(case: Case) -> str:
    """The operator a node case tests: the first non-Constant node of its un-expanded model."""
    import onnx

    base = case.model.parent.parent / re.sub(r"_expanded.*$", "", case.name) / "model.onnx"
    model = onnx.load(str(base if base.is_file() else case.model))
    ops = [n.op_type for n in model.graph.node if n.op_type != "Constant"]
    return ops[0] if ops else "Constant"


def node_table(res: dict[str, dict[str, Any]], chosen: list[Case]) -> str:
    """Markdown table: per operator, the project's and onnxruntime's pass/wrong/refused/crash."""
    rows: dict[str, dict[str, int]] = {}
    for c in chosen:
        r = res[c.id]
        row = rows.setdefault(operator(c), dict.fromkeys(
            [f"{p} {k}" for p in ("project", "ort") for k in ("pass", "wrong", "refused", "crash")], 0))
        row[f"project {kind(r['project']['status'])}"] += 1
        row[f"ort {kind(r['ort']['status'], 'ort')}"] += 1
    kinds = ("pass", "wrong", "refused", "crash")

    def cells(row: dict[str, int], p: str) -> str:
        return " / ".join(str(row.get(f"{p} {k}", 0)) for k in kinds)

    lines = ["| operator | cases | project pass/wrong/refused/crash | onnxruntime pass/wrong/refused/crash |",
             "|---|---:|---|---|"]
    total: dict[str, int] = {}
    for op, row in sorted(rows.items()):
        n = sum(v for k, v in row.items() if k.startswith("project"))
        lines.append(f"| {op} | {n} | {cells(row, 'project')} | {cells(row, 'ort')} |")
        for k, v in row.items():
            total[k] = total.get(k, 0) + v
    lines.append(f"| **all** | {len(chosen)} | {cells(total, 'project')} | {cells(total, 'ort')} |")
    return "\n".join(lines)


def node_jsonl(res: dict[str, dict[str, Any]], chosen: list[Case]) -> str:
    """One JSON object per case, the format of bench/results/onnx-node-suite-*.jsonl."""
    out = []
    for c in chosen:
        r = res[c.id]
        row: dict[str, Any] = {"case": c.name, "ort": kind(r["ort"]["status"], "ort"),
                               "project": kind(r["project"]["status"])}
        if row["project"] != "pass" and r["project"].get("detail"):
            row["error"] = r["project"]["detail"][:300]
        if "seconds" in r["project"]:
            row["s"] = r["project"]["seconds"]
        out.append(json.dumps(row))
    return "\n".join(out) + "\n"


def _select(args: list[str]) -> list[Case]:
    suites = tuple(a for a in args if a in (*SUITES, NODE)) or SUITES
    only = [a for a in args if a not in suites]
    return [c for c in cases(suites) if not only or any(o in c.id for o in only)]


def _timeout(chosen: list[Case]) -> float:
    default = 120.0 if chosen and all(c.suite == NODE for c in chosen) else 900.0
    return float(os.environ.get("CONFORMANCE_TIMEOUT", default))


if __name__ == "__main__":
    workers = int(os.environ.get("CONFORMANCE_WORKERS", "2"))
    if len(sys.argv) >= 2 and sys.argv[1] in ("report", "table", "jsonl"):
        # report [SUITE...] [FILTER...]: per case; table: per operator (node suite); jsonl OUT: per
        # case file
        # --cached: only the cases with a result for this code version (a partial run's figures)
        args = [a for a in sys.argv[2:] if a != "--cached"]
        dest = args.pop(0) if sys.argv[1] == "jsonl" else None
        chosen = _select(args)
        if "--cached" in sys.argv:
            chosen = [c for c in chosen if _cache_file(c, code_version()).is_file()]
        res = results(chosen, workers=workers, timeout=_timeout(chosen))
        if sys.argv[1] == "table":
            print(node_table(res, [c for c in chosen if c.suite == NODE]))
        elif dest is not None:
            Path(dest).write_text(node_jsonl(res, [c for c in chosen if c.suite == NODE]))
        else:
            for cid, r in sorted(res.items()):
                print(f"{cid:<60} project={r['project']['status']:<8} ort={r['ort']['status']:<6} "
                      f"tvm={r['tvm']['status']:<6} {r['project'].get('detail', '')[:150]}")
        print(json.dumps(totals(res)), "of", len(res))
    else:
        argv = sys.argv[2:]
        at = argv.index(_CLAIMS)
        claim_dir = Path(argv[at + 1])
        del argv[at:at + 2]
        _worker([a for a in argv if a != _NO_PLAIN_TVM], sys.argv[1], claim_dir, _NO_PLAIN_TVM not in argv)
