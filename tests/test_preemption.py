"""Tests of axlearn.common.preemption: a run stopped by SIGTERM or SIGINT saves the step it
reached, flushes its summaries, exits with PREEMPTED_EXIT_CODE and resumes there.

The runs that get a signal are real processes (tests/preemption_script.py) that wait at a
known step until the signal has reached them; the reference and the resumed runs train
in this process. The signal handling itself is also tested here with real signals sent
to this process, and an exit function that records instead of exiting.
"""

import logging
import os
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time

import jax
import pytest

from axlearn.common import launch_trainer_main, preemption, run_dir, run_lock
from axlearn.common.checkpointer import Checkpointer
from axlearn.common.config import ConfigError
from axlearn.common.preemption import (
    INTERRUPTED_EXIT_CODE,
    PREEMPTED_EXIT_CODE,
    Preempted,
    StopRequest,
    StopVote,
)
from tests.fresh_python import REPO, fresh_env
from tests.trainer_script import losses_by_step, read_metrics, tiny_trainer_config

SCRIPT = os.path.join(REPO, "tests", "preemption_script.py")
MAX_STEP = 6
PAUSE_STEP = 3
# How long a test waits for a subprocess to reach its pause or to exit; never reached by
# a run that works.
TIMEOUT_S = 300


def _committed_steps(trainer_dir) -> list[int]:
    cfg = Checkpointer.default_config().set(
        name="checkpointer", dir=os.path.join(trainer_dir, "checkpoints")
    )
    return cfg.instantiate(parent=None).committed_steps()


def _train_here(trainer_dir: str, max_step: int = MAX_STEP) -> None:
    """Trains (or resumes) the tiny config in this process, on one device like the script."""
    cfg = tiny_trainer_config(trainer_dir=trainer_dir, max_step=max_step)
    cfg.instantiate(parent=None, devices=jax.devices()[:1]).run()


def _start_script(trainer_dir, *args: str, devices: int = 1) -> subprocess.Popen:
    command = [sys.executable, SCRIPT, str(trainer_dir), f"--max_step={MAX_STEP}", *args]
    return subprocess.Popen(
        command, env=fresh_env(devices), cwd=REPO, stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT, text=True,
    )


@pytest.fixture(autouse=True)
def _python_s_own_sigint_handler():
    """This process's SIGINT handler as Python installs it, for the tests and back after."""
    old = signal.signal(signal.SIGINT, signal.default_int_handler)
    yield
    signal.signal(signal.SIGINT, old)


def _free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("localhost", 0))
        return probe.getsockname()[1]


def _wait_for(marker: str, processes: list[subprocess.Popen]) -> None:
    deadline = time.monotonic() + TIMEOUT_S
    while not os.path.exists(marker):
        for process in processes:
            if process.poll() is not None:
                raise AssertionError(f"exited before its pause: {process.communicate()[0][-3000:]}")
        assert time.monotonic() < deadline, "the run never reached its pause"
        time.sleep(0.05)


@pytest.fixture(name="reference_losses", scope="module")
def fixture_reference_losses(tmp_path_factory) -> dict[int, float]:
    """The losses of an uninterrupted run, steps 1 to MAX_STEP."""
    trainer_dir = str(tmp_path_factory.mktemp("reference"))
    _train_here(trainer_dir)
    return losses_by_step(trainer_dir)


@pytest.fixture(name="stopped_run", scope="module", params=["SIGTERM", "SIGINT"])
def fixture_stopped_run(request, tmp_path_factory) -> tuple[str, int, str]:
    """A run sent a signal while it trains step PAUSE_STEP: (dir, exit status, output)."""
    root = tmp_path_factory.mktemp(request.param)
    trainer_dir, marker = str(root / "run"), str(root / "paused")
    process = _start_script(trainer_dir, f"--pause_step={PAUSE_STEP}", f"--marker={marker}")
    _wait_for(marker, [process])
    os.kill(process.pid, getattr(signal, request.param))
    output = process.communicate(timeout=TIMEOUT_S)[0]
    return trainer_dir, process.returncode, output


# ----- a signal stops a training process -----


@pytest.mark.slow
def test_a_stop_signal_exits_with_the_preempted_status(stopped_run):
    _, status, output = stopped_run
    assert status == PREEMPTED_EXIT_CODE, output[-3000:]
    assert f"Stopped at step {PAUSE_STEP} on SIG" in output


