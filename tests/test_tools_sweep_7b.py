"""Tests of tools/sweep_7b.py: the plan it checks, the settings the FP8 run inherits and
how a run that overstays its cap is recorded."""

import dataclasses
import importlib.util
import os

import pytest

from tests.fresh_python import REPO, fresh_env

_SPEC = importlib.util.spec_from_file_location("sweep_7b", os.path.join(REPO, "tools", "sweep_7b.py"))
sweep = importlib.util.module_from_spec(_SPEC)
_SPEC.loader.exec_module(sweep)


def _finished(name, config, rate, overrides=(), xla_flags=""):
    return {
        "name": name, "config": config, "tokens_per_s_per_device": rate,
        "overrides": sweep.run_overrides(sweep.Run(name, config, "", tuple(overrides))),
        "xla_flags": xla_flags,
    }


def test_fp8_run_takes_the_overrides_and_flags_of_the_fastest_finished_base_run():
    fp8 = sweep.Run("fp8", "gpt_7b_fp8", "FP8", best_of="gpt_7b")
    results = [
        _finished("slow", "gpt_7b", 9_000.0, ["a=1"]),
        _finished("fast", "gpt_7b", 11_000.0, ["b=2", "c=3"], "--x=1"),
        _finished("other", "moe_8x1b", 30_000.0, ["d=4"]),
        {"name": "failed", "config": "gpt_7b", "error": "stopped"},
    ]
    resolved = sweep.resolve_best(fp8, results)
    assert resolved.config == "gpt_7b_fp8"
    assert sweep.run_overrides(resolved) == [f"input.global_batch_size={sweep.GLOBAL_BATCH}", "b=2", "c=3"]
    assert resolved.xla_flags == "--x=1"


def test_fp8_run_is_skipped_when_no_base_run_finished():
    fp8 = sweep.Run("fp8", "gpt_7b_fp8", "FP8", best_of="gpt_7b")
    assert sweep.resolve_best(fp8, [{"name": "x", "config": "gpt_7b", "error": "stopped"}]) is None


def test_an_fp8_run_with_no_base_run_finished_waits_for_the_next_base_run(monkeypatch, capsys):
    runs = (
        sweep.Run("base_a", "gpt_7b", "", ("a=1",)),
        sweep.Run("fp8", "gpt_7b_fp8", "", best_of="gpt_7b"),
        sweep.Run("moe", "moe_8x1b", ""),
        sweep.Run("base_b", "gpt_7b", "", ("b=2",)),
    )
    ran = []

    def fake_run_one(run, *, timeout_s, mesh_selector):
        del timeout_s, mesh_selector
        ran.append((run.name, run.overrides))
        if run.name == "base_a":  # Out of memory, say.
            return {"name": run.name, "config": run.config, "error": "exited with 1"}
        return {**_finished(run.name, run.config, 1.0, run.overrides), "settings": ""}

    monkeypatch.setattr(sweep, "RUNS", runs)
    monkeypatch.setattr(sweep, "run_one", fake_run_one)
    monkeypatch.setattr(sweep, "check_runs", lambda *_: None)
    assert sweep.main([]) == 0
    assert ran == [("base_a", ("a=1",)), ("moe", ()), ("base_b", ("b=2",)), ("fp8", ("b=2",))]
    assert "exited with 1" in capsys.readouterr().out


def test_dry_run_builds_every_run_s_config_for_the_4_gpu_host(capsys):
    assert sweep.main(["--dry_run"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert [line.split(":")[0] for line in lines] == [run.name for run in sweep.RUNS]


def test_dry_run_builds_every_one_gpu_run_s_config_under_the_h200_rule(capsys):
    assert sweep.main(["--gpus=1", "--dry_run"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert [line.split(":")[0] for line in lines] == [run.name for run in sweep.ONE_GPU_RUNS]
    for run, line in zip(sweep.ONE_GPU_RUNS, lines):
        assert f"input.global_batch_size={run.global_batch}" in line


def test_a_run_s_allocator_share_is_set_in_its_process_environment(monkeypatch):
    seen = {}

    class FakeProcess:
        pid = 0

        def __init__(self, argv, env, **_):
            seen.update(argv=argv, env=env)

        def wait(self, timeout=None):
            del timeout
            return 1

    monkeypatch.setattr(sweep.subprocess, "Popen", FakeProcess)
    monkeypatch.delenv("XLA_PYTHON_CLIENT_MEM_FRACTION", raising=False)
    run = sweep.Run("r", "gpt_7b", "", mem_fraction=0.9)
    record = sweep.run_one(run, timeout_s=1, mesh_selector="gpu-h200-1")
    assert seen["env"]["XLA_PYTHON_CLIENT_MEM_FRACTION"] == "0.9"
    assert record["error"] == "exited with 1 (its log above)"
    sweep.run_one(dataclasses.replace(run, mem_fraction=None), timeout_s=1, mesh_selector="x")
    assert "XLA_PYTHON_CLIENT_MEM_FRACTION" not in seen["env"]


def test_a_bad_override_fails_before_any_run(monkeypatch):
    bad = sweep.Run("bad", "gpt_7b", "", ("model.decoder.no_such_field=1",))
    monkeypatch.setattr(sweep, "RUNS", (bad,))
    with pytest.raises(SystemExit, match="run 'bad'"):
        sweep.main(["--dry_run"])


def test_a_run_past_its_cap_is_stopped_and_recorded_as_such(monkeypatch):
    monkeypatch.setattr(os, "environ", fresh_env())
    run = sweep.Run("t", "gpt_test", "tiny")
    record = sweep.run_one(run, timeout_s=0.5, mesh_selector="cpu")
    assert record["error"].startswith("stopped after")
    assert "tokens_per_s_per_device" not in record


@pytest.mark.slow
def test_a_finished_run_has_bench_s_columns_and_its_compile_time(monkeypatch):
    monkeypatch.setattr(os, "environ", fresh_env())
    record = sweep.run_one(sweep.Run("t", "gpt_test", "tiny"), timeout_s=300, mesh_selector="cpu")
    assert "error" not in record
    assert record["tokens_per_s_per_device"] > 0
    assert record["microbatches_per_step"] == 1
    assert 0 < record["compile_s"] < record["wall_s"]
    assert record["name"] in sweep.format_table([record])
