"""benchmarks/optimizer_state_check.py: gpt_test trained twice on the CPU, and its window means."""

import json
import math
import platform
import subprocess
import sys

import jax.numpy as jnp
import numpy as np
import pytest

from axlearn.common.optimizers import StochasticRoundingState
from axlearn.common.split_float import round_to_float24
from benchmarks import optimizer_state_check
from tests.fresh_python import REPO, fresh_env


def test_window_means_group_steps_by_the_window_they_end():
    losses = {1: 4.0, 2: 2.0, 3: 3.0, 4: 5.0, 6: 1.0}
    assert optimizer_state_check._window_means(losses, 2) == {2: 3.0, 4: 4.0, 6: 1.0}


def test_state_label_names_the_state_tensors_dtype_and_stochastic_rounding():
    state = {"count": jnp.zeros((), jnp.int32), "scale": jnp.ones((), jnp.float32)}
    label = optimizer_state_check._state_label
    assert label({**state, "mu": jnp.zeros((3,), jnp.bfloat16)}) == "bfloat16"
    mixed = {**state, "mu": jnp.zeros((3,), jnp.bfloat16), "nu": jnp.zeros((2, 2), jnp.float32)}
    assert label(mixed) == "bfloat16 mu, float32 nu"
    # Through the wrappers' fields and tuple positions to the state's own field names.
    nested = StochasticRoundingState(
        (
            {"nu": {"w": jnp.zeros((2,), jnp.float32), "b": jnp.zeros((2,), jnp.float32)}},
            {"mu": {"w": jnp.zeros((2,), jnp.bfloat16)}, "v": jnp.zeros((2,), jnp.bfloat16)},
        ),
        count=jnp.zeros((), jnp.int32),
    )
    assert label(nested) == "bfloat16 mu+v, float32 nu, stochastic rounding"
    rounded = StochasticRoundingState(
        {"mu": jnp.zeros((3,), jnp.bfloat16)}, count=jnp.zeros((), jnp.int32)
    )
    assert label({"inner": rounded}) == "bfloat16, stochastic rounding"
    # A Float24 pair (uint16, uint8) is one state tensor of its own kind.
    f24 = round_to_float24(jnp.zeros((3,), jnp.float32))
    assert label({**state, "mu": f24, "nu": f24}) == "float24"
    mixed = {**state, "mu": f24, "nu": jnp.zeros((3,), jnp.float32)}
    assert label(mixed) == "float24 mu, float32 nu"


def _record(dtype, evals, train=None, seed=0):
    losses = {"eval": {str(step): loss for step, loss in evals.items()}}
    if train is not None:
        losses["train"] = {str(step): loss for step, loss in train.items()}
    return {"config": "c", "config_overrides": [], "seed": seed, "state": dtype, "losses": losses}


def test_summarize_matches_a_numpy_derivation():
    f32 = {100: [3.0, 3.2, 2.9], 200: [2.5, 2.4, 2.7]}
    bf16 = {100: [3.1, 3.3], 200: [2.8, 2.6]}
    runs = [_record("bfloat16", {s: v[i] for s, v in bf16.items()}) for i in range(2)]
    runs += [_record("float32", {s: v[i] for s, v in f32.items()}) for i in range(3)]
    runs.append(_record("float32", {100: 3.0}))  # Logs no step 200: that step is left out.
    rows = optimizer_state_check.summarize(runs, "eval")
    assert [row["step"] for row in rows] == [100]
    runs.pop()
    rows = optimizer_state_check.summarize(runs, "eval")
    assert [row["step"] for row in rows] == [100, 200]
    for row in rows:
        a, b = np.array(f32[row["step"]]), np.array(bf16[row["step"]])
        assert row["reference"] == "float32"
        assert row["groups"]["float32"]["n"] == 3
        assert row["groups"]["float32"]["mean"] == pytest.approx(a.mean())
        assert row["groups"]["bfloat16"]["sd"] == pytest.approx(b.std(ddof=1))
        diff = row["diffs"]["bfloat16"]
        assert diff["diff"] == pytest.approx(b.mean() - a.mean())
        se = np.sqrt(a.var(ddof=1) / 3 + b.var(ddof=1) / 2)
        assert diff["se"] == pytest.approx(se)


