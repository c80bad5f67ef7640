"""Tests of checkpoint integrity across a run's lifecycle (axlearn.common.checkpointer, and
the trainer's use of it): the index's own checksum, committed steps that failed their
checks being saved again, and summaries on disk for every checkpointed step.
"""

import hashlib
import json
import logging
import os
import subprocess
import sys
import time
import zlib

import numpy as np
import pytest

from axlearn.common.checkpointer import (
    INDEX_CHECKSUM,
    INDEX_FILE,
    Checkpointer,
    CheckpointCorruptError,
    step_dir_name,
)
from tests.fresh_python import REPO, fresh_env
from tests.trainer_script import losses_by_step, read_metrics, tiny_trainer_config


def _checkpointer(directory, **kwargs) -> Checkpointer:
    cfg = Checkpointer.default_config().set(name="checkpointer", dir=str(directory), **kwargs)
    return cfg.instantiate(parent=None)


def _state(seed: int) -> dict:
    rng = np.random.default_rng(seed)
    return {"w": rng.normal(size=(6, 5)).astype(np.float32), "b": np.float32(seed)}


def _template() -> dict:
    return {"w": np.zeros((6, 5), np.float32), "b": np.float32(0)}


def _index_path(directory, step: int) -> str:
    return os.path.join(directory, step_dir_name(step), INDEX_FILE)


def _read(path) -> dict:
    with open(path, encoding="utf-8") as f:
        return json.load(f)


def _write(path, value: dict) -> None:
    with open(path, "w", encoding="utf-8") as f:
        json.dump(value, f)


def _flip_a_byte(path) -> None:
    with open(path, "r+b") as f:
        byte = f.read(1)
        f.seek(0)
        f.write(bytes([byte[0] ^ 0x40]))


def _saved(directory, steps, keep_last_n: int = 10, **kwargs) -> Checkpointer:
    """A checkpointer over `directory` that has committed `steps` (state `_state(step)`,
    the input position `step` in extra)."""
    checkpointer = _checkpointer(directory, keep_last_n=keep_last_n, **kwargs)
    for step in steps:
        checkpointer.save(step, _state(step), extra={"input_iterator": {"batches_consumed": step}})
        checkpointer.wait_until_finished()
    return checkpointer


# ----- the index's own checksum -----


def test_index_records_the_sha256_of_its_canonical_json_without_that_field(tmp_path):
    _saved(tmp_path, [1]).stop()
    index = _read(_index_path(tmp_path, 1))
    body = {k: v for k, v in index.items() if k != INDEX_CHECKSUM}
    canonical = json.dumps(body, sort_keys=True, separators=(",", ":"))
    assert index[INDEX_CHECKSUM] == hashlib.sha256(canonical.encode()).hexdigest()


def test_an_edited_input_position_is_skipped_on_restore_naming_the_index(tmp_path, caplog):
    checkpointer = _saved(tmp_path, [1, 2])
    path = _index_path(tmp_path, 2)
    index = _read(path)
    index["extra"]["input_iterator"]["batches_consumed"] = 7  # The checksum left as it was.
    _write(path, index)
    with caplog.at_level(logging.WARNING):
        step, restored, extra = checkpointer.restore(state=_template())
    assert step == 1 and extra == {"input_iterator": {"batches_consumed": 1}}
    np.testing.assert_array_equal(restored["w"], _state(1)["w"])
    assert f"{path} fails its sha256 check" in caplog.text
    checkpointer.stop()


def test_an_edited_index_of_an_explicit_step_raises_naming_it(tmp_path):
    checkpointer = _saved(tmp_path, [1])
    path = _index_path(tmp_path, 1)
    index = _read(path)
    index["extra"]["input_iterator"]["batches_consumed"] = 7
    _write(path, index)
    with pytest.raises(CheckpointCorruptError, match=f"{path} fails its sha256 check"):
        checkpointer.restore(step=1, state=_template())
    checkpointer.stop()


def test_an_index_without_a_checksum_restores_with_a_warning(tmp_path, caplog):
    # Indexes written before they had checksums must still restore: runs resume across
    # the upgrade.
    checkpointer = _saved(tmp_path, [1])
    path = _index_path(tmp_path, 1)
    index = _read(path)
    del index[INDEX_CHECKSUM]
    _write(path, index)
    with caplog.at_level(logging.WARNING):
        step, restored, _ = checkpointer.restore(state=_template())
    assert step == 1
    np.testing.assert_array_equal(restored["w"], _state(1)["w"])
    assert f"{path} has no {INDEX_CHECKSUM}" in caplog.text
    checkpointer.stop()


# ----- committed steps that failed their checks -----


def test_a_step_that_failed_its_checks_on_restore_is_replaced_when_saved_again(tmp_path, caplog):
    checkpointer = _saved(tmp_path, [1, 2])
    _flip_a_byte(os.path.join(tmp_path, step_dir_name(2), "arrays", "w", "0.0"))
    step, _, _ = checkpointer.restore(state=_template())
    assert step == 1
    with caplog.at_level(logging.WARNING):
        checkpointer.save(2, _state(20))
        checkpointer.wait_until_finished()
    assert "already committed" not in caplog.text and "saving it again" in caplog.text
    step, restored, _ = checkpointer.restore(step=2, state=_template())
    np.testing.assert_array_equal(restored["w"], _state(20)["w"])
    checkpointer.stop()


