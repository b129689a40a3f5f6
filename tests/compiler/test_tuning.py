"""MetaSchedule tuning: a real (small) tuning run whose output matches onnxruntime, database reuse
on recompile, the database key, and the refusal to tune what this machine cannot time."""

from __future__ import annotations

import json
import time

import numpy as np
import onnxruntime as ort
import pytest

from compiler import compile_model, host_preset_name, load_artifact, tuning, zoo
from compiler.errors import CompilerError, TargetError
from compiler.importer import import_model
from compiler.targets import get_preset

TRIALS = 8
# --tune --train: the inference module has 2 tuning tasks and the training module 5; 5 trials still
# measure every task of both (3+2 and 1 each), which is what the gradient check needs
TRAIN_TRIALS = 5


@pytest.fixture(scope="module")
def digits_mod():
    return import_model(zoo.build("digits-mlp")).mod


def _scheduled(mod) -> list[str]:
    import tvm

    return [
        gv.name_hint
        for gv, f in mod.functions.items()
        if isinstance(f, tvm.tirx.PrimFunc)
        and f.attrs is not None
        and bool(f.attrs.get("tirx.is_scheduled", 0))
    ]


@pytest.mark.slow
def test_tune_compile_reuse(tmp_path, capfd):
    onnx_path = zoo.save("digits-mlp", tmp_path / "digits.onnx")
    db = tmp_path / "db"
    t0 = time.perf_counter()
    first = compile_model(
        onnx_path,
        target=host_preset_name(),
        out_dir=tmp_path / "a",
        tune=True,
        trials=TRIALS,
        db_dir=db,
        progress=True,
    )
    t_first = time.perf_counter() - t0
    err = capfd.readouterr().err
    assert "tuning" in err and f"{TRIALS}/{TRIALS}" in err  # the rich progress bar (stderr)
    m1 = json.loads((first / "manifest.json").read_text())["tuning"]
    assert m1["tuned"] is True and m1["reused"] is False and m1["trials_run"] == TRIALS
    # one database, under <target key>/<workload hash>, with measured records
    (path,) = [p for p in db.glob("*/*") if p.is_dir()]
    assert m1["db_id"] == f"{path.parent.name}/{path.name}"
    records = (path / "database_tuning_record.json").read_text().splitlines()
    assert len(records) >= 1
    meta = json.loads((path / "tune.json").read_text())
    assert meta["trials"] == TRIALS and meta["tasks"] == 2  # the two Gemm (matmul) tasks

    # tuned output == onnxruntime (batch 5 through the batch-1 artifact)
    x = np.random.default_rng(3).standard_normal((5, 64)).astype(np.float32)
    sess = ort.InferenceSession(str(onnx_path), providers=["CPUExecutionProvider"])
    want = np.concatenate([sess.run(None, {"x": x[i : i + 1]})[0] for i in range(5)])
    np.testing.assert_allclose(load_artifact(first).infer({"x": x})["logits"], want, rtol=0, atol=1e-4)
    assert _scheduled(
        tuning.apply(
            import_model(zoo.build("digits-mlp")).mod, get_preset(host_preset_name()).tvm_target(), db,
            prepack=True,  # (compile_model pre-packs tuned inference builds)
        )
    )

    # recompiling the same model for the same target reuses the records: no trials, much faster
    t0 = time.perf_counter()
    second = compile_model(
        onnx_path,
        target=host_preset_name(),
        out_dir=tmp_path / "b",
        tune=True,
        trials=TRIALS,
        db_dir=db,
        progress=False,
    )
    t_second = time.perf_counter() - t0
    m2 = json.loads((second / "manifest.json").read_text())["tuning"]
    assert m2["reused"] is True and m2["trials_run"] == 0 and m2["db_id"] == m1["db_id"]
    assert (path / "database_tuning_record.json").read_text().splitlines() == records
    assert t_second < t_first / 2, (t_first, t_second)
    np.testing.assert_allclose(load_artifact(second).infer({"x": x})["logits"], want, rtol=0, atol=1e-4)


def test_database_key_is_target_and_workload(digits_mod, tmp_path):
    host = get_preset(host_preset_name()).tvm_target()
    p = tuning.database_path(digits_mod, host, tmp_path)
    assert p.parent.parent == tmp_path
    # deterministic, and weights do not matter (parameters are runtime inputs)
    assert tuning.database_path(import_model(zoo.build("digits-mlp", seed=5)).mod, host, tmp_path) == p
    # another architecture or another target gets another database
    assert tuning.database_path(import_model(zoo.build("sensor-mlp")).mod, host, tmp_path).name != p.name
    other = tuning.database_path(digits_mod, get_preset("x86_64-avx2").tvm_target(), tmp_path)
    assert other.parent.name != p.parent.name and other.name == p.name
    assert p.parent.name.startswith("llvm-x86_64-")


def test_default_db_dir_is_user_cache():
    import platformdirs

    assert tuning.default_db_dir() == tuning.Path(platformdirs.user_cache_dir("fractal-edge")) / "tuning"


