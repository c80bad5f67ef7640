"""Tests of attention.FusedQKVLinear's layout: one weight [3, D, N, H] (query, key and value
slices stacked, as AXLearn stores it) and bias [3, N, H], checked against NumPy."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from axlearn.common import attention as attn
from axlearn.common.golden_text import init_lines
from axlearn.common.module import F
from axlearn.common.param_init import FanAxes, default_initializer_config

RNG = np.random.default_rng(0)
D, N, H = 8, 2, 4  # model dim, heads, per-head dim.


def _fused(bias: bool = True, model_dim: int = D):
    cfg = attn.FusedQKVLinear.default_config().set(
        name="qkv",
        query_dim=model_dim,
        key_dim=model_dim,
        value_dim=model_dim,
        num_heads=N,
        per_head_dim=H,
        param_init=default_initializer_config(),
    )
    cfg.layer.bias = bias
    return cfg.instantiate(parent=None)


def _random_params():
    return {
        "qkv_proj": {
            "weight": jnp.asarray(RNG.normal(size=(3, D, N, H)), jnp.float32),
            "bias": jnp.asarray(RNG.normal(size=(3, N, H)), jnp.float32),
        }
    }


def _project(layer, params, **inputs):
    out, _ = F(layer, state=params, inputs=inputs, prng_key=None, is_training=False)
    return out


def test_weight_and_bias_are_stacked_query_key_value_slices():
    specs = _fused().create_parameter_specs_recursively()["qkv_proj"]
    assert tuple(specs["weight"].shape) == (3, D, N, H)
    assert tuple(specs["bias"].shape) == (3, N, H)
    # The slice axis is a batch axis of the fans: each slice has fan_in D.
    assert specs["weight"].fan_axes == FanAxes(in_axis=1, out_axis=(2, 3), batch_axis=(0,))
    assert tuple(specs["weight"].mesh_axes)[0] is None


def test_self_attention_projects_the_input_by_each_slice():
    layer, params = _fused(), _random_params()
    x = RNG.normal(size=(2, 5, D))
    q, k, v = _project(layer, params, query=jnp.asarray(x, jnp.float32))
    w, b = (np.asarray(params["qkv_proj"][name], np.float64) for name in ("weight", "bias"))
    for i, actual in enumerate((q, k, v)):
        expected = np.einsum("btd,dnh->btnh", x, w[i]) + b[i]
        np.testing.assert_allclose(actual, expected, rtol=1e-5, atol=1e-5)


def test_cross_attention_projects_query_key_and_value_each_by_its_slice():
    layer, params = _fused(), _random_params()
    inputs = [RNG.normal(size=(2, 5, D)) for _ in range(3)]
    query, key, value = (jnp.asarray(x, jnp.float32) for x in inputs)
    outputs = _project(layer, params, query=query, key=key, value=value)
    w, b = (np.asarray(params["qkv_proj"][name], np.float64) for name in ("weight", "bias"))
    for i, (x, actual) in enumerate(zip(inputs, outputs)):
        np.testing.assert_allclose(
            actual, np.einsum("btd,dnh->btnh", x, w[i]) + b[i], rtol=1e-5, atol=1e-5
        )


def test_key_and_value_of_another_shape_are_refused():
    layer, params = _fused(), _random_params()
    query = jnp.zeros((2, 5, D))
    with pytest.raises(ValueError, match="one shape"):
        _project(layer, params, query=query, key=jnp.zeros((2, 3, D)), value=jnp.zeros((2, 3, D)))


def test_weight_gradient_is_each_slice_outer_product_with_its_output_gradient():
    layer, params = _fused(bias=False), _random_params()
    del params["qkv_proj"]["bias"]
    x = RNG.normal(size=(2, 5, D))
    g = RNG.normal(size=(3, 2, 5, N, H))  # Output gradients of q, k, v.

    def loss(params):
        q, k, v = _project(layer, params, query=jnp.asarray(x, jnp.float32))
        return sum(jnp.sum(out * g[i]) for i, out in enumerate((q, k, v)))

    grad = jax.grad(loss)(params)["qkv_proj"]["weight"]
    expected = np.einsum("btd,pbtnh->pdnh", x, g)
    np.testing.assert_allclose(grad, expected, rtol=1e-4, atol=1e-4)


def test_each_slice_is_initialized_with_fan_in_of_the_model_dim():
    layer = _fused(bias=False, model_dim=256)
    weight = layer.initialize_parameters_recursively(jax.random.PRNGKey(0))["qkv_proj"]["weight"]
    assert weight.shape == (3, 256, N, H)
    # normal(0, 1 / fan_in) with fan_in 256, not 3 * 256: the slice axis is a batch axis.
    np.testing.assert_allclose(np.var(np.asarray(weight), axis=(1, 2, 3)), 1 / 256, rtol=0.15)


def test_init_golden_line_describes_one_slice_as_axlearn_does():
    lines = init_lines(_fused())
    assert lines == [
        f"qkv_proj/weight: normal(0, 1.0 / fan_in), shape=({D}, {N}, {H}), "
        "axes=FanAxes(in_axis=0, out_axis=(1, 2), batch_axis=())",
        "qkv_proj/bias: constant(0.0)",
    ]
