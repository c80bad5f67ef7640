"""One trainer per directory: a lock file naming the process that trains there.

While a run trains, its lock file (`<trainer_dir>/LOCK`: `run_dir.RunDir.lock_file`, whose
`lock()` holds it through `hold_on_process_0`) holds JSON naming
its holder: `{"host": ..., "pid": ..., "start_time": ...}` (process 0 of a multi-process
run holds it). A second trainer started on the directory fails at once with an error
naming the holder. A lock left by a process of this host that no longer runs (no process has its
pid, or the one that has started after the lock was taken) is taken over, with a warning
naming the old holder; a lock of another host cannot be checked, so it is refused, and
the error says how to delete it. The holder deletes the file when its run returns,
by an error or a preemption too; where it cannot (a directory that became read-only), it
warns and the run's own error stands.

Every file operation goes through `_LockFiles`, so that another storage can stand in
for local files.
"""

import contextlib
import datetime
import json
import logging
import os
import socket
import threading
import uuid
from collections.abc import Iterator
from typing import Any, Optional

log = logging.getLogger(__name__)

# Created exclusively by the one process taking over a stale lock, for the few
# instructions between checking the stale lock and replacing it.
TAKEOVER_SUFFIX = ".takeover"
_CLOCK_MARGIN_S = 5.0  # See `_holder_alive`.
_IMPORTED_AT = datetime.datetime.now(datetime.timezone.utc).timestamp()


class RunLockError(RuntimeError):
    """Another process trains in the directory, or may: its lock is held."""


class _LockFiles:
    """The few file operations the lock needs, each atomic on a local file system."""

    @staticmethod
    def create_exclusive(path: str, text: str) -> bool:
        """Creates `path` holding `text` unless it exists; returns whether it did.

        The text is written to a private file first and linked into place, so that a
        reader sees either no file or the whole text.
        """
        tmp = f"{path}.{uuid.uuid4().hex}.tmp"
        with open(tmp, "w", encoding="utf-8") as f:
            f.write(text)
            f.flush()
            os.fsync(f.fileno())
        try:
            os.link(tmp, path)
            return True
        except FileExistsError:
            return False
        finally:
            os.remove(tmp)

    @staticmethod
    def replace(path: str, text: str) -> None:
        """Replaces `path` by a file holding `text`, in one step."""
        tmp = f"{path}.{uuid.uuid4().hex}.tmp"
        with open(tmp, "w", encoding="utf-8") as f:
            f.write(text)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)

    @staticmethod
    def read(path: str) -> Optional[str]:
        """The text of `path`; None if it does not exist."""
        try:
            with open(path, encoding="utf-8") as f:
                return f.read()
        except FileNotFoundError:
            return None

    @staticmethod
    def remove(path: str) -> None:
        with contextlib.suppress(FileNotFoundError):
            os.remove(path)

    @staticmethod
    def make_dirs(path: str) -> None:
        os.makedirs(path, exist_ok=True)


def _this_holder() -> dict[str, Any]:
    return {
        "host": socket.gethostname(),
        "pid": os.getpid(),
        "start_time": datetime.datetime.now(datetime.timezone.utc).isoformat(),
    }


def _proc_stat(pid: int) -> Optional[list[str]]:
    """The fields of /proc/<pid>/stat after the command name (from the state on); None
    where there is no such file (no such process, or not Linux)."""
    try:
        with open(f"/proc/{pid}/stat", encoding="utf-8") as f:
            return f.read().rsplit(")", 1)[1].split()
    except (OSError, IndexError):
        return None


def _process_start(fields: list[str]) -> Optional[float]:
    """The start of a process as a Unix time, from its /proc/<pid>/stat fields."""
    try:
        with open("/proc/stat", encoding="utf-8") as f:
            boot = next(float(line.split()[1]) for line in f if line.startswith("btime"))
        return boot + int(fields[19]) / os.sysconf("SC_CLK_TCK")
    except (OSError, StopIteration, IndexError, ValueError):
        return None


