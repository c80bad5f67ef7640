"""compilation_cache: the cache's place, --jax_config, compiling ahead in a thread, and
(real processes) a second start that loads its train step from the cache, compiled ahead,
and trains as a start that compiles it at the first step, or compiles it past damaged
entries."""

import os
import pathlib
import subprocess

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from axlearn.common import compilation_cache
from axlearn.common.config import ConfigError
from tests.fresh_python import launch_gpt_test
from tests.trainer_script import losses_by_step


@pytest.fixture(name="restore_cache")
def fixture_restore_cache():
    """Puts back the suite's cache directory (conftest.py) after a test that moves it."""
    before = jax.config.values["jax_compilation_cache_dir"]
    yield
    compilation_cache.configure(before)


def test_unset_flag_reads_jax_variable_then_user_cache(monkeypatch):
    monkeypatch.setenv(compilation_cache.CACHE_DIR_ENV, "/suite/cache")
    assert compilation_cache.resolve_cache_dir(None) == "/suite/cache"
    monkeypatch.delenv(compilation_cache.CACHE_DIR_ENV)
    monkeypatch.setenv("XDG_CACHE_HOME", "/home/u/.xdg")
    assert compilation_cache.resolve_cache_dir(None) == "/home/u/.xdg/axlearn/jax"
    monkeypatch.delenv("XDG_CACHE_HOME")
    monkeypatch.setenv("HOME", "/home/u")
    assert compilation_cache.resolve_cache_dir(None) == "/home/u/.cache/axlearn/jax"


def test_none_turns_the_cache_off():
    assert compilation_cache.resolve_cache_dir("none") is None
    assert compilation_cache.resolve_cache_dir("gs://b/c") == "gs://b/c"


def test_jax_config_values_take_the_option_type():
    parsed = compilation_cache.parse_jax_configs(
        [
            "jax_debug_nans=true",
            "persistent_cache_min_compile_time_secs=0",  # jax_ may be left out.
            "jax_default_matmul_precision=highest",
        ]
    )
    assert parsed == [
        ("jax_debug_nans", True),
        ("jax_persistent_cache_min_compile_time_secs", 0.0),
        ("jax_default_matmul_precision", "highest"),
    ]
    assert isinstance(parsed[1][1], float)


def test_unknown_jax_option_is_one_line_with_close_names():
    with pytest.raises(ConfigError) as e:
        compilation_cache.parse_jax_configs(["jax_debug_nan=true"])
    assert "jax has no option jax_debug_nan" in str(e.value)
    assert "jax_debug_nans" in str(e.value) and "\n" not in str(e.value)


def test_jax_option_of_wrong_type_names_the_type():
    with pytest.raises(ConfigError, match="jax_debug_nans=maybe: expected true or false"):
        compilation_cache.parse_jax_configs(["jax_debug_nans=maybe"])
    with pytest.raises(ConfigError, match="expected a number"):
        compilation_cache.parse_jax_configs(["jax_persistent_cache_min_compile_time_secs=soon"])
    with pytest.raises(ConfigError, match="expected KEY=VALUE"):
        compilation_cache.parse_jax_configs(["jax_debug_nans"])


def test_unwritable_cache_dir_warns_once_and_compiles(tmp_path, caplog, restore_cache):
    blocker = tmp_path / "file"
    blocker.write_text("")
    assert compilation_cache.configure(str(blocker / "cache")) is None
    warnings = [r for r in caplog.records if r.levelname == "WARNING"]
    assert len(warnings) == 1 and "cannot be used" in warnings[0].getMessage()
    assert jax.config.values["jax_compilation_cache_dir"] is None
    assert float(jax.jit(lambda x: x + 1)(1.0)) == 2.0


def _compile_fresh(seed: int) -> tuple[float, compilation_cache.CacheOutcome]:
    """Compiles and runs one small program whose text `seed` picks, past jax's in-memory
    caches; returns its result and where it came from."""
    jax.clear_caches()
    outcome = compilation_cache.CacheOutcome()
    value = float(jax.jit(lambda x: jnp.sin(x) * seed)(jnp.float32(0.5)))
    return value, outcome


@pytest.mark.parametrize("url", ["memory://axlearn-cache-test/", None])
def test_second_compile_loads_from_the_cache(tmp_path, url, restore_cache):
    from jax._src import path as jax_path  # pylint: disable=import-outside-toplevel

    if url and getattr(jax_path, "epath_installed", False):
        # jax then reads URLs through etils[epath] itself, which has no memory:// scheme.
        pytest.skip("etils[epath] is installed: jax reads cache URLs through it")
    cache_dir = url or str(tmp_path / "cache")
    compilation_cache.configure(cache_dir, ["jax_persistent_cache_min_compile_time_secs=0"])
    seed = np.random.default_rng(0).integers(1000, 10**6)
    first, outcome = _compile_fresh(seed)
    assert outcome.describe() == "not in the compilation cache"
    second, outcome = _compile_fresh(seed)
    assert outcome.describe() == "loaded from the compilation cache"
    assert second == first == pytest.approx(np.sin(np.float32(0.5)) * seed, rel=1e-6)


def test_without_a_cache_the_outcome_says_so(restore_cache):
    compilation_cache.configure("none")
    _, outcome = _compile_fresh(3)
    assert outcome.describe() == "no compilation cache"


