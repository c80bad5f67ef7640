"""Trains a named config.

    python -m axlearn.common.launch_trainer_main --config=gpt_test --trainer_dir=/tmp/gpt_test

`--list_configs` lists the named configs; `--print_config` prints the flat config instead
of training; `--mesh_selector` picks a mesh rule (unset: named from the devices, e.g.
gpu-h100-1); `--config_override=path=value` (repeatable) edits any field.

Exit status (every failure but an unexpected one ends with one line naming its cause):
- 0: the run reached max_step.
- 1: a config error (a flag, an override, a restart on a changed config or on other data:
  --allow_config_change, --allow_data_change), a directory another trainer holds, data
  that cannot be read, a diverged run, a device out of memory (the line says what frees
  some), or an unexpected failure (with its traceback).
- 69 (`peer_watch.PEER_LOST_EXIT_CODE`): another process of a multi-process run is gone
  (killed, out of memory, its host lost); every survivor exits within a minute. Restart
  the whole run: it resumes from its last checkpoint.
  Process 0 hosts jax's coordination service, whose loss jax's client answers with an
  immediate abort (a C++ stack dump): so each process of a multi-process run trains in a
  child process under a `supervisor`, which prints one line naming the lost coordinator
  instead and exits 69. A single process runs with no child.
- 74 (`STORAGE_EXIT_CODE`): the trainer directory cannot be created (under a file, on a
  read-only file system) or written (read-only, no permission, disk full); the line names
  the path and the system's error.
- 75 (`preemption.PREEMPTED_EXIT_CODE`): SIGTERM or SIGINT stopped the run (the step it
  reached is saved unless the grace period ran out; before training started there is
  nothing to save); restart with the same flags to resume.
- 130: a second SIGINT during that stop.
"""

import sys

if __name__ == "__main__":
    from axlearn.common import supervisor as _supervisor

    _supervisor.die_with_parent()  # Only in a supervised child (see `_main`).
    # First, before anything slow (imports, jax, joining the other processes): from here on
    # a SIGTERM or SIGINT exits with PREEMPTED_EXIT_CODE, until the trainer's handlers
    # take over (they save first).
    from axlearn.common import preemption as _preemption
    from axlearn.common import run_lock as _run_lock

    _preemption.exit_on_stop_signals(on_exit=_run_lock.release_all)

# pylint: disable=wrong-import-position
import errno
import logging
import os
import traceback
from typing import Optional

from absl import app, flags
from absl import logging as absl_logging

from axlearn.common import cluster_env, launch, launch_trainer, peer_watch, run_lock, supervisor
from axlearn.common.config import ConfigError
from axlearn.common.preemption import PREEMPTED_EXIT_CODE, Preempted
from axlearn.common.run_record import TrainerDirNotWritableError
from axlearn.common.run_lock import RunLockError

launch.define_flags()
launch_trainer.define_flags()
# absl's --help lists the main module's key flags only; these modules define ours.
flags.adopt_module_key_flags(launch)
flags.adopt_module_key_flags(launch_trainer)

# JAX probes for a TPU on every host and logs its failure where there is none.
_TPU_PROBE_MESSAGE = "Unable to initialize backend 'tpu'"


class _TpuProbeFilter(logging.Filter):
    """Drops JAX's failed-TPU-probe record; passes every other record."""

    def filter(self, record: logging.LogRecord) -> bool:
        return not record.getMessage().startswith(_TPU_PROBE_MESSAGE)


def quiet_tpu_probe() -> None:
    """On a host without TPUs, JAX's record of its failed TPU probe is left out of the log."""
    if not launch.tpu_present():
        logging.getLogger("jax._src.xla_bridge").addFilter(_TpuProbeFilter())


# sysexits' EX_IOERR: the trainer directory cannot be written (read-only, no permission,
# disk full).
STORAGE_EXIT_CODE = 74
# The errors of a file system that will not take the run's files.
_STORAGE_ERRNOS = frozenset(
    {errno.EACCES, errno.EPERM, errno.EROFS, errno.ENOSPC, getattr(errno, "EDQUOT", errno.ENOSPC)}
)


