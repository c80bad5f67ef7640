"""Trains a named config.

    python -m axlearn.common.launch_trainer_main --config=gpt_test --trainer_dir=/tmp/gpt_test

`--list_configs` lists the named configs; `--print_config` prints the flat config instead
of training; `--mesh_selector` picks a mesh rule (unset: named from the devices, e.g.
gpu-h100-1); `--config_override=path=value` (repeatable) edits any field.

Exit status: 0 when the run reached max_step; `preemption.PREEMPTED_EXIT_CODE` (75) when
SIGTERM or SIGINT stopped it (the step it reached is saved unless the grace period ran
out; restart with the same flags to resume); 130 on a second SIGINT during that stop;
1 on a config error, a directory another trainer holds, or a failure.
"""

import logging
import sys

from absl import app, flags
from absl import logging as absl_logging

from axlearn.common import launch, launch_trainer
from axlearn.common.config import ConfigError
from axlearn.common.preemption import PREEMPTED_EXIT_CODE, Preempted
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


def main(argv) -> None:
    if len(argv) > 1:
        raise app.UsageError(f"Unexpected arguments: {argv[1:]}")
    absl_logging.set_verbosity(absl_logging.INFO)
    quiet_tpu_probe()
    try:
        launch.setup_from_flags(flags.FLAGS)
        launch_trainer.run_from_flags(flags.FLAGS)
    except (ConfigError, RunLockError) as e:
        # A wrong flag or config, or a directory in use: the message says what to change;
        # a traceback adds nothing.
        raise SystemExit(f"launch_trainer_main: {e}") from e
    except Preempted as e:
        # The trainer logged where it saved; the status tells a scheduler to restart it.
        raise SystemExit(PREEMPTED_EXIT_CODE) from e
    except Exception as e:  # pylint: disable=broad-except
        if _is_input_error(e):
            # Data that cannot be read: the message names the input; no traceback.
            raise SystemExit(
                f"launch_trainer_main: {e} (--data_dir=DIR for token shards, FAKE or BUILTIN)"
            ) from e
        if _is_storage_error(e):
            # A save or summary write failed (a full disk): the message names the path and
            # the cause; earlier checkpoints are intact.
            raise SystemExit(f"launch_trainer_main: {e}") from e
        if _is_divergence(e):
            # The run stopped on a bad loss: the message names the step and the last good
            # checkpoint. Exit status 1, as SystemExit with a message gives.
            raise SystemExit(f"launch_trainer_main: {e}") from e
        raise


def _is_input_error(error: Exception) -> bool:
    """Whether `error` is an input_base.InputError (looked up as _is_divergence does)."""
    input_base = sys.modules.get("axlearn.common.input_base")
    return input_base is not None and isinstance(error, input_base.InputError)


def _is_storage_error(error: Exception) -> bool:
    """Whether `error` is a failed checkpoint save or summary write (looked up as
    _is_divergence does)."""
    checkpointer = sys.modules.get("axlearn.common.checkpointer")
    writer = sys.modules.get("axlearn.common.summary_writer")
    return (checkpointer is not None and isinstance(error, checkpointer.CheckpointSaveError)) or (
        writer is not None and isinstance(error, writer.SummaryWriteError)
    )


def _is_divergence(error: Exception) -> bool:
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
    app.run(main)
