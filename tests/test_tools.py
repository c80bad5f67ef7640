"""Every tool under tools/ starts on the CPU and prints its usage (how to run it)."""

import pathlib
import subprocess
import sys

import pytest

from tests.fresh_python import REPO, fresh_env

_TOOLS = sorted(p.stem for p in (pathlib.Path(REPO) / "tools").glob("*.py"))


def test_the_tools_are_the_maintained_ones():
    assert _TOOLS == [
        "attention_check", "checkpoint_check", "generate_bench", "kernel_check", "matmul_check",
        "op_profile", "peft_bench", "quantize_check", "start_time", "step_breakdown", "sweep_7b",
    ]


@pytest.mark.slow
def test_start_time_times_a_cold_start_and_two_that_load_the_train_step_from_the_cache(tmp_path):
    env = fresh_env(1)
    env.pop("JAX_COMPILATION_CACHE_DIR", None)  # The tool's starts share a cache of their own.
    proc = subprocess.run(
        [sys.executable, "tools/start_time.py", "--config=gpt_test", "--max_step=50",
         f"--workdir={tmp_path / 'work'}", "--config_override=input.global_batch_size=2",
         "--config_override=input.max_sequence_length=16", "--config_override=evalers={}"],
        cwd=REPO, env=env, capture_output=True, text=True, timeout=600, check=False,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    # Each start: its row, then the trainer's "Started in ..." line of its phases.
    lines = proc.stdout.splitlines()[-6:]
    rows, starts = lines[0::2], lines[1::2]
    assert rows[0].startswith("cold (empty cache)") and "(not in the compilation cache)" in rows[0]
    for row, name in zip(rows[1:], ("warm: restart of the run", "warm: new run, same config")):
        assert row.startswith(name) and "% of cold" in row
    # The restart loads the step its cold start stored (untraced); the new run, from the cache.
    assert "Loaded the train step as compiled by an earlier start" in rows[1]
    assert rows[2].endswith("(loaded from the compilation cache)")
    assert "state (init)" in starts[0] and "not in the compilation cache" in starts[0]
    assert "state (restore)" in starts[1] and "state (init)" in starts[2]
    for start in starts:
        assert start.strip().startswith("Started in ") and "train step ready" in start
    for log, start in zip(("cold", "restart", "new_run"), starts):  # Each start's whole output.
        assert start.strip() in (tmp_path / "work" / "logs" / f"{log}.log").read_text()


@pytest.mark.slow
@pytest.mark.parametrize("tool", _TOOLS)
def test_help_names_the_tool_s_command_line(tool):
    proc = subprocess.run(
        [sys.executable, f"tools/{tool}.py", "--help"],
        cwd=REPO, env=fresh_env(), capture_output=True, text=True, timeout=300, check=False,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout.startswith(f"usage: {tool}.py")
    assert f"python tools/{tool}.py" in proc.stdout  # The docstring's command line.
    assert f"\nflags of python tools/{tool}.py:\n  --" in proc.stdout


@pytest.mark.slow
@pytest.mark.parametrize("tool", _TOOLS)
def test_a_wrong_flag_is_one_line_and_exit_status_2(tool):
    proc = subprocess.run(
        [sys.executable, f"tools/{tool}.py", "--no_such_flag=1"],
        cwd=REPO, env=fresh_env(), capture_output=True, text=True, timeout=300, check=False,
    )
    assert proc.returncode == 2, proc.stderr[-3000:]
    assert proc.stderr == f"tools/{tool}.py: error: Unknown command line flag 'no_such_flag'\n"
