"""Specification of axlearn.common.run_dir: the paths of a trainer directory, and its lock.

The expected paths are the layout the docs promise (docs/architecture.md, run_dir's
docstring), written out as literal strings."""

import os
import threading

from axlearn.common import run_lock
from axlearn.common.run_dir import RunDir
from axlearn.common.run_lock import RunLockError


def test_every_file_of_a_run_is_named_under_its_root():
    run = RunDir("/runs/a")
    assert run.config_record == "/runs/a/config.txt"
    assert run.data_record == "/runs/a/data.json"
    assert run.lock_file == "/runs/a/LOCK"
    assert run.checkpoints == "/runs/a/checkpoints"
    assert run.traces == "/runs/a/traces"
    assert run.wandb_run_id == "/runs/a/wandb_run_id"


def test_each_summary_writer_has_a_directory_under_summaries():
    run = RunDir("/runs/a")
    assert run.summaries() == "/runs/a/summaries"
    assert run.summaries("train") == "/runs/a/summaries/train"
    assert run.summaries("validation") == "/runs/a/summaries/validation"


def test_a_storage_url_gets_url_paths_with_its_parts_quoted():
    assert RunDir("gs://bucket/run").summaries("eval 1") == "gs://bucket/run/summaries/eval%201"


def test_run_dirs_of_one_root_are_equal():
    assert RunDir("/runs/a") == RunDir("/runs/a") != RunDir("/runs/b")


def test_a_lock_inside_a_lock_of_the_same_run_dir_takes_nothing_more(tmp_path, monkeypatch):
    taken = []
    hold = run_lock.hold_on_process_0

    def counting_hold(path):
        taken.append(path)
        return hold(path)

    monkeypatch.setattr(run_lock, "hold_on_process_0", counting_hold)
    run = RunDir(str(tmp_path))
    with run.lock():
        with run.lock():  # The trainer's, given the launcher's RunDir.
            assert run.locked
        assert run.locked and os.path.isfile(tmp_path / "LOCK")
    assert taken == [str(tmp_path / "LOCK")] and not run.locked
    assert not os.path.exists(tmp_path / "LOCK")


def test_the_lock_is_the_lock_file_and_reentrant_in_its_thread(tmp_path):
    run = RunDir(str(tmp_path))
    with run.lock():
        with RunDir(str(tmp_path)).lock():  # Another RunDir of the same directory.
            assert os.path.isfile(tmp_path / "LOCK")
        assert os.path.isfile(tmp_path / "LOCK")
    assert not os.path.exists(tmp_path / "LOCK")


def test_the_lock_keeps_another_thread_out(tmp_path):
    run = RunDir(str(tmp_path))
    errors = []

    def second():
        try:
            with run.lock():
                pass
        except RunLockError as e:
            errors.append(e)

    with run.lock():
        thread = threading.Thread(target=second)
        thread.start()
        thread.join()
    assert len(errors) == 1 and str(tmp_path / "LOCK") in str(errors[0])
