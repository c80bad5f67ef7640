"""The benchmark tool: its table and Diff column, comparing two trees or two git revisions,
and the profile and HLO-dump switches, all on the CPU."""

import html
import json
import os
import pathlib
import subprocess
import sys
import time

import jax
import pytest

from axlearn import bench
from axlearn.common import file_system, launch
from axlearn.common.input_tokens import build_token_shards
from axlearn.common.input_vocab import ByteVocabulary
from axlearn.common.mesh_selection import instance_type, mesh_rule_for

REPO = pathlib.Path(__file__).resolve().parents[1]


# gpt_test with a batch of 4 sequences of 64 tokens: each CPU step takes milliseconds.
SMALL_BATCH = (
    "--config_override=input.global_batch_size=4",
    "--config_override=input.max_sequence_length=64",
)
SMALL_BATCH_TOKENS = 4 * 64


def _run_bench_cli(tmp_path, *flags: str, xla_flags: str = "") -> str:
    """Runs `python -m axlearn.bench --config=gpt_test --warmup_steps=1 SMALL_BATCH FLAGS`
    on the CPU in `tmp_path`, with `xla_flags` after the suite's XLA_FLAGS; returns its
    stdout."""
    cmd = [
        sys.executable, "-m", "axlearn.bench", "--config=gpt_test", "--warmup_steps=1",
        *SMALL_BATCH, *flags,
    ]
    env = dict(os.environ, PYTHONPATH=str(REPO), JAX_PLATFORMS="cpu")
    if xla_flags:
        env["XLA_FLAGS"] = f"{os.environ.get('XLA_FLAGS', '')} {xla_flags}".strip()
    if any("xla_dump" in arg for arg in (*flags, xla_flags)):
        # A program loaded from the suite's compilation cache is never compiled, so dumped.
        env.pop("JAX_COMPILATION_CACHE_DIR", None)
    proc = subprocess.run(cmd, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return proc.stdout


def _result(tokens_per_s: float, step_s: float, loss: float) -> dict:
    return dict(
        num_params=1000,
        final_loss=loss,
        tflops_per_device=1.0,
        tokens_per_s_per_device=tokens_per_s,
        avg_step_time_s=step_s,
        memory_percent=50.0,
        mfu_percent=float("nan"),
        jax_version="x",
        device="1x cpu",
        losses=[3.0, loss],
        step_times=[step_s, step_s],
    )


def test_table_has_a_diff_column_that_marks_direction():
    table = bench.format_table(
        {"main": _result(1000.0, 0.2, 2.0), "branch": _result(1200.0, 0.25, 2.0)}
    )
    lines = {line.split("|")[0].strip(): line for line in table.splitlines()}
    assert "Diff (branch - main)" in lines["Metric"]
    assert "+200 (+20.0%) improved" in lines["Tokens/s/device"]
    assert "(+25.0%) REGRESSED" in lines["Avg s/step"]  # Slower steps are worse.
    assert "~" in lines["Final loss"]  # Under 1%: no mark either way.
    assert lines["MFU"].count("nan") == 2  # Unknown peak: shown, never compared.


def test_a_frozen_dpo_reference_has_a_row_of_its_own_only_where_a_run_holds_one():
    dpo = dict(_result(1000.0, 0.2, 2.0), reference_params=1000)
    table = bench.format_table({"sft": _result(1000.0, 0.2, 2.0), "dpo": dpo})
    lines = {line.split("|")[0].strip(): line for line in table.splitlines()}
    assert [c.strip() for c in lines["Parameters"].split("|")[1:3]] == ["1,000", "1,000"]
    assert [c.strip() for c in lines["Frozen DPO reference"].split("|")[1:3]] == ["-", "1,000"]
    plain = bench.format_table({"sft": _result(1000.0, 0.2, 2.0)})
    assert "Frozen DPO reference" not in plain


def test_gpu_rows_show_a_dash_where_nothing_was_sampled():
    with_gpu = dict(_result(1000.0, 0.2, 2.0), sm_clock_mhz=1512.4, gpu_power_w=695.2)
    table = bench.format_table({"h100": with_gpu, "cpu": _result(1000.0, 0.2, 2.0)})
    lines = {line.split("|")[0].strip(): line for line in table.splitlines()}
    assert [c.strip() for c in lines["SM clock (MHz)"].split("|")[1:3]] == ["1,512", "-"]
    assert [c.strip() for c in lines["GPU power (W)"].split("|")[1:3]] == ["695", "-"]


def test_parse_gpu_samples_skips_what_it_cannot_read():
    text = "1980, 126.66\n1455, 693.00\n[N/A], [N/A]\n1500\n\n1470, 69"
    assert bench.parse_gpu_samples(text) == [(1980.0, 126.66), (1455.0, 693.0), (1470.0, 69.0)]


def _fake_nvidia_smi(tmp_path, monkeypatch, body: str) -> pathlib.Path:
    """An 'nvidia-smi' first on PATH that logs its arguments and runs `body`."""
    script = tmp_path / "bin" / "nvidia-smi"
    script.parent.mkdir()
    script.write_text(f'#!/bin/sh\necho "$@" > {tmp_path}/args\n{body}\n')
    script.chmod(0o755)
    monkeypatch.setenv("PATH", f"{script.parent}{os.pathsep}{os.environ['PATH']}")
    return tmp_path / "args"


def test_gpu_sampler_averages_the_samples_of_the_visible_gpus(tmp_path, monkeypatch):
    printed = tmp_path / "printed"
    args = _fake_nvidia_smi(
        tmp_path,
        monkeypatch,
        f"echo '1500, 700.0'; echo '1700, 500.0'; echo '[N/A], 1.0'; touch {printed}; exec sleep 30",
    )
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "2,3")
    sampler = bench.GpuSampler(interval_ms=50)
    sampler.start()
    deadline = time.monotonic() + 10
    while not printed.exists() and time.monotonic() < deadline:
        time.sleep(0.02)
    assert sampler.stop() == {"sm_clock_mhz": 1600.0, "gpu_power_w": 600.0}
    logged = args.read_text()
    assert "--query-gpu=clocks.sm,power.draw" in logged
    assert "--loop-ms=50" in logged and "--id=2,3" in logged