@pytest.mark.slow
def test_a_stop_signal_commits_the_step_reached_and_flushes_its_summaries(stopped_run):
    trainer_dir, _, _ = stopped_run
    assert _committed_steps(trainer_dir) == [PAUSE_STEP]  # The policy saves only at step 6.
    assert [r["step"] for r in read_metrics(trainer_dir)] == list(range(1, PAUSE_STEP + 1))


@pytest.mark.slow
def test_a_stopped_run_releases_its_directory(stopped_run):
    trainer_dir, _, _ = stopped_run
    assert not os.path.exists(os.path.join(trainer_dir, run_dir.LOCK))


# One restart is enough: what it resumes from does not depend on the signal.
@pytest.mark.slow
@pytest.mark.parametrize("stopped_run", ["SIGTERM"], indirect=True)
def test_a_restart_resumes_at_the_saved_step_with_the_uninterrupted_losses(
    stopped_run, reference_losses, tmp_path
):
    trainer_dir = str(tmp_path / "run")
    shutil.copytree(stopped_run[0], trainer_dir)
    _train_here(trainer_dir)
    # Each step once: the restart went on from the saved step rather than from step 0.
    assert [r["step"] for r in read_metrics(trainer_dir)] == list(range(1, MAX_STEP + 1))
    assert losses_by_step(trainer_dir) == reference_losses  # Bit for bit.


@pytest.mark.slow
def test_a_signal_to_one_of_two_processes_stops_both_after_the_same_saved_step(tmp_path):
    port = _free_port()
    marker = str(tmp_path / "paused")
    processes = [
        _start_script(
            tmp_path / "run",
            f"--coordinator=localhost:{port}", "--num_processes=2", f"--process_id={i}",
            # Only process 1 waits for, and gets, the signal.
            *([f"--pause_step={PAUSE_STEP}", f"--marker={marker}"] if i == 1 else []),
        )
        for i in range(2)
    ]
    _wait_for(marker, processes)
    os.kill(processes[1].pid, signal.SIGTERM)
    outputs = [p.communicate(timeout=TIMEOUT_S)[0] for p in processes]
    for process, output in zip(processes, outputs):
        assert process.returncode == PREEMPTED_EXIT_CODE, output[-3000:]
    # Process 1 saw the signal while at step 3; the vote of that step is read at the next.
    stop_step = PAUSE_STEP + 1
    assert f"Stopped at step {stop_step} on a stop signal on another process" in outputs[0]
    assert f"Stopped at step {stop_step} on SIGTERM" in outputs[1]
    assert _committed_steps(tmp_path / "run") == [stop_step]
    assert read_metrics(tmp_path / "run")[-1]["step"] == stop_step


# ----- the signal handlers (real signals to this process) -----


class _Exits:
    """Records the statuses a StopRequest would exit with; `event` is set at the first."""

    def __init__(self):
        self.statuses = []
        self.event = threading.Event()

    def __call__(self, status: int) -> None:
        self.statuses.append(status)
        self.event.set()


def test_a_stop_signal_is_a_request_not_an_exit():
    exits = _Exits()
    with StopRequest(grace_period_s=3600, exit_fn=exits) as stop:
        assert not stop.requested
        os.kill(os.getpid(), signal.SIGTERM)
        assert stop.requested and stop.signal_name == "SIGTERM"
    assert exits.statuses == []


def test_a_second_sigint_exits_at_once_with_the_interrupted_status():
    exits, released = _Exits(), []
    with StopRequest(
        grace_period_s=3600, exit_fn=exits, on_forced_exit=lambda: released.append(True)
    ):
        os.kill(os.getpid(), signal.SIGINT)
        assert exits.statuses == []
        os.kill(os.getpid(), signal.SIGINT)
        assert exits.statuses == [INTERRUPTED_EXIT_CODE] and released == [True]


def test_a_second_sigterm_keeps_the_stop_going():
    exits = _Exits()
    with StopRequest(grace_period_s=3600, exit_fn=exits) as stop:
        os.kill(os.getpid(), signal.SIGTERM)
        os.kill(os.getpid(), signal.SIGTERM)
        assert stop.requested and exits.statuses == []


