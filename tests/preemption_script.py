"""A tiny training run that the preemption tests stop with a signal.

    python tests/preemption_script.py TRAINER_DIR --max_step N \
        [--pause_step K --marker FILE] [--coordinator HOST:PORT --num_processes P --process_id I]

Trains `tiny_trainer_config` (tests/trainer_script.py) on this process's devices. With
--pause_step, the step K is dispatched, --marker is written, and the run waits until a
stop signal has reached it: the caller sends the signal once the marker exists, so the
run is stopped at a known step without any timing. It exits as launch_trainer_main does:
with preemption.PREEMPTED_EXIT_CODE once a signal stopped it. With --coordinator, it is
one process of a multi-process run (jax.distributed, CPU collectives through gloo).
"""

import argparse
import os
import signal
import sys
import time
from typing import Optional

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

# pylint: disable=wrong-import-position
from axlearn.common import launch
from axlearn.common.preemption import PREEMPTED_EXIT_CODE, Preempted
from axlearn.common.trainer import SpmdTrainer

# Longer than any run of these tests: a signal that never comes fails the run instead.
_SIGNAL_TIMEOUT_S = 300


class PausingTrainer(SpmdTrainer):
    """Waits after dispatching step `pause_step` until a stop signal has reached it."""

    pause_step: Optional[int] = None
    marker: Optional[str] = None

    def train_step(self, input_batch):
        summaries = super().train_step(input_batch)
        if self.step == self.pause_step:
            with open(self.marker, "w", encoding="utf-8") as f:
                f.write(str(os.getpid()))
            deadline = time.monotonic() + _SIGNAL_TIMEOUT_S
            while not self.stop_requested:
                if time.monotonic() > deadline:
                    raise RuntimeError(f"No stop signal came at step {self.step}")
                time.sleep(0.01)
        return summaries


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("trainer_dir")
    parser.add_argument("--max_step", type=int, required=True)
    parser.add_argument("--pause_step", type=int, default=None)
    parser.add_argument("--marker", default=None)
    parser.add_argument("--coordinator", default=None)
    parser.add_argument("--num_processes", type=int, default=None)
    parser.add_argument("--process_id", type=int, default=None)
    args = parser.parse_args()

    launch.setup(
        jax_backend="cpu",
        distributed_coordinator=args.coordinator,
        num_processes=args.num_processes,
        process_id=args.process_id,
    )
    from tests.trainer_script import tiny_trainer_config  # pylint: disable=import-outside-toplevel

    PausingTrainer.pause_step = args.pause_step
    PausingTrainer.marker = args.marker
    cfg = tiny_trainer_config(trainer_dir=args.trainer_dir, max_step=args.max_step)
    cfg.klass = PausingTrainer
    try:
        cfg.instantiate(parent=None).run()
    except Preempted:
        sys.exit(PREEMPTED_EXIT_CODE)


if __name__ == "__main__":
    # SIGINT as an interactive shell leaves it: started by a suite in the background (whose
    # shell ignores SIGINT, which the run would then keep ignoring), the script tests the same.
    signal.signal(signal.SIGINT, signal.default_int_handler)
    main()
