"""Tests of axlearn.common.layers against NumPy re-derivations."""

import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import PartitionSpec

from axlearn.common import layers
from axlearn.common.base_layer import WeightWithCopy
from axlearn.common.config import ConfigError
from axlearn.common.module import F
from axlearn.common.param_init import default_initializer_config
from axlearn.common.sharding import create_mesh

RNG = np.random.default_rng(0)


def _build(cfg):
    layer = cfg.set(name="layer", param_init=default_initializer_config()).instantiate(parent=None)
    params = layer.initialize_parameters_recursively(jax.random.PRNGKey(0))
    return layer, params


def _call(layer, params, *inputs, is_training=False, prng_key=None, method="forward"):
    out, _ = F(
        layer,
        state=params,
        inputs=inputs,
        prng_key=prng_key,
        is_training=is_training,
        method=method,
    )
    return out


def _random_params(params):
    """Replaces every parameter by random values, so scales and biases are exercised."""
    return jax.tree_util.tree_map(
        lambda p: jnp.asarray(RNG.normal(size=p.shape), p.dtype), params
    )


def test_rmsnorm_matches_numpy():
    layer, params = _build(layers.RMSNorm.default_config().set(input_dim=6, eps=1e-5))
    params = _random_params(params)
    x = RNG.normal(size=(2, 3, 6)).astype(np.float32)
    expected = x / np.sqrt(np.mean(x**2, axis=-1, keepdims=True) + 1e-5) * params["scale"]
    np.testing.assert_allclose(_call(layer, params, jnp.asarray(x)), expected, rtol=1e-5, atol=1e-6)


def test_rmsnorm_scale_starts_at_one():
    _, params = _build(layers.RMSNorm.default_config().set(input_dim=4))
    np.testing.assert_array_equal(params["scale"], np.ones(4))


def test_rmsnorm_keeps_input_dtype():
    layer, params = _build(
        layers.RMSNorm.default_config().set(input_dim=4, forward_dtype=None)
    )
    x = jnp.ones((2, 4), jnp.bfloat16)
    assert _call(layer, params, x).dtype == jnp.bfloat16


def test_layernorm_matches_numpy():
    layer, params = _build(layers.LayerNorm.default_config().set(input_dim=5, eps=1e-6))
    params = _random_params(params)
    x = RNG.normal(size=(4, 5)).astype(np.float32)
    mean = x.mean(-1, keepdims=True)
    var = ((x - mean) ** 2).mean(-1, keepdims=True)
    expected = (x - mean) / np.sqrt(var + 1e-6) * params["scale"] + params["bias"]
    np.testing.assert_allclose(_call(layer, params, jnp.asarray(x)), expected, rtol=1e-5, atol=1e-5)


def test_linear_matches_numpy():
    layer, params = _build(layers.Linear.default_config().set(input_dim=4, output_dim=3))
    params = _random_params(params)
    x = RNG.normal(size=(2, 5, 4)).astype(np.float32)
    expected = x @ np.asarray(params["weight"]) + np.asarray(params["bias"])
    np.testing.assert_allclose(_call(layer, params, jnp.asarray(x)), expected, rtol=1e-5, atol=1e-5)


def test_linear_without_bias_has_only_a_weight():
    cfg = layers.Linear.default_config().set(input_dim=4, output_dim=3, bias=False)
    layer, params = _build(cfg)
    assert set(params) == {"weight"}
    assert params["weight"].shape == (4, 3)


def test_linear_weight_init_has_fan_in_variance():
    _, params = _build(layers.Linear.default_config().set(input_dim=400, output_dim=300))
    np.testing.assert_allclose(np.var(params["weight"]), 1 / 400, rtol=0.05)


def test_embedding_lookup_and_attend():
    layer, params = _build(layers.Embedding.default_config().set(num_embeddings=7, dim=4))
    table = np.asarray(params["weight"])
    ids = np.array([[0, 6, 3], [2, 2, 1]])
    np.testing.assert_array_equal(_call(layer, params, jnp.asarray(ids)), table[ids])
    x = RNG.normal(size=(2, 3, 4)).astype(np.float32)
    np.testing.assert_allclose(
        _call(layer, params, jnp.asarray(x), method="attend"), x @ table.T, rtol=1e-5, atol=1e-5
    )


