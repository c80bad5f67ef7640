"""A multi-process run's process whose coordinator (process 0) is gone exits with one line
and PEER_LOST_EXIT_CODE, instead of jax's abort with a C++ stack dump.

Process 0 hosts jax.distributed's coordination service. When it is gone, jax's client in
every other process logs a fatal error and aborts the process at once (SIGABRT, a C++
stack dump and Python's "Fatal Python error: Aborted" on stderr); jax offers no option
that turns this into a Python error. So the launcher of a multi-process run runs its
training in a child process (`supervise`): same command, `CHILD_ENV` set, stdout
inherited, stderr read by the parent, which passes every line through unchanged except
jax's fatal report of its coordination service, which it holds back. If the child then
dies by SIGABRT, the parent prints one line naming the lost coordinator and exits with
PEER_LOST_EXIT_CODE; held lines of a child that lives on (RELEASE_S) or ends otherwise
are printed after all. SIGTERM and SIGINT reach the child through the parent (the child
runs in its own session, so a terminal's Ctrl-C reaches it once), and the parent exits
with the child's status (128 + N for a child killed by signal N). The child dies with its
parent (`die_with_parent`), e.g. when the parent is killed with SIGKILL.
"""

import ctypes
import os
import re
import select
import signal
import subprocess
import sys
import time
from collections.abc import Sequence
from typing import BinaryIO, Optional

from axlearn.common.peer_watch import PEER_LOST_EXIT_CODE

# Set in the child's environment, to the parent's process id.
CHILD_ENV = "AXLEARN_SUPERVISOR_PID"
# Seconds a held fatal report waits for the child's abort before it is printed after all.
RELEASE_S = 10.0
FORWARDED_SIGNALS = (signal.SIGTERM, signal.SIGINT)
# The first line of jax's fatal report (glog's E or F line) about its coordination service.
_REPORT_START = re.compile(rb"^[EF]\d{4} .*(coordination service|distributed service)")
# In that report: the coordination service itself cannot be reached (process 0 is gone).
_SERVICE_LOST = re.compile(rb"Failed to send RPC to coordination service|leader task")
_PR_SET_PDEATHSIG = 1  # Linux prctl(2).


def is_child() -> bool:
    """Whether this process runs under a supervisor."""
    return CHILD_ENV in os.environ


def die_with_parent() -> None:
    """In a supervised child: the kernel kills it with SIGKILL when its supervisor is gone
    (Linux; elsewhere nothing)."""
    parent = os.environ.get(CHILD_ENV)
    if parent is None or not sys.platform.startswith("linux"):
        return
    libc = ctypes.CDLL(None, use_errno=True)
    libc.prctl(_PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
    if str(os.getppid()) != parent:  # The parent left before the call.
        os._exit(128 + signal.SIGKILL)  # pylint: disable=protected-access


def supervise(
    command: Sequence[str],
    *,
    coordinator: Optional[str],
    process: str,
    prefix: str,
    release_s: float = RELEASE_S,
) -> int:
    """Runs `command` as a supervised child (module docstring); its exit status.

    `coordinator`: process 0's host:port (None: unknown); `process`: this process, e.g.
    "process 1 of 2"; `prefix`: the start of the line printed for a lost coordinator, e.g.
    "launch_trainer_main"; `release_s`: how long a held report waits for the abort. Main
    thread only (it installs signal handlers).
    """
    out = sys.stderr.buffer
    sys.stderr.flush()
    child = subprocess.Popen(  # pylint: disable=consider-using-with
        list(command),
        env=dict(os.environ, **{CHILD_ENV: str(os.getpid())}),
        stderr=subprocess.PIPE,
        start_new_session=True,
    )
    signal.set_wakeup_fd(-1)  # The launcher's early-exit watcher no longer wakes.
    for signum in FORWARDED_SIGNALS:
        if signal.getsignal(signum) is not signal.SIG_IGN:  # e.g. nohup's SIGINT.
            signal.signal(signum, lambda signum, frame: child.send_signal(signum))
    held = _forward(child.stderr.fileno(), out, release_s)
    status = child.wait()
    if status == -signal.SIGABRT and held:
        where = f", {coordinator}" if coordinator else ""
        if any(_SERVICE_LOST.search(line) for line in held):
            cause = f"process 0 (the coordinator{where}) is gone"
        else:
            cause = f"jax's coordination service (process 0{where}) reported another process gone"
        out.write(
            f"{prefix}: {cause}; {process} stops: exiting with status "
            f"{PEER_LOST_EXIT_CODE}; restart the whole run (it resumes from its last "
            "checkpoint)\n".encode()
        )
        out.flush()
        return PEER_LOST_EXIT_CODE
    out.writelines(held)
    out.flush()
    return status if status >= 0 else 128 - status


def _forward(fd: int, out: BinaryIO, release_s: float) -> list[bytes]:
    """Copies lines from `fd` to `out` until EOF, holding back a fatal report of jax's
    coordination service unless the writer lives `release_s` past it; the held lines."""
    pending = b""  # A line not yet complete.
    held: list[bytes] = []
    held_since: Optional[float] = None
    while True:
        ready, _, _ = select.select([fd], [], [], 1.0)
        if ready:
            chunk = os.read(fd, 1 << 16)
            if not chunk:
                break
            *lines, pending = (pending + chunk).split(b"\n")
            for line in lines:
                if held_since is None and _REPORT_START.match(line):
                    held_since = time.monotonic()
                if held_since is None:
                    out.write(line + b"\n")
                else:
                    held.append(line + b"\n")
            out.flush()
        if held_since is not None and time.monotonic() - held_since > release_s:
            out.writelines(held)
            out.flush()
            held, held_since = [], None
    if pending and held_since is not None:
        held.append(pending)
    elif pending:
        out.write(pending)
    out.flush()
    return held
