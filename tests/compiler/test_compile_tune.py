"""compile_model's --tune wiring: what it hands to compiler.tuning, what it builds, what the manifest
says. The tuning itself (MetaSchedule, database reuse) is tested in test_tuning*.py; here the
measurement is replaced by the database-less lowering so the wiring test takes seconds."""

from __future__ import annotations

import json

import numpy as np
import onnxruntime as ort

from compiler import compile_model, host_preset_name, load_artifact


def test_tune_wiring_and_manifest(tmp_path, mlp_onnx, monkeypatch):
    from compiler import schedules, tuning

    calls = {}

    def fake_tune(mod, target, *, trials, db_dir, progress, time_budget, prepack, remote, **_kw):
        calls["tune"] = (target.kind.name, trials, db_dir, time_budget, prepack, remote)
        assert "main" in [gv.name_hint for gv in mod.get_global_vars()]
        return tuning.TuneResult("llvm-test/abc123", False, trials, 1.5)

    def fake_apply(mod, target, db_dir, *, prepack, prefer, **_kw):
        calls["apply"] = db_dir
        assert prefer == "user"  # the database tune() used is read first
        # the form apply_tuned() returns; no records: every kernel keeps its default schedule
        return schedules.TunedBuild(schedules.apply(mod, target), 0, 0)

    monkeypatch.setattr(tuning, "tune", fake_tune)
    monkeypatch.setattr(schedules, "apply_tuned", fake_apply)
    out = compile_model(
        mlp_onnx,
        target=host_preset_name(),
        out_dir=tmp_path / "a",
        tune=True,
        trials=12,
        db_dir=tmp_path / "db",
        progress=False,
    )
    assert calls["tune"] == ("llvm", 12, tmp_path / "db", None, True, None)
    assert calls["apply"] == tmp_path / "db"
    t = json.loads((out / "manifest.json").read_text())["tuning"]
    assert t["tuned"] is True and t["db_id"] == "llvm-test/abc123" and t["trials"] == 12
    assert t["trials_run"] == 12 and t["reused"] is False
    assert t["database"] == "user" and t["applied"] == 0  # (the fake applies no records)
    x = np.random.default_rng(0).standard_normal((4, 8)).astype(np.float32)
    sess = ort.InferenceSession(str(mlp_onnx), providers=["CPUExecutionProvider"])
    want = np.concatenate([sess.run(None, {"x": x[i : i + 1]})[0] for i in range(4)])
    np.testing.assert_allclose(load_artifact(out).infer({"x": x})["y"], want, atol=1e-4)


def test_tune_foreign_target_is_one_clear_line(run_cli, tmp_path, mlp_onnx):
    from compiler.targets import host_arch

    foreign = "rpi4" if host_arch() != "aarch64" else "x86_64"
    res = run_cli(
        "compile",
        mlp_onnx,
        "--target",
        foreign,
        "--out",
        tmp_path / "o",
        "--tune",
        "--trials",
        "4",
        "--db",
        tmp_path / "db",
        "-q",
    )
    assert res.code == 1
    assert res.error_line.startswith("error: cannot tune for this target here"), res.err
    assert not (tmp_path / "o").exists()


def test_bad_trials(run_cli, tmp_path, mlp_onnx):
    res = run_cli(
        "compile",
        mlp_onnx,
        "--target",
        host_preset_name(),
        "--out",
        tmp_path / "o",
        "--tune",
        "--trials",
        "0",
        "-q",
    )
    assert res.code == 1 and "--trials must be >= 1" in res.error_line
