"""Tests of axlearn.common.supervisor: a supervised child's stderr passes through, its exit
status and signals too, and jax's fatal report of a lost coordination service followed by
an abort becomes one line and PEER_LOST_EXIT_CODE. Real processes: the supervisor runs in
a fresh Python, its child is a small Python script."""

import signal
import subprocess
import sys
import threading

from absl import flags

from axlearn.common import launch, launch_trainer_main, supervisor
from axlearn.common.peer_watch import PEER_LOST_EXIT_CODE
from tests.fresh_python import REPO, fresh_env

# Runs `supervise` on the child script argv[1] (release_s: argv[2]) and exits with its status.
_SUPERVISOR = """
import sys
from axlearn.common import supervisor
sys.exit(supervisor.supervise(
    [sys.executable, "-c", sys.argv[1]], coordinator="host0:1234", process="process 1 of 2",
    prefix="launcher", release_s=float(sys.argv[2]),
))
"""
# The shape of jax's report when process 0 is gone (glog's E and F lines, then the dump).
_REPORT = (
    "E1128 21:03:35.157183    9766 coordination_service_agent.cc:289] Polled an error from "
    "coordination service (this can be an error from this or another task).\n"
    "F1128 21:03:35.157416    9766 client.h:80] Terminating process because the JAX "
    "distributed service detected fatal errors. absl::Status: UNAVAILABLE: Failed to send "
    "RPC to coordination service.\n"
    "*** Check failure stack trace: ***\n"
    "    @     0x7fa420a40634  absl::log_internal::LogMessage::SendToLog()\n"
)


def _supervise(child: str, release_s: float = 10.0) -> subprocess.Popen:
    return subprocess.Popen(
        [sys.executable, "-c", _SUPERVISOR, child, str(release_s)], cwd=REPO, env=fresh_env(),
        stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
    )


def _child_writing(stderr_text: str, then: str) -> str:
    return f"import os, sys\nsys.stderr.write({stderr_text!r})\nsys.stderr.flush()\n{then}\n"


def test_the_childs_stderr_and_exit_status_pass_through():
    text = "line one\nline two, no newline"
    process = _supervise(_child_writing(text, "sys.exit(3)"))
    _, stderr = process.communicate(timeout=60)
    assert process.returncode == 3
    assert stderr == text


def test_a_child_killed_by_a_signal_exits_with_128_plus_its_number():
    process = _supervise("import os, signal\nos.kill(os.getpid(), signal.SIGKILL)")
    process.communicate(timeout=60)
    assert process.returncode == 128 + signal.SIGKILL


def test_a_lost_coordination_service_and_an_abort_become_one_line_and_the_lost_status():
    process = _supervise(_child_writing("training\n" + _REPORT, "os.abort()"))
    _, stderr = process.communicate(timeout=60)
    assert process.returncode == PEER_LOST_EXIT_CODE
    assert stderr.splitlines() == [
        "training",
        "launcher: process 0 (the coordinator, host0:1234) is gone; process 1 of 2 stops: "
        f"exiting with status {PEER_LOST_EXIT_CODE}; restart the whole run (it resumes from "
        "its last checkpoint)",
    ]


def test_a_held_report_is_printed_when_the_child_exits_without_an_abort():
    process = _supervise(_child_writing(_REPORT, "sys.exit(1)"))
    _, stderr = process.communicate(timeout=60)
    assert process.returncode == 1
    assert stderr == _REPORT


def test_a_held_report_is_printed_while_the_child_lives_on_past_the_release_time():
    # The child waits for its stdin to close, which the test does once the report came.
    process = _supervise(_child_writing(_REPORT, "sys.stdin.read()\nsys.exit(0)"), release_s=0)
    stuck = threading.Timer(60, process.kill)  # A report held for good: no lines, a failure.
    stuck.start()
    seen = [process.stderr.readline() for _ in _REPORT.splitlines()]
    stuck.cancel()
    process.stdin.close()
    process.wait(timeout=60)
    assert "".join(seen) == _REPORT
    assert process.returncode == 0


def test_an_abort_without_the_report_keeps_its_output_and_status():
    process = _supervise(_child_writing("something else failed\n", "os.abort()"))
    _, stderr = process.communicate(timeout=60)
    assert process.returncode == 128 + signal.SIGABRT
    assert stderr == "something else failed\n"


def test_sigterm_to_the_supervisor_reaches_the_child_and_its_status_comes_back():
    child = (
        "import os, signal, sys, time\n"
        "signal.signal(signal.SIGTERM, lambda *_: os._exit(75))\n"
        "print('ready', flush=True)\n"
        "time.sleep(60)\n"
    )
    process = _supervise(child)
    assert process.stdout.readline() == "ready\n"
    process.send_signal(signal.SIGTERM)
    process.communicate(timeout=60)
    assert process.returncode == 75


def _launcher_flags(*args: str) -> flags.FlagValues:
    flag_values = flags.FlagValues()
    launch.define_flags(flag_values)
    flag_values(["launcher", *args])
    return flag_values


def test_a_single_process_run_is_not_supervised(monkeypatch):
    monkeypatch.delenv(supervisor.CHILD_ENV, raising=False)
    assert launch_trainer_main.supervised_placement(_launcher_flags("--cluster_env=none")) is None


def test_a_process_of_a_multi_process_run_is_supervised_naming_its_coordinator(monkeypatch):
    monkeypatch.delenv(supervisor.CHILD_ENV, raising=False)
    flag_values = _launcher_flags(
        "--distributed_coordinator=host0:1234", "--num_processes=2", "--process_id=1"
    )
    assert launch_trainer_main.supervised_placement(flag_values) == (
        "host0:1234",
        "process 1 of 2",
    )


def test_a_supervised_child_is_not_supervised_again(monkeypatch):
    monkeypatch.setenv(supervisor.CHILD_ENV, "1")
    flag_values = _launcher_flags(
        "--distributed_coordinator=host0:1234", "--num_processes=2", "--process_id=1"
    )
    assert launch_trainer_main.supervised_placement(flag_values) is None