@pytest.mark.parametrize(
    "preset, ok",
    [("x86_64", True), ("x86_64-avx2", None), ("rpi4", False), ("aarch64", False), ("riscv64-rvv", False)],
)
def test_can_measure_only_host_runnable_targets(preset, ok):
    if ok is None:  # depends on this CPU
        ok = {"avx2", "fma"} <= tuning._cpu_flags()
    assert tuning.can_measure(get_preset(preset).target)[0] is ok


def test_can_measure_checks_cpu_features(monkeypatch):
    monkeypatch.setattr(tuning, "_cpu_flags", lambda: {"sse2", "avx2", "fma"})
    good = {"kind": "llvm", "mtriple": "x86_64-linux-gnu", "mattr": ["+avx2"]}
    bad = {"kind": "llvm", "mtriple": "x86_64-linux-gnu", "mattr": ["+avx512f"]}
    assert tuning.can_measure(good) == (True, "")
    assert tuning.can_measure(bad) == (False, "this CPU lacks avx512f")


def test_foreign_target_refuses_to_tune_with_a_hint(digits_mod, tmp_path):
    with pytest.raises(TargetError) as ei:
        tuning.tune(digits_mod, "rpi4", trials=4, db_dir=tmp_path)
    assert "cannot tune for this target here" in str(ei.value) and "aarch64" in str(ei.value)
    assert "--db" in ei.value.hint
    assert not any(tmp_path.iterdir())  # nothing measured, nothing written


def test_bad_trials(digits_mod, tmp_path):
    with pytest.raises(CompilerError, match="trials must be >= 1"):
        tuning.tune(digits_mod, host_preset_name(), trials=0, db_dir=tmp_path)


def test_apply_without_database_is_a_clear_error(digits_mod, tmp_path):
    with pytest.raises(CompilerError) as ei:
        tuning.apply(digits_mod, host_preset_name(), tmp_path)
    assert "no tuning database" in str(ei.value) and "--tune" in ei.value.hint


def test_apply_foreign_target_database_needs_no_measurement(digits_mod, tmp_path):
    # a database tuned elsewhere can be applied for any target: here an empty one for rpi4
    # (no records: the module is lowered and keeps default schedules)
    path = tuning.database_path(digits_mod, "rpi4", tmp_path)
    path.mkdir(parents=True)
    (path / "database_workload.json").write_text("")
    (path / "database_tuning_record.json").write_text("")
    mod = tuning.apply(digits_mod, "rpi4", tmp_path)
    assert _scheduled(mod) == [] and "main" in [gv.name_hint for gv in mod.get_global_vars()]
    # as the compiler builds it, the kernels no record covers get the untuned build's schedules
    # (unmeasured: this machine cannot time rpi4 code, so there is no race either)
    from compiler.schedules import apply_tuned

    built = apply_tuned(digits_mod, "rpi4", tmp_path)
    assert built.applied == 0 and built.kept_default == 0 and _scheduled(built.mod)


@pytest.mark.slow
def test_tuned_training_module_matches_pytorch(tmp_path, mlp_onnx):
    """--tune --train tunes the training module's own tasks too; its gradients and SGD step stay right."""
    from compiler import TrainSettings
    from tests.compiler.test_training import _assert_grads_close, _mlp_torch, _torch_loss_grad

    train = TrainSettings(loss="ce", optimizer="sgd", lr=0.1, batch=8)
    out = compile_model(mlp_onnx, target=host_preset_name(), out_dir=tmp_path / "a", tune=True,
                        trials=TRAIN_TRIALS, db_dir=tmp_path / "db", train=train, progress=False)
    manifest = json.loads((out / "manifest.json").read_text())
    tt = manifest["training"]["tuning"]
    assert manifest["training"]["tuned"] is True and tt["tuned"] is True and tt["trials_run"] > 0
    assert tt["db_id"] != manifest["tuning"]["db_id"]  # the training workloads have their own database
    for info in (manifest["tuning"], tt):  # every task of both modules was measured
        meta = json.loads((tmp_path / "db" / info["db_id"] / "tune.json").read_text())
        assert meta["tasks"] >= 2 and min(meta["per_task"].values()) >= 1, meta
        assert len(meta["per_task"]) == meta["tasks"], meta
    art = load_artifact(out)
    tr = art.trainer
    rng = np.random.default_rng(7)
    x = rng.standard_normal((8, 8)).astype(np.float32)
    y = rng.integers(0, 4, 8).astype(np.int64)
    loss, grads = tr.loss_and_grad(art.params, x, y)
    ref_loss, ref_grads = _torch_loss_grad(_mlp_torch, art.params, x, y, "ce")
    assert loss == pytest.approx(ref_loss, rel=1e-5)
    _assert_grads_close(grads, ref_grads, art.param_names)
    new, _ = tr.apply(art.params, grads, tr.init_state(art.params))
    for p, g, q in zip(art.params, grads, new, strict=True):
        np.testing.assert_allclose(q, p - np.float32(0.1) * g, atol=1e-6)
