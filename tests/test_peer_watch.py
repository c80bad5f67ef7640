"""Tests of axlearn.common.peer_watch: a process of a multi-process run whose peer is gone
exits within a minute with one line and PEER_LOST_EXIT_CODE.

The watcher's rounds are tested against a fake key-value store and a fake clock; the
whole exit with real processes: two launchers joined through jax.distributed on the CPU,
one killed with SIGKILL (process 1, or process 0: the coordinator, whose loss the
survivor's supervisor reports)."""

import os
import re
import signal
import socket
import subprocess
import sys
import threading
import time

import pytest

from axlearn.common.peer_watch import PEER_LOST_EXIT_CODE, PeerWatch
from tests.fresh_python import REPO, fresh_env


class _Store:
    """Stands in for jax.distributed's client: a dict, or an error while `down`."""

    def __init__(self):
        self.values: dict[str, str] = {}
        self.down = False

    def key_value_set(self, key: str, value: str, allow_overwrite: bool = False) -> None:
        del allow_overwrite
        if self.down:
            raise RuntimeError("UNAVAILABLE: failed to connect to all addresses")
        self.values[key] = value

    def key_value_dir_get(self, prefix: str) -> list[tuple[str, str]]:
        if self.down:
            raise RuntimeError("UNAVAILABLE: failed to connect to all addresses")
        return [(k, v) for k, v in self.values.items() if k.startswith(prefix)]


class _Clock:
    def __init__(self):
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def _pair(store, clock, timeout_s=10.0) -> list[PeerWatch]:
    watches = [
        PeerWatch(store, process_id=i, num_processes=2, timeout_s=timeout_s, clock=clock)
        for i in range(2)
    ]
    now = clock()
    # pylint: disable=protected-access
    for watch in watches:  # start() without the thread: the test runs the rounds.
        watch._seen = {j: (None, now) for j in range(2) if j != watch._process_id}
    return watches


def test_processes_that_keep_answering_are_not_lost():
    store, clock = _Store(), _Clock()
    watches = _pair(store, clock)
    for _ in range(50):
        clock.now += 1.0
        assert [w.check() for w in watches] == [None, None]


def test_a_process_that_stops_answering_is_named_once_the_timeout_passes():
    store, clock = _Store(), _Clock()
    survivor, gone = _pair(store, clock)
    for _ in range(3):
        clock.now += 1.0
        survivor.check(), gone.check()
    lines = []
    for _ in range(12):  # Process 1 is gone: only the survivor keeps its rounds.
        clock.now += 1.0
        lines.append(survivor.check())
    # The survivor last saw its counter move at t=4 (bumped after the survivor's round at
    # t=3): the round at t=14 is the first 10 s after.
    assert lines[:10] == [None] * 10  # t=4 to t=13.
    assert "process 1 of 2 has not answered for 10 s" in lines[10]
    assert f"Exiting with status {PEER_LOST_EXIT_CODE}" in lines[10]


def test_a_store_that_stops_answering_names_process_0():
    store, clock = _Store(), _Clock()
    watch = _pair(store, clock)[1]
    watch.check()
    store.down = True
    lines = []
    for _ in range(11):
        clock.now += 1.0
        lines.append(watch.check())
    # First unanswered at t=1: the round at t=11 is the first 10 s after.
    assert lines[:10] == [None] * 10
    assert "coordination service of process 0 has not answered for 10 s" in lines[10]
    assert "UNAVAILABLE" in lines[10]


def test_the_watcher_thread_exits_with_the_lost_status_after_its_cleanup():
    exited, cleaned = threading.Event(), []
    statuses = []

    def exit_fn(status):
        statuses.append(status)
        exited.set()

    watch = PeerWatch(
        _Store(), process_id=0, num_processes=2, timeout_s=0.2, heartbeat_s=0.01,
        exit_fn=exit_fn, on_exit=lambda: cleaned.append(True),
    ).start()
    assert exited.wait(60)
    watch.stop()
    assert statuses == [PEER_LOST_EXIT_CODE] and cleaned == [True]
    assert "process 1 of 2 has not joined the watch" in watch.lost