def test_summarize_matches_seeds_as_a_numpy_derivation():
    # Seeds 1-3 with float32 runs; bfloat16 has seeds 1, 2 (two runs of seed 2) and 4, which
    # float32 lacks: the pairs are seeds 1 and 2, and seed 2's two runs count as their mean.
    f32 = [(1, 3.0), (1, 3.2), (2, 2.5), (3, 2.9)]
    bf16 = [(1, 3.3), (2, 2.6), (2, 2.8), (4, 9.9)]
    runs = [_record("float32", {100: loss}, seed=seed) for seed, loss in f32]
    runs += [_record("bfloat16", {100: loss}, seed=seed) for seed, loss in bf16]
    (row,) = optimizer_state_check.summarize(runs, "eval")
    pairs = np.array([3.3 - np.mean([3.0, 3.2]), np.mean([2.6, 2.8]) - 2.5])
    diff = row["diffs"]["bfloat16"]
    assert diff["seeds"] == 2
    assert diff["paired_diff"] == pytest.approx(pairs.mean())
    assert diff["paired_se"] == pytest.approx(pairs.std(ddof=1) / np.sqrt(2))
    # The groups' means still use every run, seed 4's too.
    groups = np.mean([x for _, x in bf16]) - np.mean([x for _, x in f32])
    assert diff["diff"] == pytest.approx(groups)
    # No shared seed: no paired difference, not an error.
    alone = [_record("float32", {100: 3.0}, seed=1), _record("bfloat16", {100: 3.1}, seed=2)]
    (row,) = optimizer_state_check.summarize(alone, "eval")
    assert row["diffs"]["bfloat16"]["seeds"] == 0
    assert math.isnan(row["diffs"]["bfloat16"]["paired_diff"])


def test_summarize_groups_a_recipe_override_apart_from_its_state_dtype():
    # float24 state with and without a recipe override, seeds 1 and 2 each; older float24
    # records (no "recipe_overrides" key) join the plain float24 group.
    plain = [(1, 2.40), (2, 2.30)]
    no_clip = [(1, 2.45), (2, 2.41)]
    clip_off = "learner.optimizer.inner.raw_update_clipping_threshold=None"
    runs = [dict(_record("float24", {700: x}, seed=seed), recipe_overrides=[]) for seed, x in plain]
    runs += [
        dict(_record("float24", {700: x}, seed=seed), recipe_overrides=[clip_off])
        for seed, x in no_clip
    ]
    runs.append(_record("float24", {700: 2.35}, seed=3))
    (row,) = optimizer_state_check.summarize(runs, "eval")
    label = f"float24, {clip_off}"
    assert row["reference"] == "float24"
    assert {k: g["n"] for k, g in row["groups"].items()} == {"float24": 3, label: 2}
    a, b = np.array([2.40, 2.30, 2.35]), np.array([2.45, 2.41])
    diff = row["diffs"][label]
    assert diff["diff"] == pytest.approx(b.mean() - a.mean())
    assert diff["se"] == pytest.approx(np.sqrt(a.var(ddof=1) / 3 + b.var(ddof=1) / 2))
    pairs = np.array([2.45 - 2.40, 2.41 - 2.30])
    assert diff["paired_diff"] == pytest.approx(pairs.mean())
    assert diff["paired_se"] == pytest.approx(pairs.std(ddof=1) / np.sqrt(2))


def test_summarize_compares_with_a_chosen_reference():
    # float24 state against gpt_1b_narrow_state's label, which sorts first: it would be the
    # reference unless another is named.
    narrow = "bfloat16 gradient_square_ema, float16 update_ema"
    runs = [_record("float24", {700: x}, seed=seed) for seed, x in [(1, 2.40), (2, 2.30)]]
    runs += [_record(narrow, {700: x}, seed=seed) for seed, x in [(1, 2.41), (2, 2.33)]]
    (row,) = optimizer_state_check.summarize(runs, "eval")
    assert row["reference"] == narrow  # The first in sorted order.
    (row,) = optimizer_state_check.summarize(runs, "eval", reference="float24")
    assert row["reference"] == "float24"
    assert {k: g["n"] for k, g in row["groups"].items()} == {"float24": 2, narrow: 2}
    assert row["diffs"][narrow]["paired_diff"] == pytest.approx(np.mean([0.01, 0.03]))
    with pytest.raises(SystemExit, match="--reference='float32' names no group"):
        optimizer_state_check.summarize(runs, "eval", reference="float32")


def _with_setup(run, device, python="3.12.3"):
    run["setup"] = {"device": device, "python": python, "data_dir": "BUILTIN"}
    return run