def test_one_hot_grad_embedding_sums_the_gradient_of_each_row_as_a_scatter_add():
    layer, params = _build(layers.OneHotGradEmbedding.default_config().set(num_embeddings=7, dim=4))
    table = np.asarray(params["weight"])
    ids = np.array([[0, 6, 3, 3], [2, 3, 3, 1]])  # A frequent token, and rows never read.
    dy = RNG.normal(size=(2, 4, 4)).astype(np.float32)

    def loss(weight):
        return jnp.sum(_call(layer, {"weight": weight}, jnp.asarray(ids)) * dy)

    expected = np.zeros_like(table)
    np.add.at(expected, ids.reshape(-1), dy.reshape(-1, 4))
    np.testing.assert_array_equal(_call(layer, params, jnp.asarray(ids)), table[ids])
    np.testing.assert_allclose(jax.grad(loss)(params["weight"]), expected, rtol=1e-6, atol=1e-6)
    # Through a bf16 copy, the float32 weight gets the float32 sum of the copy's rows' cotangents.
    copied = WeightWithCopy(params["weight"], params["weight"].astype(jnp.bfloat16))

    def copied_loss(weight):
        out = _call(layer, {"weight": copied._replace(weight=weight)}, jnp.asarray(ids))
        return jnp.sum(out.astype(jnp.float32) * dy)

    grad = jax.grad(copied_loss)(params["weight"])
    assert grad.dtype == jnp.float32
    # The bf16 output's cotangent is dy in bf16; its sums are not rounded again.
    dy_bf16 = np.asarray(jnp.asarray(dy).astype(jnp.bfloat16).astype(jnp.float32))
    expected = np.zeros_like(table)
    np.add.at(expected, ids.reshape(-1), dy_bf16.reshape(-1, 4))
    np.testing.assert_allclose(grad, expected, rtol=1e-6, atol=1e-6)


def test_dropout_is_identity_when_not_training_or_rate_is_none():
    x = jnp.ones((4, 8))
    layer, params = _build(layers.Dropout.default_config().set(rate=0.5))
    np.testing.assert_array_equal(_call(layer, params, x, is_training=False), x)
    layer, params = _build(layers.Dropout.default_config())
    out = _call(layer, params, x, is_training=True, prng_key=jax.random.PRNGKey(1))
    np.testing.assert_array_equal(out, x)


def test_dropout_zeroes_about_rate_and_rescales_the_rest():
    layer, params = _build(layers.Dropout.default_config().set(rate=0.25))
    x = jnp.ones((200, 100))
    out = np.asarray(_call(layer, params, x, is_training=True, prng_key=jax.random.PRNGKey(1)))
    np.testing.assert_allclose(np.unique(out), [0.0, 1 / 0.75], rtol=1e-6)
    np.testing.assert_allclose((out == 0).mean(), 0.25, atol=0.01)


def test_dropout_rejects_rate_of_one():
    with pytest.raises(ConfigError, match="rate"):
        _build(layers.Dropout.default_config().set(rate=1.0))


def test_stochastic_depth_row_mode_drops_whole_examples():
    layer, params = _build(layers.StochasticDepth.default_config().set(rate=0.5, mode="row"))
    x = jnp.ones((64, 3, 4))
    out = np.asarray(_call(layer, params, x, is_training=True, prng_key=jax.random.PRNGKey(3)))
    per_row = out.reshape(64, -1)
    for row in per_row:
        assert np.all(row == 0) or np.all(row == 2.0)
    assert 0 < (per_row[:, 0] == 0).sum() < 64


def test_stochastic_depth_batch_mode_drops_all_or_nothing():
    layer, params = _build(layers.StochasticDepth.default_config().set(rate=0.5, mode="batch"))
    x = jnp.ones((8, 3))
    for seed in range(5):
        out = _call(layer, params, x, is_training=True, prng_key=jax.random.PRNGKey(seed))
        out = np.asarray(out)
        assert np.all(out == 0) or np.all(out == 2.0)


def test_stochastic_depth_rejects_unknown_mode():
    with pytest.raises(ConfigError, match="mode"):
        _build(layers.StochasticDepth.default_config().set(rate=0.1, mode="column"))


def _np_erf(x):
    return np.vectorize(math.erf)(x)


_NUMPY_ACTIVATIONS = {
    "linear": lambda x: x,
    "nn.relu": lambda x: np.maximum(x, 0),
    "nn.silu": lambda x: x / (1 + np.exp(-x)),
    "nn.gelu": lambda x: 0.5 * x * (1 + np.tanh(np.sqrt(2 / np.pi) * (x + 0.044715 * x**3))),
    "exact_gelu": lambda x: 0.5 * x * (1 + _np_erf(x / np.sqrt(2))),
    "quick_gelu": lambda x: x / (1 + np.exp(-1.702 * x)),
    "squared_relu": lambda x: np.maximum(x, 0) ** 2,
    "nn.tanh": np.tanh,
}


@pytest.mark.parametrize("name", sorted(_NUMPY_ACTIVATIONS))
def test_activation_matches_numpy(name):
    x = RNG.normal(size=(50,)).astype(np.float32) * 3
    np.testing.assert_allclose(
        layers.get_activation_fn(name)(jnp.asarray(x)),
        _NUMPY_ACTIVATIONS[name](x.astype(np.float64)),
        rtol=1e-5,
        atol=1e-5,
    )


def test_unknown_activation_lists_the_known_names():
    with pytest.raises(ConfigError, match="nn.silu"):
        layers.get_activation_fn("nn.swish")


def test_scaled_hidden_dim_rounds_up_to_multiple():
    assert layers.scaled_hidden_dim(8 / 3, round_up_to_multiples_of=128)(3072) == 8192
    assert layers.scaled_hidden_dim(4)(10) == 40


