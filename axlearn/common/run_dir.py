"""A trainer directory (`--trainer_dir`, the trainer's `dir`): the one place that names
what a run writes there, and the holder of its lock.

    <trainer_dir>/
      config.txt               the resolved config in golden text (`run_record`)
      data.json                the data every input reads (`data_record`)
      LOCK                     the running trainer's (`run_lock`)
      checkpoints/step_*/      the checkpointer's
      summaries/train/         the trainer's summary writer: TensorBoard events, metrics.jsonl
      summaries/<evaler>/      each evaler's summary writer, the same
      traces/                  jax.profiler traces (`start_trace_steps`)
      wandb_run_id, wandb/     the W&B run that all the summary writers share

    run = RunDir(trainer_dir)
    run.checkpoints, run.summaries("train"), run.config_record
    with run.lock():  # re-entrant: the launcher holds it, then the trainer again
        ...

Paths are joined with `file_system.join` (local paths and storage URLs). This module
imports no jax.
"""

import contextlib
import dataclasses
from collections.abc import Iterator
from typing import Union

from axlearn.common import file_system

CONFIG_RECORD = "config.txt"  # The resolved config in golden text.
DATA_RECORD = "data.json"  # The data every input reads.
LOCK = "LOCK"  # JSON naming the trainer that holds the directory.
CHECKPOINTS = "checkpoints"  # The checkpointer's directory: one step_* directory a step.
SUMMARIES = "summaries"  # One directory per summary writer, named for its owner.
TRAIN_SUMMARIES = "train"  # The trainer's own summary writer, under SUMMARIES.
TRACES = "traces"  # jax.profiler traces.
METRICS_JSONL = "metrics.jsonl"  # A summary writer's JSON lines, in its directory.
WANDB_RUN_ID = "wandb_run_id"  # The id of the W&B run its summary writers share.


@dataclasses.dataclass(frozen=True)
class RunDir:
    """The paths under one trainer directory, `root` (a local path or a storage URL)."""

    root: str

    def path(self, *parts: str) -> str:
        """`root/part/...`."""
        return file_system.join(self.root, *parts)

    @property
    def config_record(self) -> str:
        return self.path(CONFIG_RECORD)

    @property
    def data_record(self) -> str:
        return self.path(DATA_RECORD)

    @property
    def lock_file(self) -> str:
        return self.path(LOCK)

    @property
    def checkpoints(self) -> str:
        return self.path(CHECKPOINTS)

    def summaries(self, name: str = "") -> str:
        """The summary directory of `name` (an evaler, or TRAIN_SUMMARIES); without a
        name, the directory that holds them all (TensorBoard's --logdir)."""
        return self.path(SUMMARIES, name) if name else self.path(SUMMARIES)

    @property
    def traces(self) -> str:
        return self.path(TRACES)

    @property
    def wandb_run_id(self) -> str:
        return self.path(WANDB_RUN_ID)

    @contextlib.contextmanager
    def lock(self) -> Iterator[None]:
        """Holds the directory's LOCK on process 0 (`run_lock.hold_on_process_0`):
        re-entrant within a process, so the launcher and the trainer may both hold it."""
        from axlearn.common import run_lock  # pylint: disable=import-outside-toplevel

        with run_lock.hold_on_process_0(self.root):
            yield


def as_run_dir(directory: Union[str, RunDir]) -> RunDir:
    """`directory` as a RunDir: the launcher hands one down, a caller may pass the path."""
    return directory if isinstance(directory, RunDir) else RunDir(directory)