def test_gpu_sampler_without_nvidia_smi_samples_nothing(tmp_path, monkeypatch):
    monkeypatch.setenv("PATH", str(tmp_path))  # No nvidia-smi anywhere on it.
    sampler = bench.GpuSampler()
    sampler.start()
    assert sampler.stop() == {}


def test_gpu_time_ms_calls_once_to_compile_then_traces_the_calls():
    calls = []

    def fn(x):
        calls.append(x)
        return x + 1

    total, per_kernel = bench.gpu_time_ms(fn, 1.0, calls=3)
    assert len(calls) == 4
    assert (total, per_kernel) == (0.0, {})  # The CPU has no GPU stream in its trace.


class _FakeDevice:
    """A device that runs dispatched steps one after another, `step_time` each, on a
    virtual clock: a dispatch costs the host `dispatch_time`, and waiting on a step moves
    the clock to that step's completion."""

    def __init__(self, step_time: int, dispatch_time: int):
        self.step_time, self.dispatch_time = step_time, dispatch_time
        self.now = 0
        self.finish_times: list[int] = []
        self.idle: list[int] = []  # Between each step's completion and the next one's start.
        self.awaited_ahead: list[int] = []  # Steps dispatched beyond the one awaited.

    def clock(self) -> int:
        return self.now

    def dispatch(self) -> "_FakeLoss":
        self.now += self.dispatch_time
        begin = max([self.now] + self.finish_times[-1:])
        if self.finish_times:
            self.idle.append(begin - self.finish_times[-1])
        self.finish_times.append(begin + self.step_time)
        return _FakeLoss(self, len(self.finish_times) - 1)


class _FakeLoss:
    def __init__(self, device: _FakeDevice, index: int):
        self.device, self.index = device, index

    def block_until_ready(self):
        device = self.device
        device.awaited_ahead.append(len(device.finish_times) - 1 - self.index)
        device.now = max(device.now, device.finish_times[self.index])
        return self


