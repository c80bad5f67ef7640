"""Stopping a run cleanly on SIGTERM or SIGINT (a preempted VM, Ctrl-C).

A preempted cloud VM gets SIGTERM and, a grace period later, SIGKILL. While a trainer
runs, `StopRequest` turns SIGTERM and SIGINT into a request: the trainer finishes the
current step, saves it, flushes its summaries and raises `Preempted`, which the launcher
turns into exit status PREEMPTED_EXIT_CODE; a restart resumes from the saved step.

- If that takes longer than the grace period, the process exits anyway, with the same
  status and a message: the last committed checkpoint stays valid (commits are atomic).
- A second SIGINT during the stop exits at once with INTERRUPTED_EXIT_CODE.
- A signal may reach only one process of a multi-process run; `StopVote` makes all of
  them stop after the same step.
- Before the trainer runs (imports, joining the other processes, building the config),
  and after, `exit_on_stop_signals` makes SIGTERM and SIGINT exit at once with
  PREEMPTED_EXIT_CODE: there is nothing to save yet, and a restart starts the same way.
  The launcher installs it first thing, before importing jax.
"""

import logging
import os
import signal
import sys
import threading
from collections.abc import Callable
from typing import Any, Optional

log = logging.getLogger(__name__)

# The exit status of a run stopped by SIGTERM or SIGINT, saved or out of time: sysexits'
# EX_TEMPFAIL ("temporary failure; retry"), which no crash or kill gives. Restart it.
PREEMPTED_EXIT_CODE = 75
# A second SIGINT during the stop: 128 + SIGINT, as a shell reports a process Ctrl-C killed.
INTERRUPTED_EXIT_CODE = 128 + signal.SIGINT
# Seconds from the signal to the exit when the config does not say: inside the 30 s that
# cloud VMs and Kubernetes pods get between their preemption notice and SIGKILL.
DEFAULT_GRACE_PERIOD_S = 25.0
STOP_SIGNALS = (signal.SIGTERM, signal.SIGINT)
DEADLINE_THREAD = "preemption-deadline"  # The thread that exits once the grace period ends.
EARLY_EXIT_THREAD = "preemption-early-exit"  # The thread `exit_on_stop_signals` wakes.


class Preempted(Exception):
    """The run stopped early on SIGTERM or SIGINT, after saving the step it reached."""

    def __init__(self, message: str, *, step: int, saved_step: Optional[int], signal_name: str):
        super().__init__(message)
        self.step = step  # The last step trained.
        self.saved_step = saved_step  # The checkpoint saved at the stop; None: none.
        self.signal_name = signal_name


class _EarlyExit:
    """SIGTERM and SIGINT exit at once with PREEMPTED_EXIT_CODE, while installed and no
    StopRequest is (see `exit_on_stop_signals`).

    Python runs a signal handler only in the main thread between bytecodes, which a long
    C call (joining the other processes of a run, say) can delay for minutes. So the
    handler also wakes a watcher thread through `signal.set_wakeup_fd` (written by the
    C-level handler the moment the signal arrives), and whichever comes first exits.
    """

    def __init__(self):
        self._lock = threading.Lock()
        self._installed = False
        self._paused = 0  # StopRequests installed: they handle the signals meanwhile.
        self._on_exit: Optional[Callable[[], None]] = None

    def install(self, on_exit: Optional[Callable[[], None]] = None) -> None:
        if threading.current_thread() is not threading.main_thread():
            raise RuntimeError("exit_on_stop_signals must be called in the main thread")
        self._on_exit = on_exit
        first = not self._installed
        # Before the handlers: a signal the moment one is in place already exits.
        self._installed = True
        for signum in STOP_SIGNALS:
            if signal.getsignal(signum) is not signal.SIG_IGN:  # e.g. nohup's SIGINT.
                signal.signal(signum, self._handle)
        if not first:
            return
        read_fd, write_fd = os.pipe()
        os.set_blocking(write_fd, False)
        try:
            signal.set_wakeup_fd(write_fd, warn_on_full_buffer=False)
        except ValueError:  # Refused (not the main interpreter): the handlers alone.
            os.close(read_fd)
            os.close(write_fd)
            return
        watcher = threading.Thread(
            target=self._watch, args=(read_fd,), name=EARLY_EXIT_THREAD, daemon=True
        )
        watcher.start()

    def pause(self) -> None:
        with self._lock:
            self._paused += 1

    def resume(self) -> None:
        with self._lock:
            self._paused -= 1

    def _handle(self, signum: int, frame: Any) -> None:
        del frame
        self._exit(signum)

    def _watch(self, read_fd: int) -> None:
        while True:
            data = os.read(read_fd, 64)
            if not data:
                return
            for signum in data:
                if signum in STOP_SIGNALS:
                    self._exit(signum)

    def _exit(self, signum: int) -> None:
        with self._lock:
            if self._paused or not self._installed:
                return
            name = signal.Signals(signum).name
            sys.stderr.write(
                f"{name} received before training started (or after it ended): exiting with "
                f"status {PREEMPTED_EXIT_CODE}, nothing to save; a restart with the same flags "
                "starts the same way\n"
            )
            if self._on_exit is not None:
                self._on_exit()
            for stream in (sys.stdout, sys.stderr):
                stream.flush()
            os._exit(PREEMPTED_EXIT_CODE)  # pylint: disable=protected-access


