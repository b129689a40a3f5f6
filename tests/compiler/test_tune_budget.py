"""Tuning budgets: --trials split into an equal share per task, --time-budget, progress per task."""

from __future__ import annotations

import json

import pytest

from compiler import tuning, zoo
from compiler.build import TuneBudget, tune_model
from compiler.errors import CompilerError
from compiler.importer import import_model


def test_plan_gives_every_task_its_share():
    assert tuning._plan(64, 6) == (64, 4, 11)  # 11 per task at most, rounds of 4
    assert tuning._plan(8, 2) == (8, 4, 4)
    assert tuning._plan(4, 6) == (4, 1, 1)  # fewer trials than tasks: one each for the first four
    assert tuning._plan(2048, 9) == (2048, 56, 228)
    glob, per_iter, per_task = tuning._plan(None, 3)  # a time budget alone: small rounds, no share
    assert glob >= 100_000 and per_iter == 8 and per_task is None


def test_reuse_rule():
    assert tuning._reusable({"trials": 64, "seconds": 10.0}, 64, None)
    assert not tuning._reusable({"trials": 32, "seconds": 10.0}, 64, None)
    assert tuning._reusable({"trials": 8, "seconds": 30.0}, None, 20.0)
    assert not tuning._reusable({"trials": 8, "seconds": 10.0}, None, 20.0)
    assert not tuning._reusable(None, 1, None)


def test_budget_must_be_positive(tmp_path):
    mod = import_model(zoo.build("digits-mlp")).mod
    for kw in ({"trials": 0}, {"trials": None, "time_budget": 0.0}, {"trials": None}):
        with pytest.raises(CompilerError):
            tuning.tune(mod, "x86_64", db_dir=tmp_path, progress=False, **kw)


@pytest.mark.slow
def test_trials_are_shared_and_progress_is_per_task(tmp_path, capfd):
    onnx_path = zoo.save("digits-mlp", tmp_path / "digits.onnx")
    res = tune_model(onnx_path, target="x86_64", budget=TuneBudget(trials=6), db_dir=tmp_path / "db")
    err = capfd.readouterr().err
    meta = json.loads((tuning.Path(res.path) / "tune.json").read_text())
    assert meta["per_task"] and sorted(meta["per_task"].values()) == [3, 3]
    assert res.trials_run == 6 and meta["trials"] == 6
    assert "budget 6 trials (3 per task)" in err
    for name in meta["per_task"]:
        assert f"{name}: 3 trials, best " in err  # one line per measured round, per task


@pytest.mark.slow
def test_time_budget_stops_tuning_and_is_reused(tmp_path, run_cli):
    onnx_path = zoo.save("digits-mlp", tmp_path / "digits.onnx")
    res = run_cli("compile", onnx_path, "--target", "x86_64", "--tune", "--time-budget", "1", "--db",
                  tmp_path / "db", "--out", tmp_path / "art")
    assert res.code == 0, res.err
    assert "time budget of 1 s spent after" in res.err
    info = json.loads((tmp_path / "art" / "manifest.json").read_text())["tuning"]
    assert info["time_budget"] == 1.0 and info["trials"] == 0 and not info["reused"]
    # MetaSchedule's first round gives each task one batch of 8 before it checks the clock
    assert 1 <= info["trials_run"] <= 16
    path = tuning.Path(tmp_path / "db") / info["db_id"]
    assert json.loads((path / "tune.json").read_text())["trials"] == info["trials_run"]
    assert (path / "database_tuning_record.json").read_text().strip()
    budget = TuneBudget(trials=None, time_budget=1.0)
    again = tune_model(onnx_path, target="x86_64", budget=budget, db_dir=tmp_path / "db", progress=False)
    assert again.reused and again.trials_run == 0
