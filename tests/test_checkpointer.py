"""Tests of axlearn.common.checkpointer: the promise is that the newest committed checkpoint
is always whole, a restart resumes exactly, and failures are loud and harmless."""

import concurrent.futures
import errno
import json
import logging
import math
import os
import signal
import socket
import subprocess
import sys
import threading
import time

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
import tensorstore as ts

from axlearn.common import checkpointer as checkpointer_lib
from axlearn.common.checkpointer import (
    INDEX_FILE,
    Checkpointer,
    CheckpointCorruptError,
    CheckpointSaveError,
    RestoreStepError,
    TensorStoreStateStorage,
    every_n_steps_and_last_policy,
    every_n_steps_policy,
    step_dir_name,
)
from axlearn.common.config import ConfigError, config_for_function
from tests.fresh_python import fresh_env

TESTS_DIR = os.path.dirname(os.path.abspath(__file__))


def _make(directory, **kwargs) -> Checkpointer:
    cfg = Checkpointer.default_config().set(name="checkpointer", dir=str(directory), **kwargs)
    return cfg.instantiate(parent=None)


@pytest.fixture(name="make_checkpointer")
def fixture_make_checkpointer(tmp_path):
    made = []

    def make(directory=None, **kwargs):
        made.append(_make(directory or tmp_path / "ckpt", **kwargs))
        return made[-1]

    yield make
    for checkpointer in made:
        try:
            checkpointer.stop()
        except Exception:  # pylint: disable=broad-except
            pass  # Tests of failures leave errors behind on purpose.


def _random_state(seed: int) -> dict:
    """Leaves of the kinds a trainer state holds, from NumPy values."""
    rng = np.random.default_rng(seed)
    return {
        "model": {
            "w": jnp.asarray(rng.normal(size=(6, 5)).astype(np.float32)),
            "emb": jnp.asarray(rng.normal(size=(7, 3)).astype(ml_dtypes.bfloat16)),
        },
        "learner": (
            jnp.asarray(rng.integers(0, 100, size=(4,)), jnp.int32),
            {"count": jnp.int32(seed)},
        ),
        "prng_key": jax.random.key(seed),
        "host_table": rng.normal(size=(2, 2)),
    }


def _template(state):
    def leaf(x):
        if isinstance(x, jax.Array):
            return jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding)
        return np.zeros_like(x)

    return jax.tree_util.tree_map(leaf, state)


def _as_numpy(tree):
    def leaf(x):
        if isinstance(x, jax.Array) and jax.dtypes.issubdtype(x.dtype, jax.dtypes.prng_key):
            x = jax.random.key_data(x)
        return np.array(x)  # A copy: later edits of the source must not show.

    return jax.tree_util.tree_map(leaf, tree)


def _assert_trees_equal(actual, expected):
    actual, expected = _as_numpy(actual), _as_numpy(expected)
    assert jax.tree_util.tree_structure(actual) == jax.tree_util.tree_structure(expected)
    for a, e in zip(jax.tree_util.tree_leaves(actual), jax.tree_util.tree_leaves(expected)):
        assert a.dtype == e.dtype and a.shape == e.shape
        np.testing.assert_array_equal(a, e)


def _chunk_file(directory, step: int, leaf: str) -> str:
    return os.path.join(directory, step_dir_name(step), "arrays", leaf, "0.0")


# ----- policies and config -----


def test_every_n_steps_policy_saves_multiples_within_range():
    policy = every_n_steps_policy(3, min_step=4, max_step=12)
    assert [s for s in range(20) if policy(s)] == [6, 9, 12]


def test_every_n_steps_and_last_policy_also_saves_max_step():
    policy = every_n_steps_and_last_policy(5, min_step=1, max_step=17)
    assert [s for s in range(25) if policy(s)] == [5, 10, 15, 17]


def test_config_prints_the_spec_fields():
    cfg = Checkpointer.default_config().set(
        keep_every_n_steps=5000,
        keep_last_n=3,
        save_policy=config_for_function(every_n_steps_and_last_policy).set(n=5000, max_step=750000),
    )
    assert cfg.debug_string().splitlines() == [
        "gc_loop_interval_seconds: 60",
        "keep_every_n_steps: 5000",
        "keep_last_n: 3",
        "klass: 'axlearn.common.checkpointer.Checkpointer'",
        "save_policy.fn: 'axlearn.common.checkpointer.every_n_steps_and_last_policy'",
        "save_policy.max_step: 750000",
        "save_policy.min_step: 1",
        "save_policy.n: 5000",
        "storage.klass: 'axlearn.common.checkpointer.TensorStoreStateStorage'",
        "storage.timeout_secs: 3600",
    ]


def test_invalid_keep_last_n_is_rejected_with_its_path(tmp_path):
    with pytest.raises(ConfigError, match="checkpointer.keep_last_n"):
        _make(tmp_path, keep_last_n=0)