def test_a_stop_that_outlasts_the_grace_period_exits_with_the_preempted_status(caplog):
    exits, released = _Exits(), []
    with caplog.at_level(logging.ERROR, logger="axlearn.common.preemption"):
        with StopRequest(
            grace_period_s=0.05, exit_fn=exits, on_forced_exit=lambda: released.append(True)
        ):
            os.kill(os.getpid(), signal.SIGTERM)
            assert exits.event.wait(TIMEOUT_S)
    assert exits.statuses == [PREEMPTED_EXIT_CODE] and released == [True]
    assert "did not stop within 0.05 s of SIGTERM" in caplog.text
    assert "last committed checkpoint is intact" in caplog.text


def test_no_deadline_is_left_running_once_the_stop_request_is_left():
    exits = _Exits()
    with StopRequest(grace_period_s=3600, exit_fn=exits):
        os.kill(os.getpid(), signal.SIGTERM)
        assert _deadline_threads()
    assert not _deadline_threads() and exits.statuses == []


def _deadline_threads() -> list[threading.Thread]:
    return [
        t for t in threading.enumerate() if t.name == preemption.DEADLINE_THREAD and t.is_alive()
    ]


def test_the_previous_handlers_come_back_when_the_request_is_left():
    def previous(signum, frame):
        del signum, frame

    old = signal.signal(signal.SIGTERM, previous)
    try:
        with StopRequest():
            assert signal.getsignal(signal.SIGTERM) is not previous
        assert signal.getsignal(signal.SIGTERM) is previous
        assert signal.getsignal(signal.SIGINT) is signal.default_int_handler
    finally:
        signal.signal(signal.SIGTERM, old)


def test_handlers_are_installed_only_in_the_main_thread():
    seen = []

    def enter():
        with StopRequest():
            seen.append(signal.getsignal(signal.SIGTERM))

    before = signal.getsignal(signal.SIGTERM)
    thread = threading.Thread(target=enter)
    thread.start()
    thread.join()
    assert seen == [before]


def test_an_ignored_signal_stays_ignored():
    old = signal.signal(signal.SIGINT, signal.SIG_IGN)
    try:
        with StopRequest():
            assert signal.getsignal(signal.SIGINT) is signal.SIG_IGN
    finally:
        signal.signal(signal.SIGINT, old)


# ----- the processes' vote -----


class _FakeCollective:
    """Stands in for the all-reduce: the OR of each process's flag of one call, by call."""

    def __init__(self, process_count: int):
        self.rounds: list[list[bool]] = []
        self.process_count = process_count
        self.calls = 0

    def dispatcher(self, process: int):
        counter = [0]

        def dispatch(flag: bool):
            self.calls += 1
            index = counter[0]
            counter[0] += 1
            while len(self.rounds) <= index:
                self.rounds.append([False] * self.process_count)
            self.rounds[index][process] = flag
            return _Handle(self, index)

        return dispatch


class _Handle:
    def __init__(self, collective: _FakeCollective, index: int):
        self._collective, self._index = collective, index

    def __bool__(self) -> bool:
        return any(self._collective.rounds[self._index])


def test_every_process_stops_after_the_step_after_any_process_is_signalled():
    collective = _FakeCollective(process_count=2)
    votes = [StopVote(2, collective.dispatcher(p)) for p in range(2)]
    signalled_at = {1: 3}  # Only process 1 gets the signal, during step 3.
    decisions = {p: [] for p in range(2)}
    for step in range(1, 7):
        # Each process dispatches its step's vote before any reads it (they are collective).
        for p, vote in enumerate(votes):
            decisions[p].append(vote(step >= signalled_at.get(p, 99)))
    assert decisions[0] == decisions[1] == [False, False, False, True, True, True]


def test_one_process_stops_after_the_signalled_step_without_a_collective():
    collective = _FakeCollective(process_count=1)
    vote = StopVote(1, collective.dispatcher(0))
    assert [vote(step >= 3) for step in range(1, 5)] == [False, False, True, True]
    assert collective.calls == 0


# ----- the trainer's config and the launcher's status -----


def test_grace_period_must_be_positive_and_is_named_in_the_error(tmp_path):
    cfg = tiny_trainer_config(trainer_dir=str(tmp_path)).set(preemption_grace_period_s=0.0)
    with pytest.raises(ConfigError, match=r"trainer\.preemption_grace_period_s must be None or"):
        cfg.instantiate(parent=None)


