"""Settings for the whole suite: it means the same on a GPU as on the CPU, and compiles
as little as it can.

The tests compare float32 results with NumPy and a resumed or rewritten run's losses with
the original's, bit for bit. On the CPU both hold as written. On a GPU, XLA would by
default multiply float32 matrices in TF32 (about 3 decimal digits) and sum some gradients
with atomic adds in whatever order the threads arrive: deterministic ops and the highest
matmul precision turn that off for the tests.

Compiling, not running, takes most of the suite's time on a CPU: the models are tiny, and
a trainer's step and initialization each take seconds to compile. So where jax runs on
the CPU alone, LLVM compiles without optimizations (the same XLA program, built two to
four times faster and slower to run, which tiny models do not notice). And a persistent
compilation cache in a temporary directory, made for this pytest run and removed after
it, lets every test after the first that builds the same program load it instead. A
cache hit skips XLA, so a test of what XLA writes (an HLO dump) turns the cache off.

The pytest-xdist workers and the scripts that the tests start in fresh processes
(`fresh_python`, on the CPU) inherit these settings through the environment.
"""

import importlib.util
import os
import shutil
import tempfile
from importlib import metadata


def _add_xla_flag(flag: str) -> None:
    """Adds `flag` to XLA_FLAGS unless the user set that flag already."""
    flags = os.environ.get("XLA_FLAGS", "")
    if flag.split("=")[0] not in flags:
        os.environ["XLA_FLAGS"] = f"{flags} {flag}".strip()


def _cpu_only() -> bool:
    """Whether jax runs on the CPU alone here: told so, or with no GPU or TPU plugin."""
    platforms = os.environ.get("JAX_PLATFORMS")
    if platforms:
        return platforms == "cpu"
    plugins = metadata.entry_points(group="jax_plugins")
    return not plugins and not any(
        importlib.util.find_spec(name) for name in ("jax_plugins", "libtpu")
    )


# XLA reads its flags once, when the first backend starts: before any test imports jax.
_add_xla_flag("--xla_gpu_deterministic_ops=true")
if _cpu_only():
    _add_xla_flag("--xla_backend_optimization_level=0")

# The process that makes the cache directory (pytest itself, or xdist's controller, which
# starts the workers after this runs) removes it when the run ends.
_CACHE_DIR_ENV = "JAX_COMPILATION_CACHE_DIR"
_OWNED_CACHE_DIR = None
if not os.environ.get(_CACHE_DIR_ENV):
    _OWNED_CACHE_DIR = tempfile.mkdtemp(prefix="axlearn-tests-jax-cache-")
    os.environ[_CACHE_DIR_ENV] = _OWNED_CACHE_DIR
# Every program is worth keeping: most of the suite's compiles take well under a second.
_CACHE_SETTINGS = {
    "jax_persistent_cache_min_compile_time_secs": 0.0,
    "jax_persistent_cache_min_entry_size_bytes": -1,  # No size limit.
}
for _name, _value in _CACHE_SETTINGS.items():
    os.environ[_name.upper()] = str(_value)

# The suite's config texts name classes and functions that its test modules define.
_TRUSTED_ENV = "AXLEARN_TRUSTED_PACKAGES"
os.environ[_TRUSTED_ENV] = ",".join(filter(None, (os.environ.get(_TRUSTED_ENV), "tests")))

import jax  # noqa: E402  (after XLA_FLAGS and the cache settings)

jax.config.update("jax_default_matmul_precision", "highest")
# Also where a plugin imported jax before this file set the environment.
jax.config.update("jax_compilation_cache_dir", os.environ[_CACHE_DIR_ENV])
for _name, _value in _CACHE_SETTINGS.items():
    jax.config.update(_name, _value)


def pytest_unconfigure(config):
    del config
    if _OWNED_CACHE_DIR is not None:
        shutil.rmtree(_OWNED_CACHE_DIR, ignore_errors=True)