# ----- save and restore -----


def test_restore_returns_saved_values_of_every_leaf_kind(make_checkpointer):
    checkpointer = make_checkpointer()
    state = _random_state(1)
    expected = _as_numpy(state)
    checkpointer.save(5, state)
    checkpointer.wait_until_finished()
    step, restored, _ = checkpointer.restore(state=_template(state))
    assert step == 5
    _assert_trees_equal(restored, expected)
    assert jax.dtypes.issubdtype(restored["prng_key"].dtype, jax.dtypes.prng_key)
    assert restored["model"]["emb"].dtype == jnp.bfloat16


def test_restore_without_checkpoint_returns_the_template(make_checkpointer):
    template = _template(_random_state(0))
    assert make_checkpointer().restore(state=template) == (None, template, None)


def test_extra_metadata_is_restored_with_the_arrays(make_checkpointer):
    checkpointer = make_checkpointer()
    state = _random_state(0)
    checkpointer.save(2, state, extra={"input": {"epoch": 1, "position": 37}})
    _, _, extra = checkpointer.restore(state=_template(state))
    assert extra == {"input": {"epoch": 1, "position": 37}}


def test_restore_picks_the_latest_committed_step_or_the_one_asked(make_checkpointer):
    checkpointer = make_checkpointer(keep_last_n=5)
    for step in (1, 2, 3):
        checkpointer.save(step, _random_state(step))
    template = _template(_random_state(0))
    step, restored, _ = checkpointer.restore(state=template)
    assert step == 3
    _assert_trees_equal(restored, _random_state(3))
    step, restored, _ = checkpointer.restore(step=2, state=template)
    assert step == 2
    _assert_trees_equal(restored, _random_state(2))


def test_restore_of_a_step_not_committed_is_one_line_listing_the_committed_ones(
    make_checkpointer, tmp_path
):
    checkpointer = make_checkpointer(keep_last_n=5)
    for step in (2, 4):
        checkpointer.save(step, _random_state(step))
    with pytest.raises(RestoreStepError) as error:
        checkpointer.restore(step=3, state=_template(_random_state(0)))
    assert str(error.value) == (
        f"No committed checkpoint for step 3 in {tmp_path / 'ckpt'}; committed steps: [2, 4]"
    )


# ----- verdicts -----


def _index(directory, step: int) -> dict:
    with open(os.path.join(directory, step_dir_name(step), INDEX_FILE), encoding="utf-8") as f:
        return json.load(f)


def test_a_verdict_is_recorded_in_an_index_that_still_checks_out(make_checkpointer, tmp_path):
    checkpointer = make_checkpointer(keep_last_n=5)
    checkpointer.save(1, _random_state(1))
    checkpointer.set_verdict(1, False, reason="diverged")
    checkpointer.wait_until_finished()
    index = _index(tmp_path / "ckpt", 1)
    assert (index["good"], index["verdict_reason"]) == (False, "diverged")
    body = {k: v for k, v in index.items() if k != "index_sha256"}
    canonical = json.dumps(body, sort_keys=True, separators=(",", ":"))
    assert index["index_sha256"] == __import__("hashlib").sha256(canonical.encode()).hexdigest()
    checkpointer.set_verdict(1, True)
    checkpointer.wait_until_finished()
    assert checkpointer.verdict(1) is True and "verdict_reason" not in _index(tmp_path / "ckpt", 1)
    # The explicit step restores: the rewritten index passes its checks.
    step, restored, _ = checkpointer.restore(step=1, state=_template(_random_state(0)))
    assert step == 1
    _assert_trees_equal(restored, _random_state(1))


def test_restore_skips_steps_judged_bad_unless_asked_for_one(make_checkpointer):
    checkpointer = make_checkpointer(keep_last_n=5)
    for step in (1, 2, 3):
        checkpointer.save(step, _random_state(step))
    checkpointer.set_verdict(3, False, reason="diverged")
    template = _template(_random_state(0))
    step, restored, _ = checkpointer.restore(state=template)
    assert step == 2
    _assert_trees_equal(restored, _random_state(2))
    step, restored, _ = checkpointer.restore(step=3, state=template)
    assert step == 3
    _assert_trees_equal(restored, _random_state(3))


def test_when_every_step_is_judged_bad_restore_asks_for_one(make_checkpointer):
    checkpointer = make_checkpointer(keep_last_n=5)
    checkpointer.save(1, _random_state(1))
    checkpointer.set_verdict(1, False)
    with pytest.raises(RestoreStepError, match=r"judged bad \(steps \[1\]\).*--restore_step"):
        checkpointer.restore(state=_template(_random_state(0)))