def test_a_committed_step_whose_index_fails_its_check_is_replaced_when_saved(tmp_path):
    # No restore saw it: the save itself rechecks the index before refusing to save.
    checkpointer = _saved(tmp_path, [1])
    path = _index_path(tmp_path, 1)
    index = _read(path)
    index["extra"] = {"edited": True}
    _write(path, index)
    checkpointer.save(1, _state(10))
    checkpointer.wait_until_finished()
    _, restored, extra = checkpointer.restore(step=1, state=_template())
    np.testing.assert_array_equal(restored["w"], _state(10)["w"])
    assert extra is None
    checkpointer.stop()


def test_an_intact_committed_step_is_not_saved_again(tmp_path, caplog):
    checkpointer = _saved(tmp_path, [1])
    with caplog.at_level(logging.WARNING):
        checkpointer.save(1, _state(10))
        checkpointer.wait_until_finished()
    assert "already committed" in caplog.text
    _, restored, _ = checkpointer.restore(step=1, state=_template())
    np.testing.assert_array_equal(restored["w"], _state(1)["w"])
    checkpointer.stop()


def test_garbage_collection_never_keeps_a_failed_step_in_place_of_intact_ones(tmp_path):
    checkpointer = _saved(tmp_path, [10, 20, 30], keep_last_n=1, keep_every_n_steps=10)
    checkpointer.stop()
    _flip_a_byte(os.path.join(tmp_path, step_dir_name(30), "arrays", "w", "0.0"))
    checkpointer = _checkpointer(tmp_path, keep_last_n=1)
    assert checkpointer.restore(state=_template())[0] == 20
    # Before step 30 is trained again, step 25 is saved: the newest intact checkpoint. The
    # corrupt 30 does not count as newer, and is kept until it is saved again.
    checkpointer.save(25, _state(25))
    checkpointer.wait_until_finished()
    assert checkpointer.committed_steps() == [25, 30]
    assert checkpointer.restore(state=_template())[0] == 25
    checkpointer.save(30, _state(30))
    checkpointer.wait_until_finished()
    assert checkpointer.committed_steps() == [30]
    checkpointer.stop()


@pytest.mark.slow
def test_a_corrupted_latest_step_is_rewritten_when_the_restarted_run_reaches_it(tmp_path):
    trainer_dir = str(tmp_path)
    cfg = tiny_trainer_config(trainer_dir=trainer_dir, max_step=4, save_every_n_steps=2)
    cfg.instantiate(parent=None).run()
    reference = losses_by_step(trainer_dir)
    step_dir = os.path.join(trainer_dir, "checkpoints", step_dir_name(4))
    index = _read(os.path.join(step_dir, INDEX_FILE))
    chunk = next(name for name in sorted(index["files"]) if not name.endswith(".zarray"))
    _flip_a_byte(os.path.join(step_dir, chunk))

    trainer = cfg.instantiate(parent=None)
    trainer.run()
    assert trainer.step == 4
    # Steps 3 and 4 were trained again from step 2, as before; their records replace the
    # first run's.
    assert [r["step"] for r in read_metrics(trainer_dir)] == [1, 2, 3, 4]
    assert losses_by_step(trainer_dir) == reference
    # Step 4 is a fresh commit: its index checks out and every file matches its record.
    index = _read(os.path.join(step_dir, INDEX_FILE))
    body = {k: v for k, v in index.items() if k != INDEX_CHECKSUM}
    canonical = json.dumps(body, sort_keys=True, separators=(",", ":"))
    assert index[INDEX_CHECKSUM] == hashlib.sha256(canonical.encode()).hexdigest()
    for name, record in index["files"].items():
        with open(os.path.join(step_dir, name), "rb") as f:
            data = f.read()
        assert record == {"size": len(data), "crc32": zlib.crc32(data)}, name


# ----- summaries at every checkpoint -----

# Trains the tiny trainer with summaries held in memory (max_queue 1000), saving every 2
# steps; once step 4 is committed it touches the marker file and the writer thread sleeps,
# so training stops at the save of step 6, which waits for it.
_PAUSING_RUN = """
import sys, time
from axlearn.common.checkpointer import Checkpointer
from tests.trainer_script import tiny_trainer_config

trainer_dir, marker = sys.argv[1], sys.argv[2]

class PausingCheckpointer(Checkpointer):
    def _commit(self, step_dir, index):
        super()._commit(step_dir, index)
        if index["step"] == 4:
            open(marker, "w").close()
            time.sleep(600)

cfg = tiny_trainer_config(trainer_dir=trainer_dir, max_step=100, save_every_n_steps=2)
cfg.checkpointer.klass = PausingCheckpointer
cfg.summary_writer.max_queue = 1000
cfg.instantiate(parent=None).run()
"""


@pytest.mark.slow
def test_metrics_hold_every_checkpointed_step_after_a_kill(tmp_path):
    trainer_dir, marker = tmp_path / "run", tmp_path / "marker"
    process = subprocess.Popen(
        [sys.executable, "-c", _PAUSING_RUN, str(trainer_dir), str(marker)],
        cwd=REPO,
        env=fresh_env(devices=1),
    )
    try:
        deadline = time.time() + 240
        while not marker.exists() and process.poll() is None and time.time() < deadline:
            time.sleep(0.05)
        assert marker.exists(), "the training process never committed step 4"
    finally:
        process.kill()  # SIGKILL: nothing is flushed on the way out.
        process.wait(timeout=30)
    checkpointer = _checkpointer(trainer_dir / "checkpoints")
    assert checkpointer.latest_committed_step() == 4
    steps = [record["step"] for record in read_metrics(str(trainer_dir))]
    assert steps[:4] == [1, 2, 3, 4]
