"""Settings for the whole suite, so that it means the same on a GPU as on the CPU, and so
that it compiles each program once.

The tests compare float32 results with NumPy and a resumed or rewritten run's losses with
the original's, bit for bit. On the CPU both hold as written. On a GPU, XLA would by
default multiply float32 matrices in TF32 (about 3 decimal digits) and sum some gradients
with atomic adds in whatever order the threads arrive; the two settings below turn that
off for the tests. Scripts that the tests start in fresh processes run on the CPU
(`fresh_python`), where neither setting changes anything.

Many tests build the same tiny trainer, whose step and initialization take seconds to
compile on a CPU: a persistent compilation cache in a temporary directory, made for this
pytest run and removed after it, lets every test after the first load the compiled
program instead. The pytest-xdist workers and the tests' subprocesses inherit its
directory through the environment. A cache hit skips XLA, so a test of what XLA writes
(an HLO dump) turns the cache off for itself.
"""

import os
import shutil
import tempfile

# XLA reads its flags once, when the first backend starts: before any test imports jax.
_DETERMINISTIC = "--xla_gpu_deterministic_ops=true"
if "--xla_gpu_deterministic_ops" not in os.environ.get("XLA_FLAGS", ""):
    os.environ["XLA_FLAGS"] = f"{os.environ.get('XLA_FLAGS', '')} {_DETERMINISTIC}".strip()

# The process that makes the cache directory (pytest itself, or xdist's controller, which
# starts the workers after this runs) removes it when the run ends.
_CACHE_ENV = "JAX_COMPILATION_CACHE_DIR"
_OWNED_CACHE_DIR = None
if not os.environ.get(_CACHE_ENV):
    _OWNED_CACHE_DIR = tempfile.mkdtemp(prefix="axlearn-tests-jax-cache-")
    os.environ[_CACHE_ENV] = _OWNED_CACHE_DIR
    # Every program is worth caching: most of the suite's compiles take under a second.
    os.environ["JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS"] = "0"
    os.environ["JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES"] = "-1"

import jax  # noqa: E402  (after XLA_FLAGS and the cache settings)

jax.config.update("jax_default_matmul_precision", "highest")


def pytest_unconfigure(config):
    del config
    if _OWNED_CACHE_DIR is not None:
        shutil.rmtree(_OWNED_CACHE_DIR, ignore_errors=True)
