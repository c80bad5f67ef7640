"""Runs a test's script in a fresh Python process, on the CPU, with the repository importable.

jax fixes its device count when it starts, so a test of meshes runs its script in a new
process; the script sets `XLA_FLAGS=--xla_force_host_platform_device_count=N` before it
imports jax (or the caller passes `devices=N`).
"""

import os
import subprocess
import sys
from typing import Optional

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