def _holder_alive(holder: dict[str, Any]) -> bool:
    """Whether the process a lock of this host names still runs.

    Not if no process has its pid, or that process is a zombie (exited, not yet reaped),
    or it started after the lock was taken (the pid was reused, as a restarted container
    reuses its pids).
    """
    pid, locked = holder["pid"], _timestamp(holder.get("start_time"))
    if pid == os.getpid():
        # This process took no lock before it imported this module: an older lock naming
        # its pid is a previous process's (a restarted container's).
        return locked is None or locked >= _IMPORTED_AT
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # Another user's process.
        pass
    fields = _proc_stat(pid)
    if fields is None:
        return True  # No /proc (not Linux): os.kill's answer stands.
    if fields[0] in ("Z", "X"):
        return False
    started = _process_start(fields)
    # A process takes its lock after it starts; the margin covers /proc's whole-second
    # boot time and small clock adjustments, erring toward "alive".
    return started is None or locked is None or started <= locked + _CLOCK_MARGIN_S


def _timestamp(iso_time: Any) -> Optional[float]:
    try:
        return datetime.datetime.fromisoformat(iso_time).timestamp()
    except (TypeError, ValueError):
        return None


def _describe(holder: dict[str, Any]) -> str:
    return (
        f"pid {holder.get('pid')} on host {holder.get('host')}, started "
        f"{holder.get('start_time')}"
    )


class RunLock:
    """One lock file, `path` (a trainer directory's LOCK; not re-entrant: see `hold`)."""

    def __init__(self, path: str):
        self._path = path
        self._directory = os.path.dirname(path) or "."
        self._text: Optional[str] = None  # Our lock file's text while we hold it.

    @property
    def path(self) -> str:
        return self._path

    @property
    def held(self) -> bool:
        return self._text is not None

    def holder(self) -> Optional[dict[str, Any]]:
        """The holder the lock file names; None if there is no lock file."""
        text = _LockFiles.read(self._path)
        return None if text is None else self._parse(text)

    def _parse(self, text: str) -> dict[str, Any]:
        try:
            holder = json.loads(text)
            if not isinstance(holder, dict) or not isinstance(holder.get("pid"), int):
                raise ValueError("not an object with an int pid")
        except ValueError as e:
            raise RunLockError(
                f"{self._path} is not a lock file this version can read ({e}): {text[:200]!r}. "
                f"If no trainer runs in {self._directory}, delete it (rm {self._path})."
            ) from e
        return holder

    def acquire(self) -> None:
        """Takes the lock, or raises RunLockError naming the process that holds it."""
        if self.held:
            raise RunLockError(f"{self._path} is already held by this RunLock")
        _LockFiles.make_dirs(self._directory)
        text = json.dumps(_this_holder())
        # A takeover that finds the lock changed under it starts again; a few rounds
        # settle any race (each round either takes the lock or names a live holder).
        for _ in range(5):
            if _LockFiles.create_exclusive(self._path, text):
                self._text = text
                return
            current = _LockFiles.read(self._path)
            if current is None:
                continue  # Released since; try again.
            holder = self._parse(current)
            self._check_stale(holder)
            if self._take_over(current, text):
                log.warning(
                    "Took over the stale lock %s of a process that no longer runs (%s)",
                    self._path, _describe(holder),
                )
                self._text = text
                return
        raise RunLockError(f"Could not take {self._path}: other processes keep changing it")

    def _check_stale(self, holder: dict[str, Any]) -> None:
        """Raises RunLockError unless `holder` is a process of this host that is not alive."""
        where = f"{self._directory} is in use: {self._path} names {_describe(holder)}"
        if holder.get("host") != socket.gethostname():
            raise RunLockError(
                f"{where}. A process of another host cannot be checked from here. If you are "
                f"sure no trainer runs there, delete the lock (rm {self._path}) and start again."
            )
        if _holder_alive(holder):
            raise RunLockError(
                f"{where}, which is running. Stop that trainer, or train in another directory. "
                f"If that process is not a trainer of this directory, delete the lock "
                f"(rm {self._path})."
            )

    def _take_over(self, stale: str, text: str) -> bool:
        """Replaces the lock file by `text` if it still holds `stale`; returns whether it did."""
        guard = self._path + TAKEOVER_SUFFIX
        if not _LockFiles.create_exclusive(guard, text):
            raise RunLockError(
                f"Another process is taking over the stale lock {self._path} now ({guard} "
                f"exists). If none is (that file is left over), delete it (rm {guard})."
            )
        try:
            if _LockFiles.read(self._path) != stale:
                return False
            _LockFiles.replace(self._path, text)
            return True
        finally:
            _LockFiles.remove(guard)

    def release(self) -> None:
        """Deletes the lock file if it still is ours (else warns and leaves it)."""
        text, self._text = self._text, None
        if text is None:
            return
        try:
            current = _LockFiles.read(self._path)
            if current != text:
                log.warning(
                    "%s was removed or replaced while this process held it (now: %r); left as "
                    "is", self._path, current,
                )
                return
            _LockFiles.remove(self._path)
        except OSError as e:
            # A directory that became read-only, say: the run's own error says why it ended,
            # and must not be hidden behind this one. A stale lock is taken over on restart.
            log.warning(
                "Could not remove the lock %s (%s); the next start on this host takes it over",
                self._path, e,
            )


