"""A multi-process run whose process is gone stops every other process within a minute,
with one line and PEER_LOST_EXIT_CODE, instead of hanging in a collective.

A process killed (kill -9, an out-of-memory kill, a lost host) leaves the others waiting
in their next collective: forever with NCCL; with gloo (CPU) the collective fails, and
then jax's shutdown barrier waits for the dead process until the coordination service
aborts the survivors with a C++ stack dump. So each process, once it joined the run,
runs a watcher thread: it bumps its own counter in jax.distributed's key-value store
every HEARTBEAT_S and reads the others'. A counter that has not moved for PEER_TIMEOUT_S,
or a store that cannot be reached for that long (process 0, which hosts it, is gone),
makes the watcher log one line naming the process and exit with PEER_LOST_EXIT_CODE
(after `on_exit`, e.g. releasing the run's lock). PEER_TIMEOUT_S is well inside jax's
own heartbeat timeout (100 s), so the watcher speaks first. A process whose run finished
or was preempted says so (`finish`) before it leaves, and is not waited for.

When process 0, which hosts jax's coordination service, is killed, jax's client in every
other process aborts it at once, before this watcher can speak; `supervisor` turns that
abort into one line and PEER_LOST_EXIT_CODE.
"""

import logging
import os
import sys
import threading
import time
from collections.abc import Callable
from typing import Any, Optional

log = logging.getLogger(__name__)

# sysexits' EX_UNAVAILABLE: a process of the run is gone; restart the whole run (it
# resumes from its last checkpoint).
PEER_LOST_EXIT_CODE = 69
HEARTBEAT_S = 1.0  # How often each process bumps its counter and reads the others'.
PEER_TIMEOUT_S = 20.0  # A counter still this long means its process is gone.
_KEY_PREFIX = "axlearn_peer_watch/"
FINISHED = "finished"  # A process's value once it ended by design (`PeerWatch.finish`).
WATCH_THREAD = "peer-watch"


