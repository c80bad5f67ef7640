"""Tests of what a run leaves to recover from (axlearn.common.trainer, checkpointer and
summary_writer, through the launcher where a process is involved): the checkpoint named
good trains on, --restore_step restores the step asked for, a full disk leaves no
partial step and a parseable metrics.jsonl, and a killed run resumed writes each step once.
"""

import json
import os
import signal
import subprocess
import sys
import time

import jax
import numpy as np
import pytest

from axlearn.common.checkpointer import INDEX_FILE, Checkpointer, step_dir_name
from axlearn.common.launch_trainer_main import STORAGE_EXIT_CODE
from tests import test_launch
from tests.fresh_python import REPO, fresh_env
from tests.trainer_script import read_metrics, tiny_trainer_config

MAIN = "axlearn.common.launch_trainer_main"

# test_launch's tiny gpt_test run on fake batches, also saving every step (keeping one)
# and warmed up in one step.
TINY_RUN = (
    *test_launch.TINY_RUN,
    "--config_override=checkpointer.save_policy.n=1",
    "--config_override=checkpointer.keep_last_n=1",
    "--config_override=learner.optimizer.inner.update_schedule.warmup_steps=1",
)


def _main(*argv: str, script: str = None) -> subprocess.CompletedProcess:
    """The launcher in a subprocess on one fake CPU device; `script`: Python code that
    runs first (to break something), then the launcher's main with `argv`."""
    if script is None:
        command = [sys.executable, "-m", MAIN, *argv]
    else:
        runner = f"{script}\nfrom absl import app\nfrom {MAIN} import main\napp.run(main)\n"
        command = [sys.executable, "-c", runner, *argv]
    return subprocess.run(
        command, env=fresh_env(1), cwd=REPO, capture_output=True, text=True, timeout=300
    )


def _last_line(result: subprocess.CompletedProcess) -> str:
    return result.stderr.strip().splitlines()[-1]


def _verdicts(trainer_dir) -> dict[int, object]:
    directory = os.path.join(trainer_dir, "checkpoints")
    verdicts = {}
    for name in sorted(os.listdir(directory)):
        with open(os.path.join(directory, name, INDEX_FILE), encoding="utf-8") as f:
            index = json.load(f)
        verdicts[index["step"]] = index["good"]
    return verdicts


# ----- divergence: the good checkpoint it names trains on -----


@pytest.fixture(name="diverged_and_rerun", scope="module")
def fixture_diverged_and_rerun(tmp_path_factory):
    """gpt_test trained two steps, resumed at learning rate 1e6 (step 3's update blows the
    parameters up), then rerun at the config's own rate to step 5: (trainer dir, the
    diverged run, the checkpoint verdicts after it, the rerun). The schedules read the
    update count + 1, so a first step at 1e6 would blow up before any checkpoint."""
    trainer_dir = tmp_path_factory.mktemp("diverged")
    warm = _main(*TINY_RUN, f"--trainer_dir={trainer_dir}", "--config_override=max_step=2")
    assert warm.returncode == 0, warm.stderr[-3000:]
    first = _main(
        *TINY_RUN,
        f"--trainer_dir={trainer_dir}",
        "--config_override=max_step=10",
        "--config_override=learner.optimizer.inner.learning_rate=1e6",
        "--allow_config_change",
    )
    verdicts_after_first = _verdicts(trainer_dir)
    rerun = _main(
        *TINY_RUN,
        f"--trainer_dir={trainer_dir}",
        "--config_override=max_step=5",
        "--allow_config_change",
    )
    return trainer_dir, first, verdicts_after_first, rerun


@pytest.mark.slow
def test_a_blown_up_update_stops_the_run_naming_the_state_before_it(diverged_and_rerun):
    trainer_dir, first, verdicts, _ = diverged_and_rerun
    assert first.returncode == 1, first.stderr[-3000:]
    line = _last_line(first)
    assert "The parameter norm grew from" in line and "at step 3" in line
    assert f"the last good checkpoint is step 2 in {trainer_dir}/checkpoints" in line
    # Step 2 trained on (step 3's loss and gradients were finite): judged good and kept.
    assert verdicts == {2: True}