def test_time_steps_times_each_step_with_the_next_one_queued():
    device = _FakeDevice(step_time=50, dispatch_time=1)
    step_times, losses = bench.time_steps(device.dispatch, 6, clock=device.clock)
    assert [loss.index for loss in losses] == list(range(6))
    # One step is always queued behind the awaited one, except after the last...
    assert device.awaited_ahead == [1, 1, 1, 1, 1, 0]
    # ...so the device never waits for the host between steps,
    assert device.idle == [0] * 5
    # and each step's time is the device's; the first also holds the first dispatch.
    assert step_times == [51, 50, 50, 50, 50, 50]


def test_rounds_alternate_the_order_and_average_each_side():
    order = []
    rates = {"main": iter([100.0, 110.0, 120.0]), "branch": iter([200.0, 190.0, 180.0])}

    def run(tree):
        order.append(tree)
        rate = next(rates[tree])
        return dict(_result(rate, 1.0 / rate, 2.0), losses=[len(order)])

    results = bench.run_in_rounds({"main": "main", "branch": "branch"}, run, rounds=3)
    assert order == ["main", "branch", "branch", "main", "main", "branch"]
    assert results["main"]["tokens_per_s_per_device"] == 110.0
    assert results["branch"]["runs_tokens_per_s_per_device"] == [200.0, 190.0, 180.0]
    assert results["branch"]["avg_step_time_s"] == sum(1 / r for r in (200, 190, 180)) / 3
    assert results["main"]["losses"] == [1]  # Curves and text columns: the first run's.
    assert results["main"]["device"] == "1x cpu"
    with pytest.raises(ValueError, match="rounds must be at least 1"):
        bench.run_in_rounds({"main": "main"}, run, rounds=0)


def test_summarize_trace_without_a_trace(tmp_path):
    assert "No GPU kernels" in bench.summarize_trace(str(tmp_path), steps=1)


@pytest.mark.slow
def test_compare_dirs_runs_both_trees_and_writes_the_page(tmp_path):
    trees = []
    for name in ("base", "head"):
        tree = tmp_path / name
        tree.mkdir()
        for package in ("axlearn", "experiments"):
            (tree / package).symlink_to(REPO / package)
        trees.append(str(tree))
    page, out = tmp_path / "cmp.html", tmp_path / "cmp.json"
    stdout = _run_bench_cli(
        tmp_path, "--steps=2", f"--compare_dirs={','.join(trees)}", f"--html={page}",
        f"--json_out={out}",
    )
    assert "Diff (head - base)" in stdout
    results = json.loads(out.read_text())
    assert set(results) == {"base", "head"}
    for result in results.values():
        assert result["tokens_per_s_per_device"] > 0 and len(result["losses"]) == 3
        assert result["tokens_per_step"] == SMALL_BATCH_TOKENS
        assert result["microbatches_per_step"] == 1
    text = page.read_text()
    assert "<svg" in text and "Loss per step" in text and "Diff (head - base)" in text


@pytest.mark.slow
def test_compare_xla_flags_runs_this_tree_under_each_side_s_flags(tmp_path):
    # Each side dumps its HLO where its own flag says; the environment's --xla_dump_to
    # comes first on both sides, so it must stay empty (XLA takes a flag's last value).
    env_dump, dump_a, dump_b = (tmp_path / name for name in ("env", "a", "b"))
    side_a, side_b = f"--xla_dump_to={dump_a}", f"--xla_dump_to={dump_b}"
    out = tmp_path / "cmp.json"
    stdout = _run_bench_cli(
        tmp_path, "--steps=1", f"--compare_xla_flags={side_a}", f"--compare_xla_flags={side_b}",
        f"--json_out={out}", xla_flags=f"--xla_dump_to={env_dump}",
    )
    assert f"Diff ({side_b} - {side_a})" in stdout
    assert set(json.loads(out.read_text())) == {side_a, side_b}
    for dump in (dump_a, dump_b):
        assert list(dump.glob("*train_step*after_optimizations.txt")), f"nothing in {dump}"
    assert not env_dump.exists() or not list(env_dump.iterdir())