_EARLY_EXIT = _EarlyExit()


def exit_on_stop_signals(on_exit: Optional[Callable[[], None]] = None) -> None:
    """From now on, SIGTERM and SIGINT exit this process at once with PREEMPTED_EXIT_CODE,
    except while a StopRequest is installed (a trainer runs: it saves first).

    For a launcher, before anything slow (importing jax, joining the other processes,
    compiling): there is nothing to save yet. `on_exit` runs just before the exit (e.g.
    releasing locks). Main thread only.
    """
    _EARLY_EXIT.install(on_exit)


class StopRequest:
    """Turns SIGTERM and SIGINT into a request to stop, while installed (a context manager).

    Handlers are installed only in the main thread (Python runs signal handlers there
    only), not over a signal the process ignores, and the previous ones come back on exit.
    """

    def __init__(
        self,
        *,
        grace_period_s: float = DEFAULT_GRACE_PERIOD_S,
        on_forced_exit: Optional[Callable[[], None]] = None,
        exit_fn: Callable[[int], Any] = os._exit,
    ):
        """`on_forced_exit` runs just before an exit that skips the run's cleanup (e.g.
        releasing locks); `exit_fn` ends the process then (tests pass a recorder)."""
        self._grace_period_s = grace_period_s
        self._on_forced_exit = on_forced_exit
        self._exit_fn = exit_fn
        self._signal_name: Optional[str] = None
        self._previous: dict[int, Any] = {}
        self._deadline: Optional[threading.Timer] = None

    @property
    def requested(self) -> bool:
        return self._signal_name is not None

    @property
    def signal_name(self) -> Optional[str]:
        """The name of the first stop signal received (e.g. 'SIGTERM'); None: none yet."""
        return self._signal_name

    def __enter__(self) -> "StopRequest":
        if threading.current_thread() is not threading.main_thread():
            log.info("Not in the main thread: SIGTERM and SIGINT keep their handlers")
            return self
        for signum in STOP_SIGNALS:
            previous = signal.getsignal(signum)
            if previous is signal.SIG_IGN:
                continue  # The parent asked this process to ignore it (e.g. nohup).
            self._previous[signum] = previous
            signal.signal(signum, self._handle)
        if self._previous:
            _EARLY_EXIT.pause()
        return self

    def __exit__(self, *exc_info) -> None:
        if self._deadline is not None:
            self._deadline.cancel()
            self._deadline.join()
            self._deadline = None
        for signum, previous in self._previous.items():
            # None: the handler was not installed from Python; the default stands for it.
            signal.signal(signum, signal.SIG_DFL if previous is None else previous)
        if self._previous:
            _EARLY_EXIT.resume()
        self._previous.clear()

    def _handle(self, signum: int, frame: Any) -> None:
        del frame
        name = signal.Signals(signum).name
        if self._signal_name is None:
            self._signal_name = name
            log.warning(
                "%s received: finishing the current step, saving it and exiting with status "
                "%d within %g s%s",
                name, PREEMPTED_EXIT_CODE, self._grace_period_s,
                " (Ctrl-C again exits at once, unsaved)" if signum == signal.SIGINT else "",
            )
            self._deadline = threading.Timer(self._grace_period_s, self._out_of_time)
            self._deadline.name, self._deadline.daemon = DEADLINE_THREAD, True
            self._deadline.start()
        elif signum == signal.SIGINT:
            self._exit(
                INTERRUPTED_EXIT_CODE,
                f"{name} received again during the stop: exiting at once, without saving",
            )
        else:
            log.warning("%s received again: the stop is under way", name)

    def _out_of_time(self) -> None:
        self._exit(
            PREEMPTED_EXIT_CODE,
            f"The run did not stop within {self._grace_period_s:g} s of {self._signal_name}: "
            f"exiting with status {PREEMPTED_EXIT_CODE} before saving the step it reached. The "
            "last committed checkpoint is intact (commits are atomic); a restart resumes there.",
        )

    def _exit(self, status: int, message: str) -> None:
        log.error("%s", message)
        if self._on_forced_exit is not None:
            self._on_forced_exit()
        for stream in (sys.stdout, sys.stderr):
            stream.flush()
        self._exit_fn(status)