def _main(argv) -> None:
    """`main`; in a process of a multi-process run, in a supervised child (module docstring)."""
    placement = supervised_placement(flags.FLAGS)
    if placement is None:
        main(argv)
        return
    coordinator, process = placement
    raise SystemExit(
        supervisor.supervise(
            [sys.executable, *sys.orig_argv[1:]],
            coordinator=coordinator,
            process=process,
            prefix="launch_trainer_main",
        )
    )


def supervised_placement(
    flag_values: flags.FlagValues,
) -> Optional[tuple[Optional[str], str]]:
    """(process 0's host:port or None, "process I of N") of a process of a multi-process run that
    is not yet supervised; None: run here (one process, a supervised child, or a placement
    error, which `launch.setup` reports)."""
    if supervisor.is_child():
        return None
    if flag_values.distributed_auto:
        return None, "this process"
    try:
        placement = cluster_env.process_placement(
            coordinator_address=flag_values.distributed_coordinator,
            num_processes=flag_values.num_processes,
            process_id=flag_values.process_id,
            local_device_ids=cluster_env.parse_device_ids(flag_values.local_device_ids),
            cluster_env=flag_values.cluster_env,
        )
    except (ConfigError, ValueError):
        return None
    if placement is None:
        return None
    return (
        placement.coordinator_address,
        f"process {placement.process_id} of {placement.num_processes}",
    )


def main(argv) -> None:
    if len(argv) > 1:
        raise app.UsageError(f"Unexpected arguments: {argv[1:]}")
    absl_logging.set_verbosity(absl_logging.INFO)
    quiet_tpu_probe()
    try:
        launch.setup_from_flags(flags.FLAGS)
        launch_trainer.run_from_flags(flags.FLAGS)
    except Exception as e:  # pylint: disable=broad-except
        status, line = exit_for(e, trainer_dir=flags.FLAGS["trainer_dir"].value)
        watch = peer_watch.current_watch()
        if watch is not None and status == PREEMPTED_EXIT_CODE:
            watch.finish()  # Every process stopped after the same step.
        if watch is None:  # One process: a normal exit.
            if line is None and status == 1:
                raise
            if line is not None and status == 1:
                raise SystemExit(line) from e  # Printed, with status 1.
            if line is not None:
                sys.stderr.write(f"{line}\n")
            raise SystemExit(status) from e
        _exit_multi_process(e, status, line, watch)
    watch = peer_watch.current_watch()
    if watch is not None:
        watch.finish()


def exit_for(error: Exception, trainer_dir: Optional[str] = None) -> tuple[int, Optional[str]]:
    """(exit status, the one line to print, or None: the traceback) of a failed run in
    `trainer_dir`."""
    if isinstance(error, TrainerDirNotWritableError):
        return STORAGE_EXIT_CODE, f"launch_trainer_main: {error}"
    if isinstance(error, (ConfigError, RunLockError)):
        # A wrong flag or config, or a directory in use: the message says what to change.
        return 1, f"launch_trainer_main: {error}"
    if isinstance(error, Preempted):
        # The trainer logged where it saved; the status tells a scheduler to restart it.
        return PREEMPTED_EXIT_CODE, None
    if _is_storage_error(error):
        # A save or summary write failed: the message names the path and the cause; the
        # earlier checkpoints are intact.
        return STORAGE_EXIT_CODE, f"launch_trainer_main: {error}"
    storage = _storage_error(error, trainer_dir)
    if storage is not None:
        return STORAGE_EXIT_CODE, f"launch_trainer_main: cannot write the run's files: {storage}"
    if _is_input_error(error):
        # Data that cannot be read: the message names the input.
        return 1, f"launch_trainer_main: {error} (--data_dir=DIR for token shards, FAKE or BUILTIN)"
    if _is_divergence(error):
        # The run stopped on a bad loss: the message names the step and the last good checkpoint.
        return 1, f"launch_trainer_main: {error}"
    if _is_device_out_of_memory(error):
        first = str(error).strip().splitlines()[0]
        return 1, (
            f"launch_trainer_main: a device ran out of memory ({first[:300]}): train fewer "
            "sequences at a time (--config_override=per_device_microbatch_size=N), recompute "
            "more (the layers' remat_spec), or give jax more of the card than its default 75% "
            "(XLA_PYTHON_CLIENT_MEM_FRACTION=0.94)"
        )
    return 1, None