@pytest.mark.slow
def test_a_rerun_at_a_sane_learning_rate_trains_on_from_the_good_step(diverged_and_rerun):
    trainer_dir, first, _, rerun = diverged_and_rerun
    assert rerun.returncode == 0, rerun.stderr[-3000:]
    assert "Restored step 2 from" in rerun.stderr
    records = read_metrics(str(trainer_dir))
    assert [r["step"] for r in records] == [1, 2, 3, 4, 5]  # The blown-up step 3 is gone.
    first_norm = records[0]["learner/parameter_norm"]
    for record in records[1:]:
        assert record["learner/skipped_steps"] == 0
        assert np.isfinite(record["loss"])
        assert record["learner/parameter_norm"] < 2 * first_norm
    assert _verdicts(trainer_dir)[4] is True  # Step 5 trained on step 4.


# ----- --restore_step -----


@pytest.fixture(name="four_steps", scope="module")
def fixture_four_steps(tmp_path_factory):
    """The tiny trainer run to step 4, saving every step: its directory."""
    trainer_dir = str(tmp_path_factory.mktemp("four_steps"))
    tiny_trainer_config(trainer_dir=trainer_dir, max_step=4, save_every_n_steps=1).instantiate(
        parent=None
    ).run()
    return trainer_dir


@pytest.mark.slow
def test_restore_step_restores_the_parameters_of_that_step(four_steps):
    trainer = tiny_trainer_config(trainer_dir=four_steps, max_step=2).instantiate(parent=None)
    trainer.run(restore_step=2)  # max_step 2: restores, trains nothing.
    assert trainer.step == 2
    # The reference: step 2's arrays read back as NumPy, without the trainer.
    reader = Checkpointer.default_config().set(
        name="reader", dir=os.path.join(four_steps, "checkpoints")
    ).instantiate(parent=None)
    params = jax.tree.map(np.asarray, trainer.model_params())
    template = {"model": jax.tree.map(np.zeros_like, params)}
    step, saved, _ = reader.restore(step=2, state=template, subset=True)
    assert step == 2
    for actual, expected in zip(jax.tree.leaves(params), jax.tree.leaves(saved["model"])):
        np.testing.assert_array_equal(actual, expected)
    # Steps 3 and 4 are set aside: a later resume starts from step 2, not from them.
    assert reader.verdict(3) is False and reader.verdict(4) is False
    assert reader.restore(state=template, subset=True)[0] == 2


@pytest.mark.slow
def test_restore_step_of_a_missing_step_is_one_line_listing_the_steps(tmp_path):
    trainer_dir = tmp_path / "run"
    result = _main(*TINY_RUN, f"--trainer_dir={trainer_dir}", "--config_override=max_step=2")
    assert result.returncode == 0, result.stderr[-3000:]
    result = _main(
        *TINY_RUN, f"--trainer_dir={trainer_dir}", "--config_override=max_step=2",
        "--restore_step=7",
    )
    assert result.returncode == 1
    assert _last_line(result) == (
        f"launch_trainer_main: No committed checkpoint for step 7 in {trainer_dir}/checkpoints; "
        "committed steps: [1, 2]"
    )


# ----- a full disk -----

# Makes the checkpoint write of step 3 fail as a full disk does, after its data landed.
_FULL_DISK_AT_CHECKPOINT_3 = """
import errno, os
from axlearn.common import checkpointer
real_write = checkpointer.TensorStoreStateStorage.write
def write(self, snapshot, step_dir):
    files = real_write(self, snapshot, step_dir)
    if step_dir.endswith("step_00000003"):
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
    return files
checkpointer.TensorStoreStateStorage.write = write
"""

# Makes the write of step 3's metrics.jsonl record land a few bytes and fail as a full disk.
_FULL_DISK_AT_METRICS_3 = """
import errno, os
real_write = os.write
def write(fd, data):
    if os.readlink(f"/proc/self/fd/{fd}").endswith("train/metrics.jsonl") and (
        b'"step": 3,' in bytes(data)
    ):
        real_write(fd, bytes(data[:9]))
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
    return real_write(fd, data)
os.write = write
"""