class StopVote:
    """Whether to stop after this step, agreed by every process of the run.

    A signal may reach only one process, and all of them must save the same step (the
    save is collective). With one process the local request is the answer, at no cost.
    With several, each step starts a cross-process OR of the local requests
    (`dispatch_any`, asynchronous: a tiny all-reduce queued behind the step) and reads the
    OR started one step earlier, which has finished by the time the loop waits for the
    previous step's loss anyway. So the vote never stalls the loop, costs one scalar
    all-reduce a step, and every process stops after the same step: one step after the
    first process saw its signal.
    """

    def __init__(self, process_count: int, dispatch_any: Optional[Callable[[bool], Any]]):
        """`dispatch_any(flag)` starts the OR of `flag` over the processes and returns a
        handle whose `bool()` waits for it (unused with one process)."""
        self._process_count = process_count
        self._dispatch_any = dispatch_any
        self._in_flight: Optional[Any] = None

    @classmethod
    def over_mesh(cls, mesh: Any) -> "StopVote":
        """The vote of the processes whose devices form `mesh`."""
        import jax  # pylint: disable=import-outside-toplevel

        count = jax.process_count()
        return cls(count, dispatch_any_on_mesh(mesh) if count > 1 else None)

    def __call__(self, requested_here: bool) -> bool:
        """Called after each step's dispatch, with whether this process was asked to stop."""
        if self._process_count == 1:
            return requested_here
        previous, self._in_flight = self._in_flight, self._dispatch_any(requested_here)
        return previous is not None and bool(previous)


def dispatch_any_on_mesh(mesh: Any) -> Callable[[bool], Any]:
    """A `StopVote.dispatch_any` over the devices of `mesh` (all the run's processes)."""
    import jax  # pylint: disable=import-outside-toplevel
    import jax.numpy as jnp  # pylint: disable=import-outside-toplevel
    import numpy as np  # pylint: disable=import-outside-toplevel
    from jax.sharding import NamedSharding, PartitionSpec  # pylint: disable=import-outside-toplevel

    # One entry a device, each process writing its flag into its own devices' entries.
    sharding = NamedSharding(mesh, PartitionSpec(tuple(mesh.axis_names)))
    shape = (mesh.size,)
    devices = sorted(sharding.addressable_devices, key=lambda d: d.id)
    any_true = jax.jit(jnp.max, out_shardings=NamedSharding(mesh, PartitionSpec()))

    def dispatch(flag: bool) -> Any:
        value = np.full((1,), flag, np.int32)
        shards = [jax.device_put(value, device) for device in devices]
        flags = jax.make_array_from_single_device_arrays(shape, sharding, shards)
        return _Vote(any_true(flags))

    return dispatch


class _Vote:
    """The result of one cross-process OR; `bool()` waits for it."""

    def __init__(self, result: Any):
        self._result = result

    def __bool__(self) -> bool:
        import numpy as np  # pylint: disable=import-outside-toplevel

        return bool(np.asarray(self._result.addressable_data(0)))
