"""The activation partition specs of `layers.Embedding` and the norms (AXLearn's fields):
each set spec becomes a sharding constraint on its tensor, and None adds none.

The constraints are read from the traced program on a one-device mesh with named axes,
where they are recorded as given (a constraint never changes values).
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import PartitionSpec

from axlearn.common import layers
from axlearn.common.module import functional as F
from axlearn.common.param_init import default_initializer_config
from axlearn.common.sharding import create_mesh

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


def _build(cfg):
    layer = cfg.set(name="layer", param_init=default_initializer_config()).instantiate(parent=None)
    return layer, layer.initialize_parameters_recursively(jax.random.PRNGKey(0))


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
