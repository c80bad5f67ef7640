"""A tiny training run that checkpoints every step and resumes from the latest commit.

Used by tests/test_checkpointer.py as a subprocess that can be killed with SIGKILL:
an MLP regression trained with optax Adam on data that depends only on the step, so an
interrupted-and-resumed run must reproduce an uninterrupted run's losses exactly.

    python tests/checkpointer_train_script.py --dir D --steps N --losses FILE \
        [--pause_before_commit STEP --marker FILE]

With --pause_before_commit, the save of STEP writes all its data and then sleeps before
its index is written (touching --marker first), so the caller can kill the process
between the data and the commit.
"""

import argparse
import os
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np
import optax

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from axlearn.common.checkpointer import Checkpointer  # pylint: disable=wrong-import-position


def batch_for_step(step: int) -> tuple[np.ndarray, np.ndarray]:
    """The input pipeline: batch `step` is a pure function of `step`."""
    rng = np.random.default_rng(1000 + step)
    x = rng.normal(size=(32, 8)).astype(np.float32)
    y = np.sin(x.sum(axis=1, keepdims=True)).astype(np.float32)
    return x, y


def init_params() -> dict:
    k1, k2 = jax.random.split(jax.random.PRNGKey(0))
    return {
        "hidden": {"w": jax.random.normal(k1, (8, 16)) * 0.3, "b": jnp.zeros((16,))},
        "out": {"w": jax.random.normal(k2, (16, 1)) * 0.3, "b": jnp.zeros((1,))},
    }


OPTIMIZER = optax.adam(1e-2)


def loss_fn(params: dict, x: jax.Array, y: jax.Array) -> jax.Array:
    h = jnp.tanh(x @ params["hidden"]["w"] + params["hidden"]["b"])
    pred = h @ params["out"]["w"] + params["out"]["b"]
    return jnp.mean((pred - y) ** 2)


def _train_step_impl(state, x, y):
    loss, grads = jax.value_and_grad(loss_fn)(state["params"], x, y)
    updates, opt_state = OPTIMIZER.update(grads, state["opt_state"], state["params"])
    params = optax.apply_updates(state["params"], updates)
    return {"params": params, "opt_state": opt_state}, loss


# The state is donated, as a real trainer does: the checkpointer must copy it in time.
train_step = jax.jit(_train_step_impl, donate_argnums=0)


class PausingCheckpointer(Checkpointer):
    """Sleeps between the data and the index of one step (the test kills it there)."""

    pause_step = None
    marker = None

    def _commit(self, step_dir, index):
        if index["step"] == self.pause_step:
            with open(self.marker, "w", encoding="utf-8") as f:
                f.write(step_dir)
            time.sleep(600)
        super()._commit(step_dir, index)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--dir", required=True)
    parser.add_argument("--steps", type=int, required=True)
    parser.add_argument("--losses", required=True)
    parser.add_argument("--pause_before_commit", type=int, default=None)
    parser.add_argument("--marker", default=None)
    args = parser.parse_args()

    PausingCheckpointer.pause_step = args.pause_before_commit
    PausingCheckpointer.marker = args.marker
    cfg = PausingCheckpointer.default_config().set(name="checkpointer", dir=args.dir, keep_last_n=3)
    checkpointer = cfg.instantiate(parent=None)

    params = init_params()
    state = {"params": params, "opt_state": OPTIMIZER.init(params)}
    restored_step, state, extra = checkpointer.restore(state=state)
    next_step = 1 if restored_step is None else extra["next_batch"]
    with open(args.losses, "a", encoding="utf-8") as log:
        log.write(f"start {next_step}\n")
        for step in range(next_step, args.steps + 1):
            state, loss = train_step(state, *batch_for_step(step))
            log.write(f"{step} {float(loss).hex()}\n")
            log.flush()
            checkpointer.save(step, state, extra={"next_batch": step + 1})
    checkpointer.stop()


if __name__ == "__main__":
    main()
