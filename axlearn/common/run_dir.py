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
      compiled/                the train step compiled, for restarts (`executable_store`)
      wandb_run_id, wandb/     the W&B run that all the summary writers share

    run = RunDir(trainer_dir)
    run.checkpoints, run.summaries("train"), run.config_record  # paths (strings)
    with run.lock():  # the launcher's; the trainer it hands `run` to takes it no more
        ...

Paths are joined with `file_system.join` (local paths and storage URLs). This module
imports no jax.
"""

import contextlib
import threading
from collections.abc import Iterator
from typing import Optional

from axlearn.common import file_system, run_lock

CONFIG_RECORD = "config.txt"  # The resolved config in golden text.
DATA_RECORD = "data.json"  # The data every input reads.
LOCK = "LOCK"  # JSON naming the trainer that holds the directory.
CHECKPOINTS = "checkpoints"  # The checkpointer's directory: one step_* directory a step.
SUMMARIES = "summaries"  # One directory per summary writer, named for its owner.
TRAIN_SUMMARIES = "train"  # The trainer's own summary writer, under SUMMARIES.
TRACES = "traces"  # jax.profiler traces.
COMPILED = "compiled"  # Executables that restarts load instead of compiling.
METRICS_JSONL = "metrics.jsonl"  # A summary writer's JSON lines, in its directory.
WANDB_RUN_ID = "wandb_run_id"  # The id of the W&B run its summary writers share.


class RunDir:
    """The paths under one trainer directory, `root` (a local path or a storage URL), each
    joined once, when it is made; `summaries(name)` joins a writer's on demand."""

    def __init__(self, root: str):
        self.root = root
        self.config_record = file_system.join(root, CONFIG_RECORD)
        self.data_record = file_system.join(root, DATA_RECORD)
        self.lock_file = file_system.join(root, LOCK)
        self.checkpoints = file_system.join(root, CHECKPOINTS)
        self.traces = file_system.join(root, TRACES)
        self.compiled = file_system.join(root, COMPILED)
        self.wandb_run_id = file_system.join(root, WANDB_RUN_ID)
        self._locking_thread: Optional[int] = None  # That of the `lock()` block running.

    def __repr__(self) -> str:
        return f"RunDir({self.root!r})"

    def __eq__(self, other: object) -> bool:
        return isinstance(other, RunDir) and other.root == self.root

    def __hash__(self) -> int:
        return hash(self.root)

    def summaries(self, name: str = "") -> str:
        """The summary directory of `name` (an evaler, or TRAIN_SUMMARIES); without a
        name, the directory that holds them all (TensorBoard's --logdir)."""
        parts = (SUMMARIES, name) if name else (SUMMARIES,)
        return file_system.join(self.root, *parts)

    @property
    def locked(self) -> bool:
        """Whether a `lock()` block of this RunDir runs (on every process of the run)."""
        return self._locking_thread is not None

    @contextlib.contextmanager
    def lock(self) -> Iterator[None]:
        """Holds the directory's LOCK while the block runs, on process 0 of the run
        (`run_lock.hold_on_process_0`: every process fails if it cannot). Taken once: a
        `lock()` in the same thread inside a block of this RunDir's (the trainer's, in the
        launcher's) takes nothing more; another thread fails as another process would."""
        if self._locking_thread == threading.get_ident():
            yield
            return
        with run_lock.hold_on_process_0(self.lock_file):
            self._locking_thread = threading.get_ident()
            try:
                yield
            finally:
                self._locking_thread = None