def _storage_error(error: BaseException, trainer_dir: Optional[str]) -> Optional[OSError]:
    """The OSError of a file system that will not take a file of `trainer_dir` (one that
    names no file: any), in `error`'s chain; None."""
    root = os.path.abspath(trainer_dir) if trainer_dir and "://" not in trainer_dir else None
    seen = set()
    while error is not None and id(error) not in seen:
        seen.add(id(error))
        if isinstance(error, OSError) and error.errno in _STORAGE_ERRNOS:
            name = error.filename
            if root is None or not name or os.path.abspath(str(name)).startswith(root):
                return error
        error = error.__cause__ or error.__context__
    return None


def _exit_multi_process(
    error: Exception, status: int, line: Optional[str], watch: "peer_watch.PeerWatch"
) -> None:
    """Ends one process of a multi-process run that failed. An unexpected failure waits
    for the peer watch's verdict first: a collective that failed because another process
    is gone exits with PEER_LOST_EXIT_CODE. The exit skips jax's shutdown barrier, which
    would wait for processes that are gone or stuck, and then abort."""
    if status == PREEMPTED_EXIT_CODE:  # Every process stopped after the same step.
        raise SystemExit(status) from error
    if line is None:
        lost = watch.wait_for_loss(peer_watch.PEER_TIMEOUT_S + 3 * peer_watch.HEARTBEAT_S)
        if lost is not None:
            status, line = peer_watch.PEER_LOST_EXIT_CODE, f"launch_trainer_main: {lost}"
        else:
            traceback.print_exception(error)
    if line is not None:
        sys.stderr.write(f"{line}\n")
    run_lock.release_all()
    for stream in (sys.stdout, sys.stderr):
        stream.flush()
    os._exit(status)  # pylint: disable=protected-access


def _is_input_error(error: BaseException) -> bool:
    """Whether `error` is an input_base.InputError (looked up as _is_divergence does)."""
    input_base = sys.modules.get("axlearn.common.input_base")
    return input_base is not None and isinstance(error, input_base.InputError)


def _is_storage_error(error: BaseException) -> bool:
    """Whether `error` is a failed checkpoint save or summary write (looked up as
    _is_divergence does)."""
    checkpointer = sys.modules.get("axlearn.common.checkpointer")
    writer = sys.modules.get("axlearn.common.summary_writer")
    return (checkpointer is not None and isinstance(error, checkpointer.CheckpointSaveError)) or (
        writer is not None and isinstance(error, writer.SummaryWriteError)
    )


def _is_device_out_of_memory(error: BaseException) -> bool:
    """Whether `error` is jax's runtime error for an allocation a device could not make
    (a program's buffers, or an array put on it), not a full disk."""
    text = str(error)
    return (
        type(error).__name__ in ("JaxRuntimeError", "XlaRuntimeError")
        and text.startswith("RESOURCE_EXHAUSTED")
        and "Out of memory" in text
    )


def _is_divergence(error: BaseException) -> bool:
    """Whether `error` is the trainer's TrainingDivergedError. Looked up where training
    loaded it, so that the launcher does not import the trainer (and jax) to start."""
    trainer = sys.modules.get("axlearn.common.trainer")
    return trainer is not None and isinstance(error, trainer.TrainingDivergedError)


def exit_on_help(argv: list[str]) -> None:
    """Prints the help absl's --help prints and exits 0 (absl's exits 1): asking for help
    is no error. --helpfull adds every module's flags."""
    if "--helpfull" in argv:
        print(flags.FLAGS.get_help())
    elif any(arg in ("-h", "--help", "--helpshort", "-?") for arg in argv):
        print(__doc__.strip(), flags.FLAGS.main_module_help(), sep="\n\n")
    else:
        return
    raise SystemExit(0)


if __name__ == "__main__":
    exit_on_help(sys.argv[1:])
    app.run(_main)
