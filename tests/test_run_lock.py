"""Tests of axlearn.common.run_lock: one trainer per directory.

Holders and racers are real processes (small Python scripts that import only run_lock);
the trainers tested against them run in this process with their training loop replaced,
since the lock is taken and released around it.
"""

import datetime
import json
import logging
import os
import socket
import subprocess
import sys
import threading

import pytest
from absl import flags

from axlearn.common import launch, launch_trainer, run_dir, run_lock
from axlearn.common.run_dir import LOCK as LOCK_FILE_NAME
from axlearn.common.run_lock import RunLock, RunLockError
from axlearn.common.trainer import SpmdTrainer
from tests.fresh_python import REPO, fresh_env
from tests.trainer_script import tiny_trainer_config

# Takes the lock file argv[1], says so, and holds it until its standard input closes.
HOLDER = """
import sys
from axlearn.common import run_lock
with run_lock.hold(sys.argv[1]):
    print("held", flush=True)
    sys.stdin.read()
"""

# Says it is ready, waits for the file argv[2], then tries the lock file argv[1] once; a
# winner holds it until its standard input closes.
RACER = """
import os, sys, time
from axlearn.common import run_lock
print("ready", flush=True)
while not os.path.exists(sys.argv[2]):
    time.sleep(0.001)
lock = run_lock.RunLock(sys.argv[1])
try:
    lock.acquire()
except run_lock.RunLockError:
    print("refused", flush=True)
    sys.exit(0)
print("held", flush=True)
sys.stdin.read()
lock.release()
"""


def _python(script: str, *args: str) -> subprocess.Popen:
    return subprocess.Popen(
        [sys.executable, "-c", script, *args], cwd=REPO, env=fresh_env(),
        stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
    )


def _finish(process: subprocess.Popen) -> None:
    process.stdin.close()
    assert process.wait(timeout=60) == 0


def _lock_path(directory) -> str:
    return os.path.join(directory, LOCK_FILE_NAME)


def _read_lock(directory) -> dict:
    with open(_lock_path(directory), encoding="utf-8") as f:
        return json.load(f)


def _write_lock(directory, **holder) -> None:
    with open(_lock_path(directory), "w", encoding="utf-8") as f:
        json.dump(holder, f)


def _dead_pid() -> int:
    """The pid of a process of this host that has exited (and been reaped)."""
    process = subprocess.Popen([sys.executable, "-c", "pass"])
    process.wait()
    return process.pid


def _trainer(trainer_dir) -> SpmdTrainer:
    return tiny_trainer_config(trainer_dir=str(trainer_dir)).instantiate(parent=None)


# ----- what the lock says -----


def test_the_lock_names_its_holders_host_pid_and_start_time(tmp_path):
    lock = RunLock(_lock_path(tmp_path))
    lock.acquire()
    holder = _read_lock(tmp_path)
    lock.release()
    assert holder["host"] == socket.gethostname() and holder["pid"] == os.getpid()
    started = datetime.datetime.fromisoformat(holder["start_time"])
    assert started.tzinfo is not None and started <= datetime.datetime.now(datetime.timezone.utc)


def test_a_trainer_holds_the_lock_while_it_trains_and_releases_it_after(tmp_path, monkeypatch):
    seen = []
    monkeypatch.setattr(SpmdTrainer, "_train", lambda self: seen.append(_read_lock(tmp_path)))
    _trainer(tmp_path).run()
    assert [holder["pid"] for holder in seen] == [os.getpid()]
    assert not os.path.exists(_lock_path(tmp_path))


def test_a_trainer_that_fails_releases_the_lock(tmp_path, monkeypatch):
    def fail(self):
        raise ValueError("failed while training")

    monkeypatch.setattr(SpmdTrainer, "_train", fail)
    with pytest.raises(ValueError, match="failed while training"):
        _trainer(tmp_path).run()
    assert not os.path.exists(_lock_path(tmp_path))


# ----- a second trainer -----


def test_a_second_trainer_fails_at_once_naming_the_holder(tmp_path, monkeypatch):
    holder = _python(HOLDER, _lock_path(tmp_path))
    assert holder.stdout.readline().strip() == "held"
    monkeypatch.setattr(SpmdTrainer, "_train", lambda self: pytest.fail("it trained"))
    try:
        with pytest.raises(RunLockError) as error:
            _trainer(tmp_path).run()
        assert f"names pid {holder.pid} on host {socket.gethostname()}, started" in str(error.value)
        assert _read_lock(tmp_path)["pid"] == holder.pid  # Left as it was.
    finally:
        _finish(holder)
    assert not os.path.exists(_lock_path(tmp_path))  # The holder released it on exit.


def test_a_second_launcher_run_fails_before_recording_its_config(tmp_path):
    _write_lock(tmp_path, host="another-host", pid=1, start_time="2026-01-01T00:00:00+00:00")
    flag_values = flags.FlagValues()
    launch.define_flags(flag_values)
    launch_trainer.define_flags(flag_values)
    flag_values(
        [
            "launch_trainer_main", "--config=gpt_test", "--data_dir=FAKE",
            f"--trainer_dir={tmp_path}", "--mesh_selector=none",
        ]
    )
    with pytest.raises(RunLockError, match="names pid 1 on host another-host"):
        launch_trainer.run_from_flags(flag_values)
    assert not os.path.exists(tmp_path / run_dir.CONFIG_RECORD)


# ----- stale and foreign locks -----