@pytest.mark.slow
def test_a_full_disk_at_a_save_removes_the_partial_step_and_stops_in_one_line(tmp_path):
    trainer_dir = tmp_path / "run"
    result = _main(
        *TINY_RUN, f"--trainer_dir={trainer_dir}", "--config_override=max_step=6",
        script=_FULL_DISK_AT_CHECKPOINT_3,
    )
    assert result.returncode == STORAGE_EXIT_CODE, result.stderr[-3000:]
    step_dir = trainer_dir / "checkpoints" / step_dir_name(3)
    assert _last_line(result) == (
        f"launch_trainer_main: Saving checkpoint step 3 to {step_dir} failed: the disk is full "
        "(OSError: [Errno 28] No space left on device). Earlier checkpoints in "
        f"{trainer_dir}/checkpoints are intact."
    )
    assert not step_dir.exists()
    assert sorted(_verdicts(trainer_dir)) == [2]
    steps = [r["step"] for r in read_metrics(str(trainer_dir))]  # Every line parses.
    assert steps == sorted(set(steps)) and steps[:3] == [1, 2, 3]


@pytest.mark.slow
def test_a_full_disk_at_a_metrics_write_leaves_whole_lines_and_stops_in_one_line(tmp_path):
    trainer_dir = tmp_path / "run"
    result = _main(
        *TINY_RUN, f"--trainer_dir={trainer_dir}", "--config_override=max_step=6",
        script=_FULL_DISK_AT_METRICS_3,
    )
    assert result.returncode == STORAGE_EXIT_CODE, result.stderr[-3000:]
    path = trainer_dir / "summaries" / "train" / "metrics.jsonl"
    assert _last_line(result) == (
        f"launch_trainer_main: Writing summaries to {path} failed: No space left on device"
    )
    assert [r["step"] for r in read_metrics(str(trainer_dir))] == [1, 2]


# ----- kill -9, then resume -----

# Trains the tiny trainer, saving every 2 steps and writing every step's summaries at once;
# once step 4 is committed, the writer thread sleeps, so training goes on to step 6 and
# waits there, its records of steps 5 and 6 on disk past the newest checkpoint.
_STALLING_RUN = """
import sys, time
from axlearn.common.checkpointer import Checkpointer
from tests.trainer_script import tiny_trainer_config

trainer_dir = sys.argv[1]

class StallingCheckpointer(Checkpointer):
    def _commit(self, step_dir, index):
        super()._commit(step_dir, index)
        if index["step"] == 4 and index["good"] is None:
            time.sleep(600)

cfg = tiny_trainer_config(trainer_dir=trainer_dir, max_step=100, save_every_n_steps=2)
cfg.checkpointer.klass = StallingCheckpointer
cfg.instantiate(parent=None).run()
"""


@pytest.mark.slow
def test_a_run_killed_and_resumed_has_each_step_once_in_its_metrics(tmp_path):
    trainer_dir = tmp_path / "run"
    process = subprocess.Popen(
        [sys.executable, "-c", _STALLING_RUN, str(trainer_dir)], cwd=REPO, env=fresh_env(1)
    )
    metrics = trainer_dir / "summaries" / "train" / "metrics.jsonl"
    try:
        deadline = time.time() + 240
        while process.poll() is None and time.time() < deadline:
            if metrics.exists() and '"step": 6,' in metrics.read_text(encoding="utf-8"):
                break
            time.sleep(0.05)
        assert process.poll() is None, "the training process ended early"
    finally:
        os.kill(process.pid, signal.SIGKILL)
        process.wait(timeout=30)
    assert [r["step"] for r in read_metrics(str(trainer_dir))][-1] >= 6
    tiny_trainer_config(trainer_dir=str(trainer_dir), max_step=8, save_every_n_steps=2).instantiate(
        parent=None
    ).run()
    assert [r["step"] for r in read_metrics(str(trainer_dir))] == list(range(1, 9))
