"""Tuning databases shipped with the project (compiler/tuned): found and applied without trials,
keyed independently of the core count, matching the zoo models, and extended by a user's own."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import onnxruntime as ort
import pytest

from compiler import compile_model, load_artifact, tuning, zoo
from compiler.importer import import_model
from compiler.targets import get_preset

SHIPPED = tuning.shipped_db_dir()
X86 = ("x86_64", "x86_64-avx2", "x86_64-avx512")


def _shipped() -> list[tuple[Path, dict]]:
    return [(p.parent, json.loads(p.read_text())) for p in sorted(SHIPPED.glob("*/*/tune.json"))]


@pytest.fixture
def user_cache(tmp_path, monkeypatch) -> Path:
    """An empty user cache: the default database dir (no --db) lives under it."""
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    root = tuning.default_db_dir()
    assert str(root).startswith(str(tmp_path))
    return root


@pytest.fixture
def no_tuning(monkeypatch):
    """MetaSchedule's tuner, replaced by a failure: a test using it proves no trial ran."""
    from tvm.s_tir import meta_schedule as ms

    def refuse(*_a, **_k):
        raise AssertionError("the tuner was invoked")

    monkeypatch.setattr(ms.tune, "tune_tasks", refuse)
    monkeypatch.setattr(ms.relax_integration, "extract_tasks", refuse)


def test_target_key_ignores_num_cores_only(tmp_path):
    mod = import_model(zoo.build("digits-mlp")).mod
    base = dict(get_preset("x86_64-avx512").target)
    paths = {n: tuning.database_path(mod, dict(base, **{"num-cores": n}), tmp_path) for n in (1, 2, 4, 64)}
    assert len(set(paths.values())) == 1  # a database tuned on 2 cores serves a 4-core machine
    for other in ("x86_64", "x86_64-avx2"):  # another ISA is another key
        assert tuning.database_path(mod, get_preset(other).target, tmp_path).parent != paths[2].parent


# What this checkout ships (docs/benchmarks-history.md, "tuning the channels-last graph"); extend
# with the tuning.
EXPECTED = {(model, preset) for model in zoo.NAMES for preset in X86}


def test_shipped_databases_are_pruned_and_hold_the_default_budget():
    shipped = _shipped()
    assert EXPECTED <= {(m["model"], m["preset"]) for _, m in shipped}
    for path, meta in shipped:
        assert meta["preset"] in X86 and meta["model"] in zoo.NAMES
        # pruned: one record per task, every one a valid measurement
        records = (path / "database_tuning_record.json").read_text().splitlines()
        assert len(records) == meta["records"] == len(meta["best_us"]) >= 1
        # compile --tune asks for 64 trials by default: a shipped database must hold them
        assert meta["trials"] >= 64 and meta["measured_on"] == "local"
        # keyed by the preset's target minus num-cores: the same key on any core count
        many_cores = dict(get_preset(meta["preset"]).target, **{"num-cores": 64})
        assert path.parent.name == tuning._target_key(tuning._as_target(many_cores))


@pytest.mark.parametrize("model, preset", sorted({(m["model"], m["preset"]) for _, m in _shipped()}))
def test_shipped_database_matches_its_zoo_model(model, preset):
    """The directory is where a compile of the zoo model looks (workload hash unchanged), and
    every one of its records applies."""
    mod = import_model(zoo.build(model)).mod
    target = get_preset(preset).tvm_target()
    path = tuning.database_path(mod, target, SHIPPED, prepack=True)
    meta = json.loads((path / "tune.json").read_text())
    assert (meta["model"], meta["preset"]) == (model, preset)
    _, applied = tuning.apply_counted(mod, target, SHIPPED, prepack=True)
    assert applied >= meta["records"] >= 1


def test_compile_tune_uses_the_shipped_database_without_trials(tmp_path, user_cache, no_tuning, run_cli):
    onnx_path = zoo.save("digits-mlp", tmp_path / "digits.onnx")
    res = run_cli("compile", onnx_path, "--target", "x86_64", "--tune", "--out", tmp_path / "tuned")
    assert res.code == 0, res.err
    assert "using the shipped database" in res.err and "none run" in res.err
    info = json.loads((tmp_path / "tuned" / "manifest.json").read_text())["tuning"]
    assert info["schedule"] == "tuned" and info["database"] == "shipped"
    assert info["reused"] is True and info["trials_run"] == 0
    # both Gemm kernels have a shipped record; each was timed against its default schedule here
    # and the faster kept (test below)
    assert info["applied"] + info["kept_default"] >= 2
    assert not user_cache.exists()  # nothing measured, nothing written to the user cache
    # the shipped schedules differ from the untuned build's default ones, and compute the same
    untuned = compile_model(onnx_path, target="x86_64", out_dir=tmp_path / "untuned", progress=False)
    assert json.loads((untuned / "manifest.json").read_text())["tuning"]["schedule"] == "default"
    if info["applied"]:
        assert (tmp_path / "tuned" / "infer.so").read_bytes() != (untuned / "infer.so").read_bytes()
    x = np.random.default_rng(0).standard_normal((3, 64)).astype(np.float32)
    sess = ort.InferenceSession(str(onnx_path), providers=["CPUExecutionProvider"])
    want = np.concatenate([sess.run(None, {"x": x[i : i + 1]})[0] for i in range(3)])
    got = load_artifact(tmp_path / "tuned").infer({"x": x})["logits"]
    np.testing.assert_allclose(got, want, rtol=0, atol=1e-4)


