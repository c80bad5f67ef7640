"""Learner.ignore_undefined_loss: a step with a NaN or infinite loss is undone, a finite one
is the plain SGD step (checked against NumPy)."""

import jax
import jax.numpy as jnp
import numpy as np

from axlearn.common import optimizers as opt
from axlearn.common.config import config_for_function
from axlearn.common.learner import Learner

LR = 0.1


def _learner(ignore: bool):
    sgd = config_for_function(opt.sgd_optimizer).set(learning_rate=LR)
    cfg = Learner.default_config().set(name="learner", optimizer=sgd, ignore_undefined_loss=ignore)
    return cfg.instantiate(parent=None)


PARAMS = {"w": jnp.asarray([1.0, -2.0, 3.0])}
GRADS = {"w": jnp.asarray([0.5, 0.25, -1.0])}


def test_finite_loss_steps_like_sgd_and_counts_nothing():
    learner = _learner(True)
    params, state, summaries = learner.update(
        PARAMS, GRADS, learner.init(PARAMS), loss=jnp.float32(2.0)
    )
    want = np.asarray(PARAMS["w"]) - LR * np.asarray(GRADS["w"])
    np.testing.assert_allclose(params["w"], want, rtol=1e-6)
    assert int(state["undefined_loss_steps"]) == 0 and int(summaries["skipped_steps"]) == 0


def test_undefined_loss_leaves_params_and_state_unchanged_and_counts_a_skipped_step():
    learner = _learner(True)
    state0 = learner.init(PARAMS)
    params, state, _ = learner.update(PARAMS, GRADS, state0, loss=jnp.float32(2.0))
    for bad in (jnp.nan, jnp.inf):
        undone, undone_state, summaries = learner.update(
            params, GRADS, state, loss=jnp.float32(bad)
        )
        np.testing.assert_array_equal(undone["w"], params["w"])
        for key in ("optimizer", "ema"):
            for got, want in zip(jax.tree.leaves(undone_state[key]), jax.tree.leaves(state[key])):
                np.testing.assert_array_equal(got, want)
        state = undone_state
    assert int(state["undefined_loss_steps"]) == 2 and int(summaries["skipped_steps"]) == 2


def test_without_the_flag_an_undefined_loss_still_updates():
    learner = _learner(False)
    state0 = learner.init(PARAMS)
    params, state, _ = learner.update(PARAMS, GRADS, state0, loss=jnp.float32(jnp.nan))
    assert "undefined_loss_steps" not in state
    np.testing.assert_allclose(params["w"], np.asarray(PARAMS["w"]) - LR * np.asarray(GRADS["w"]))