@pytest.mark.parametrize("names", [("nn.silu", "linear"), ("nn.gelu", "nn.gelu"), ("squared_relu", "nn.sigmoid")])
def test_gated_product_gradients_match_autodiff(names):
    # gated_product has a hand-written VJP; autodiff of the plain product is the reference.
    act0, act1 = (layers.get_activation_fn(n) for n in names)
    rng = np.random.default_rng(0)
    a, b, w = (jnp.asarray(rng.normal(size=(3, 7)), jnp.float32) for _ in range(3))
    ours = jax.grad(lambda a_, b_: jnp.sum(layers.gated_product(act0, act1, a_, b_) * w), (0, 1))
    plain = jax.grad(lambda a_, b_: jnp.sum(act0(a_) * act1(b_) * w), (0, 1))
    for got, want in zip(ours(a, b), plain(a, b)):
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(layers.gated_product(act0, act1, a, b), act0(a) * act1(b), rtol=1e-6)


# ----- activation partition specs -----
# The activation partition specs of `layers.Embedding` and the norms (AXLearn's fields):
# each set spec becomes a sharding constraint on its tensor, and None adds none.
#
# The constraints are read from the traced program on a one-device mesh with named axes,
# where they are recorded as given (a constraint never changes values).


DIM, VOCAB = 8, 16


def _constraints(layer, params, inputs, method: str = "forward"):
    """(shape, spec) of each sharding constraint in the program of layer.method(inputs)
    (a tuple of arrays, or a dict of keyword arguments whose arrays are traced), in order."""
    if isinstance(inputs, dict):
        arrays = {k: v for k, v in inputs.items() if isinstance(v, jax.Array)}
        static = {k: v for k, v in inputs.items() if k not in arrays}
    else:
        arrays, static = inputs, None

    def run(params, arrays):
        args = arrays if static is None else dict(arrays, **static)
        return F(
            layer, state=params, inputs=args, prng_key=None, is_training=False, method=method
        )[0]

    mesh = create_mesh((1, 1), ("data", "model"), devices=jax.devices()[:1])
    with jax.set_mesh(mesh):
        jaxpr = jax.make_jaxpr(run)(params, arrays)
    found = []
    for eqn in jaxpr.jaxpr.eqns:
        if eqn.primitive.name == "sharding_constraint":
            found.append((tuple(eqn.invars[0].aval.shape), eqn.params["sharding"].spec))
    return found


def test_embedding_constrains_ids_table_and_output():
    layer, params = _build(
        layers.Embedding.default_config().set(
            num_embeddings=VOCAB,
            dim=DIM,
            input_partition_spec=("data", None),
            embedding_partition_spec=("model", None),
            output_partition_spec=("data", None, "model"),
        )
    )
    ids = jnp.arange(6, dtype=jnp.int32).reshape(2, 3)
    assert _constraints(layer, params, (ids,)) == [
        ((2, 3), PartitionSpec("data", None)),
        ((VOCAB, DIM), PartitionSpec("model", None)),
        ((2, 3, DIM), PartitionSpec("data", None, "model")),
    ]
    out, _ = F(layer, state=params, inputs=(ids,), prng_key=None, is_training=False)
    np.testing.assert_array_equal(out, np.asarray(params["weight"])[np.asarray(ids)])


@pytest.mark.parametrize("norm", [layers.RMSNorm, layers.LayerNorm])
def test_norm_constrains_input_and_output(norm):
    layer, params = _build(
        norm.default_config().set(
            input_dim=DIM,
            input_partition_spec=("data", "model", None),
            output_partition_spec=("data", None, None),
        )
    )
    x = jnp.ones((2, 3, DIM))
    assert _constraints(layer, params, (x,)) == [
        ((2, 3, DIM), PartitionSpec("data", "model", None)),
        ((2, 3, DIM), PartitionSpec("data", None, None)),
    ]


def test_rms_norm_residual_and_norm_constrains_the_input_and_each_normalized_output():
    layer, params = _build(
        layers.RMSNorm.default_config().set(
            input_dim=DIM,
            input_partition_spec=("data", "model", None),
            output_partition_spec=("data", None, None),
        )
    )
    x = jnp.ones((2, 3, DIM))
    found = _constraints(layer, params, dict(x=x, consumers=2), method="residual_and_norm")
    assert [spec for _, spec in found] == [
        PartitionSpec("data", "model", None),
        PartitionSpec("data", None, None),
        PartitionSpec("data", None, None),
    ]


def test_unset_specs_add_no_constraint():
    emb, emb_params = _build(layers.Embedding.default_config().set(num_embeddings=VOCAB, dim=DIM))
    norm, norm_params = _build(layers.RMSNorm.default_config().set(input_dim=DIM))
    assert _constraints(emb, emb_params, (jnp.zeros((2, 3), jnp.int32),)) == []
    assert _constraints(norm, norm_params, (jnp.ones((2, 3, DIM)),)) == []
