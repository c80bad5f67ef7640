"""TransformerTextEmbeddings: lookup, positions, norm, dropout and the tied `attend`."""

import jax
import jax.numpy as jnp
import numpy as np

from axlearn.common.embedding import TransformerTextEmbeddings
from axlearn.common.layers import Embedding, RMSNorm
from axlearn.common.module import functional as F
from axlearn.common.param_init import default_initializer_config

VOCAB, DIM = 11, 6


def _build(**kwargs):
    cfg = TransformerTextEmbeddings.default_config().set(
        name="emb", dim=DIM, vocab_size=VOCAB, param_init=default_initializer_config(), **kwargs
    )
    layer = cfg.instantiate(parent=None)
    params = layer.initialize_parameters_recursively(jax.random.PRNGKey(1))
    return layer, params


def _ids(batch=2, seq=5):
    return jax.random.randint(jax.random.PRNGKey(2), (batch, seq), 0, VOCAB)


def test_forward_looks_up_token_rows():
    layer, params = _build()
    ids = _ids()
    out, _ = F(layer, state=params, inputs=(ids,), prng_key=None, is_training=False)
    table = np.asarray(params["token_emb"]["weight"])
    np.testing.assert_allclose(out, table[np.asarray(ids)], rtol=1e-6)


def test_position_embeddings_are_added_per_position():
    layer, params = _build(pos_emb=Embedding.default_config().set(num_embeddings=16))
    ids = _ids()
    positions = jnp.array([[3, 4, 5, 0, 1], [0, 1, 2, 3, 4]])
    out, _ = F(
        layer, state=params, inputs=dict(input_ids=ids, positions=positions),
        prng_key=None, is_training=False,
    )
    table = np.asarray(params["token_emb"]["weight"])
    pos_table = np.asarray(params["pos_emb"]["weight"])
    expected = table[np.asarray(ids)] + pos_table[np.asarray(positions)]
    np.testing.assert_allclose(out, expected, rtol=1e-6)


def test_default_positions_count_from_zero():
    layer, params = _build(pos_emb=Embedding.default_config().set(num_embeddings=16))
    ids = _ids()
    out, _ = F(layer, state=params, inputs=(ids,), prng_key=None, is_training=False)
    table = np.asarray(params["token_emb"]["weight"])
    pos_table = np.asarray(params["pos_emb"]["weight"])
    np.testing.assert_allclose(out, table[np.asarray(ids)] + pos_table[None, :5], rtol=1e-6)


def test_norm_is_applied_after_the_sum():
    layer, params = _build(norm=RMSNorm.default_config().set(eps=1e-6))
    ids = _ids()
    out, _ = F(layer, state=params, inputs=(ids,), prng_key=None, is_training=False)
    x = np.asarray(params["token_emb"]["weight"])[np.asarray(ids)]
    expected = x / np.sqrt(np.mean(x * x, axis=-1, keepdims=True) + 1e-6)
    np.testing.assert_allclose(out, expected, rtol=1e-5)


def test_dropout_only_while_training():
    layer, params = _build()
    layer_cfg = layer.config
    layer_cfg.dropout.rate = 0.5
    layer = layer_cfg.instantiate(parent=None)
    ids = _ids(batch=4, seq=8)
    key = jax.random.PRNGKey(3)
    eval_out, _ = F(layer, state=params, inputs=(ids,), prng_key=key, is_training=False)
    train_out, _ = F(layer, state=params, inputs=(ids,), prng_key=key, is_training=True)
    table = np.asarray(params["token_emb"]["weight"])[np.asarray(ids)]
    np.testing.assert_allclose(eval_out, table, rtol=1e-6)
    train_out = np.asarray(train_out)
    dropped = train_out == 0
    assert 0 < dropped.mean() < 1
    np.testing.assert_allclose(train_out[~dropped], 2 * table[~dropped], rtol=1e-6)


def test_attend_multiplies_by_the_transposed_table():
    layer, params = _build()
    x = jax.random.normal(jax.random.PRNGKey(4), (2, 3, DIM))
    logits, _ = F(layer, state=params, inputs=(x,), prng_key=None, is_training=False,
                  method="attend")
    expected = np.asarray(x) @ np.asarray(params["token_emb"]["weight"]).T
    np.testing.assert_allclose(logits, expected, rtol=1e-5, atol=1e-6)


def test_parameter_paths_and_shapes():
    layer, _ = _build(pos_emb=Embedding.default_config().set(num_embeddings=16))
    specs = layer.create_parameter_specs_recursively()
    assert list(specs["token_emb"]["weight"].shape) == [VOCAB, DIM]
    assert list(specs["pos_emb"]["weight"].shape) == [16, DIM]