def test_a_record_slower_than_the_default_schedule_is_not_used(tmp_path, user_cache, no_tuning, monkeypatch):
    """A tuned build is never slower than the untuned one: each kernel with a record is timed
    against its default schedule at compile time and the faster one is built (timings faked
    here so the outcome is known: the first kernel's default wins, the other's record)."""
    from compiler import schedules

    # (the defaults' own variant timing off: only the race calls the timer)
    real = schedules.schedule_prepared
    monkeypatch.setattr(schedules, "schedule_prepared", lambda p, t, measure=None: real(p, t, measure=False))
    timed: list[list[str]] = []

    def fake_time_all(funcs, _target):
        timed.append(sorted(funcs))
        if len(timed) == 1:  # the kernels with their records
            return {n: 1.0 for n in funcs}
        return {n: 0.5 if n == min(funcs) else 2.0 for n in funcs}  # their default schedules

    monkeypatch.setattr(schedules, "_time_all", fake_time_all)
    onnx_path = zoo.save("digits-mlp", tmp_path / "digits.onnx")
    out = compile_model(onnx_path, target="x86_64", out_dir=tmp_path / "a", tune=True, trials=64,
                        progress=False)
    info = json.loads((out / "manifest.json").read_text())["tuning"]
    assert len(timed) == 2 and timed[0] == timed[1] and len(timed[0]) >= 2, timed
    assert info["database"] == "shipped" and info["trials_run"] == 0
    assert info["kept_default"] == 1 and info["applied"] == len(timed[0]) - 1
    x = np.random.default_rng(1).standard_normal((2, 64)).astype(np.float32)
    sess = ort.InferenceSession(str(onnx_path), providers=["CPUExecutionProvider"])
    want = np.concatenate([sess.run(None, {"x": x[i : i + 1]})[0] for i in range(2)])
    np.testing.assert_allclose(load_artifact(out).infer({"x": x})["logits"], want, rtol=0, atol=1e-4)


def test_explicit_db_ignores_the_shipped_databases(tmp_path):
    mod = import_model(zoo.build("digits-mlp")).mod
    with pytest.raises(tuning.CompilerError, match="no tuning database"):
        tuning.apply(mod, "x86_64", tmp_path / "db", prepack=True)
    assert tuning.apply_counted(mod, "x86_64", tmp_path / "db", prepack=True, shipped=True)[1] >= 2


def _funcs(mod) -> dict[str, object]:
    import tvm

    return {gv.name_hint: f for gv, f in mod.functions.items() if isinstance(f, tvm.tirx.PrimFunc)}


@pytest.mark.slow
def test_user_tuning_extends_and_wins_over_the_shipped_database(tmp_path, user_cache, monkeypatch):
    """A budget beyond the shipped one tunes into the user cache; the user's records win for
    the tasks they cover, the shipped ones fill the rest; the user database is then reused."""
    import tvm_ffi

    shipped = tmp_path / "shipped"
    mod = import_model(zoo.build("digits-mlp")).mod
    src = tuning.database_path(mod, "x86_64", SHIPPED, prepack=True)
    dst = shipped / src.parent.name / src.name
    shutil.copytree(src, dst)
    meta = json.loads((dst / "tune.json").read_text())
    (dst / "tune.json").write_text(json.dumps({**meta, "trials": 2}))  # a small shipped budget
    monkeypatch.setattr(tuning, "shipped_db_dir", lambda: shipped)

    assert tuning.tune(mod, "x86_64", trials=2, prepack=True, progress=False).source == "shipped"
    res = tuning.tune(mod, "x86_64", trials=4, prepack=True, progress=False)  # more than shipped
    assert res.source == "user" and res.trials_run == 4 and not res.reused
    user = Path(res.path)
    assert user.parent.parent == user_cache
    again = tuning.tune(mod, "x86_64", trials=4, prepack=True, progress=False)
    assert again.reused and again.trials_run == 0 and again.source == "user"

    def funcs(db_dir, **kw):
        return _funcs(tuning.apply(mod, "x86_64", db_dir, prepack=True, **kw))

    only_user = funcs(user_cache, shipped=False)
    only_shipped = funcs(shipped, shipped=False)
    both = funcs(None, prefer="user")
    assert both.keys() == only_user.keys() == only_shipped.keys()
    # (4 trials vs the shipped best: the two databases schedule some kernel differently)
    assert any(not tvm_ffi.structural_equal(f, only_shipped[n]) for n, f in only_user.items())
    for name, f in both.items():
        assert tvm_ffi.structural_equal(f, only_user[name]), name
    # the user database loses one task's records: the shipped record fills it in
    lines = (user / "database_tuning_record.json").read_text().splitlines(keepends=True)
    (user / "database_tuning_record.json").write_text("".join(x for x in lines if x.startswith("[0,")))
    assert tuning.apply_counted(mod, "x86_64", user_cache, prepack=True, shipped=False)[1] == 1
    both = funcs(None, prefer="user")
    partial = funcs(user_cache, shipped=False)
    scheduled = {n for n, f in both.items() if bool(f.attrs.get("tirx.is_scheduled", 0))
                 and not n.endswith("_weight_prepack")}  # (the layout rewrites of a schedule)
    taken = {n for n in scheduled if n in partial and tvm_ffi.structural_equal(both[n], partial[n])}
    filled = {n for n in scheduled - taken
              if n in only_shipped and tvm_ffi.structural_equal(both[n], only_shipped[n])}
    assert len(taken) == 1 and len(filled) == 1, (scheduled, taken, filled)
