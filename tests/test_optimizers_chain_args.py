"""`chain` configured as AXLearn writes it: transformations in the `args` field (its *args),
dumped as `args[i]` lines and applied in order (checked against NumPy)."""

import jax.numpy as jnp
import numpy as np

from axlearn.common import optimizers as opt
from axlearn.common.config import config_for_function
from axlearn.common.golden_text import parse_flat_text


def _chain_config():
    return config_for_function(opt.chain).set(
        args=[
            config_for_function(opt.clip_by_global_norm).set(max_norm=1.0, eps=0.0),
            config_for_function(opt.sgd_optimizer).set(learning_rate=0.5),
        ]
    )


def test_chain_args_dump_as_indexed_lines_and_parse_back():
    text = _chain_config().debug_string()
    assert "args[0].fn: 'axlearn.common.optimizers.clip_by_global_norm'" in text.splitlines()
    assert "args[1].learning_rate: 0.5" in text.splitlines()
    assert parse_flat_text(text).debug_string() == text


def test_chain_args_clip_then_step_in_order():
    chain = _chain_config().instantiate()
    grads = np.asarray([3.0, 4.0])
    updates, _ = chain.update({"w": jnp.asarray(grads)}, chain.init({"w": jnp.zeros(2)}))
    want = -0.5 * grads / np.linalg.norm(grads)  # Clipped to norm 1, then -lr * g.
    np.testing.assert_allclose(updates["w"], want, rtol=1e-6)