@pytest.mark.parametrize(
    "flags, message",
    [
        (["--compare_xla_flags=", "--compare=HEAD,HEAD^"], "at most one of"),
        (["--compare_xla_flags=--xla_a=1"], "given twice"),
        (["--compare_xla_flags=", "--compare_xla_flags="], "two different settings"),
        (
            ["--compare_xla_flags=", "--compare_xla_flags=--a", "--config_override=no_such=1"],
            "side 'gpt_test': <root> (SpmdTrainer.Config) has no field 'no_such'",
        ),
        (["--compare=HEAD,HEAD^", "--profile_dir=/tmp/p"], "trace or dump one run"),
        (["--compare_dirs=a,b", "--xla_dump_dir=/tmp/d"], "trace or dump one run"),
    ],
)
def test_comparisons_reject_what_they_cannot_do(flags, message, capsys):
    with pytest.raises(SystemExit):
        bench.main(["--config=gpt_test", *flags])
    assert message in capsys.readouterr().err


def test_comparison_runs_get_a_local_data_dir_as_an_absolute_path(tmp_path, monkeypatch):
    for split in ("train", "validation"):
        build_token_shards(
            ["some text"], vocab=ByteVocabulary(), output_prefix=str(tmp_path / "data" / split)
        )
    monkeypatch.chdir(tmp_path)
    calls = []

    def fake_run(tree, argv, *, xla_flags=""):
        calls.append((tree, list(argv), xla_flags))
        return _result(100.0, 1.0, 2.0)

    monkeypatch.setattr(bench, "_run_in_tree", fake_run)
    bench.main(["--config=gpt_test", "--data_dir=data", "--compare_xla_flags=", "--compare_xla_flags=--a"])
    assert [c[2] for c in calls] == ["", "--a"]
    assert all(f"--data_dir={tmp_path / 'data'}" in argv for _, argv, _ in calls)
    assert all(tree == str(REPO) for tree, _, _ in calls)
    calls.clear()
    url = "memory://bench-data-dir/data"  # A storage URL passes as it is.
    for path in (tmp_path / "data").iterdir():
        file_system.write_bytes(f"{url}/{path.name}", path.read_bytes())
    bench.main(["--config=gpt_test", f"--data_dir={url}", "--compare_dirs=a,b"])
    assert [c[0] for c in calls] == ["a", "b"]
    assert all(f"--data_dir={url}" in argv for _, argv, _ in calls)


def test_compare_configs_runs_each_named_config_of_this_tree_in_rounds(tmp_path, monkeypatch):
    calls = []

    def fake_run(tree, argv, *, xla_flags=""):
        calls.append((tree, list(argv)))
        rate = 110.0 if "--config=gpt_125m" in argv else 100.0
        return _result(rate, 1.0, 2.0)

    monkeypatch.setattr(bench, "_run_in_tree", fake_run)
    page, out = tmp_path / "cmp.html", tmp_path / "cmp.json"
    bench.main([
        "--compare_configs=gpt_test,gpt_125m", "--rounds=2", "--steps=3",
        "--config_override=input.global_batch_size=4", f"--html={page}", f"--json_out={out}",
    ])
    configs = [[a for a in argv if a.startswith("--config=")] for _, argv in calls]
    # A B, then B A.
    assert configs == [["--config=gpt_test"], ["--config=gpt_125m"],
                       ["--config=gpt_125m"], ["--config=gpt_test"]]
    assert all(tree == str(REPO) for tree, _ in calls)
    assert all("--steps=3" in argv and "--config_override=input.global_batch_size=4" in argv
               for _, argv in calls)
    results = json.loads(out.read_text())
    assert results["gpt_125m"]["tokens_per_s_per_device"] == 110.0
    assert "gpt_test vs gpt_125m" in page.read_text()


