"""Tests of the trainer's divergence guard (axlearn.common.trainer) and of the checkpointer
keeping the newest good checkpoint.

A bad step is one whose update the optimizer (skip_and_clip_by_global_norm) skipped. The
runs here poison chosen batches with an out-of-vocabulary token, which makes exactly those
steps' losses and gradients NaN (tests/trainer_script.py), so which steps are bad is known
in advance.
"""

import json
import logging
import os

import numpy as np
import pytest

from axlearn.common import launch, launch_trainer, launch_trainer_main
from axlearn.common.checkpointer import INDEX_FILE, Checkpointer, step_dir_name
from axlearn.common.config import ConfigError
from axlearn.common.trainer import ConsecutiveBadStepsError, NonFiniteLossError
from tests.trainer_script import (
    BATCH,
    SEQ_LEN,
    VOCAB,
    PoisonedFakeLmInput,
    adamw_learner_config,
    read_metrics,
    tiny_trainer_config,
)


def _committed_steps(trainer_dir: str) -> list[int]:
    cfg = Checkpointer.default_config().set(
        name="checkpointer", dir=os.path.join(trainer_dir, "checkpoints")
    )
    return cfg.instantiate(parent=None).committed_steps()


def _guarded_config(trainer_dir: str, *, bad_steps, max_step: int, max_bad: int):
    """The tiny trainer under skip_and_clip, saving every 2 steps, with `bad_steps` poisoned."""
    input_cfg = PoisonedFakeLmInput.default_config().set(
        is_training=True,
        global_batch_size=BATCH,
        max_sequence_length=SEQ_LEN,
        vocab_size=VOCAB,
        poisoned_batches=[step - 1 for step in bad_steps],  # Batch i is trained at step i + 1.
    )
    cfg = tiny_trainer_config(
        trainer_dir=trainer_dir,
        max_step=max_step,
        save_every_n_steps=2,
        input_cfg=input_cfg,
        learner=adamw_learner_config(skip_non_finite=True),
    )
    cfg.max_consecutive_bad_steps = max_bad
    return cfg


class _Warnings(logging.Handler):
    """Collects the trainer's warnings (caplog is per test; the fixtures are per module)."""

    def __init__(self):
        super().__init__(level=logging.WARNING)
        self.messages = []

    def emit(self, record):
        self.messages.append(record.getMessage())


def _run_collecting_warnings(cfg):
    """Runs a trainer from `cfg`: (the error it stopped with or None, its warnings)."""
    logger, records = logging.getLogger("axlearn.common.trainer"), _Warnings()
    logger.addHandler(records)
    try:
        cfg.instantiate(parent=None).run()
    except ConsecutiveBadStepsError as e:
        return e, records.messages
    finally:
        logger.removeHandler(records)
    return None, records.messages


# ----- a run that diverges: bad from step 4 on -----


@pytest.fixture(name="diverged_run", scope="module")
def fixture_diverged_run(tmp_path_factory):
    """Steps 4-10 bad, 5 in a row allowed: (trainer dir, the error, the warnings)."""
    trainer_dir = str(tmp_path_factory.mktemp("diverged"))
    cfg = _guarded_config(trainer_dir, bad_steps=range(4, 11), max_step=10, max_bad=5)
    error, warnings = _run_collecting_warnings(cfg)
    return trainer_dir, error, warnings


@pytest.mark.slow
def test_consecutive_bad_steps_stop_the_run_naming_the_last_good_checkpoint(diverged_run):
    trainer_dir, error, _ = diverged_run
    assert error is not None, "the run did not stop"
    message = str(error)
    assert "5 bad steps in a row (steps 4-8)" in message
    assert "the last good checkpoint is step 2 in" in message
    assert "max_consecutive_bad_steps=5" in message and "\n" not in message


@pytest.mark.slow
def test_no_checkpoint_is_written_once_the_loss_went_bad(diverged_run):
    trainer_dir, _, warnings = diverged_run
    assert _committed_steps(trainer_dir) == [2]
    # The saves due at steps 4, 6 and 8 left nothing on disk, not even uncommitted files.
    assert sorted(os.listdir(os.path.join(trainer_dir, "checkpoints"))) == [step_dir_name(2)]
    assert sum("Not saving checkpoint step" in m for m in warnings) == 2  # 8 stopped first.


@pytest.mark.slow
def test_a_trainer_checkpoint_is_recorded_good_in_its_index(diverged_run):
    trainer_dir, _, _ = diverged_run
    path = os.path.join(trainer_dir, "checkpoints", step_dir_name(2), INDEX_FILE)
    with open(path, encoding="utf-8") as f:
        assert json.load(f)["good"] is True


@pytest.mark.slow
def test_bad_step_counts_are_written_as_summaries(diverged_run):
    trainer_dir, _, _ = diverged_run
    records = {r["step"]: r for r in read_metrics(trainer_dir)}
    assert sorted(records) == list(range(1, 8))  # Step 8 stopped the run before its write.
    consecutive = [records[s]["trainer/consecutive_bad_steps"] for s in range(1, 8)]
    assert consecutive == [0, 0, 0, 1, 2, 3, 4]
    assert [records[s]["trainer/skipped_steps"] for s in range(1, 8)] == consecutive
    assert [records[s]["trainer/nonfinite_loss_steps"] for s in range(1, 8)] == consecutive
    # The optimizer's own count agrees.
    assert [records[s]["learner/skipped_steps"] for s in range(1, 8)] == consecutive