def test_summary_warns_where_a_group_ran_only_on_other_setups(capsys):
    # float24 on H200s only, float32 on H100s only: the difference mixes in the setups'.
    runs = [_with_setup(_record("float32", {100: 3.0}), "NVIDIA H100 80GB HBM3") for _ in range(2)]
    runs += [_with_setup(_record("float24", {100: 3.1}), "NVIDIA H200") for _ in range(2)]
    optimizer_state_check._print_summary(runs, window=0)
    out = capsys.readouterr().out
    assert "float32: 2 x NVIDIA H100 80GB HBM3, Python 3.12.3, data BUILTIN" in out
    assert "WARNING: float24 and float32 ran on different setups" in out
    # One float32 run on an H200 too: a setup in common, no warning.
    runs.append(_with_setup(_record("float32", {100: 3.0}), "NVIDIA H200"))
    optimizer_state_check._print_summary(runs, window=0)
    assert "WARNING" not in capsys.readouterr().out
    # Records from before setups were recorded: listed as such, no warning.
    optimizer_state_check._print_summary([_record("float32", {100: 3.0}), runs[2]], window=0)
    out = capsys.readouterr().out
    assert "float32: 1 x not recorded" in out and "WARNING" not in out
    # Another Python alone (another built-in corpus) is another setup.
    other_python = [_with_setup(_record("float32", {100: 3.0}), "NVIDIA H200", python="3.11.7")]
    optimizer_state_check._print_summary(other_python + runs[2:4], window=0)
    assert "WARNING: float24 and float32" in capsys.readouterr().out


def test_summary_lists_a_group_by_file_where_its_runs_came_from_several(tmp_path, capsys):
    # float32 from two files (two hosts' calls) whose means differ; float24 from one.
    host_a, host_b, f24 = [3.0, 3.2, 3.1], [2.8, 2.9], [3.0, 3.05]
    files = {
        "a.json": {f"r{i}": _record("float32", {100: 3.5, 200: x}) for i, x in enumerate(host_a)},
        "b.json": {f"r{i}": _record("float32", {100: 3.5, 200: x}) for i, x in enumerate(host_b)},
        "c.json": {f"r{i}": _record("float24", {100: 3.5, 200: x}) for i, x in enumerate(f24)},
    }
    for name, records in files.items():
        (tmp_path / name).write_text(json.dumps(records))
    runs = optimizer_state_check._load_runs([str(tmp_path / name) for name in files])
    assert [run["file"] for run in runs] == ["a.json"] * 3 + ["b.json"] * 2 + ["c.json"] * 2
    optimizer_state_check._print_summary(runs, window=0)
    out = capsys.readouterr().out
    a, b = np.array(host_a), np.array(host_b)
    assert f"  float32: a.json {a.mean():.4f} ± {a.std(ddof=1):.4f} (n=3); " in out
    assert f"b.json {b.mean():.4f} ± {b.std(ddof=1):.4f} (n=2)" in out
    assert "Evaler 'eval' loss at step 200 by file" in out
    # float24 came from one file: nothing to list for it.
    assert "c.json" not in out
    # A file of one run: its loss alone.
    optimizer_state_check._print_summary(runs[:4], window=0)
    assert f"b.json {host_b[0]:.4f} (n=1)" in capsys.readouterr().out


def test_summarize_windows_the_training_loss():
    runs = [_record("float32", {}, train={1: 4.0, 2: 2.0, 3: 1.0, 4: 3.0}) for _ in range(2)]
    rows = optimizer_state_check.summarize(runs, "train", window=2)
    assert [(r["step"], r["groups"]["float32"]["mean"]) for r in rows] == [(2, 3.0), (4, 2.0)]
    assert rows[0]["diffs"] == {}
    # One run has no spread: the standard deviation is NaN, not an error.
    one = optimizer_state_check.summarize(runs[:1], "train", window=2)
    assert math.isnan(one[0]["groups"]["float32"]["sd"])


def _run(tmp_path, *flags):
    out = tmp_path / "losses.json"
    _tool(
        "--config=gpt_test",
        f"--trainer_dir={tmp_path / 'runs'}", f"--json_out={out}",
        "--config_override=max_step=6", "--config_override=summary_writer.write_every_n_steps=1",
        "--config_override=evalers['validation'].eval_policy.n=3",
        "--config_override=evalers['validation'].eval_policy.max_step=6",
        *flags,
    )
    return out


def _tool(*flags) -> str:
    return subprocess.run(
        [sys.executable, "benchmarks/optimizer_state_check.py", *flags],
        cwd=REPO, env=fresh_env(), check=True, capture_output=True, text=True, timeout=600,
    ).stdout


@pytest.mark.parametrize(
    "flags, message",
    [
        (
            ["--cast_only", "--cast_first"],
            "--cast_only and --configured_only train one run: --cast_first has nothing to order",
        ),
        (["--cast_only", "--configured_only"], "give --cast_only or --configured_only, not both"),
    ],
)
def test_contradictory_run_flags_are_refused(flags, message):
    result = subprocess.run(
        [sys.executable, "benchmarks/optimizer_state_check.py", "--trainer_dir=/nonexistent",
         *flags],
        cwd=REPO, env=fresh_env(), capture_output=True, text=True, timeout=600,
    )
    assert result.returncode == 2
    assert message in result.stderr