# ----- compiling ahead -----


def _abstract(shape, dtype=jnp.float32):
    sharding = jax.sharding.SingleDeviceSharding(jax.devices()[0])
    return jax.ShapeDtypeStruct(shape, dtype, sharding=sharding)


def test_a_step_compiled_ahead_computes_what_the_jitted_call_does():
    def step(state, batch):
        return {"w": state["w"] - 0.1 * batch.mean(axis=0)}, jnp.square(batch).sum()

    jitted = jax.jit(step)
    ahead = compilation_cache.CompiledAhead(
        jitted, lambda: ({"w": _abstract((3,))}, _abstract((4, 3))), what="a step",
        log_fn=lambda message: None,
    )
    batch = np.random.default_rng(0).normal(size=(4, 3)).astype(np.float32)
    state = {"w": jnp.ones(3)}
    got = ahead.result()(state, jnp.asarray(batch))
    np.testing.assert_allclose(got[0]["w"], 1.0 - 0.1 * batch.mean(axis=0), rtol=1e-6)
    np.testing.assert_allclose(got[1], np.square(batch).sum(), rtol=1e-5)
    assert ahead.outcome  # Said where the program came from.


def test_an_error_compiling_ahead_is_raised_by_result_as_the_call_raises_it():
    def step(x):
        return x @ jnp.ones((5, 2))  # (3,) against (5, 2): a shape error while tracing.

    ahead = compilation_cache.CompiledAhead(
        jax.jit(step), lambda: (_abstract((3,)),), what="a step", log_fn=lambda message: None
    )
    with pytest.raises(TypeError) as direct:
        jax.jit(step)(jnp.ones(3))
    with pytest.raises(TypeError) as raised:
        ahead.result()
    assert str(raised.value) == str(direct.value)


def test_a_mismatch_names_the_first_leaf_that_differs_and_how():
    expected = {"ids": _abstract((8, 16), jnp.int32), "weights": _abstract((8, 16))}
    same = {"ids": jnp.zeros((8, 16), jnp.int32), "weights": jnp.zeros((8, 16))}
    assert compilation_cache.abstract_mismatch(expected, same, "the batch") is None
    shorter = dict(same, ids=jnp.zeros((8, 12), jnp.int32))
    assert compilation_cache.abstract_mismatch(expected, shorter, "the batch") == (
        "the batch['ids'] is int32[8, 12], expected int32[8, 16]"
    )
    fewer = {"ids": same["ids"], "mask": same["weights"]}
    assert compilation_cache.abstract_mismatch(expected, fewer, "the batch") == (
        "the batch has ['mask'] and lacks ['weights']"
    )
    on_host = dict(same, weights=np.zeros((8, 16), np.float32))
    message = compilation_cache.abstract_mismatch(expected, on_host, "the batch")
    assert message.startswith("the batch['weights'] is sharded as None, expected ")


# ----- real processes -----




def _train_step_line(result: subprocess.CompletedProcess) -> str:
    (line,) = [l for l in result.stderr.splitlines() if "Compiled the train step" in l]
    return line


def _start_line(result: subprocess.CompletedProcess) -> str:
    (line,) = [l for l in result.stderr.splitlines() if "Started in " in l]
    return line


@pytest.fixture(name="warm_cache", scope="module")
def fixture_warm_cache(tmp_path_factory):
    """A cache that one run of gpt_test filled, compiling its step at the first step (not
    ahead); that run's compile line and its trainer directory."""
    root = tmp_path_factory.mktemp("cache_runs")
    result = launch_gpt_test(root / "first", root / "cache", "compile_ahead=False")
    assert "(compiled at the first step: not in the compilation cache)" in _start_line(result)
    return root / "cache", _train_step_line(result), root / "first"


@pytest.mark.slow
def test_first_start_compiles_and_stores_its_step(warm_cache):
    cache_dir, line, _ = warm_cache
    assert line.endswith("(not in the compilation cache)")
    assert any(name.startswith("jit__train_step") for name in os.listdir(cache_dir))


@pytest.mark.slow
def test_second_process_loads_its_step_from_the_cache(warm_cache, tmp_path):
    cache_dir, _, first_dir = warm_cache
    result = launch_gpt_test(tmp_path / "second", cache_dir)
    assert _train_step_line(result).endswith("(loaded from the compilation cache)")
    # Compiled ahead, while the state was initialized; the same steps as the first run's.
    assert "(compiled ahead in " in _start_line(result)
    assert "does not fit" not in result.stderr
    assert losses_by_step(str(tmp_path / "second")) == losses_by_step(str(first_dir))


@pytest.mark.slow
def test_damaged_cache_compiles_with_one_warning(warm_cache, tmp_path):
    # In place: jax's keys depend on the cache's path. The start replaces the entries, so
    # that the cache is whole again for the other tests.
    for entry in pathlib.Path(warm_cache[0]).iterdir():
        entry.write_bytes(b"not an executable")
    result = launch_gpt_test(tmp_path / "third", warm_cache[0])
    assert _train_step_line(result).endswith("(not in the compilation cache)")
    warnings = [l for l in result.stderr.splitlines() if "cannot load" in l]
    assert len(warnings) == 1, result.stderr[-3000:]
    assert "Error reading persistent compilation cache" not in result.stderr