def test_a_step_judged_bad_is_replaced_when_saved_again(make_checkpointer):
    checkpointer = make_checkpointer(keep_last_n=5)
    checkpointer.save(1, _random_state(1))
    checkpointer.set_verdict(1, False)
    checkpointer.save(1, _random_state(7))
    checkpointer.wait_until_finished()
    assert checkpointer.verdict(1) is None
    _, restored, _ = checkpointer.restore(step=1, state=_template(_random_state(0)))
    _assert_trees_equal(restored, _random_state(7))


def test_save_returns_before_the_files_are_written(make_checkpointer, monkeypatch):
    checkpointer = make_checkpointer()
    release = threading.Event()
    real_write = TensorStoreStateStorage.write

    def blocked_write(self, snapshot, step_dir):
        release.wait(timeout=30)
        return real_write(self, snapshot, step_dir)

    monkeypatch.setattr(TensorStoreStateStorage, "write", blocked_write)
    checkpointer.save(1, _random_state(1))
    assert checkpointer.committed_steps() == []
    release.set()
    checkpointer.wait_until_finished()
    assert checkpointer.committed_steps() == [1]


def test_next_save_waits_for_the_previous_one(make_checkpointer, monkeypatch):
    checkpointer = make_checkpointer(keep_last_n=2)
    real_write = TensorStoreStateStorage.write

    def slow_write(self, snapshot, step_dir):
        time.sleep(0.3)
        return real_write(self, snapshot, step_dir)

    monkeypatch.setattr(TensorStoreStateStorage, "write", slow_write)
    checkpointer.save(1, _random_state(1))
    checkpointer.save(2, _random_state(2))
    assert checkpointer.committed_steps() == [1]


@pytest.mark.parametrize("host_memory_kind", [None, "numpy"], ids=["pinned_host", "numpy"])
def test_changing_the_state_after_save_does_not_change_the_checkpoint(
    make_checkpointer, host_memory_kind
):
    storage = TensorStoreStateStorage.default_config().set(host_memory_kind=host_memory_kind)
    checkpointer = make_checkpointer(storage=storage)
    state = _random_state(4)
    expected = _as_numpy(state)
    checkpointer.save(1, state)
    # A train step that donates (reuses) the saved buffers, and a host array edited in place.
    jax.jit(lambda s: jax.tree_util.tree_map(lambda x: x * 0, s), donate_argnums=0)(state["model"])
    state["host_table"][:] = -1.0
    checkpointer.wait_until_finished()
    _, restored, _ = checkpointer.restore(state=_template(_random_state(0)))
    _assert_trees_equal(restored, expected)


def test_saving_a_committed_step_again_is_skipped_with_a_warning(make_checkpointer, caplog):
    checkpointer = make_checkpointer()
    checkpointer.save(1, _random_state(1))
    checkpointer.wait_until_finished()
    with caplog.at_level(logging.WARNING):
        checkpointer.save(1, _random_state(2))
    checkpointer.wait_until_finished()
    assert "already committed" in caplog.text
    _, restored, _ = checkpointer.restore(state=_template(_random_state(0)))
    _assert_trees_equal(restored, _random_state(1))


def test_shape_mismatch_names_the_parameter_and_the_file(make_checkpointer):
    checkpointer = make_checkpointer()
    state = _random_state(0)
    checkpointer.save(1, state)
    template = _template(state)
    template["model"]["w"] = jax.ShapeDtypeStruct((6, 4), jnp.float32)
    expected = r"'model/w'.*\(6, 4\).*step_00000001/index.json.*\(6, 5\)"
    with pytest.raises(ValueError, match=expected):
        checkpointer.restore(state=template)


def test_dtype_mismatch_names_the_parameter_and_the_file(make_checkpointer):
    checkpointer = make_checkpointer()
    state = _random_state(0)
    checkpointer.save(1, state)
    template = _template(state)
    template["model"]["emb"] = jax.ShapeDtypeStruct((7, 3), jnp.float32)
    with pytest.raises(ValueError, match=r"'model/emb'.*float32.*index.json.*bfloat16"):
        checkpointer.restore(state=template)


def test_missing_leaf_is_reported_by_path(make_checkpointer):
    checkpointer = make_checkpointer()
    state = _random_state(0)
    checkpointer.save(1, state)
    template = _template(state)
    template["model"]["extra_bias"] = jax.ShapeDtypeStruct((3,), jnp.float32)
    with pytest.raises(ValueError, match=r"missing from the checkpoint: \['model/extra_bias'\]"):
        checkpointer.restore(state=template)


# ----- commit protocol and corruption -----


def test_step_directory_without_index_is_never_restored(make_checkpointer, tmp_path):
    checkpointer = make_checkpointer(keep_last_n=5)
    checkpointer.save(1, _random_state(1))
    checkpointer.save(2, _random_state(2))
    checkpointer.wait_until_finished()
    os.remove(tmp_path / "ckpt" / step_dir_name(2) / INDEX_FILE)  # As if killed before commit.
    assert checkpointer.committed_steps() == [1]
    step, restored, _ = checkpointer.restore(state=_template(_random_state(0)))
    assert step == 1
    _assert_trees_equal(restored, _random_state(1))