# ----- real processes -----


def _free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("localhost", 0))
        return probe.getsockname()[1]


def _launch(trainer_dir, port: int, process_id: int) -> subprocess.Popen:
    command = [
        sys.executable, "-m", "axlearn.common.launch_trainer_main", "--config=gpt_test",
        "--data_dir=FAKE", f"--trainer_dir={trainer_dir}", "--jax_backend=cpu",
        f"--distributed_coordinator=localhost:{port}", "--num_processes=2",
        f"--process_id={process_id}",
        "--config_override=input.global_batch_size=2",
        "--config_override=input.max_sequence_length=16",
        "--config_override=evalers={}",
        "--config_override=max_step=100000",
        "--config_override=log_every_n_steps=1",
    ]
    return subprocess.Popen(
        command, cwd=REPO, env=fresh_env(1), stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
        text=True,
    )


def _read_until(process: subprocess.Popen, marker: str, lines: list[str]) -> None:
    for line in process.stdout:
        lines.append(line)
        if marker in line:
            return
    raise AssertionError(f"exited before {marker!r}: {''.join(lines)[-3000:]}")


@pytest.mark.slow
def test_the_survivor_of_a_killed_process_exits_within_a_minute_with_one_line(tmp_path):
    killed = 1
    port = _free_port()
    processes = [_launch(tmp_path / "run", port, i) for i in range(2)]
    survivor = processes[1 - killed]
    lines: list[str] = []
    try:
        _read_until(survivor, "step      2/", lines)  # Both train: steps are collective.
        processes[killed].kill()
        processes[killed].wait()
        start = time.monotonic()
        lines.extend(survivor.stdout)
        survivor.wait(timeout=120)
        took = time.monotonic() - start
    finally:
        for process in processes:
            if process.poll() is None:
                process.send_signal(signal.SIGKILL)
                process.wait()
    output = "".join(lines)
    assert survivor.returncode == PEER_LOST_EXIT_CODE, output[-3000:]
    assert took < 60, output[-3000:]
    last = output.strip().splitlines()[-1]
    assert last.startswith("launch_trainer_main: Process") or "stops:" in last, output[-3000:]
    assert f"process {killed}" in last and "is gone" in last
    assert "Fatal Python error" not in output and "Aborted" not in output
    assert not os.path.exists(tmp_path / "run" / "LOCK")


@pytest.mark.slow
def test_the_survivor_of_a_killed_coordinator_exits_with_one_line_and_no_stack_dump(tmp_path):
    port = _free_port()
    coordinator, survivor = [_launch(tmp_path / "run", port, i) for i in range(2)]
    lines: list[str] = []
    try:
        _read_until(survivor, "step      2/", lines)
        coordinator.kill()  # Its supervisor: the training child dies with it.
        coordinator.wait()
        lines.extend(survivor.stdout)
        survivor.wait(timeout=60)
    finally:
        for process in (coordinator, survivor):
            if process.poll() is None:
                process.send_signal(signal.SIGKILL)
                process.wait()
    output = "".join(lines)
    assert survivor.returncode == PEER_LOST_EXIT_CODE, output[-3000:]
    last = output.strip().splitlines()[-1]
    assert last.startswith(
        f"launch_trainer_main: process 0 (the coordinator, localhost:{port}) is gone; "
        "process 1 of 2 stops"
    ), output[-3000:]
    assert "Aborted" not in output and "Check failure" not in output, output[-3000:]
    assert not re.search(r"^\s*@\s+0x[0-9a-f]+", output, re.MULTILINE), output[-3000:]


def test_a_process_that_finished_is_not_waited_for():
    store, clock = _Store(), _Clock()
    survivor, finished = _pair(store, clock)
    clock.now += 1.0
    survivor.check(), finished.check()
    finished.finish()
    for _ in range(30):
        clock.now += 1.0
        assert survivor.check() is None


def test_a_store_that_fails_from_the_start_starts_no_watcher():
    store = _Store()
    store.down = True
    assert PeerWatch(store, process_id=0, num_processes=2).start() is None