def test_a_float32_cast_changes_nothing_and_bfloat16_changes_the_losses(tmp_path):
    # On the CPU the sums are deterministic: the float32 control must equal the run as
    # configured to the bit, at every training step and every evaluation, which fails if
    # the cast wrapper itself changed the update.
    control_file = _run(tmp_path / "f32", "--state_dtype=float32", "--window=2")
    control = {name: run["losses"] for name, run in json.loads(control_file.read_text()).items()}
    assert set(control) == {"as_configured", "float32_state"}
    for source in ("train", "validation"):
        assert control["as_configured"][source] == control["float32_state"][source]
    assert sorted(control["as_configured"]["train"], key=int) == [str(s) for s in range(1, 7)]
    assert sorted(control["as_configured"]["validation"], key=int) == ["3", "6"]
    # The bfloat16 run trains first here (--cast_first) and is reported second all the same.
    rounded_file = _run(tmp_path / "bf16", "--cast_first", "--config_override=seed=3")
    records = json.loads(rounded_file.read_text())
    assert list(records) == ["as_configured", "bfloat16_state"]
    assert [r["state"] for r in records.values()] == ["float32", "bfloat16"]
    setup = {"device": "cpu", "python": platform.python_version(), "data_dir": None}
    assert [r["setup"] for r in records.values()] == [setup, setup]
    assert {r["seed"] for r in records.values()} == {3}
    assert "seed=3" in records["as_configured"]["config_overrides"]
    rounded = {name: run["losses"] for name, run in records.items()}
    assert rounded["as_configured"]["train"] != control["as_configured"]["train"]  # Seed 3.
    assert rounded["as_configured"]["train"] != rounded["bfloat16_state"]["train"]

    # --cast_only trains the bfloat16 run alone: the same run (the CPU's sums are
    # deterministic), recorded alone.
    alone_file = _run(tmp_path / "alone", "--cast_only", "--config_override=seed=3")
    alone = json.loads(alone_file.read_text())
    assert list(alone) == ["bfloat16_state"]
    assert alone["bfloat16_state"]["losses"] == rounded["bfloat16_state"]
    # --configured_only trains the config as it is, alone: the first run of that pair.
    configured = json.loads(
        _run(tmp_path / "configured", "--configured_only", "--config_override=seed=3").read_text()
    )
    assert list(configured) == ["as_configured"]
    assert configured["as_configured"]["losses"] == rounded["as_configured"]

    # The files together: three float32 runs and two bfloat16 runs.
    summary = _tool("--summarize", str(control_file), str(rounded_file), str(alone_file))
    assert "float32 (n=3)" in summary and "bfloat16 (n=2)" in summary
    last = summary.strip().splitlines()[-1].split("|")
    assert last[0].strip() == "6"
    bf16_at_6 = rounded["bfloat16_state"]["validation"]["6"]
    assert last[2].strip().startswith(f"{bf16_at_6:.4f}")


def test_a_recipe_override_is_applied_and_recorded_apart(tmp_path):
    # Adastar without its update clipping (which fires in gpt_test's first steps): the
    # losses differ from the clipped run of the same seed, and the record names the override.
    clip_off = "learner.optimizer.inner.raw_update_clipping_threshold=None"
    clipped = _run(tmp_path / "clipped", "--cast_only", "--state_dtype=float32")
    unclipped = _run(
        tmp_path / "unclipped", "--cast_only", "--state_dtype=float32",
        f"--recipe_override={clip_off}",
    )
    (a,) = json.loads(clipped.read_text()).values()
    (b,) = json.loads(unclipped.read_text()).values()
    assert a["recipe_overrides"] == [] and b["recipe_overrides"] == [clip_off]
    assert clip_off not in b["config_overrides"]
    assert a["losses"]["train"]["1"] == b["losses"]["train"]["1"]  # The same initial weights.
    assert a["losses"]["train"]["6"] != b["losses"]["train"]["6"]
    summary = _tool("--summarize", str(clipped), str(unclipped))
    assert "float32 (n=1)" in summary and f"float32, {clip_off} (n=1)" in summary


def test_an_evaler_that_never_ran_is_left_out_of_the_record(tmp_path):
    # Evaluation every 10 steps up to step 20 in a 6-step run: the evaler writes no summaries.
    out = _run(
        tmp_path, "--cast_only", "--state_dtype=float32",
        "--config_override=evalers['validation'].eval_policy.n=10",
        "--config_override=evalers['validation'].eval_policy.max_step=20",
    )
    (record,) = json.loads(out.read_text()).values()
    assert list(record["losses"]) == ["train"]
    assert sorted(record["losses"]["train"], key=int) == [str(s) for s in range(1, 7)]


def test_differences_under_the_fourth_decimal_print_in_scientific_notation():
    assert optimizer_state_check._difference(0.0012, 0.0018) == "+0.0012 ± 0.0018"
    assert optimizer_state_check._difference(-1.2e-6, 1.9e-6) == "-1.2e-06 ± 1.9e-06"
