"""Decoder: logits, heads, masking, KV-cache decoding and sampling."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from axlearn.common.base_layer import is_parameter_spec
from axlearn.common.config import ConfigError
from axlearn.common.decoder import Decoder, LmHead, filter_logits, sampling_choice
from axlearn.common.hf_llama import llama_model_config
from axlearn.common.layers import Linear
from axlearn.common.module import functional as F
from axlearn.common.param_init import default_initializer_config

VOCAB, DIM = 37, 16


def _decoder_config(*, tied=True, repeated=True, **decoder_kwargs) -> Decoder.Config:
    cfg = llama_model_config(
        vocab_size=VOCAB, dim=DIM, num_layers=2, num_heads=4, num_kv_heads=2, hidden_dim=24,
        tie_word_embeddings=tied, repeated=repeated, eos_token_id=1, pad_token_id=0,
    ).decoder
    return cfg.set(
        name="decoder", dtype=jnp.float32, param_init=default_initializer_config(), **decoder_kwargs
    )


def _random_params(layer, seed: int = 0):
    """NumPy draws for every parameter (fast: no per-parameter compilation).

    Weights ~ N(0, 1/fan_in); norm scales near one so that they matter; unit-scale
    embeddings spread the logits out, so argmax ties are unlikely.
    """
    rng = np.random.RandomState(seed)
    specs = layer.create_parameter_specs_recursively()

    def draw(path, spec):
        shape = tuple(spec.shape)
        if getattr(path[-1], "key", None) == "scale":
            return jnp.asarray(1.0 + 0.1 * rng.randn(*shape), jnp.float32)
        fan_in = spec.fan_axes.fans(shape)["fan_in"]
        return jnp.asarray(rng.randn(*shape) / np.sqrt(fan_in), jnp.float32)

    return jax.tree_util.tree_map_with_path(draw, specs, is_leaf=is_parameter_spec)


def _build(cfg: Decoder.Config, seed: int = 0):
    decoder = cfg.instantiate(parent=None)
    return decoder, _random_params(decoder, seed)


def _call(decoder, params, method="forward", **inputs):
    """Runs `decoder.<method>(**inputs)` jitted; non-array inputs are static."""
    arrays = {k: v for k, v in inputs.items() if isinstance(v, (jax.Array, np.ndarray))}
    static = {k: v for k, v in inputs.items() if k not in arrays}

    def run(params, arrays):
        out, _ = F(decoder, state=params, inputs={**arrays, **static}, prng_key=None,
                   is_training=False, method=method)
        return out

    return jax.jit(run)(params, arrays)


def _ids(batch, seq, seed=1, low=2):
    return jax.random.randint(jax.random.PRNGKey(seed), (batch, seq), low, VOCAB)


def test_tied_logits_are_hidden_states_times_token_table():
    decoder, params = _build(_decoder_config(tied=True))
    out = _call(decoder, params, input_ids=_ids(2, 6))
    table = np.asarray(params["emb"]["token_emb"]["weight"])
    expected = np.asarray(out["hidden_states"]) @ table.T
    np.testing.assert_allclose(out["logits"], expected, rtol=1e-5, atol=1e-5)
    assert "lm_head" not in params


def test_untied_logits_use_the_lm_head_weight():
    decoder, params = _build(_decoder_config(tied=False))
    out = _call(decoder, params, input_ids=_ids(2, 6))
    head = np.asarray(params["lm_head"]["weight"])
    assert head.shape == (DIM, VOCAB)
    np.testing.assert_allclose(
        out["logits"], np.asarray(out["hidden_states"]) @ head, rtol=1e-5, atol=1e-5
    )


def test_logits_soft_cap_bounds_logits_by_tanh():
    cfg = _decoder_config()
    decoder, params = _build(cfg)
    capped_decoder, _ = _build(cfg.clone(logits_soft_cap=2.0))
    ids = _ids(2, 6)
    raw = np.asarray(_call(decoder, params, input_ids=ids)["logits"])
    capped = _call(capped_decoder, params, input_ids=ids)["logits"]
    np.testing.assert_allclose(capped, 2.0 * np.tanh(raw / 2.0), rtol=1e-5, atol=1e-6)


def test_hidden_states_are_the_output_norm_of_the_transformer_output():
    decoder, params = _build(_decoder_config())
    out = _call(decoder, params, input_ids=_ids(2, 6))
    # Divided by the output norm's scale, every hidden vector has unit RMS.
    normalized = np.asarray(out["hidden_states"]) / np.asarray(params["output_norm"]["scale"])
    rms = np.sqrt(np.mean(np.square(normalized), axis=-1))
    np.testing.assert_allclose(rms, np.ones_like(rms), rtol=1e-3)


def test_causal_attention_mask_keeps_earlier_logits_independent_of_later_tokens():
    cfg = _decoder_config()
    cfg.transformer.layer.self_attention.attention.causal = False  # The decoder turns it on.
    decoder, params = _build(cfg)
    ids = _ids(1, 8)
    changed = ids.at[:, 5:].set((ids[:, 5:] + 3) % VOCAB)
    a = _call(decoder, params, input_ids=ids)["logits"]
    b = _call(decoder, params, input_ids=changed)["logits"]
    np.testing.assert_allclose(a[:, :5], b[:, :5], rtol=1e-5, atol=1e-6)
    assert not np.allclose(a[:, 5:], b[:, 5:])


def test_unknown_attention_mask_is_rejected_with_its_path():
    with pytest.raises(ConfigError, match="attention_mask"):
        _decoder_config(attention_mask="bidirectional").instantiate(parent=None)


def test_dropout_rate_fills_unset_dropout_rates_only():
    cfg = _decoder_config(dropout_rate=0.25)
    cfg.output_dropout.rate = 0.5
    decoder = cfg.instantiate(parent=None)
    assert decoder.emb.dropout.config.rate == 0.25
    assert decoder.output_dropout.config.rate == 0.5


def test_packed_documents_match_separate_documents():
    decoder, params = _build(_decoder_config())
    doc_a, doc_b = _ids(1, 5, seed=3), _ids(1, 4, seed=4)
    packed = jnp.concatenate([doc_a, doc_b], axis=1)
    segment_ids = jnp.array([[1] * 5 + [2] * 4])
    positions = jnp.array([list(range(5)) + list(range(4))])
    out = _call(decoder, params, input_ids=packed, segment_ids=segment_ids, positions=positions)
    alone_b = _call(decoder, params, input_ids=doc_b)["logits"]
    np.testing.assert_allclose(out["logits"][:, 5:], alone_b, rtol=1e-4, atol=1e-5)


@pytest.mark.slow
@pytest.mark.parametrize("repeated", [True, False])
def test_extend_step_prefill_then_single_steps_equal_forward(repeated):
    decoder, params = _build(_decoder_config(repeated=repeated))
    ids = _ids(2, 7)
    full = _call(decoder, params, input_ids=ids)["logits"]
    cache = _call(decoder, params, method="init_states", batch_size=2, max_len=7)
    cache, out = _call(decoder, params, method="extend_step", cached_states=cache,
                       input_ids=ids[:, :4], time_step=jnp.zeros([2], jnp.int32))
    steps = [out["logits"]]
    for t in range(4, 7):
        cache, out = _call(decoder, params, method="extend_step", cached_states=cache,
                           input_ids=ids[:, t : t + 1], time_step=jnp.full([2], t, jnp.int32))
        steps.append(out["logits"])
    np.testing.assert_allclose(jnp.concatenate(steps, axis=1), full, rtol=1e-4, atol=1e-5)


def _greedy_by_recomputation(decoder, params, prompt, max_len, eos_token_id):
    """Argmax of forward() on the growing sequence: the reference for cached decoding.

    The sequence is right-padded to max_len so that one compiled forward serves every
    step; causal attention makes the logits at position t independent of the padding.
    """
    forward = jax.jit(lambda p, ids: _call(decoder, p, input_ids=ids)["logits"])
    seq = list(np.asarray(prompt))
    while len(seq) < max_len:
        padded = jnp.array([seq + [0] * (max_len - len(seq))])
        token = int(np.argmax(forward(params, padded)[0, len(seq) - 1]))
        seq.append(token)
        if token == eos_token_id:
            break
    return seq


@pytest.mark.slow
def test_greedy_decode_equals_recomputation_for_prompts_of_different_lengths():
    cfg = _decoder_config(eos_token_id=VOCAB + 1)  # Never produced: run to max_len.
    decoder, params = _build(cfg)
    prompts = np.asarray(_ids(3, 4, seed=5))
    lengths = np.array([4, 2, 1])
    padded = np.where(np.arange(4)[None] < lengths[:, None], prompts, 0)
    max_len = 9
    out = _call(decoder, params, method="greedy_decode", prompt_ids=jnp.asarray(padded),
                max_len=max_len)
    for row in range(3):
        expected = _greedy_by_recomputation(
            decoder, params, prompts[row, : lengths[row]], max_len, cfg.eos_token_id
        )
        assert list(np.asarray(out["sequences"][row])) == expected
    assert list(np.asarray(out["lengths"])) == [max_len] * 3


@pytest.mark.slow
def test_greedy_decode_stops_at_eos_and_pads_after_it():
    cfg = _decoder_config(eos_token_id=VOCAB + 1)
    decoder, params = _build(cfg)
    prompt = _ids(1, 3, seed=6)
    free = _call(decoder, params, method="greedy_decode", prompt_ids=prompt, max_len=10)
    free_seq = list(np.asarray(free["sequences"][0]))
    eos = free_seq[5]  # Declare the third generated token to be EOS.
    first = free_seq.index(eos, 3)
    stop_decoder, _ = _build(cfg.clone(eos_token_id=eos))
    out = _call(stop_decoder, params, method="greedy_decode", prompt_ids=prompt, max_len=10)
    expected = free_seq[: first + 1] + [cfg.pad_token_id] * (10 - first - 1)
    assert list(np.asarray(out["sequences"][0])) == expected
    assert int(out["lengths"][0]) == first + 1


@pytest.mark.slow
def test_sampling_with_top_k_1_equals_greedy():
    decoder, params = _build(_decoder_config(eos_token_id=VOCAB + 1))
    prompt = _ids(2, 3, seed=7)
    greedy = _call(decoder, params, method="greedy_decode", prompt_ids=prompt, max_len=8)
    sampled = _call(decoder, params, method="sample_decode", prompt_ids=prompt, max_len=8,
                    prng_key=jax.random.PRNGKey(0), num_decodes=3, top_k=1, temperature=0.7)
    assert sampled["sequences"].shape == (2, 3, 8)
    for d in range(3):
        np.testing.assert_array_equal(sampled["sequences"][:, d], greedy["sequences"])


@pytest.mark.slow
def test_sample_decodes_differ_across_decodes_at_high_temperature():
    decoder, params = _build(_decoder_config(eos_token_id=VOCAB + 1))
    prompt = _ids(1, 2, seed=8)
    out = _call(decoder, params, method="sample_decode", prompt_ids=prompt, max_len=12,
                prng_key=jax.random.PRNGKey(1), num_decodes=4, temperature=5.0)
    seqs = np.asarray(out["sequences"][0])
    np.testing.assert_array_equal(seqs[:, :2], np.repeat(np.asarray(prompt), 4, axis=0))
    assert len({tuple(s) for s in seqs}) > 1


def _np_softmax(x):
    e = np.exp(x - x.max(-1, keepdims=True))
    return e / e.sum(-1, keepdims=True)


def test_filter_logits_temperature_top_k_and_top_p_against_numpy():
    logits = np.array([[2.0, 1.0, 0.5, -1.0, 3.0, 0.0]], np.float32)
    scaled = np.asarray(filter_logits(jnp.asarray(logits), temperature=2.0))
    np.testing.assert_allclose(scaled, logits / 2.0, rtol=1e-6)
    top2 = np.asarray(filter_logits(jnp.asarray(logits), top_k=2))
    assert set(np.flatnonzero(np.isfinite(top2[0]))) == {0, 4}
    # Probabilities sorted: 3.0 (~0.56), 2.0 (~0.21), 1.0, ... top_p=0.7 needs the top two.
    probs = _np_softmax(logits)[0]
    order = np.argsort(-probs)
    expected_kept = set(order[: np.searchsorted(np.cumsum(probs[order]), 0.7) + 1])
    top_p = np.asarray(filter_logits(jnp.asarray(logits), top_p=0.7))
    assert set(np.flatnonzero(np.isfinite(top_p[0]))) == expected_kept == {0, 4}
    tiny_p = np.asarray(filter_logits(jnp.asarray(logits), top_p=1e-6))
    assert set(np.flatnonzero(np.isfinite(tiny_p[0]))) == {4}


def test_sampling_frequencies_follow_the_filtered_distribution():
    logits = jnp.array([1.0, 0.2, 2.0, -0.5, 1.5])
    choose = sampling_choice(temperature=1.5, top_k=3)
    n = 20000
    batch = jnp.broadcast_to(logits, (n, 5))
    draws = np.asarray(choose(batch, jax.random.PRNGKey(0)))
    freq = np.bincount(draws, minlength=5) / n
    kept = np.array([1, 0, 1, 0, 1], bool)
    expected = np.where(kept, np.exp(np.asarray(logits) / 1.5), 0.0)
    expected /= expected.sum()
    np.testing.assert_allclose(freq, expected, atol=0.015)


def test_invalid_sampling_knobs_are_rejected():
    with pytest.raises(ValueError, match="temperature"):
        filter_logits(jnp.zeros([1, 3]), temperature=0.0)
    with pytest.raises(ValueError, match="top_p"):
        filter_logits(jnp.zeros([1, 3]), top_p=1.5)


def test_lm_head_config_gets_dim_and_vocab():
    cfg = _decoder_config(lm_head=Linear.default_config().set(bias=False))
    decoder = cfg.instantiate(parent=None)
    specs = decoder.create_parameter_specs_recursively()
    assert list(specs["lm_head"]["weight"].shape) == [DIM, VOCAB]


# ----- the untied LM head -----
# decoder.LmHead, AXLearn's untied output layer: its logits against NumPy, in and out of
# a decoder.


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