@pytest.mark.slow
def test_bad_steps_warn_at_the_first_second_fourth_of_a_row(diverged_run):
    _, _, warnings = diverged_run
    skipped = [m for m in warnings if "the optimizer skipped the update" in m]
    assert [m.split(":")[0] for m in skipped] == ["Step 4", "Step 5", "Step 7"]


# ----- a run whose bad steps end -----


@pytest.fixture(name="recovered_runs", scope="module")
def fixture_recovered_runs(tmp_path_factory):
    """Steps 3 and 4 bad, 3 in a row allowed, to step 6; then resumed to step 8:
    (trainer dir, the first run's warnings, the second run's error)."""
    trainer_dir = str(tmp_path_factory.mktemp("recovered"))
    cfg = _guarded_config(trainer_dir, bad_steps=[3, 4], max_step=6, max_bad=3)
    error, warnings = _run_collecting_warnings(cfg)
    assert error is None, error
    cfg = _guarded_config(trainer_dir, bad_steps=[3, 4], max_step=8, max_bad=1)
    second_error, _ = _run_collecting_warnings(cfg)
    return trainer_dir, warnings, second_error


@pytest.mark.slow
def test_bad_steps_that_end_reset_the_count_and_saving_resumes(recovered_runs):
    trainer_dir, warnings, _ = recovered_runs
    records = {r["step"]: r for r in read_metrics(trainer_dir)}
    assert [records[s]["trainer/consecutive_bad_steps"] for s in range(1, 7)] == [0, 0, 1, 2, 0, 0]
    assert records[6]["trainer/skipped_steps"] == 2
    assert any("Step 5 updated the parameters again after 2 skipped steps" in m for m in warnings)
    assert _committed_steps(trainer_dir)[:2] == [2, 6]  # Not 4: it was bad.


@pytest.mark.slow
def test_a_resumed_run_counts_only_the_steps_it_skips(recovered_runs):
    trainer_dir, _, second_error = recovered_runs
    # The restored optimizer state has counted 2 skipped steps; the resumed run skips none,
    # so even max_consecutive_bad_steps=1 lets it finish.
    assert second_error is None, second_error
    records = {r["step"]: r for r in read_metrics(trainer_dir)}
    assert records[8]["learner/skipped_steps"] == 2
    assert records[7]["trainer/skipped_steps"] == records[8]["trainer/skipped_steps"] == 0
    assert _committed_steps(trainer_dir) == [2, 6, 8]


# ----- configuration and the launcher -----


@pytest.mark.parametrize("value", [0, -1, 2.5])
def test_max_consecutive_bad_steps_must_be_a_positive_int(value):
    cfg = tiny_trainer_config(trainer_dir=None)
    cfg.max_consecutive_bad_steps = value
    with pytest.raises(ConfigError, match=r"trainer\.max_consecutive_bad_steps must be"):
        cfg.instantiate(parent=None)


def _quiet_main(monkeypatch) -> None:
    """launch_trainer_main.main in this process, without its process-wide setup."""
    monkeypatch.setattr(launch, "setup_from_flags", lambda flag_values: None)
    monkeypatch.setattr(launch_trainer_main, "quiet_tpu_probe", lambda: None)
    monkeypatch.setattr(launch_trainer_main.absl_logging, "set_verbosity", lambda level: None)


@pytest.mark.parametrize("error_type", [ConsecutiveBadStepsError, NonFiniteLossError])
def test_launcher_exits_with_status_1_and_the_one_line_message(monkeypatch, error_type):
    message = "5 bad steps in a row (steps 4-8): ... the last good checkpoint is step 2 in /d"

    def diverge(flag_values):
        raise error_type(message)

    _quiet_main(monkeypatch)
    monkeypatch.setattr(launch_trainer, "run_from_flags", diverge)
    with pytest.raises(SystemExit) as exit_info:
        launch_trainer_main.main(["launch_trainer_main"])
    # SystemExit with a message prints it to stderr and exits with status 1.
    assert exit_info.value.code == f"launch_trainer_main: {message}"


def test_launcher_lets_other_errors_through_with_their_traceback(monkeypatch):
    def fail(flag_values):
        raise KeyError("not a divergence")

    _quiet_main(monkeypatch)
    monkeypatch.setattr(launch_trainer, "run_from_flags", fail)
    with pytest.raises(KeyError):
        launch_trainer_main.main(["launch_trainer_main"])


# ----- garbage collection keeps the newest good checkpoint -----


def test_garbage_collection_keeps_the_newest_good_checkpoint_besides_its_rules(tmp_path):
    checkpointer = (
        Checkpointer.default_config()
        .set(name="checkpointer", dir=str(tmp_path), keep_last_n=1)
        .instantiate(parent=None)
    )
    state = {"w": np.arange(6, dtype=np.float32)}
    for step, good in ((1, True), (2, True), (3, None), (4, False)):
        checkpointer.save(step, state, good=good)
        checkpointer.wait_until_finished()
    checkpointer.run_garbage_collection()
    # keep_last_n=1 keeps 4; step 2 is the newest saved good; 1 and 3 go.
    assert checkpointer.committed_steps() == [2, 4]
    assert checkpointer.latest_good_step() == 2
    checkpointer.stop()
