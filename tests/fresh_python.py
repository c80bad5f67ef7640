"""Runs a test's script in a fresh Python process, on the CPU, with the repository importable.

jax fixes its device count when it starts, so a test of meshes runs its script in a new
process; the script sets `XLA_FLAGS=--xla_force_host_platform_device_count=N` before it
imports jax (or the caller passes `devices=N`).
"""

import os
import subprocess
import sys
from typing import Any, Optional

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def fresh_env(devices: Optional[int] = None) -> dict[str, str]:
    """The environment of a test's subprocess: the repository importable and jax on the
    CPU, with `devices` fake devices (None: as XLA_FLAGS already says)."""
    env = dict(os.environ, PYTHONPATH=REPO, JAX_PLATFORMS="cpu")
    if devices is not None:
        # After the suite's own flags (conftest.py), which the script keeps.
        flags = os.environ.get("XLA_FLAGS", "")
        env["XLA_FLAGS"] = f"{flags} --xla_force_host_platform_device_count={devices}".strip()
    return env


def run_python(
    script: str, *args: str, devices: Optional[int] = None, timeout: int = 300
) -> subprocess.CompletedProcess:
    """Runs `python -c script *args` from the repository root; returns the finished process."""
    return subprocess.run(
        [sys.executable, "-c", script, *args],
        cwd=REPO,
        env=fresh_env(devices),
        capture_output=True,
        text=True,
        timeout=timeout,
        check=False,
    )


def assert_prints_ok(script: str, *args: str, marker: str = "OK", **kwargs) -> str:
    """Runs `script` as `run_python` does and checks that it exits 0 having printed `marker`;
    returns its standard output."""
    result = run_python(script, *args, **kwargs)
    assert result.returncode == 0 and marker in result.stdout, (
        result.stdout[-1000:] + result.stderr[-3000:]
    )
    return result.stdout


def launch_gpt_test(trainer_dir: Any, cache_dir: Any, *overrides: str) -> subprocess.CompletedProcess:
    """Trains gpt_test for two steps through the launcher, in a process of its own on one
    CPU device, with the compilation cache at `cache_dir` (the suite's own left out) and
    `overrides` (--config_override values); checks that it exits 0."""
    command = [
        sys.executable, "-m", "axlearn.common.launch_trainer_main", "--config=gpt_test",
        "--data_dir=FAKE", f"--trainer_dir={trainer_dir}", "--jax_backend=cpu",
        f"--jax_compilation_cache_dir={cache_dir}",
        "--config_override=input.global_batch_size=2",
        "--config_override=input.max_sequence_length=16",
        "--config_override=evalers={}",
        "--config_override=max_step=2",
        "--config_override=summary_writer.write_every_n_steps=1",  # Both steps' losses.
        *(f"--config_override={o}" for o in overrides),
    ]
    env = fresh_env(1)
    env.pop("JAX_COMPILATION_CACHE_DIR", None)
    result = subprocess.run(
        command, cwd=REPO, env=env, capture_output=True, text=True, timeout=300, check=False
    )
    assert result.returncode == 0, result.stderr[-3000:]
    return result
