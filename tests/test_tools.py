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
        "op_profile", "quantize_check", "step_breakdown", "sweep_7b",
    ]


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