def test_the_launcher_turns_a_preempted_run_into_its_exit_status(monkeypatch):
    def preempted(flag_values):
        del flag_values
        raise Preempted("stopped", step=3, saved_step=3, signal_name="SIGTERM")

    monkeypatch.setattr(launch_trainer_main.launch, "setup_from_flags", lambda flag_values: None)
    monkeypatch.setattr(launch_trainer_main.launch_trainer, "run_from_flags", preempted)
    with pytest.raises(SystemExit) as exit_info:
        launch_trainer_main.main(["launch_trainer_main"])
    assert exit_info.value.code == PREEMPTED_EXIT_CODE == preemption.PREEMPTED_EXIT_CODE


# ----- before the trainer runs: the launcher's first handlers -----


def _catches_sigterm(pid: int) -> bool:
    """Whether process `pid` has a handler for SIGTERM installed (its SigCgt mask)."""
    with open(f"/proc/{pid}/status", encoding="utf-8") as f:
        mask = next(line.split()[1] for line in f if line.startswith("SigCgt:"))
    return bool(int(mask, 16) & (1 << (signal.SIGTERM - 1)))


def _start_launcher(tmp_path, *flags: str) -> subprocess.Popen:
    command = [
        sys.executable, "-m", "axlearn.common.launch_trainer_main", "--config=gpt_test",
        "--data_dir=FAKE", f"--trainer_dir={tmp_path / 'run'}", "--jax_backend=cpu", *flags,
    ]
    return subprocess.Popen(
        command, env=fresh_env(1), cwd=REPO, stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT, text=True,
    )


@pytest.mark.skipif(not os.path.exists("/proc/self/status"), reason="reads /proc")
def test_a_sigterm_right_after_the_launcher_starts_exits_with_the_preempted_status(tmp_path):
    process = _start_launcher(tmp_path)
    deadline = time.monotonic() + TIMEOUT_S
    # The first moment a SIGTERM can be told from the default one: its handler is in place.
    while not _catches_sigterm(process.pid):
        assert process.poll() is None and time.monotonic() < deadline
        time.sleep(0.001)
    os.kill(process.pid, signal.SIGTERM)
    output = process.communicate(timeout=TIMEOUT_S)[0]
    assert process.returncode == PREEMPTED_EXIT_CODE, output[-3000:]
    assert output.strip().splitlines()[-1].startswith("SIGTERM received before training started")
    assert not os.path.exists(tmp_path / "run")  # Nothing was written.


_SIGTERM_AS_THE_HANDLER_LANDS = """
import os, signal, time
from axlearn.common import preemption
install = signal.signal
def install_then_signal(signum, handler):
    previous = install(signum, handler)
    if signum == signal.SIGTERM:
        os.kill(os.getpid(), signal.SIGTERM)  # Handled before the next line of install().
    return previous
signal.signal = install_then_signal
preemption.exit_on_stop_signals()
time.sleep(5)
print("still running")
"""


def test_a_sigterm_the_moment_its_early_handler_lands_exits():
    result = subprocess.run(
        [sys.executable, "-c", _SIGTERM_AS_THE_HANDLER_LANDS], cwd=REPO, env=fresh_env(),
        capture_output=True, text=True, timeout=60, check=False,
    )
    assert result.returncode == PREEMPTED_EXIT_CODE, result.stdout + result.stderr[-2000:]
    assert "SIGTERM received before training started" in result.stderr
    assert "still running" not in result.stdout


@pytest.mark.slow
def test_a_sigterm_while_joining_other_processes_exits_at_once(tmp_path):
    # Process 1 of 2 waits in jax.distributed's C++ connect for a coordinator that never
    # comes (300 s by default): Python's own handler would run only once that returns.
    command = [f"--distributed_coordinator=localhost:{_free_port()}", "--num_processes=2",
               "--process_id=1"]
    process = _start_launcher(tmp_path, *command)
    seen = []
    for line in process.stdout:
        seen.append(line)
        if "Connecting to JAX distributed service" in line:
            break
    else:
        raise AssertionError("".join(seen)[-3000:])
    os.kill(process.pid, signal.SIGTERM)
    output = "".join(seen) + process.communicate(timeout=60)[0]
    assert process.returncode == PREEMPTED_EXIT_CODE, output[-3000:]
    assert "SIGTERM received before training started" in output
