"""Trains a named config.

    python -m axlearn.common.launch_trainer_main --config=gpt_test --trainer_dir=/tmp/gpt_test

`--print_config` prints the flat config instead of training; `--mesh_selector` applies a
mesh rule; `--config_override=path=value` (repeatable) edits any field.
"""

from absl import app, flags
from absl import logging as absl_logging

from axlearn.common import launch, launch_trainer
from axlearn.common.config import ConfigError

launch.define_flags()
launch_trainer.define_flags()


def main(argv) -> None:
    if len(argv) > 1:
        raise app.UsageError(f"Unexpected arguments: {argv[1:]}")
    absl_logging.set_verbosity(absl_logging.INFO)
    try:
        launch.setup_from_flags(flags.FLAGS)
        launch_trainer.run_from_flags(flags.FLAGS)
    except ConfigError as e:
        # A wrong flag or config: the message says what to change; a traceback adds nothing.
        raise SystemExit(f"launch_trainer_main: {e}") from e


if __name__ == "__main__":
    app.run(main)