class PeerWatch:
    """The watcher of one process (see the module docstring)."""

    def __init__(
        self,
        client: Any,
        *,
        process_id: int,
        num_processes: int,
        timeout_s: float = PEER_TIMEOUT_S,
        heartbeat_s: float = HEARTBEAT_S,
        on_exit: Optional[Callable[[], None]] = None,
        exit_fn: Callable[[int], Any] = os._exit,
        clock: Callable[[], float] = time.monotonic,
    ):
        """`client`: jax.distributed's client (key_value_set, key_value_dir_get)."""
        self._client = client
        self._process_id = process_id
        self._num_processes = num_processes
        self._timeout_s = timeout_s
        self._heartbeat_s = heartbeat_s
        self._on_exit = on_exit
        self._exit_fn = exit_fn
        self._clock = clock
        self._counter = 0
        # Per other process: (its last counter seen, when it was first seen at that value).
        self._seen: dict[int, tuple[Optional[str], float]] = {}
        self._unreachable_since: Optional[float] = None
        self._lost: Optional[str] = None
        self._lost_event = threading.Event()
        self._stopped = threading.Event()

    @property
    def lost(self) -> Optional[str]:
        """The line saying which process is gone; None while all answer."""
        return self._lost

    def wait_for_loss(self, timeout_s: float) -> Optional[str]:
        """Waits up to `timeout_s` for a verdict that a process is gone; its line, or None."""
        self._lost_event.wait(timeout_s)
        return self._lost

    def start(self) -> Optional["PeerWatch"]:
        """Starts the watcher thread; None (no thread) where the store does not answer
        the first round: a jax whose client differs must not end a healthy run."""
        try:
            self._client.key_value_set(
                f"{_KEY_PREFIX}{self._process_id}", "0", allow_overwrite=True
            )
            self._client.key_value_dir_get(_KEY_PREFIX)
        except Exception as e:  # pylint: disable=broad-except
            log.warning("No watch for lost processes: jax's key-value store failed (%s)", e)
            return None
        now = self._clock()
        self._seen = {i: (None, now) for i in range(self._num_processes) if i != self._process_id}
        thread = threading.Thread(target=self._loop, name=WATCH_THREAD, daemon=True)
        thread.start()
        return self

    def stop(self) -> None:
        self._stopped.set()

    def finish(self) -> None:
        """Stops watching and tells the others that this process ended by design (its run
        finished or was preempted), so that its silence from now on is no loss."""
        self.stop()
        try:
            self._client.key_value_set(
                f"{_KEY_PREFIX}{self._process_id}", FINISHED, allow_overwrite=True
            )
        except Exception as e:  # pylint: disable=broad-except
            log.warning("Could not tell the other processes that this one finished: %s", e)

    def _loop(self) -> None:
        while not self._stopped.wait(self._heartbeat_s):
            line = self.check()
            if line is not None:
                self._exit(line)
                return

    def check(self) -> Optional[str]:
        """One round: bumps this process's counter, reads the others'; the line saying which
        process is gone, or None."""
        now = self._clock()
        try:
            self._counter += 1
            self._client.key_value_set(
                f"{_KEY_PREFIX}{self._process_id}", str(self._counter), allow_overwrite=True
            )
            counters = dict(self._client.key_value_dir_get(_KEY_PREFIX))
        except Exception as e:  # pylint: disable=broad-except
            # The coordination service (hosted by process 0) does not answer.
            if self._unreachable_since is None:
                self._unreachable_since = now
            if now - self._unreachable_since >= self._timeout_s:
                return self._verdict(
                    f"the coordination service of process 0 has not answered for "
                    f"{now - self._unreachable_since:.0f} s ({_first_line(e)}): process 0 is gone"
                )
            return None
        self._unreachable_since = None
        for process, (last, since) in list(self._seen.items()):
            value = counters.get(f"{_KEY_PREFIX}{process}")
            if value == FINISHED:
                del self._seen[process]
            elif value != last:
                self._seen[process] = (value, now)
            elif now - since >= self._timeout_s:
                return self._verdict(
                    f"process {process} of {self._num_processes} has not "
                    f"{'joined the watch' if last is None else 'answered'} for "
                    f"{now - since:.0f} s: it is gone (killed, out of memory or its host lost)"
                )
        return None

    def _verdict(self, reason: str) -> str:
        self._lost = (
            f"Process {self._process_id} of {self._num_processes} stops: {reason}. Exiting with "
            f"status {PEER_LOST_EXIT_CODE}; restart the whole run (it resumes from its last "
            "checkpoint)"
        )
        self._lost_event.set()
        return self._lost

    def _exit(self, line: str) -> None:
        log.error("%s", line)
        if self._on_exit is not None:
            self._on_exit()
        for stream in (sys.stdout, sys.stderr):
            stream.flush()
        self._exit_fn(PEER_LOST_EXIT_CODE)


def _first_line(error: BaseException) -> str:
    text = str(error).strip()
    return text.splitlines()[0][:200] if text else type(error).__name__


_WATCH: Optional[PeerWatch] = None


def start_watch(on_exit: Optional[Callable[[], None]] = None) -> Optional[PeerWatch]:
    """Starts this process's watcher once it joined a multi-process run through
    jax.distributed; None (nothing started) for a single process."""
    global _WATCH  # pylint: disable=global-statement
    import jax  # pylint: disable=import-outside-toplevel

    if jax.process_count() == 1 or _WATCH is not None:
        return _WATCH
    try:
        # pylint: disable-next=import-outside-toplevel
        from jax._src.distributed import global_state

        client = getattr(global_state, "client", None)
    except ImportError:
        client = None
    if client is None:
        log.warning("No jax.distributed client here: a lost process is not watched for")
        return None
    _WATCH = PeerWatch(
        client,
        process_id=jax.process_index(),
        num_processes=jax.process_count(),
        on_exit=on_exit,
    ).start()
    return _WATCH


def current_watch() -> Optional[PeerWatch]:
    """The watcher `start_watch` started in this process; None if none."""
    return _WATCH