def test_compare_overrides_runs_one_config_with_each_side_s_overrides_last(tmp_path, monkeypatch):
    calls = []

    def fake_run(tree, argv, *, xla_flags=""):
        calls.append(list(argv))
        return _result(110.0 if "--config_override=max_step=7" in argv else 100.0, 1.0, 2.0)

    monkeypatch.setattr(bench, "_run_in_tree", fake_run)
    page, out = tmp_path / "cmp.html", tmp_path / "cmp.json"
    description = "learner.optimizer.inner.adam_update_transformation.per_param_scale.description"
    side = f"max_step=7 \"{description}='x y'\""  # Shell quoting keeps 'x y' one value.
    bench.main([
        "--config=gpt_test", "--config_override=max_step=5", "--compare_overrides=",
        f"--compare_overrides={side}", "--rounds=2", f"--html={page}", f"--json_out={out}",
    ])
    overrides = [[a for a in argv if a.startswith("--config_override=")] for argv in calls]
    shared = ["--config_override=max_step=5"]
    side_b = ["--config_override=max_step=7", f"--config_override={description}='x y'"]
    # As configured, then the overrides, then the other way round; each side's after the
    # shared ones, so that they win where both set a field.
    assert overrides == [shared, shared + side_b, shared + side_b, shared]
    assert all("--config=gpt_test" in argv for argv in calls)
    results = json.loads(out.read_text())
    assert list(results) == ["as configured", side]
    assert results[side]["tokens_per_s_per_device"] == 110.0
    assert "gpt_test: as configured vs max_step=7" in html.unescape(page.read_text())


@pytest.mark.parametrize(
    "flags, message",
    [
        (["--compare_overrides=a=1"], "given twice"),
        (["--compare_overrides=a=1", "--compare_overrides=a=1"], "two different settings"),
        (["--compare_overrides=", "--compare_overrides=a"], "each override is PATH=VALUE"),
        (["--compare_overrides=", "--compare_overrides=a='1"], "--compare_overrides=\"a='1\""),
        (  # gpt_test's optimizer is Adastar itself, with no `rounding`: fails before running.
            ["--compare_overrides=", "--compare_overrides=learner.optimizer.inner.rounding=x"],
            "side 'learner.optimizer.inner.rounding=x': learner.optimizer.inner",
        ),
        (
            ["--compare_overrides=", "--compare_overrides=a=1", "--compare_dirs=c,d"],
            "at most one of",
        ),
    ],
)
def test_compare_overrides_rejects_what_it_cannot_do(flags, message, capsys):
    with pytest.raises(SystemExit):
        bench.main(["--config=gpt_test", *flags])
    assert message in capsys.readouterr().err


@pytest.mark.parametrize(
    "flags, message",
    [
        ([], "give --config, or --compare_configs in its place"),
        (["--config=gpt_test", "--compare_configs=a,b"], "give --config, or --compare_configs"),
        (["--compare_configs=gpt_test"], "two different config names"),
        (["--compare_configs=a,a"], "two different config names"),
        (["--compare_configs=a,b", "--compare_dirs=c,d"], "at most one of"),
        (["--compare_configs=gpt_test,no_such_config"], "side 'no_such_config'"),
    ],
)
def test_compare_configs_rejects_what_it_cannot_do(flags, message, capsys):
    with pytest.raises(SystemExit):
        bench.main(flags)
    assert message in capsys.readouterr().err


@pytest.fixture(name="single_run", scope="module")
def fixture_single_run(tmp_path_factory):
    """One benchmark run with a trace, an HLO dump, and the 4 sequences on one CPU device
    one at a time: (its directory, its stdout)."""
    tmp_path = tmp_path_factory.mktemp("single_run")
    stdout = _run_bench_cli(
        tmp_path, "--steps=1", f"--profile_dir={tmp_path / 'prof'}",
        f"--xla_dump_dir={tmp_path / 'dump'}", "--config_override=per_device_microbatch_size=1",
    )
    return tmp_path, stdout