def test_a_stale_lock_of_a_dead_process_of_this_host_is_taken_over_with_a_warning(
    tmp_path, caplog
):
    dead = _dead_pid()
    _write_lock(tmp_path, host=socket.gethostname(), pid=dead, start_time="2026-01-01T00:00:00")
    lock = RunLock(_lock_path(tmp_path))
    with caplog.at_level(logging.WARNING, logger="axlearn.common.run_lock"):
        lock.acquire()
    assert f"Took over the stale lock {_lock_path(tmp_path)}" in caplog.text
    assert f"pid {dead} on host {socket.gethostname()}" in caplog.text
    assert _read_lock(tmp_path)["pid"] == os.getpid()
    lock.release()


def test_a_lock_naming_a_pid_that_a_later_process_reuses_is_stale(tmp_path):
    later = _python("import sys; sys.stdin.read()")  # Runs, and started after 2000.
    try:
        _write_lock(
            tmp_path, host=socket.gethostname(), pid=later.pid,
            start_time="2000-01-01T00:00:00+00:00",
        )
        lock = RunLock(_lock_path(tmp_path))
        lock.acquire()
        assert _read_lock(tmp_path)["pid"] == os.getpid()
        lock.release()
    finally:
        _finish(later)


def test_an_older_lock_naming_this_process_s_pid_is_a_previous_process_s(tmp_path):
    # As a restarted container finds it: its pid is the one the previous process had.
    _write_lock(
        tmp_path, host=socket.gethostname(), pid=os.getpid(),
        start_time="2000-01-01T00:00:00+00:00",
    )
    lock = RunLock(_lock_path(tmp_path))
    lock.acquire()
    assert _read_lock(tmp_path)["start_time"] != "2000-01-01T00:00:00+00:00"
    lock.release()


def test_a_lock_this_process_took_is_not_taken_again(tmp_path):
    first = RunLock(_lock_path(tmp_path))
    first.acquire()
    try:
        with pytest.raises(RunLockError, match=f"names pid {os.getpid()} on host"):
            RunLock(_lock_path(tmp_path)).acquire()
    finally:
        first.release()


def test_a_lock_of_another_host_is_refused_saying_how_to_delete_it(tmp_path):
    _write_lock(tmp_path, host="another-host", pid=_dead_pid(), start_time="2026-01-01T00:00:00")
    with pytest.raises(RunLockError) as error:
        RunLock(_lock_path(tmp_path)).acquire()
    assert "another host cannot be checked" in str(error.value)
    assert f"rm {_lock_path(tmp_path)}" in str(error.value)


def test_an_unreadable_lock_file_is_refused_naming_it(tmp_path):
    with open(_lock_path(tmp_path), "w", encoding="utf-8") as f:
        f.write("{not json")
    with pytest.raises(RunLockError, match=f"{_lock_path(tmp_path)} is not a lock file"):
        RunLock(_lock_path(tmp_path)).acquire()


def test_of_processes_racing_for_a_stale_lock_exactly_one_takes_it(tmp_path):
    _write_lock(tmp_path, host=socket.gethostname(), pid=_dead_pid(), start_time="2026-01-01")
    go = str(tmp_path / "go")
    racers = [_python(RACER, _lock_path(tmp_path), go) for _ in range(4)]
    try:
        assert all(r.stdout.readline().strip() == "ready" for r in racers)
        open(go, "w", encoding="utf-8").close()
        outcomes = [r.stdout.readline().strip() for r in racers]
        assert sorted(outcomes) == ["held", "refused", "refused", "refused"]
        assert _read_lock(tmp_path)["pid"] == racers[outcomes.index("held")].pid
    finally:
        for racer in racers:
            _finish(racer)
    assert not os.path.exists(_lock_path(tmp_path))


# ----- holding within one process -----


def test_holding_again_in_the_same_thread_keeps_the_lock_until_the_outer_hold_ends(tmp_path):
    with run_lock.hold(_lock_path(tmp_path)):
        with run_lock.hold(_lock_path(tmp_path)):
            pass
        assert _read_lock(tmp_path)["pid"] == os.getpid()
    assert not os.path.exists(_lock_path(tmp_path))


def test_another_thread_of_the_holding_process_is_refused(tmp_path):
    errors = []

    def second():
        try:
            with run_lock.hold(_lock_path(tmp_path)):
                pass
        except RunLockError as e:
            errors.append(str(e))

    with run_lock.hold(_lock_path(tmp_path)):
        thread = threading.Thread(target=second)
        thread.start()
        thread.join()
    assert len(errors) == 1 and "held by another thread of this process" in errors[0]


def test_release_all_releases_the_held_locks_for_a_forced_exit(tmp_path):
    with run_lock.hold(_lock_path(tmp_path / "a")), run_lock.hold(_lock_path(tmp_path / "b")):
        run_lock.release_all()
        assert not os.path.exists(_lock_path(tmp_path / "a"))
        assert not os.path.exists(_lock_path(tmp_path / "b"))
    # Leaving the holds afterwards neither fails nor touches a lock taken since.
    assert not os.path.exists(_lock_path(tmp_path / "a"))


def test_a_lock_that_cannot_be_removed_leaves_the_run_s_own_error_standing(
    tmp_path, monkeypatch, caplog
):
    def read_only(path):
        raise PermissionError(13, "Permission denied", path)

    with pytest.raises(ValueError, match="the save failed"):
        with caplog.at_level(logging.WARNING, logger="axlearn.common.run_lock"):
            with run_lock.hold(_lock_path(tmp_path)):
                # The directory turns read-only under the run, whose save then fails.
                monkeypatch.setattr(run_lock._LockFiles, "remove", staticmethod(read_only))
                raise ValueError("the save failed")
    assert f"Could not remove the lock {_lock_path(tmp_path)}" in caplog.text