# The locks this process holds: {lock path: [the lock, the holding thread, depth]}.
_HELD: dict[str, list] = {}
_HELD_GUARD = threading.Lock()


@contextlib.contextmanager
def hold(path: str) -> Iterator[None]:
    """Holds the lock file `path` while the block runs.

    Re-entrant within a thread; another thread of this process fails as another process
    would.
    """
    key = os.path.abspath(path)
    with _HELD_GUARD:
        entry = _HELD.get(key)
        if entry is not None and entry[1] != threading.get_ident():
            raise RunLockError(
                f"{key} is held by another thread of this process (pid {os.getpid()})"
            )
        if entry is None:
            lock = RunLock(path)
            lock.acquire()
            entry = _HELD[key] = [lock, threading.get_ident(), 0]
        entry[2] += 1
    try:
        yield
    finally:
        with _HELD_GUARD:
            entry[2] -= 1
            if entry[2] == 0 and _HELD.get(key) is entry:
                del _HELD[key]
                entry[0].release()


def release_all() -> None:
    """Releases every lock this process holds: for an exit that skips `hold`'s cleanup
    (`os._exit` once a preempted run's grace period ends)."""
    with _HELD_GUARD:
        entries = list(_HELD.values())
        _HELD.clear()
    for lock, _, _ in entries:
        try:
            lock.release()
        except OSError as e:
            log.warning("Could not release %s: %s", lock.path, e)


@contextlib.contextmanager
def hold_on_process_0(path: str) -> Iterator[None]:
    """`hold(path)` on process 0 of a run; every process fails if it cannot.

    The processes of a multi-process run share the directory: process 0 holds the lock,
    and all of them learn whether it could (a broadcast, once a run), so that a refused
    run stops on every process instead of leaving the others waiting in a collective.
    """
    import jax  # pylint: disable=import-outside-toplevel

    if jax.process_count() == 1:
        with hold(path):
            yield
        return
    from jax.experimental import multihost_utils  # pylint: disable=import-outside-toplevel
    import numpy as np  # pylint: disable=import-outside-toplevel

    with contextlib.ExitStack() as stack:
        error: Optional[RunLockError] = None
        if jax.process_index() == 0:
            try:
                stack.enter_context(hold(path))
            except RunLockError as e:
                error = e
        locked = bool(multihost_utils.broadcast_one_to_all(np.asarray(error is None)))
        if error is not None:
            raise error
        if not locked:
            raise RunLockError(
                f"Process 0 could not lock {path}; "
                "its log says which process holds it"
            )
        yield