@pytest.mark.slow
def test_profile_and_xla_dump_switches_save_a_trace_and_the_hlo(single_run):
    tmp_path, _ = single_run
    assert list((tmp_path / "prof").rglob("*.xplane.pb")), "no trace of the timed steps"
    dumped = (tmp_path / "dump").glob("*train_step*after_optimizations.txt")
    assert list(dumped), "no optimized HLO"


@pytest.mark.slow
def test_the_table_shows_the_microbatches_a_step_runs(single_run):
    _, stdout = single_run
    lines = {line.split("|")[0].strip(): line for line in stdout.splitlines() if "|" in line}
    assert lines["Microbatches/step"].split("|")[1].strip() == "4"
    assert lines["Tokens/step"].split("|")[1].strip() == f"{SMALL_BATCH_TOKENS:,}"


@pytest.mark.slow
def test_compare_benchmarks_two_git_revisions(tmp_path):
    # HEAD and its tree are the same code under two names: the path from revision to
    # exported tree to table is what is checked.
    if subprocess.run(["git", "-C", str(REPO), "rev-parse", "HEAD"], capture_output=True).returncode:
        pytest.skip("not a git checkout")
    revs = "HEAD,HEAD^{tree}"
    stdout = _run_bench_cli(tmp_path, "--steps=1", f"--compare={revs}", f"--json_out={tmp_path / 'cmp.json'}")
    assert "Diff (HEAD^{tree} - HEAD)" in stdout
    assert set(json.loads((tmp_path / "cmp.json").read_text())) == {"HEAD", "HEAD^{tree}"}


def test_write_json_writes_indented_json_and_nothing_without_a_path(tmp_path):
    path = tmp_path / "out.json"
    bench.write_json(str(path), {"a": [1, 2]})
    assert json.loads(path.read_text()) == {"a": [1, 2]}
    assert path.read_text().startswith('{\n "a"')  # indent=1, as the scripts wrote it.
    bench.write_json(None, {"b": 1})
    assert [p.name for p in tmp_path.iterdir()] == ["out.json"]


# ----- one-line errors and the mesh selector -----


def test_an_unknown_config_name_is_one_line_on_stderr(capsys):
    assert bench.main(["--config=gpt_tst", "--steps=1"]) == 1
    err = capsys.readouterr().err
    assert err.startswith("axlearn.bench: Unknown config 'gpt_tst'")
    assert "Did you mean: gpt_test" in err
    assert err.count("\n") == 1  # No traceback.


class _Built(Exception):
    """Stops a benchmark once its config is built."""


def _mesh_rule_of_the_run(monkeypatch, *flags: str):
    """The mesh rule `bench.main(["--config=gpt_test", *flags])` builds its config with."""
    built = {}

    def build(config, **kwargs):
        built.update(kwargs)
        raise _Built

    monkeypatch.setattr(launch, "setup", lambda **kwargs: None)  # Leaves XLA_FLAGS alone.
    monkeypatch.setattr(bench, "build_benchmark_config", build)
    with pytest.raises(_Built):
        bench.main(["--config=gpt_test", *flags])
    rules = [("cpu", (1, -1)), ("gpu-.*", (-1, 1))]
    return mesh_rule_for(built["mesh_selector"], rules, devices=built["devices"])


def test_without_a_mesh_selector_the_run_names_it_from_its_devices(monkeypatch):
    device = jax.devices()[0]
    expected = instance_type(device.platform, device.device_kind, jax.device_count())
    assert _mesh_rule_of_the_run(monkeypatch).selector == expected
    assert _mesh_rule_of_the_run(monkeypatch, "--mesh_selector=none") is None


def test_a_mesh_selector_that_contradicts_the_devices_is_one_line_on_stderr(monkeypatch, capsys):
    monkeypatch.setattr(launch, "setup", lambda **kwargs: None)
    assert bench.main(["--config=gpt_test", "--mesh_selector=tpu-v5p-8"]) == 1
    err = capsys.readouterr().err
    assert err.startswith("axlearn.bench: --mesh_selector=tpu-v5p-8 contradicts this run's devices")
    assert err.count("\n") == 1