def test_a_save_cut_short_is_removed_at_restore_with_one_line(make_checkpointer, tmp_path, caplog):
    checkpointer = make_checkpointer(keep_last_n=5)
    checkpointer.save(1, _random_state(1))
    checkpointer.wait_until_finished()
    torn = tmp_path / "ckpt" / step_dir_name(2)
    torn.mkdir()
    (torn / "model").write_bytes(b"half a chunk")  # As if killed before its commit.
    with caplog.at_level(logging.WARNING, logger="axlearn.common.checkpointer"):
        step, _, _ = checkpointer.restore(state=_template(_random_state(0)))
    assert step == 1 and not torn.exists()
    (line,) = [r.getMessage() for r in caplog.records if step_dir_name(2) in r.getMessage()]
    assert f"no {INDEX_FILE}" in line and "removed" in line and "step is 1" in line


def test_truncated_chunk_falls_back_to_previous_step_with_warning(
    make_checkpointer, tmp_path, caplog
):
    checkpointer = make_checkpointer(keep_last_n=5)
    checkpointer.save(1, _random_state(1))
    checkpointer.save(2, _random_state(2))
    checkpointer.wait_until_finished()
    path = _chunk_file(tmp_path / "ckpt", 2, "model/w")
    os.truncate(path, os.path.getsize(path) // 2)
    with caplog.at_level(logging.WARNING):
        step, restored, _ = checkpointer.restore(state=_template(_random_state(0)))
    assert step == 1
    _assert_trees_equal(restored, _random_state(1))
    assert "step_00000002/arrays/model/w/0.0" in caplog.text and "truncated" in caplog.text


def test_altered_chunk_of_same_size_is_detected_by_checksum(make_checkpointer, tmp_path, caplog):
    checkpointer = make_checkpointer(keep_last_n=5)
    checkpointer.save(1, _random_state(1))
    checkpointer.save(2, _random_state(2))
    checkpointer.wait_until_finished()
    path = _chunk_file(tmp_path / "ckpt", 2, "model/w")
    with open(path, "r+b") as f:
        byte = f.read(1)
        f.seek(0)
        f.write(bytes([byte[0] ^ 0x40]))
    with caplog.at_level(logging.WARNING):
        step, _, _ = checkpointer.restore(state=_template(_random_state(0)))
    assert step == 1
    assert "CRC32" in caplog.text


def test_corrupt_explicit_step_raises(make_checkpointer, tmp_path):
    checkpointer = make_checkpointer(keep_last_n=5)
    checkpointer.save(1, _random_state(1))
    checkpointer.wait_until_finished()
    os.truncate(_chunk_file(tmp_path / "ckpt", 1, "model/w"), 3)
    with pytest.raises(CheckpointCorruptError, match="step_00000001/arrays/model/w/0.0") as error:
        checkpointer.restore(step=1, state=_template(_random_state(0)))
    assert isinstance(error.value, RestoreStepError)  # One line from the launcher.
    assert str(error.value).endswith("; committed steps: [1]") and "\n" not in str(error.value)


def test_unreadable_index_is_skipped(make_checkpointer, tmp_path):
    checkpointer = make_checkpointer(keep_last_n=5)
    checkpointer.save(1, _random_state(1))
    checkpointer.save(2, _random_state(2))
    checkpointer.wait_until_finished()
    with open(tmp_path / "ckpt" / step_dir_name(2) / INDEX_FILE, "w", encoding="utf-8") as f:
        f.write('{"format": ')
    step, _, _ = checkpointer.restore(state=_template(_random_state(0)))
    assert step == 1


def test_index_records_sizes_and_checksums_of_every_written_file(make_checkpointer, tmp_path):
    checkpointer = make_checkpointer()
    checkpointer.save(1, _random_state(1))
    checkpointer.wait_until_finished()
    step_dir = tmp_path / "ckpt" / step_dir_name(1)
    with open(step_dir / INDEX_FILE, encoding="utf-8") as f:
        index = json.load(f)
    on_disk = {
        os.path.relpath(os.path.join(root, name), step_dir)
        for root, _, names in os.walk(step_dir)
        for name in names
        if name != INDEX_FILE
    }
    assert set(index["files"]) == on_disk
    for name, record in index["files"].items():
        data = (step_dir / name).read_bytes()
        assert record == {"size": len(data), "crc32": __import__("zlib").crc32(data)}


# ----- failures during save -----


def test_disk_full_during_data_write_raises_clear_error_and_keeps_previous(
    make_checkpointer, tmp_path, monkeypatch
):
    checkpointer = make_checkpointer(keep_last_n=5)
    checkpointer.save(1, _random_state(1))
    checkpointer.wait_until_finished()
    real_write = TensorStoreStateStorage.write

    def write_then_fill_disk(self, snapshot, step_dir):
        real_write(self, snapshot, step_dir)  # Some data lands, then the disk is full.
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    monkeypatch.setattr(TensorStoreStateStorage, "write", write_then_fill_disk)
    checkpointer.save(2, _random_state(2))
    with pytest.raises(CheckpointSaveError, match=r"step 2 to .*step_00000002.*disk is full"):
        checkpointer.wait_until_finished()
    assert not os.path.exists(tmp_path / "ckpt" / step_dir_name(2))
    step, restored, _ = checkpointer.restore(state=_template(_random_state(0)))
    assert step == 1
    _assert_trees_equal(restored, _random_state(1))


def test_disk_full_while_writing_index_is_raised_by_next_save(
    make_checkpointer, tmp_path, monkeypatch
):
    checkpointer = make_checkpointer(keep_last_n=5)
    checkpointer.save(1, _random_state(1))
    checkpointer.wait_until_finished()

    def full(path, value):
        with open(f"{path}.tmp", "w", encoding="utf-8") as f:
            f.write(json.dumps(value)[:10])  # A torn temporary file, as a full disk leaves.
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    monkeypatch.setattr(checkpointer_lib, "_write_json_atomically", full)
    checkpointer.save(2, _random_state(2))
    with pytest.raises(CheckpointSaveError, match=r"step_00000002.*disk is full.*intact"):
        checkpointer.save(3, _random_state(3))
    assert checkpointer.committed_steps() == [1]
    _, restored, _ = checkpointer.restore(state=_template(_random_state(0)))
    _assert_trees_equal(restored, _random_state(1))


def test_unwritable_directory_raises_clear_error_and_keeps_previous(
    make_checkpointer, tmp_path, monkeypatch
):
    directory = tmp_path / "ckpt"
    checkpointer = make_checkpointer(keep_last_n=5)
    checkpointer.save(1, _random_state(1))
    checkpointer.wait_until_finished()
    os.chmod(directory, 0o555)
    try:
        probe = directory / "probe"
        try:
            probe.mkdir()
            probe.rmdir()
            denied = False
        except PermissionError:
            denied = True
        if not denied:
            # Root ignores permission bits: make directory creation fail as it would for others.
            def no_mkdir(path, *args, **kwargs):
                raise PermissionError(errno.EACCES, os.strerror(errno.EACCES), str(path))

            monkeypatch.setattr(checkpointer_lib.os, "makedirs", no_mkdir)
        checkpointer.save(2, _random_state(2))
        with pytest.raises(CheckpointSaveError, match=r"step_00000002.*not writable"):
            checkpointer.wait_until_finished()
    finally:
        monkeypatch.undo()
        os.chmod(directory, 0o755)
    assert checkpointer.committed_steps() == [1]
    _, restored, _ = checkpointer.restore(state=_template(_random_state(0)))
    _assert_trees_equal(restored, _random_state(1))


def test_a_failed_write_is_raised_only_once_the_writes_still_running_end():
    # A save's clean-up removes its directory: no write may still be adding files then.
    release, finished = threading.Event(), []

    def slow_write():
        release.wait(timeout=30)
        finished.append(True)

    with concurrent.futures.ThreadPoolExecutor(max_workers=2) as pool:
        failed = pool.submit(lambda: (_ for _ in ()).throw(OSError(errno.ENOSPC, "full")))
        running = pool.submit(slow_write)
        threading.Timer(0.2, release.set).start()
        errors = checkpointer_lib._wait_for_all([failed, running], timeout=60)
    assert finished == [True] and running.done()
    assert [e.errno for e in errors] == [errno.ENOSPC]


def test_failed_save_does_not_block_later_saves(make_checkpointer, monkeypatch):
    checkpointer = make_checkpointer(keep_last_n=5)
    real_write = TensorStoreStateStorage.write

    def fail(self, snapshot, step_dir):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(TensorStoreStateStorage, "write", fail)
    checkpointer.save(1, _random_state(1))
    with pytest.raises(CheckpointSaveError):
        checkpointer.wait_until_finished()
    monkeypatch.setattr(TensorStoreStateStorage, "write", real_write)
    checkpointer.save(2, _random_state(2))
    checkpointer.wait_until_finished()
    assert checkpointer.committed_steps() == [2]


# ----- garbage collection and temporary checkpoints -----


def test_keep_last_n_keeps_exactly_the_newest_n(make_checkpointer):
    checkpointer = make_checkpointer(keep_last_n=3)
    for step in range(1, 8):
        checkpointer.save(step, _random_state(step))
    checkpointer.wait_until_finished()
    assert checkpointer.committed_steps() == [5, 6, 7]


def test_keep_every_n_steps_also_keeps_multiples(make_checkpointer):
    checkpointer = make_checkpointer(keep_last_n=2, keep_every_n_steps=4)
    for step in range(1, 11):
        checkpointer.save(step, _random_state(step))
    checkpointer.wait_until_finished()
    assert checkpointer.committed_steps() == [4, 8, 9, 10]


def test_gc_removes_uncommitted_directories_older_than_newest_commit(make_checkpointer, tmp_path):
    directory = tmp_path / "ckpt"
    os.makedirs(directory / step_dir_name(3) / "arrays")  # Left by a crash.
    os.makedirs(directory / step_dir_name(9) / "arrays")  # Newer than any commit: left alone.
    checkpointer = make_checkpointer(keep_last_n=5)
    checkpointer.save(5, _random_state(5))
    checkpointer.wait_until_finished()
    assert sorted(os.listdir(directory)) == [step_dir_name(5), step_dir_name(9)]


def test_gc_loop_runs_in_the_background(make_checkpointer, tmp_path):
    directory = tmp_path / "ckpt"
    checkpointer = make_checkpointer(keep_last_n=5, gc_loop_interval_seconds=0.05)
    checkpointer.save(5, _random_state(5))
    checkpointer.wait_until_finished()
    os.makedirs(directory / step_dir_name(2))
    deadline = time.time() + 10
    while os.path.exists(directory / step_dir_name(2)) and time.time() < deadline:
        time.sleep(0.02)
    assert not os.path.exists(directory / step_dir_name(2))


def test_time_based_checkpoints_are_temporary(make_checkpointer):
    checkpointer = make_checkpointer(
        keep_last_n=2,
        save_policy=config_for_function(every_n_steps_policy).set(n=10),
        temporary_save_interval_seconds=0.2,
    )
    state = _random_state(0)
    assert not checkpointer.should_save(1)
    time.sleep(0.25)
    assert checkpointer.should_save(1)
    assert checkpointer.save_if_policy(1, state)
    assert not checkpointer.save_if_policy(2, state)  # The interval starts again.
    time.sleep(0.25)
    assert checkpointer.save_if_policy(3, state)
    checkpointer.wait_until_finished()
    assert checkpointer.committed_steps() == [3]  # Step 1 was replaced by step 3.
    assert checkpointer.save_if_policy(10, state)  # By the step policy: permanent.
    checkpointer.wait_until_finished()
    assert checkpointer.committed_steps() == [10]
    time.sleep(0.25)
    assert checkpointer.save_if_policy(11, state)
    checkpointer.wait_until_finished()
    assert checkpointer.committed_steps() == [10, 11]
    assert checkpointer.save_if_policy(20, state)
    checkpointer.wait_until_finished()
    assert checkpointer.committed_steps() == [10, 20]


# ----- crash and mesh changes (subprocesses) -----


def _read_losses(path) -> tuple[list[int], dict[int, str]]:
    starts, losses = [], {}
    with open(path, encoding="utf-8") as f:
        for line in f:
            first, second = line.split()
            if first == "start":
                starts.append(int(second))
            else:
                losses[int(first)] = second
    return starts, losses


def _train(directory, steps, losses, *extra_args, wait=True):
    command = [
        sys.executable,
        os.path.join(TESTS_DIR, "checkpointer_train_script.py"),
        f"--dir={directory}",
        f"--steps={steps}",
        f"--losses={losses}",
        *extra_args,
    ]
    env = fresh_env(devices=1)
    if not wait:
        return subprocess.Popen(command, env=env)
    subprocess.run(command, env=env, check=True, timeout=300)
    return None


@pytest.mark.slow
def test_kill_during_save_resumes_from_previous_commit_with_identical_losses(tmp_path):
    steps, kill_step = 8, 5
    _train(tmp_path / "reference", steps, tmp_path / "reference.txt")
    _, reference = _read_losses(tmp_path / "reference.txt")

    directory, marker = tmp_path / "interrupted", tmp_path / "marker"
    process = _train(
        directory, steps, tmp_path / "first.txt",
        f"--pause_before_commit={kill_step}", f"--marker={marker}", wait=False,
    )
    deadline = time.time() + 120
    while not marker.exists() and process.poll() is None and time.time() < deadline:
        time.sleep(0.05)
    assert marker.exists(), "the training process never reached the paused commit"
    os.kill(process.pid, signal.SIGKILL)
    process.wait(timeout=30)
    torn = directory / step_dir_name(kill_step)
    assert torn.is_dir() and not (torn / INDEX_FILE).exists()
    assert _make(directory).latest_committed_step() == kill_step - 1

    _train(directory, steps, tmp_path / "resumed.txt")
    starts, resumed = _read_losses(tmp_path / "resumed.txt")
    assert starts == [kill_step]
    assert resumed == {step: reference[step] for step in range(kill_step, steps + 1)}
    _, first = _read_losses(tmp_path / "first.txt")
    assert all(first[step] == reference[step] for step in range(1, kill_step))
    assert _make(directory).committed_steps() == [6, 7, 8]  # The script keeps the last 3.


def _mesh_script(mode, directory, path, devices):
    env = fresh_env(devices)
    script = os.path.join(TESTS_DIR, "checkpointer_mesh_script.py")
    command = [sys.executable, script, mode, str(directory), str(path)]
    subprocess.run(command, env=env, check=True, timeout=300)


@pytest.fixture(name="fsdp8_checkpoint", scope="module")
def fixture_fsdp8_checkpoint(tmp_path_factory):
    """A checkpoint saved from 8 devices with fsdp=8, and its NumPy reference values."""
    root = tmp_path_factory.mktemp("fsdp8")
    rng = np.random.default_rng(7)
    reference = {
        "w": rng.normal(size=(16, 12)).astype(np.float32),
        # Values exactly representable in bfloat16, so float32 is an exact reference.
        "emb": rng.normal(size=(8, 24)).astype(ml_dtypes.bfloat16).astype(np.float32),
        "counts": rng.integers(-1000, 1000, size=(32,)).astype(np.int32),
        "odd": rng.normal(size=(5, 4)).astype(np.float32),
        "scalar": np.float32(rng.normal()),
        "key": rng.integers(0, 2**32, size=(2,), dtype=np.uint32),
    }
    np.savez(root / "reference.npz", **reference)
    _mesh_script("save", root / "ckpt", root / "reference.npz", devices=8)
    return root / "ckpt", reference


@pytest.mark.slow
def test_fsdp8_checkpoint_through_numpy_copies_writes_the_same_files(fsdp8_checkpoint, tmp_path):
    directory, reference = fsdp8_checkpoint
    np.savez(tmp_path / "reference.npz", **reference)
    _mesh_script("save_numpy", tmp_path / "ckpt", tmp_path / "reference.npz", devices=8)
    indexes = []
    for root in (directory, tmp_path / "ckpt"):
        with open(os.path.join(root, step_dir_name(3), INDEX_FILE), encoding="utf-8") as f:
            indexes.append(json.load(f))
    assert indexes[1]["files"] == indexes[0]["files"]  # Sizes and CRC32s, file by file.
    assert indexes[1]["arrays"] == indexes[0]["arrays"]


@pytest.mark.parametrize(
    "mode,devices,shard_shapes",
    [
        ("restore_1", 1, {"w": (16, 12), "emb": (8, 24), "counts": (32,)}),
        pytest.param(
            "restore_2x4", 8, {"w": (8, 3), "emb": (2, 12), "counts": (4,)}, marks=pytest.mark.slow
        ),
    ],
)
def test_fsdp8_checkpoint_restores_onto_other_meshes(
    fsdp8_checkpoint, tmp_path, mode, devices, shard_shapes
):
    directory, reference = fsdp8_checkpoint
    _mesh_script(mode, directory, tmp_path / "out.npz", devices=devices)
    restored = np.load(tmp_path / "out.npz")
    for name, expected in reference.items():
        assert restored[name].dtype == np.asarray(expected).dtype, name
        np.testing.assert_array_equal(restored[name], expected, err_msg=name)
        assert len(restored[f"{name}.shard_shapes"]) == devices
    for name, shape in shard_shapes.items():
        assert {tuple(s) for s in restored[f"{name}.shard_shapes"]} == {shape}


def test_restore_reads_what_tensorstores_zarr_reader_reads(make_checkpointer, monkeypatch):
    # Chunks of at most 64 bytes: several per array, the last ones padded past its edge.
    monkeypatch.setattr(checkpointer_lib, "_TARGET_CHUNK_BYTES", 64)
    rng = np.random.default_rng(3)
    state = {
        "f32": jnp.asarray(rng.normal(size=(7, 5)).astype(np.float32)),
        "bf16": jnp.asarray(rng.normal(size=(3, 11, 2)).astype(ml_dtypes.bfloat16)),
        "int4": jnp.asarray(rng.integers(-8, 8, size=(17, 5)), jnp.int4),
        "fp8": jnp.asarray(rng.normal(size=(13,)).astype(ml_dtypes.float8_e4m3fn)),
        "scalar": jnp.float32(2.5),
    }
    checkpointer = make_checkpointer()
    checkpointer.save(1, state)
    checkpointer.wait_until_finished()
    step_dir = os.path.join(checkpointer.directory, step_dir_name(1))
    with open(os.path.join(step_dir, INDEX_FILE), encoding="utf-8") as f:
        arrays = json.load(f)["arrays"]
    assert [n for n, meta in arrays.items() if math.prod(meta["chunks"] or [1]) < math.prod(
        meta["shape"] or [1])] == ["bf16", "f32", "int4"]  # Several chunks each.
    _, restored, _ = checkpointer.restore(state=_template(state))
    for name, meta in arrays.items():
        spec = TensorStoreStateStorage._spec(step_dir, name, meta)
        expected = ts.open(spec, open=True).result().read().result()
        np.testing.assert_array_equal(np.asarray(restored[name]), expected, err_msg=name)
        np.testing.assert_array_equal(np.asarray(restored[name]), np.asarray(state[name]))


def test_sharded_save_writes_one_chunk_per_shard(fsdp8_checkpoint):
    directory, _ = fsdp8_checkpoint
    with open(os.path.join(directory, step_dir_name(3), INDEX_FILE), encoding="utf-8") as f:
        index = json.load(f)
    assert index["arrays"]["w"]["chunks"] == [2, 12]  # fsdp=8 over 16 rows.
    assert index["arrays"]["emb"]["chunks"] == [8, 3]  # fsdp=8 over 24 columns.
    w_files = sorted(
        f for f in index["files"] if f.startswith("arrays/w/") and not f.endswith(".zarray")
    )
    assert w_files == [f"arrays/w/{i}.0" for i in range(8)]


@pytest.mark.parametrize("kind", ["device", 3])
def test_host_memory_kind_that_is_not_a_host_memory_is_a_config_error(tmp_path, kind):
    storage = TensorStoreStateStorage.default_config().set(host_memory_kind=kind)
    with pytest.raises(ConfigError, match="checkpointer.storage.host_memory_kind"):
        _make(tmp_path, storage=storage)


def test_host_memory_kind_the_devices_lack_is_a_config_error(make_checkpointer):
    storage = TensorStoreStateStorage.default_config().set(host_memory_kind="far_memory")
    checkpointer = make_checkpointer(storage=storage)
    with pytest.raises(ConfigError, match="host_memory_kind='far_memory'.*pinned_host"):
        checkpointer.save(1, _random_state(1))
    assert checkpointer.committed_steps() == []


@pytest.mark.parametrize(
    "flags, host_copies", [([], "pinned_host (default)"), (["--host_memory_kind=numpy"], "numpy")]
)
def test_benchmark_saves_each_new_state_and_restores_the_last(
    tmp_path, monkeypatch, capsys, flags, host_copies
):
    from tools import checkpoint_check  # pylint: disable=import-outside-toplevel

    argv = ["bench", "--size=65536", "--leaves=2", "--repeats=2", f"--dir={tmp_path}", *flags]
    monkeypatch.setattr(sys, "argv", argv)
    checkpoint_check.main()
    out = capsys.readouterr().out
    assert f"host copies: {host_copies}" in out
    assert "values equal: True" in out
    # The second save holds the state after one step (x + 1), not the first state again:
    # saving the same arrays twice would not time a second device-to-host copy.
    first = checkpoint_check.build_state(65536, 2, jnp.float32)
    template = {k: np.zeros(v.shape, v.dtype) for k, v in first.items()}
    cfg = Checkpointer.default_config().set(name="reader", dir=str(tmp_path))
    with cfg.instantiate(parent=None) as reader:
        step, saved, _ = reader.restore(state=template)
    assert step == 2
    for name, array in first.items():
        np.testing.assert_array_equal(np.asarray(saved[name]), np.asarray(array) + 1)


@pytest.mark.slow
@pytest.mark.parametrize("host_memory_kind", [[], ["numpy"]], ids=["pinned_host", "numpy"])
def test_two_processes_each_write_their_own_shards_and_restore_resharded(
    tmp_path, host_memory_kind
):
    with socket.socket() as probe:
        probe.bind(("localhost", 0))
        port = probe.getsockname()[1]
    script = os.path.join(TESTS_DIR, "checkpointer_multiprocess_script.py")
    env = fresh_env(devices=4)
    processes = [
        subprocess.Popen(
            [sys.executable, script, str(i), str(tmp_path), str(port), *host_memory_kind],
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        for i in range(2)
    ]
    outputs = [p.communicate(timeout=300)[0] for p in processes]
    for i, (process, output) in enumerate(zip(processes, outputs)):
        assert process.returncode == 0 and f"process {i} restored" in output, output
    step_dir = tmp_path / step_dir_name(1)
    with open(step_dir / "manifest_00001.json", encoding="utf-8") as f:
        by_process_1 = set(json.load(f)["files"])
    # Process 1 owns devices 4..7: rows 8..15 of w, and no replica 0 of the replicated r.
    assert by_process_1 == {f"arrays/w/{i}.0" for i in range(4, 8)}
    with open(step_dir / INDEX_FILE, encoding="utf-8") as f:
        index = json.load(f)
    assert {f"arrays/w/{i}.0" for i in range(8)} | {"arrays/r/0"} <= set(index["files"])
