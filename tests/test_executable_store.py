"""executable_store: an executable stored and loaded back computes what the jitted
function does (against NumPy); its key follows the config text, the arguments and the
source; a damaged, cut-short or foreign entry is refused; and (real processes) a start of
the same run loads the train step its last start stored, without tracing it, and trains
the same steps, or compiles past a damaged entry with one warning."""

import importlib
import logging
import os
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from axlearn.common import executable_store
from tests.fresh_python import launch_gpt_test
from tests.trainer_script import losses_by_step


def _abstract(shape, dtype=jnp.float32):
    sharding = jax.sharding.SingleDeviceSharding(jax.devices()[0])
    return jax.ShapeDtypeStruct(shape, dtype, sharding=sharding)


def _step(state, batch):
    return {"w": state["w"] - 0.1 * batch.mean(axis=0)}, jnp.square(batch).sum()


_ARGS = ({"w": _abstract((3,))}, _abstract((4, 3)))


def test_a_loaded_entry_computes_what_the_function_does():
    compiled = jax.jit(_step, donate_argnums=(0,)).lower(*_ARGS).compile()
    data = executable_store.encode_entry("k", compiled)
    loaded = executable_store.decode_entry(data, "k")
    batch = np.random.default_rng(0).normal(size=(4, 3)).astype(np.float32)
    state, total = loaded({"w": jnp.ones(3)}, jnp.asarray(batch))
    np.testing.assert_allclose(state["w"], 1.0 - 0.1 * batch.mean(axis=0), rtol=1e-6)
    np.testing.assert_allclose(total, np.square(batch).sum(), rtol=1e-5)
    assert jax.tree.structure(loaded.out_info) == jax.tree.structure(compiled.out_info)


@pytest.mark.parametrize(
    "damage,message",
    [
        (lambda data: data[: len(data) // 2], "damaged or cut short"),
        (lambda data: b"PK\x03\x04" + data, "not an entry of this format"),
        (lambda data: data, "stored under another key"),
    ],
)
def test_a_damaged_or_foreign_entry_is_refused(damage, message):
    compiled = jax.jit(_step).lower(*_ARGS).compile()
    data = damage(executable_store.encode_entry("k", compiled))
    key = "other" if message.startswith("stored") else "k"
    with pytest.raises(executable_store.UnreadableEntryError, match=message):
        executable_store.decode_entry(data, key)


def test_the_key_follows_the_config_text_and_the_arguments():
    key = executable_store.entry_key("a: 1", _ARGS)
    assert executable_store.entry_key("a: 1", _ARGS) == key
    assert executable_store.entry_key("a: 2", _ARGS) != key
    longer = ({"w": _abstract((3,))}, _abstract((5, 3)))
    assert executable_store.entry_key("a: 1", longer) != key
    bf16 = ({"w": _abstract((3,), jnp.bfloat16)}, _abstract((4, 3)))
    assert executable_store.entry_key("a: 1", bf16) != key


def test_the_key_follows_jax_options_and_xla_flags(monkeypatch):
    key = executable_store.entry_key("a: 1", _ARGS)
    before = jax.config.values["jax_enable_x64"]
    jax.config.update("jax_enable_x64", not before)
    try:
        assert executable_store.entry_key("a: 1", _ARGS) != key
    finally:
        jax.config.update("jax_enable_x64", before)
    assert executable_store.entry_key("a: 1", _ARGS) == key
    monkeypatch.setenv("XLA_FLAGS", os.environ.get("XLA_FLAGS", "") + " --xla_dump_to=/x")
    assert executable_store.entry_key("a: 1", _ARGS) != key


def test_the_source_digest_follows_a_loaded_module_outside_the_installation(
    tmp_path, monkeypatch
):
    module = tmp_path / "user_layer_for_digest.py"
    module.write_text("SCALE = 1\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    importlib.import_module("user_layer_for_digest")
    try:
        before = executable_store.source_digest()
        assert executable_store.source_digest() == before
        module.write_text("SCALE = 2\n")
        assert executable_store.source_digest() != before
    finally:
        sys.modules.pop("user_layer_for_digest", None)


def test_the_store_saves_loads_and_keeps_one_entry(tmp_path, caplog):
    store = executable_store.ExecutableStore(str(tmp_path), "step", "a: 1")
    assert store.key(_ARGS) == executable_store.entry_key("a: 1", _ARGS)
    assert store.load(store.key(_ARGS)) is None  # Nothing stored yet: no warning either.
    store.save(store.key(_ARGS), jax.jit(_step).lower(*_ARGS).compile())
    longer = ({"w": _abstract((3,))}, _abstract((5, 3)))
    store.save(store.key(longer), jax.jit(_step).lower(*longer).compile())
    entry = store.path(store.key(longer))
    assert os.listdir(tmp_path) == [os.path.basename(entry)]  # The older one removed.
    assert store.load(store.key(_ARGS)) is None
    assert store.load(store.key(longer)) is not None
    with open(entry, "wb") as f:
        f.write(b"not an entry")
    with caplog.at_level(logging.WARNING, logger="axlearn.common.executable_store"):
        assert store.load(store.key(longer)) is None
    assert "cannot be loaded (not an entry of this format): compiling step" in caplog.text


# ----- real processes -----




# Two microbatches of one row: the count is logged by a start that loads the step too.
_MICROBATCHES = "per_device_microbatch_size=1"
_MICROBATCH_LINE = "Each step accumulates gradients over 2 microbatches of 1 rows a device"


def _start_again(trainer_dir, cache_dir) -> subprocess.CompletedProcess:
    """The same run started again from its first step (its checkpoints removed)."""
    losses = losses_by_step(str(trainer_dir))
    subprocess.run(["rm", "-rf", str(trainer_dir / "checkpoints"), str(trainer_dir / "summaries")],
                   check=True)
    result = launch_gpt_test(trainer_dir, cache_dir, _MICROBATCHES)
    assert losses_by_step(str(trainer_dir)) == losses
    return result


@pytest.mark.slow
def test_a_start_of_the_same_run_loads_its_step_without_tracing(tmp_path):
    first = launch_gpt_test(tmp_path / "run", tmp_path / "cache", _MICROBATCHES)
    assert "Stored train_step for restarts: " in first.stderr
    (entry,) = os.listdir(tmp_path / "run" / "compiled")
    again = _start_again(tmp_path / "run", tmp_path / "cache")
    assert "Loaded the train step as compiled by an earlier start" in again.stderr
    assert "Compiling the train step" not in again.stderr  # Neither traced nor compiled.
    assert again.stderr.count(_MICROBATCH_LINE) == first.stderr.count(_MICROBATCH_LINE) == 1
    assert "not traced" in [l for l in again.stderr.splitlines() if "Started in " in l][0]
    assert os.listdir(tmp_path / "run" / "compiled") == [entry]

    # A damaged entry: one warning, the step compiles, trains the same and is stored again.
    (tmp_path / "run" / "compiled" / entry).write_bytes(b"\0" * 100)
    damaged = _start_again(tmp_path / "run", tmp_path / "cache")
    warnings = [l for l in damaged.stderr.splitlines() if "cannot be loaded" in l]
    assert len(warnings) == 1 and entry in warnings[0], damaged.stderr[-3000:]
    assert "Compiled the train step" in damaged.stderr
    assert (tmp_path / "run" / "compiled" / entry).read_bytes().startswith(
        executable_store.MAGIC
    )
