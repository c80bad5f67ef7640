"""Tests of axlearn.common.weight_copies: what a step carries of its weights, against NumPy
casts and the float32 bits themselves."""

import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest

from axlearn.common.base_layer import ParameterSpec
from axlearn.common.config import ConfigError
from axlearn.common.param_init import FanAxes
from axlearn.common.weight_copies import WeightCopies, uses_float32_weight_grads

SPECS = {
    "weight": ParameterSpec(shape=(4, 6), dtype=jnp.float32, fan_axes=FanAxes()),
    "scale": ParameterSpec(shape=(6,), dtype=jnp.float32),
}


def _params(seed: int = 0) -> dict:
    rng = np.random.default_rng(seed)
    return {
        name: jnp.asarray(rng.normal(size=spec.shape), jnp.float32) for name, spec in SPECS.items()
    }


def _copies(carry, split) -> WeightCopies:
    return WeightCopies(SPECS, train_dtype=jnp.bfloat16, carry=carry, split=split, path="trainer")


def test_without_carrying_the_state_is_the_parameters_alone():
    params = _params()
    model, copies, low_bits = _copies(None, None).carry(params)
    assert model is params and copies is None and low_bits is None


def test_carried_copies_are_the_weights_cast_and_other_parameters_have_none():
    params = _params()
    model, copies, low_bits = _copies(True, None).carry(params)
    assert model is params and low_bits is None and copies["scale"] is None
    want = np.asarray(params["weight"]).astype(ml_dtypes.bfloat16)
    np.testing.assert_array_equal(np.asarray(copies["weight"]), want)


def test_split_weights_join_to_the_same_float32_bits():
    params = _params()
    weight_copies = _copies(True, True)
    model, high, low = weight_copies.carry(params)
    assert model["weight"] is None and model["scale"] is params["scale"]
    assert high["weight"].dtype == jnp.bfloat16 and low["weight"].dtype == jnp.int16
    joined = weight_copies.join(model, high, low)
    for name, x in params.items():
        np.testing.assert_array_equal(
            np.asarray(joined[name]).view(np.uint32), np.asarray(x).view(np.uint32)
        )


def test_train_dtype_params_use_the_carried_copies_in_place_of_casts():
    params = _params()
    weight_copies = _copies(True, None)
    marker = jnp.full(SPECS["weight"].shape, 7, jnp.bfloat16)  # Not the weight's cast.
    got = weight_copies.train_dtype_params(
        params, {"weight": marker, "scale": None}, float32_weight_grads=False
    )
    np.testing.assert_array_equal(np.asarray(got["weight"]), np.asarray(marker))
    want_scale = np.asarray(params["scale"]).astype(ml_dtypes.bfloat16)
    np.testing.assert_array_equal(np.asarray(got["scale"]), want_scale)


@pytest.mark.parametrize(
    "carry, split, train_dtype, message",
    [
        (True, None, None, r"trainer\.carry_train_dtype_weights needs a train_dtype"),
        (None, True, jnp.bfloat16, r"trainer\.split_carried_weights needs"),
        (True, True, jnp.float16, r"trainer\.split_carried_weights needs"),
    ],
)
def test_options_that_do_not_go_together_name_the_field(carry, split, train_dtype, message):
    with pytest.raises(ConfigError, match=message):
        WeightCopies(SPECS, train_dtype=train_dtype, carry=carry, split=split, path="trainer")


def test_split_weights_must_be_float32():
    specs = {"weight": ParameterSpec(shape=(4, 6), dtype=jnp.float16, fan_axes=FanAxes())}
    with pytest.raises(ConfigError, match="parameter weight is float16"):
        WeightCopies(specs, train_dtype=jnp.bfloat16, carry=True, split=True, path="trainer")


def test_float32_weight_gradients_only_for_microbatches_on_one_device():
    assert uses_float32_weight_grads(4, 1) and uses_float32_weight_grads(2, 1)
    assert not uses_float32_weight_grads(1, 1)
    assert not uses_float32_weight_grads(4, 2)  # Reduced across devices: bf16 moves half.
