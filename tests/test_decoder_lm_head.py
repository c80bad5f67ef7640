"""decoder.LmHead, AXLearn's untied output layer: its logits against NumPy, in and out of
a decoder."""

import jax
import jax.numpy as jnp
import numpy as np

from axlearn.common.base_layer import is_parameter_spec
from axlearn.common.decoder import LmHead
from axlearn.common.hf_llama import llama_model_config
from axlearn.common.module import functional as F
from axlearn.common.param_init import default_initializer_config

VOCAB, DIM = 29, 8
RNG = np.random.default_rng(0)


def _run(layer, params, method="forward", **inputs):
    out, _ = F(layer, state=params, inputs=inputs, prng_key=None, is_training=False, method=method)
    return out


def test_lm_head_logits_are_inputs_times_the_transposed_weight():
    head = LmHead.default_config().set(
        name="head", vocab_size=VOCAB, embedding_dim=DIM, dtype=jnp.float32
    ).instantiate(parent=None)
    weight = RNG.normal(size=(VOCAB, DIM)).astype(np.float32)
    x = RNG.normal(size=(2, 3, DIM)).astype(np.float32)
    logits = _run(head, {"weight": jnp.asarray(weight)}, x=jnp.asarray(x))
    np.testing.assert_allclose(logits, x @ weight.T, rtol=1e-5, atol=1e-5)
    spec = head.create_parameter_specs_recursively()["weight"]
    assert list(spec.shape) == [VOCAB, DIM] and tuple(spec.mesh_axes) == (None, "model")


def test_decoder_with_an_lm_head_takes_logits_from_its_own_weight():
    cfg = llama_model_config(
        vocab_size=VOCAB, dim=DIM, num_layers=1, num_heads=2, num_kv_heads=2, hidden_dim=16,
        tie_word_embeddings=True, repeated=False, eos_token_id=1, pad_token_id=0,
    ).decoder.set(
        name="decoder", dtype=jnp.float32, param_init=default_initializer_config(),
        lm_head=LmHead.default_config(),
    )
    decoder = cfg.instantiate(parent=None)
    specs = decoder.create_parameter_specs_recursively()
    params = jax.tree.map(
        lambda spec: jnp.asarray(RNG.normal(size=spec.shape) / 4, jnp.float32),
        specs,
        is_leaf=is_parameter_spec,
    )
    assert params["lm_head"]["weight"].shape == (VOCAB, DIM)
    ids = jnp.asarray(RNG.integers(2, VOCAB, size=(2, 5)), jnp.int32)
    out = jax.jit(lambda p, i: _run(decoder, p, input_ids=i))(params, ids)
    want = np.asarray(out["hidden_states"]) @ np.asarray(params["lm_head"]["weight"]).T
    np.testing.assert_allclose(out["logits"], want, rtol=1e-5, atol=1e-5)
    assert not np.allclose(want, np.asarray(out["hidden_states"]) @ np.asarray(
        params["emb"]["token_emb"]["weight"]).T)
