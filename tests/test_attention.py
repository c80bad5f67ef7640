"""Tests of axlearn.common.attention: numerics against NumPy, decoding, stacks, remat, sharding."""

import re
import textwrap
import types

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from axlearn.common import attention as attn
from axlearn.common.base_layer import is_parameter_spec
from axlearn.common.config import ConfigError, config_for_function
from axlearn.common.golden_text import init_lines, parse_flat_text
from axlearn.common.layers import RMSNorm, scaled_hidden_dim
from axlearn.common.module import F
from axlearn.common.param_init import FanAxes, default_initializer_config
from axlearn.common.utils import flatten_with_paths
from tests import reference_spec
from tests.fresh_python import REPO, assert_prints_ok

RNG = np.random.default_rng(0)

# ----- configs and helpers -----


def _rms_norm():
    return RMSNorm.default_config().set(eps=1e-5, forward_dtype=None)


def _gqa_attention(*, num_heads=4, num_kv_heads=2, theta=500000.0, qk_norm=True, cap=None):
    """The spec's attention: fused GQA projection, RoPE, QK-norm, no biases."""
    cfg = attn.GroupedQueryAttention.default_config().set(
        num_heads=num_heads, causal=True, atten_logit_cap=cap
    )
    cfg.input_linear = attn.RoFormerQKVLinear.default_config().set(
        input_linear=attn.FusedGroupedQKVLinear.default_config().set(
            num_kv_heads=num_kv_heads,
            layer=attn.MultiheadInputLinear.default_config().set(bias=False),
        ),
        rotary_value=False,
    )
    cfg.input_linear.rope_pos_emb_layer.theta = theta
    cfg.output_linear.bias = False
    if qk_norm:
        cfg.query_scale.norm = _rms_norm()
        cfg.key_scale.norm = _rms_norm()
    return cfg


def _layer_config(*, structure="prenorm", **attention_kwargs):
    """A Llama-like transformer layer: RMSNorm, GQA + RoPE + QK-norm, SwiGLU."""
    cfg = attn.TransformerLayer.default_config()
    cfg.self_attention.set(
        attention=_gqa_attention(**attention_kwargs), norm=_rms_norm(), structure=structure
    )
    cfg.feed_forward.set(
        hidden_dim=24, activation=("nn.silu", "linear"), norm=_rms_norm(), structure=structure
    )
    cfg.feed_forward.linear1.bias = False
    cfg.feed_forward.linear2.bias = False
    return cfg


def _build(cfg, seed=0):
    layer = cfg.set(name="layer", param_init=default_initializer_config()).instantiate(parent=None)
    params = layer.initialize_parameters_recursively(jax.random.PRNGKey(seed))
    return layer, params


def _randomize(params, scale=0.5):
    """Random values everywhere (norm scales too), so every parameter matters."""
    return jax.tree_util.tree_map(
        lambda p: jnp.asarray(RNG.normal(size=p.shape) * scale + (p == 1) * 1.0, p.dtype), params
    )


def _call(layer, params, method="forward", is_training=False, prng_key=None, **inputs):
    """Calls `layer.<method>(**inputs)` under jit (much faster than op-by-op on CPU)."""
    arrays = {k: v for k, v in inputs.items() if isinstance(v, (jax.Array, np.ndarray, dict))}
    static = tuple(sorted((k, v) for k, v in inputs.items() if k not in arrays))
    cache_key = (id(layer), method, is_training, static)
    if cache_key not in _JITTED:

        def fn(params, prng_key, arrays):
            out, _ = F(
                layer,
                state=params,
                inputs=dict(arrays, **dict(static)),
                prng_key=prng_key,
                is_training=is_training,
                method=method,
            )
            return out

        _JITTED[cache_key] = (layer, jax.jit(fn))  # Holding the layer keeps its id unique.
    return _JITTED[cache_key][1](params, prng_key, arrays)


_JITTED = {}


def _assert_trees_close(actual, desired, rtol=1e-4):
    """Elementwise closeness, with an absolute tolerance relative to each tensor's scale."""

    def check(a, b):
        scale = float(np.max(np.abs(b))) or 1.0
        np.testing.assert_allclose(a, b, rtol=rtol, atol=rtol * scale)

    jax.tree_util.tree_map(check, actual, desired)


# ----- NumPy reference -----


def np_rms_norm(x, scale, eps=1e-5):
    return x / np.sqrt(np.mean(x * x, axis=-1, keepdims=True) + eps) * scale


def np_rope(x, positions, theta):
    """Rotary embedding as complex rotation of the pairs (x[i], x[i + H/2])."""
    half = x.shape[-1] // 2
    freqs = theta ** (-np.arange(half) * 2.0 / x.shape[-1])
    angles = positions[..., None, None] * freqs  # [B, T, 1, half]
    z = (x[..., :half] + 1j * x[..., half:]) * np.exp(1j * angles)
    return np.concatenate([z.real, z.imag], axis=-1)


def np_softmax_attention(q, k, v, mask, cap=None):
    """q [B,T,N,H], k/v [B,S,K,H], mask [B,T,S] bool -> [B,T,N,H]."""
    groups = q.shape[2] // k.shape[2]
    k, v = np.repeat(k, groups, axis=2), np.repeat(v, groups, axis=2)
    logits = np.einsum("btnh,bsnh->bnts", q, k)
    if cap is not None:
        logits = cap * np.tanh(logits / cap)
    logits = np.where(mask[:, None], logits, -np.inf)
    probs = np.exp(logits - logits.max(-1, keepdims=True))
    probs /= probs.sum(-1, keepdims=True)
    return np.einsum("bnts,bsnh->btnh", probs, v)


def np_causal_mask(batch, length, segment_ids=None):
    mask = np.tril(np.ones((length, length), bool))[None].repeat(batch, 0)
    if segment_ids is not None:
        mask &= segment_ids[:, :, None] == segment_ids[:, None, :]
    return mask


def np_gqa_attention(x, p, *, num_heads, num_kv_heads, theta, positions, mask, qk_norm, cap=None):
    w = np.asarray(p["i_proj"]["i_proj"]["qkv_proj"]["weight"], np.float64)
    qkv = np.einsum("btd,dnh->btnh", x, w)
    n, k = num_heads, num_kv_heads
    q, key, value = qkv[:, :, :n], qkv[:, :, n : n + k], qkv[:, :, n + k :]
    q, key = np_rope(q, positions, theta), np_rope(key, positions, theta)
    if qk_norm:
        q = np_rms_norm(q, np.asarray(p["scale_query"]["norm"]["scale"]))
        key = np_rms_norm(key, np.asarray(p["scale_key"]["norm"]["scale"]))
    q = q / np.sqrt(q.shape[-1])
    context = np_softmax_attention(q, key, value, mask, cap)
    return np.einsum("btnh,dnh->btd", context, np.asarray(p["o_proj"]["weight"], np.float64))


def np_swiglu(x, p):
    w0, w1, w2 = (
        np.asarray(p[n]["weight"], np.float64) for n in ("linear1_0", "linear1_1", "linear2")
    )
    gate = x @ w0
    return (gate / (1 + np.exp(-gate)) * (x @ w1)) @ w2


def np_transformer_layer(x, p, *, positions, mask, theta=500000.0, **kw):
    a, f = p["self_attention"], p["feed_forward"]
    h = np_rms_norm(x, np.asarray(a["norm"]["scale"]))
    x = x + np_gqa_attention(
        h, a["attention"], num_heads=4, num_kv_heads=2, theta=theta, positions=positions,
        mask=mask, qk_norm=True, **kw,
    )
    return x + np_swiglu(np_rms_norm(x, np.asarray(f["norm"]["scale"])), f)


# ----- numerics -----


@pytest.mark.slow
def test_transformer_layer_matches_numpy():
    layer, params = _build(_layer_config().set(input_dim=16))
    params = _randomize(params)
    x = RNG.normal(size=(2, 6, 16))
    positions = np.broadcast_to(np.arange(6), (2, 6))
    out = _call(layer, params, data=jnp.asarray(x, jnp.float32))
    expected = np_transformer_layer(x, params, positions=positions, mask=np_causal_mask(2, 6))
    np.testing.assert_allclose(out, expected, rtol=2e-4, atol=2e-4)


@pytest.mark.slow
def test_explicit_positions_drive_rope():
    layer, params = _build(_layer_config().set(input_dim=16))
    params = _randomize(params)
    x = RNG.normal(size=(1, 5, 16))
    positions = np.array([[7, 3, 11, 0, 2]])
    out = _call(layer, params, data=jnp.asarray(x, jnp.float32), positions=jnp.asarray(positions))
    expected = np_transformer_layer(x, params, positions=positions, mask=np_causal_mask(1, 5))
    np.testing.assert_allclose(out, expected, rtol=2e-4, atol=2e-4)


@pytest.mark.slow
def test_segment_ids_mask_attention_across_documents():
    layer, params = _build(_layer_config().set(input_dim=16))
    params = _randomize(params)
    x = RNG.normal(size=(2, 7, 16))
    segment_ids = np.array([[1, 1, 1, 2, 2, 3, 3], [1, 1, 1, 1, 1, 0, 0]])
    # Positions restart in each document, as a packing input pipeline provides them.
    positions = np.array([[0, 1, 2, 0, 1, 0, 1], [0, 1, 2, 3, 4, 0, 1]])
    out = _call(
        layer,
        params,
        data=jnp.asarray(x, jnp.float32),
        segment_ids=jnp.asarray(segment_ids),
        positions=jnp.asarray(positions),
    )
    expected = np_transformer_layer(
        x, params, positions=positions, mask=np_causal_mask(2, 7, segment_ids)
    )
    np.testing.assert_allclose(out, expected, rtol=2e-4, atol=2e-4)
    # A packed document gives what it gives alone.
    alone = _call(layer, params, data=jnp.asarray(x[:1, 3:5], jnp.float32))
    np.testing.assert_allclose(out[:1, 3:5], alone, rtol=1e-5, atol=1e-5)


def test_multihead_attention_with_biases_matches_numpy():
    cfg = attn.MultiheadAttention.default_config().set(
        query_dim=12, key_dim=12, value_dim=12, output_dim=10, num_heads=3, causal=True
    )
    layer, params = _build(cfg)
    params = _randomize(params)
    x = RNG.normal(size=(2, 5, 12))
    p = jax.tree_util.tree_map(lambda a: np.asarray(a, np.float64), params)
    proj = {
        n: np.einsum("btd,dnh->btnh", x, p["i_proj"][n]["weight"]) + p["i_proj"][n]["bias"]
        for n in ("q_proj", "k_proj", "v_proj")
    }
    context = np_softmax_attention(
        proj["q_proj"] / 2.0, proj["k_proj"], proj["v_proj"], np_causal_mask(2, 5)
    )
    expected = np.einsum("btnh,dnh->btd", context, p["o_proj"]["weight"]) + p["o_proj"]["bias"]
    out = _call(layer, params, query=jnp.asarray(x, jnp.float32))
    assert out.shape == (2, 5, 10)
    np.testing.assert_allclose(out, expected, rtol=1e-4, atol=1e-4)


def test_cross_attention_reads_keys_from_source():
    cfg = attn.MultiheadAttention.default_config().set(
        query_dim=8, key_dim=6, value_dim=6, output_dim=8, num_heads=2
    )
    layer, params = _build(cfg)
    params = _randomize(params)
    query, source = RNG.normal(size=(1, 3, 8)), RNG.normal(size=(1, 4, 6))
    p = jax.tree_util.tree_map(lambda a: np.asarray(a, np.float64), params)
    q, k, v = (
        np.einsum("btd,dnh->btnh", inputs, p["i_proj"][name]["weight"]) + p["i_proj"][name]["bias"]
        for inputs, name in ((query, "q_proj"), (source, "k_proj"), (source, "v_proj"))
    )
    context = np_softmax_attention(q / 2.0, k, v, np.ones((1, 3, 4), bool))
    expected = np.einsum("btnh,dnh->btd", context, p["o_proj"]["weight"]) + p["o_proj"]["bias"]
    src = jnp.asarray(source, jnp.float32)
    out = _call(layer, params, query=jnp.asarray(query, jnp.float32), key=src, value=src)
    np.testing.assert_allclose(out, expected, rtol=1e-4, atol=1e-4)


@pytest.mark.slow
def test_rope_matches_transformers_llama_rotation():
    torch = pytest.importorskip("torch")
    llama = pytest.importorskip("transformers.models.llama.modeling_llama")
    theta, head_dim = 10000.0, 8
    emb_layer = attn.RoFormerSinusoidalPositionalEmbedding.default_config().set(
        name="rope", dim=head_dim, theta=theta
    ).instantiate(parent=None)
    positions = np.array([[0, 1, 5, 9]])
    x = RNG.normal(size=(1, 4, 3, head_dim)).astype(np.float32)
    ours = attn.apply_rotary_position_embeddings(
        jnp.asarray(x), _call(emb_layer, {}, positions=jnp.asarray(positions))
    )
    # Hugging Face's formulation: cos/sin of cat(freqs, freqs), rotate_half.
    inv_freq = 1.0 / theta ** (np.arange(0, head_dim, 2) / head_dim)
    freqs = positions[..., None] * inv_freq
    emb = np.concatenate([freqs, freqs], axis=-1)
    xt = torch.tensor(x).transpose(1, 2)  # [B, N, T, H]
    ref, _ = llama.apply_rotary_pos_emb(
        xt,
        xt,
        torch.tensor(np.cos(emb), dtype=torch.float32),
        torch.tensor(np.sin(emb), dtype=torch.float32),
    )
    np.testing.assert_allclose(ours, ref.transpose(1, 2).numpy(), rtol=1e-5, atol=1e-5)


def test_rope_gradients_match_a_numpy_derivation():
    # The rotation has a hand-written VJP; check it and the angles' cotangents against
    # the rotation written out as a matrix: y = R x per (position, pair), so dx = R^T dy.
    half = 3
    x = RNG.normal(size=(2, 4, 3, 2 * half)).astype(np.float32)
    sin_cos = RNG.normal(size=(2, 4, 2 * half)).astype(np.float32)
    dy = RNG.normal(size=x.shape).astype(np.float32)
    loss = lambda x_, sc: jnp.sum(attn.apply_rotary_position_embeddings(x_, sc) * dy)
    dx, dsc = jax.grad(loss, argnums=(0, 1))(jnp.asarray(x), jnp.asarray(sin_cos))
    s, c = sin_cos[..., None, :half], sin_cos[..., None, half:]
    x1, x2, g1, g2 = x[..., :half], x[..., half:], dy[..., :half], dy[..., half:]
    np.testing.assert_allclose(dx[..., :half], g1 * c + g2 * s, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(dx[..., half:], g2 * c - g1 * s, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(dsc[..., :half], np.sum(x1 * g2 - x2 * g1, axis=2), rtol=1e-4, atol=1e-4)
    np.testing.assert_allclose(dsc[..., half:], np.sum(x1 * g1 + x2 * g2, axis=2), rtol=1e-4, atol=1e-4)


def test_rotary_value_rotates_values_too():
    cfg = attn.RoFormerQKVLinear.default_config().set(
        query_dim=8, key_dim=8, value_dim=8, num_heads=2, per_head_dim=4, rotary_value=True
    )
    layer, params = _build(cfg)
    x = RNG.normal(size=(1, 3, 8))
    q, k, v = _call(layer, params, query=jnp.asarray(x, jnp.float32))
    raw_v = np.einsum("btd,dnh->btnh", x, params["i_proj"]["v_proj"]["weight"])
    raw_v += np.asarray(params["i_proj"]["v_proj"]["bias"])
    np.testing.assert_allclose(v, np_rope(raw_v, np.arange(3)[None], 10000.0), rtol=1e-4, atol=1e-5)


def test_attention_matches_jax_dot_product_attention():
    cfg = _gqa_attention(qk_norm=False).set(
        query_dim=16, key_dim=16, value_dim=16, output_dim=16, attention_implementation="xla"
    )
    layer, params = _build(cfg)
    params = _randomize(params)
    x = RNG.normal(size=(2, 9, 16))
    qkv = np.einsum("btd,dnh->btnh", x, params["i_proj"]["i_proj"]["qkv_proj"]["weight"])
    positions = np.arange(9)[None]
    q = np_rope(qkv[:, :, :4], positions, 500000.0)
    k = np_rope(qkv[:, :, 4:6], positions, 500000.0)
    as_f32 = lambda a: jnp.asarray(a, jnp.float32)
    context = jax.nn.dot_product_attention(
        as_f32(q), as_f32(k), as_f32(qkv[:, :, 6:]), is_causal=True, implementation="xla"
    )
    expected = np.einsum("btnh,dnh->btd", context, params["o_proj"]["weight"])
    out = _call(layer, params, query=as_f32(x))
    np.testing.assert_allclose(out, expected, rtol=1e-4, atol=1e-4)


def _cudnn_on_xla(calls):
    """Stands in for jax.nn.dot_product_attention on CPU: records the call, runs XLA."""
    real = jax.nn.dot_product_attention

    def fake(*args, implementation=None, **kwargs):
        calls.append(dict(kwargs, implementation=implementation, dtype=args[0].dtype))
        return real(*args, implementation="xla", **kwargs)

    return fake


def test_cudnn_call_masks_segments_and_matches_numpy(monkeypatch):
    calls = []
    monkeypatch.setattr(jax.nn, "dot_product_attention", _cudnn_on_xla(calls))
    cfg = _layer_config()
    cfg.self_attention.attention.attention_implementation = "cudnn"
    layer, params = _build(cfg.set(input_dim=16))
    params = _randomize(params)
    x = RNG.normal(size=(2, 6, 16))
    segment_ids = np.array([[1, 1, 2, 2, 2, 3], [1, 1, 1, 1, 0, 0]])
    positions = np.array([[0, 1, 0, 1, 2, 0], [0, 1, 2, 3, 0, 1]])
    out = _call(
        layer, params, data=jnp.asarray(x, jnp.float32), segment_ids=jnp.asarray(segment_ids),
        positions=jnp.asarray(positions),
    )
    assert [c["implementation"] for c in calls] == ["cudnn"]
    assert calls[0]["is_causal"] and calls[0]["scale"] == 1.0
    expected = np_transformer_layer(
        x, params, positions=positions, mask=np_causal_mask(2, 6, segment_ids)
    )
    np.testing.assert_allclose(out, expected, rtol=2e-4, atol=2e-4)


def test_decoding_one_token_on_cudnn_attends_to_the_cached_prefix(monkeypatch):
    calls = []
    monkeypatch.setattr(jax.nn, "dot_product_attention", _cudnn_on_xla(calls))
    monkeypatch.setattr(jax, "default_backend", lambda: "gpu")
    cfg = _layer_config()
    cfg.self_attention.attention.attention_implementation = "cudnn"
    layer, params = _build(cfg.set(input_dim=16))
    params = _randomize(params, scale=0.3)
    x = RNG.normal(size=(2, 5, 16))
    positions = np.arange(5)[None].repeat(2, 0)
    expected = np_transformer_layer(x, params, positions=positions, mask=np_causal_mask(2, 5))
    cache = _call(layer, params, method="init_states", batch_size=2, max_len=8)
    cache, _ = _call(
        layer, params, method="extend_step", cached_states=cache,
        data=jnp.asarray(x[:, :4], jnp.float32), time_step=jnp.zeros(2, jnp.int32),
    )
    assert not calls  # A prefill of several tokens: the XLA path.
    # Row 0 decodes its 5th token; row 1 its 3rd, over a slot the prefill filled (masked).
    step = jnp.asarray(np.stack([x[0, 4:5], x[1, 2:3]]), jnp.float32)
    _, out = _call(
        layer, params, method="extend_step", cached_states=cache, data=step,
        time_step=jnp.array([4, 2], jnp.int32),
    )
    assert [c["implementation"] for c in calls] == ["cudnn"]
    assert calls[0]["key_value_seq_lengths"].shape == (2,)
    np.testing.assert_allclose(out[0], expected[0, 4:5], rtol=2e-4, atol=2e-4)
    np.testing.assert_allclose(out[1], expected[1, 2:3], rtol=2e-4, atol=2e-4)


@pytest.mark.slow
def test_auto_implementation_picks_cudnn_on_gpu_for_bf16_only(monkeypatch):
    calls = []
    monkeypatch.setattr(jax.nn, "dot_product_attention", _cudnn_on_xla(calls))
    monkeypatch.setattr(jax, "default_backend", lambda: "gpu")
    # cuDNN needs per_head_dim % 8 == 0: 16 / 2 heads.
    layer, params = _build(_layer_config(num_heads=2, num_kv_heads=1).set(input_dim=16))
    x = jnp.asarray(RNG.normal(size=(2, 6, 16)))
    _call(layer, params, data=x.astype(jnp.float32))
    assert not calls  # float32: XLA.
    bf16 = jax.tree_util.tree_map(lambda p: p.astype(jnp.bfloat16), params)
    _call(layer, bf16, data=x.astype(jnp.bfloat16))
    assert [c["dtype"] for c in calls] == [jnp.bfloat16]
    # Decoding takes it one token at a time, not for a prefill of two.
    cache = _call(layer, bf16, method="init_states", batch_size=2, max_len=8)
    cache, _ = _call(
        layer, bf16, method="extend_step", cached_states=cache, data=x[:, :2].astype(jnp.bfloat16),
        time_step=jnp.zeros(2, jnp.int32),
    )
    assert len(calls) == 1
    _call(
        layer, bf16, method="extend_step", cached_states=cache,
        data=x[:, 2:3].astype(jnp.bfloat16), time_step=jnp.full(2, 2, jnp.int32),
    )
    assert len(calls) == 2


def test_atten_logit_cap_matches_numpy():
    layer, params = _build(_layer_config(cap=2.0).set(input_dim=16))
    params = _randomize(params, scale=1.5)
    x = RNG.normal(size=(1, 5, 16))
    out = _call(layer, params, data=jnp.asarray(x, jnp.float32))
    expected = np_transformer_layer(
        x, params, positions=np.arange(5)[None], mask=np_causal_mask(1, 5), cap=2.0
    )
    np.testing.assert_allclose(out, expected, rtol=2e-4, atol=2e-4)


def _ffn_config(**kwargs):
    return attn.TransformerFeedForwardLayer.default_config().set(
        input_dim=6, hidden_dim=10, **kwargs
    )


def test_feed_forward_squared_relu_with_residual_weight_matches_numpy():
    layer, params = _build(_ffn_config(activation="squared_relu", residual_weight=0.5))
    params = _randomize(params)
    p = jax.tree_util.tree_map(lambda a: np.asarray(a, np.float64), params)
    x = RNG.normal(size=(2, 3, 6))
    mean = x.mean(-1, keepdims=True)
    h = (x - mean) / np.sqrt(((x - mean) ** 2).mean(-1, keepdims=True) + 1e-8)
    h = h * p["norm"]["scale"] + p["norm"]["bias"]
    hidden = np.maximum(h @ p["linear1"]["weight"] + p["linear1"]["bias"], 0) ** 2
    expected = x + 0.5 * (hidden @ p["linear2"]["weight"] + p["linear2"]["bias"])
    out = _call(layer, params, inputs=jnp.asarray(x, jnp.float32))
    np.testing.assert_allclose(out, expected, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("structure", ["prenorm", "postnorm", "hybridnorm"])
def test_feed_forward_structures_match_numpy(structure):
    cfg = _ffn_config(activation=("nn.silu", "linear"), norm=_rms_norm(), structure=structure)
    cfg.linear1.bias = cfg.linear2.bias = False
    layer, params = _build(cfg)
    params = _randomize(params)
    p = jax.tree_util.tree_map(lambda a: np.asarray(a, np.float64), params)
    x = RNG.normal(size=(2, 3, 6))
    if structure == "prenorm":
        expected = x + np_swiglu(np_rms_norm(x, p["norm"]["scale"]), p)
    elif structure == "postnorm":
        expected = np_rms_norm(x + np_swiglu(x, p), p["norm"]["scale"])
    else:
        branch = np_swiglu(np_rms_norm(x, p["prenorm"]["scale"]), p)
        expected = x + np_rms_norm(branch, p["postnorm"]["scale"])
    out = _call(layer, params, inputs=jnp.asarray(x, jnp.float32))
    np.testing.assert_allclose(out, expected, rtol=1e-4, atol=1e-4)


def test_feed_forward_summaries_match_numpy():
    cfg = _ffn_config(
        activation=("nn.relu", "linear"),
        add_dead_neuron_summary=True,
        add_value_rms_norm_summary=["inputs", "linear2_outputs"],
    )
    layer, params = _build(cfg)
    params = _randomize(params)
    p = jax.tree_util.tree_map(lambda a: np.asarray(a, np.float64), params)
    x = RNG.normal(size=(2, 3, 6))
    _, collection = F(
        layer, state=params, inputs=dict(inputs=jnp.asarray(x, jnp.float32)), prng_key=None,
        is_training=False,
    )
    mean = x.mean(-1, keepdims=True)
    h = (x - mean) / np.sqrt(((x - mean) ** 2).mean(-1, keepdims=True) + 1e-8)
    h = h * p["norm"]["scale"] + p["norm"]["bias"]
    gate = np.maximum(h @ p["linear1_0"]["weight"] + p["linear1_0"]["bias"], 0)
    hidden = gate * (h @ p["linear1_1"]["weight"] + p["linear1_1"]["bias"])
    branch = hidden @ p["linear2"]["weight"] + p["linear2"]["bias"]
    summaries = collection.summaries
    np.testing.assert_allclose(summaries["rms_norm/inputs"], np.sqrt((x**2).mean()), rtol=1e-5)
    np.testing.assert_allclose(
        summaries["rms_norm/linear2_outputs"], np.sqrt((branch**2).mean()), rtol=1e-4
    )
    assert float(summaries["dead_neurons/linear1_0"]) == (gate.reshape(-1, 10).max(0) <= 0).sum()


def test_feed_forward_hidden_dim_from_a_rule_config():
    rule = config_for_function(scaled_hidden_dim).set(scale=8 / 3, round_up_to_multiples_of=8)
    layer, params = _build(_ffn_config().set(hidden_dim=rule))
    assert layer.hidden_dim == 16  # ceil(6 * 8/3) = 16, already a multiple of 8.
    assert params["linear1"]["weight"].shape == (6, 16)


def _times(input_dim=None, *, scale):
    # input_dim defaults to None: the layer fills it in, and configs may not leave a
    # nested function's argument REQUIRED.
    return int(input_dim * scale)


def test_feed_forward_hidden_dim_from_a_function_of_input_dim():
    layer, _ = _build(_ffn_config().set(hidden_dim=config_for_function(_times).set(scale=3)))
    assert layer.hidden_dim == 18


# ----- projection variants -----


def _np_project(x, w):
    return np.einsum("btd,dnh->btnh", x, np.asarray(w, np.float64))


@pytest.mark.parametrize(
    "klass, num_kv_heads",
    [
        (attn.QKVLinear, None),
        (attn.GroupedQKVLinear, 1),
        (attn.FusedQKVLinear, None),
        (attn.FusedGroupedQKVLinear, 1),
    ],
)
def test_qkv_projections_match_numpy(klass, num_kv_heads):
    cfg = klass.default_config().set(
        query_dim=8, key_dim=8, value_dim=8, num_heads=2, per_head_dim=3
    )
    cfg.layer.bias = False
    if num_kv_heads is not None:
        cfg.num_kv_heads = num_kv_heads
    layer, params = _build(cfg)
    kv_heads = num_kv_heads or 2
    assert layer.num_kv_heads == kv_heads
    x = RNG.normal(size=(2, 4, 8))
    q, k, v = _call(layer, params, query=jnp.asarray(x, jnp.float32))
    if klass is attn.FusedQKVLinear:  # [3, D, N, H]: query, key and value weights stacked.
        w = np.asarray(params["qkv_proj"]["weight"])
        assert w.shape == (3, 8, 2, 3)
        expected = tuple(_np_project(x, part) for part in w)
    elif "qkv_proj" in params:
        w = np.asarray(params["qkv_proj"]["weight"])
        assert w.shape == (8, 2 + 2 * kv_heads, 3)
        splits = (w[:, :2], w[:, 2 : 2 + kv_heads], w[:, 2 + kv_heads :])
        expected = tuple(_np_project(x, part) for part in splits)
    else:
        names = ("q_proj", "k_proj", "v_proj")
        expected = tuple(_np_project(x, params[n]["weight"]) for n in names)
    for actual, want in zip((q, k, v), expected):
        np.testing.assert_allclose(actual, want, rtol=1e-5, atol=1e-5)


def test_per_dim_scale_starts_at_one_and_scales_by_softplus():
    cfg = attn.ScaleQuery.default_config().set(
        per_head_dim=4, per_dim_scale=attn.PerDimScale.default_config()
    )
    layer, params = _build(cfg)
    x = RNG.normal(size=(1, 2, 3, 4))
    np.testing.assert_allclose(
        _call(layer, params, proj=jnp.asarray(x, jnp.float32)), x / 2.0, rtol=1e-5, atol=1e-6
    )
    param = RNG.normal(size=4)
    params = {"per_dim_scale": {"param": jnp.asarray(param, jnp.float32)}}
    out = _call(layer, params, proj=jnp.asarray(x, jnp.float32))
    expected = x * np.log1p(np.exp(param)) / np.log(2.0) / 2.0
    np.testing.assert_allclose(out, expected, rtol=1e-5, atol=1e-6)


# ----- parameter layout -----


def test_parameter_paths_match_the_spec_optimizer_regexes():
    cfg = attn.RepeatedTransformerLayer.default_config().set(
        input_dim=16, num_layers=2, layer=_layer_config()
    )
    layer = cfg.set(name="layer").instantiate(parent=None)
    specs = layer.create_parameter_specs_recursively()
    paths = [path for path, _ in flatten_with_paths(specs, is_leaf=is_parameter_spec)]
    for regex in (
        ".*attention/o_proj/weight",
        ".*attention/i_proj/i_proj/qkv_proj/weight",
        ".*feed_forward/linear1_0/weight",
        ".*feed_forward/linear1_1/weight",
        ".*feed_forward/linear2/weight",
        ".*attention/scale_query/norm/scale",
    ):
        assert any(re.fullmatch(regex, p) for p in paths), regex
    qkv = specs["repeat"]["layer"]["self_attention"]["attention"]["i_proj"]["i_proj"]["qkv_proj"]
    assert tuple(qkv["weight"].shape) == (2, 16, 4 + 2 * 2, 4)


def test_multihead_attention_rejects_grouped_projection():
    cfg = _gqa_attention()
    cfg = attn.MultiheadAttention.default_config().set(
        query_dim=16, key_dim=16, value_dim=16, output_dim=16, num_heads=4,
        input_linear=cfg.input_linear,
    )
    with pytest.raises(ConfigError, match="GroupedQueryAttention"):
        _build(cfg)


def test_cudnn_with_logit_cap_is_rejected_at_construction():
    cfg = _gqa_attention(cap=30.0).set(
        query_dim=16, key_dim=16, value_dim=16, output_dim=16, attention_implementation="cudnn"
    )
    with pytest.raises(ConfigError, match="atten_logit_cap"):
        _build(cfg)


def test_unknown_attention_implementation_is_rejected():
    cfg = _gqa_attention().set(
        query_dim=16, key_dim=16, value_dim=16, output_dim=16, attention_implementation="flash"
    )
    with pytest.raises(ConfigError, match="attention_implementation"):
        _build(cfg)


# ----- decoding -----


def _stack_config(kind, num_layers=3, **layer_kwargs):
    klass = dict(stacked=attn.StackedTransformerLayer, repeated=attn.RepeatedTransformerLayer)[kind]
    return klass.default_config().set(
        input_dim=16, num_layers=num_layers, layer=_layer_config(**layer_kwargs)
    )


@pytest.mark.slow
@pytest.mark.parametrize("kind", ["layer", "stacked", "repeated"])
def test_extend_step_matches_forward(kind):
    cfg = _layer_config().set(input_dim=16) if kind == "layer" else _stack_config(kind)
    layer, params = _build(cfg)
    params = _randomize(params, scale=0.3)
    x = jnp.asarray(RNG.normal(size=(2, 7, 16)), jnp.float32)
    expected = _call(layer, params, data=x)
    outputs = _prefill_then_decode(layer, params, x, prefill=3, max_len=10)
    np.testing.assert_allclose(outputs, expected, rtol=1e-5, atol=1e-5)


def _prefill_then_decode(layer, params, x, *, prefill, max_len):
    """The outputs [B,T,D] of extend_step over x [B,T,D]: its first `prefill` tokens in
    one step, then one token a step."""
    batch = x.shape[0]
    cache = _call(layer, params, method="init_states", batch_size=batch, max_len=max_len)
    cache, out = _call(
        layer, params, method="extend_step", cached_states=cache, data=x[:, :prefill],
        time_step=jnp.zeros(batch, jnp.int32),
    )
    outputs = [out]
    for t in range(prefill, x.shape[1]):
        cache, out = _call(
            layer, params, method="extend_step", cached_states=cache, data=x[:, t : t + 1],
            time_step=jnp.full(batch, t, jnp.int32),
        )
        outputs.append(out)
    return jnp.concatenate(outputs, axis=1)


@pytest.mark.parametrize("qkv_bias", [False, True])
def test_decoding_in_one_kernel_matches_forward(monkeypatch, qkv_bias):
    """Steps of one token through `decode_step_attention` (RoPE, cache write, attention),
    interpreted, give the forward pass's outputs; each prenorm RMSNorm is left unfinished
    to the step kernel and the activations, but where the QKV projection has a bias
    (its outputs then do not scale with its input): there the norm is its own kernel."""
    from axlearn.common import layers  # pylint: disable=import-outside-toplevel
    from axlearn.common.kernels import dispatch  # pylint: disable=import-outside-toplevel

    # No QK-norm (the kernel takes a query scale alone); heads of 16, a cache of 16 keys.
    cfg = _layer_config(qk_norm=False).set(input_dim=64)
    cfg.self_attention.attention.input_linear.input_linear.layer.bias = qkv_bias
    layer, params = _build(cfg)
    params = _randomize(params, scale=0.3)
    x = jnp.asarray(RNG.normal(size=(2, 6, 64)), jnp.float32)
    expected = _call(layer, params, data=x)
    steps, norms = [], []  # Whether each step finished a norm; each norm kernel's input.
    original_step, original_norm = attn.decode_step_attention, layers.rms_norm_forward

    def step(*args, **kwargs):
        steps.append(args[5] is not None)  # The sixth argument: norm_input.
        return original_step(*args, **kwargs)

    def norm(x, *args, **kwargs):
        norms.append(x.shape)
        return original_norm(x, *args, **kwargs)

    monkeypatch.setattr(attn, "decode_step_attention", step)
    monkeypatch.setattr(layers, "rms_norm_forward", norm)
    with dispatch.interpreted():
        outputs = _prefill_then_decode(layer, params, x, prefill=2, max_len=16)
    # Traced once (the steps share a jitted program). The prefill's attention norms its
    # 2 x 2 rows in the kernel, the activations finish the feed-forward's norms.
    assert steps == [not qkv_bias]
    assert norms == [(2, 2, 64)] + [(2, 1, 64)] * qkv_bias
    # float32 throughout; the online softmax sums in another order than the einsum path.
    _assert_trees_close(outputs, expected, rtol=1e-5)


@pytest.mark.slow
def test_extend_step_handles_different_time_steps_per_example():
    layer, params = _build(_layer_config().set(input_dim=16))
    params = _randomize(params, scale=0.3)
    x = jnp.asarray(RNG.normal(size=(2, 5, 16)), jnp.float32)
    expected = _call(layer, params, data=x)
    cache = _call(layer, params, method="init_states", batch_size=2, max_len=6)
    # Example 0 has 4 tokens cached, example 1 has 2.
    cache, _ = _call(
        layer, params, method="extend_step", cached_states=cache, data=x[:, :4],
        time_step=jnp.zeros(2, jnp.int32),
    )
    step_inputs = jnp.stack([x[0, 4:5], x[1, 2:3]])
    _, out = _call(
        layer, params, method="extend_step", cached_states=cache, data=step_inputs,
        time_step=jnp.array([4, 2], jnp.int32),
    )
    np.testing.assert_allclose(out[0], expected[0, 4:5], rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(out[1], expected[1, 2:3], rtol=1e-5, atol=1e-5)


def test_init_states_uses_cache_dtype_and_stacks_layers():
    cfg = _stack_config("repeated", num_layers=3)
    cfg.layer.self_attention.attention.input_linear.cache_dtype = jnp.bfloat16
    layer, _ = _build(cfg)
    cache = _call(layer, {}, method="init_states", batch_size=2, max_len=5)
    key = cache["self_attention"]["key"]
    assert key.shape == (3, 2, 5, 2, 4) and key.dtype == jnp.bfloat16
    layer, _ = _build(_layer_config().set(input_dim=16))
    cache = _call(layer, {}, method="init_states", batch_size=2, max_len=5)
    assert cache["self_attention"]["value"].dtype == jnp.float32


# ----- stacked vs repeated -----


def _stacked_params_from_repeated(repeated_params, num_layers):
    layer = repeated_params["repeat"]["layer"]
    return {
        f"layer{i}": jax.tree_util.tree_map(lambda p, i=i: p[i], layer) for i in range(num_layers)
    }


@pytest.mark.slow
def test_stacked_and_repeated_give_same_outputs_and_gradients():
    repeated, rep_params = _build(_stack_config("repeated"))
    rep_params = _randomize(rep_params, scale=0.3)
    stacked, _ = _build(_stack_config("stacked"))
    stk_params = _stacked_params_from_repeated(rep_params, 3)
    x = jnp.asarray(RNG.normal(size=(2, 5, 16)), jnp.float32)
    segment_ids = jnp.array([[1, 1, 2, 2, 2], [1, 1, 1, 1, 1]])

    def loss(layer, params):
        out = _call(
            layer, params, is_training=True, prng_key=jax.random.PRNGKey(1), data=x,
            segment_ids=segment_ids,
        )
        return jnp.sum(out**2), out

    (rep_loss, rep_out), rep_grads = jax.value_and_grad(loss, argnums=1, has_aux=True)(
        repeated, rep_params
    )
    (stk_loss, stk_out), stk_grads = jax.value_and_grad(loss, argnums=1, has_aux=True)(
        stacked, stk_params
    )
    np.testing.assert_allclose(rep_out, stk_out, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(rep_loss, stk_loss, rtol=1e-5)
    _assert_trees_close(_stacked_params_from_repeated(rep_grads, 3), stk_grads)


# ----- the spec's config and remat -----


def _spec_transformer_config():
    lines = reference_spec.lines_with_prefix("model.decoder.transformer.")
    return lines, parse_flat_text("\n".join(lines), source=str(reference_spec.path()))


def test_spec_transformer_config_dumps_back_to_the_spec_lines():
    lines, cfg = _spec_transformer_config()
    assert cfg.debug_string() == "\n".join(lines)  # In the spec's own order.


def _small_spec_transformer(remat_spec="spec"):
    _, cfg = _spec_transformer_config()
    cfg.set(input_dim=32, num_layers=2)
    cfg.layer.self_attention.attention.num_heads = 4
    cfg.layer.self_attention.attention.input_linear.input_linear.num_kv_heads = 2
    cfg.layer.feed_forward.hidden_dim = 48
    if remat_spec != "spec":
        cfg.layer.remat_spec = remat_spec
    return cfg


def _grads(cfg, params, x):
    layer = cfg.set(name="layer", param_init=default_initializer_config()).instantiate(parent=None)

    def loss(p):
        out = _call(layer, p, is_training=True, prng_key=jax.random.PRNGKey(2), data=x)
        return jnp.sum(out**2)

    return jax.jit(jax.grad(loss))(params)


@pytest.mark.slow
def test_spec_remat_policies_give_identical_gradients():
    layer, params = _build(_small_spec_transformer())
    params = _randomize(params, scale=0.2)
    x = jnp.asarray(RNG.normal(size=(2, 8, 32)), jnp.float32)
    reference = _grads(_small_spec_transformer(remat_spec=None), params, x)
    for remat_spec in ("spec", {"prevent_cse": True, "policy": "nothing_saveable"}):
        grads = _grads(_small_spec_transformer(remat_spec), params, x)
        assert all(np.all(np.isfinite(g)) for g in jax.tree_util.tree_leaves(grads))
        _assert_trees_close(grads, reference, rtol=1e-5)


def _saved_residuals(capsys, cfg, x):
    layer, params = _build(cfg)

    def loss(p):
        out, _ = F(layer, state=p, inputs=dict(data=x), prng_key=None, is_training=True)
        return jnp.sum(out**2)

    jax.ad_checkpoint.print_saved_residuals(loss, params)
    return capsys.readouterr().out


def test_spec_remat_policy_saves_the_named_projections(capsys):
    x = jnp.asarray(RNG.normal(size=(2, 8, 32)), jnp.float32)
    saved = _saved_residuals(capsys, _small_spec_transformer().layer.set(input_dim=32), x)
    for name in ("q_proj", "k_proj", "v_proj", "context", "o_proj"):
        assert f"named 'GroupedQueryAttention.{name}'" in saved, saved
    # The feed-forward hidden activations [B,T,48] are recomputed, not saved.
    assert "f32[2,8,48]" not in saved, saved


def test_repeated_layers_recompute_hidden_activations_under_the_spec_policy(capsys):
    x = jnp.asarray(RNG.normal(size=(2, 8, 32)), jnp.float32)
    # Saved residuals of the scan carry a leading layer axis: [L,B,T,48].
    assert "f32[2,2,8,48]" in _saved_residuals(capsys, _small_spec_transformer(None), x)
    saved = _saved_residuals(capsys, _small_spec_transformer(), x)
    assert "f32[2,2,8,48]" not in saved and "f32[2,2,8,4,8]" in saved, saved


def test_spec_policy_also_saves_the_cudnn_attention_kernel_outputs():
    kernel = types.SimpleNamespace(name="dot_product_attention_fwd_wrapper")
    other = types.SimpleNamespace(name="dot_general")
    spec_policy = attn.build_remat_spec()["policy"].instantiate()
    assert spec_policy(kernel) and not spec_policy(other)
    # A policy that does not keep the context recomputes the kernel as well.
    ffn_only = attn.build_remat_spec(names_which_can_be_saved=".*linear1_0")["policy"]
    assert not ffn_only.instantiate()(kernel)


# ----- sharding -----

# Meshes (pipeline, data, expert, fsdp, seq, model) the sharded run is checked on. XLA
# partitions the layer wrong on the first two unless its weights are gathered before their
# matmuls (`sharding.gathered_for_matmul`), and on the third, whose 'model' axis does not
# divide the 2 key/value heads, unless those heads are kept whole (`whole_heads_if_uneven`).
_MESHES = [
    (1, 2, 1, 2, 1, 2),
    (1, 2, 2, 1, 1, 2),
    (1, 1, 1, 1, 2, 4),
    (1, 1, 1, 4, 1, 2),
    (1, 2, 1, 4, 1, 1),
]

_SHARDED_SCRIPT = textwrap.dedent(
    """
    import os
    import sys
    sys.path.insert(0, {repo!r}); sys.path.insert(0, os.path.join({repo!r}, "tests"))
    import jax, jax.numpy as jnp, numpy as np
    from test_attention import (
        _MESHES, _assert_trees_close, _build, _call, _randomize, _small_spec_transformer
    )
    from axlearn.common.base_layer import is_parameter_spec
    from axlearn.common.sharding import create_mesh, named_sharding

    layer, params = _build(_small_spec_transformer())
    params = _randomize(params, scale=0.2)
    x = jnp.asarray(np.random.default_rng(1).normal(size=(8, 8, 32)), jnp.float32)

    def loss(p, x):
        out = _call(layer, p, is_training=True, prng_key=jax.random.PRNGKey(0), data=x)
        return jnp.sum(out ** 2), out

    step = jax.jit(jax.value_and_grad(loss, has_aux=True))
    (ref_loss, ref_out), ref_grads = step(params, x)
    specs = layer.create_parameter_specs_recursively()
    for shape in _MESHES:
        mesh = create_mesh(shape, ("pipeline", "data", "expert", "fsdp", "seq", "model"))
        shardings = jax.tree_util.tree_map(
            lambda s: named_sharding(mesh, s.partition_spec), specs, is_leaf=is_parameter_spec
        )
        with jax.set_mesh(mesh):
            sharded = jax.device_put(params, shardings)
            xs = jax.device_put(x, named_sharding(mesh, (("data", "expert", "fsdp"), None, None)))
            (loss_value, out), grads = step(sharded, xs)
        attention = sharded["repeat"]["layer"]["self_attention"]["attention"]
        qkv = attention["i_proj"]["i_proj"]["qkv_proj"]
        # qkv_proj's weight [layers, model_dim over (expert, fsdp, seq), heads over model, dim].
        expected_shard = (2, 32 // (shape[2] * shape[3] * shape[4]), 8 // shape[5], 8)
        assert qkv["weight"].addressable_shards[0].data.shape == expected_shard, shape
        np.testing.assert_allclose(out, ref_out, rtol=1e-5, atol=1e-5)
        np.testing.assert_allclose(loss_value, ref_loss, rtol=1e-5)
        _assert_trees_close(grads, ref_grads)
    print("SHARDED_OK")
    """
)


@pytest.mark.slow
def test_repeated_transformer_sharded_over_8_devices_matches_single_device():
    reference_spec.path()  # The script builds the spec's transformer.
    assert_prints_ok(_SHARDED_SCRIPT.format(repo=REPO), marker="SHARDED_OK", devices=8)


def test_split_heads_gradient_concatenates_the_parts():
    x = jnp.asarray(RNG.normal(size=(2, 3, 7, 4)), jnp.float32)
    w = [jnp.asarray(RNG.normal(size=(2, 3, n, 4)), jnp.float32) for n in (3, 2, 2)]
    loss = lambda x_: sum(jnp.sum(p * w_) for p, w_ in zip(attn.split_heads(x_, (3, 2, 2)), w))
    parts = attn.split_heads(x, (3, 2, 2))
    np.testing.assert_array_equal(jnp.concatenate(parts, axis=2), x)
    np.testing.assert_array_equal(jax.grad(loss)(x), jnp.concatenate(w, axis=2))


# ----- fused QKV projections -----
# Tests of attention.FusedQKVLinear's layout: one weight [3, D, N, H] (query, key and value
# slices stacked, as AXLearn stores it) and bias [3, N, H], checked against NumPy.


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


# ----- ALiBi biases and sigmoid attention -----


def np_alibi_slopes(num_heads):
    """The ALiBi paper's slopes: 2^(-8k/n), k = 1..n, for n a power of two; otherwise the
    slopes of the largest power of two p below n, then the odd-k slopes of 2p."""
    p = 2 ** int(np.floor(np.log2(num_heads)))
    slopes = [2.0 ** (-8.0 * k / p) for k in range(1, p + 1)]
    if p < num_heads:
        slopes += [2.0 ** (-8.0 * k / (2 * p)) for k in range(1, 2 * p + 1, 2)][: num_heads - p]
    return np.array(slopes)


def np_alibi_biases(segment_ids, positions, num_heads):
    """[B,N,T,T]: slope * (key position - query position) where a query may attend
    (causal by position, same segment), -inf elsewhere."""
    distance = positions[:, None, :] - positions[:, :, None]
    allowed = (distance <= 0) & (segment_ids[:, :, None] == segment_ids[:, None, :])
    alibi = np_alibi_slopes(num_heads)[None, :, None, None] * distance[:, None]
    return np.where(allowed[:, None], alibi, -np.inf)


@pytest.mark.parametrize("num_heads", [8, 12])
def test_alibi_slopes_follow_the_paper(num_heads):
    np.testing.assert_allclose(attn.alibi_get_slopes(num_heads), np_alibi_slopes(num_heads))
    if num_heads == 8:  # The paper's example: 1/2, 1/4, ..., 1/256.
        np.testing.assert_allclose(attn.alibi_get_slopes(8), 0.5 ** np.arange(1, 9))


def test_alibi_biases_match_numpy_with_packed_segments():
    layer, _ = _build(attn.ALiBiAttentionLogitBiasLayer.default_config().set(num_heads=6))
    segment_ids = np.array([[1, 1, 1, 2, 2, 2, 2], [1, 1, 1, 1, 1, 1, 1]])
    positions = np.array([[0, 1, 2, 0, 1, 2, 3], [0, 1, 2, 3, 4, 5, 6]])
    out = np.asarray(
        _call(layer, {}, segment_ids=jnp.asarray(segment_ids), positions=jnp.asarray(positions))
    )
    expected = np_alibi_biases(segment_ids, positions, 6)
    assert out.shape == (2, 6, 7, 7)
    allowed = np.isfinite(expected)
    np.testing.assert_allclose(out[allowed], expected[allowed], rtol=1e-6)
    assert np.all(out[~allowed] < -1e30)


def test_causal_bias_layer_masks_later_positions_and_other_segments():
    layer, _ = _build(attn.CausalAttentionLogitBiasLayer.default_config())
    segment_ids, positions = np.array([[1, 1, 2, 2]]), np.array([[0, 1, 0, 1]])
    out = np.asarray(
        _call(layer, {}, segment_ids=jnp.asarray(segment_ids), positions=jnp.asarray(positions))
    )
    allowed = np.array([[1, 0, 0, 0], [1, 1, 0, 0], [0, 0, 1, 0], [0, 0, 1, 1]], bool)
    assert out.shape == (1, 1, 4, 4)
    assert np.all(out[0, 0][allowed] == 0) and np.all(out[0, 0][~allowed] < -1e30)


def _sigmoid_attention(**kwargs):
    return attn.SigmoidAttention.default_config().set(
        query_dim=12, key_dim=12, value_dim=12, output_dim=10, num_heads=3, seq_len=5, **kwargs
    )


def np_sigmoid_attention_layer(x, params, *, mask, seq_len, biases=None, subtract=True):
    """MultiheadAttention's projections around sigmoid(q k^T / sqrt(H) + biases - log(seq_len))
    per key (0 where masked) in place of the softmax."""
    p = jax.tree_util.tree_map(lambda a: np.asarray(a, np.float64), params)
    q, k, v = (
        np.einsum("btd,dnh->btnh", x, p["i_proj"][n]["weight"]) + p["i_proj"][n]["bias"]
        for n in ("q_proj", "k_proj", "v_proj")
    )
    logits = np.einsum("btnh,bsnh->bnts", q / np.sqrt(q.shape[-1]), k)
    if biases is not None:
        logits = logits + biases
    if subtract:
        logits = logits - np.log(seq_len)
    probs = np.where(mask[:, None], 1.0 / (1.0 + np.exp(-logits)), 0.0)
    context = np.einsum("bnts,bsnh->btnh", probs, v)
    return np.einsum("btnh,dnh->btd", context, p["o_proj"]["weight"]) + p["o_proj"]["bias"]


@pytest.mark.parametrize("subtract", [True, False])
def test_sigmoid_attention_matches_numpy(subtract):
    layer, params = _build(_sigmoid_attention(causal=True, subtract_seq_len_bias=subtract))
    params = _randomize(params)
    x = RNG.normal(size=(2, 5, 12))
    out = _call(layer, params, query=jnp.asarray(x, jnp.float32))
    expected = np_sigmoid_attention_layer(
        x, params, mask=np_causal_mask(2, 5), seq_len=5, subtract=subtract
    )
    np.testing.assert_allclose(out, expected, rtol=1e-4, atol=1e-4)


def test_sigmoid_attention_with_alibi_biases_matches_numpy():
    layer, params = _build(_sigmoid_attention())  # Not causal: the biases mask.
    params = _randomize(params)
    x = RNG.normal(size=(2, 5, 12))
    segment_ids = np.array([[1, 1, 2, 2, 2], [1, 1, 1, 1, 1]])
    positions = np.array([[0, 1, 0, 1, 2], [0, 1, 2, 3, 4]])
    biases = np_alibi_biases(segment_ids, positions, 3)
    alibi, _ = _build(attn.ALiBiAttentionLogitBiasLayer.default_config().set(num_heads=3))
    layer_biases = _call(
        alibi, {}, segment_ids=jnp.asarray(segment_ids), positions=jnp.asarray(positions)
    )
    out = _call(
        layer, params, query=jnp.asarray(x, jnp.float32), attention_logit_biases=layer_biases
    )
    expected = np_sigmoid_attention_layer(
        x, params, mask=np.isfinite(biases[:, 0]), seq_len=5, biases=np.where(
            np.isfinite(biases), biases, 0.0
        )
    )
    np.testing.assert_allclose(out, expected, rtol=1e-4, atol=1e-4)


def test_sigmoid_attention_decodes_like_forward():
    cfg = _sigmoid_attention(causal=True)
    layer, params = _build(cfg)
    params = _randomize(params)
    x = jnp.asarray(RNG.normal(size=(2, 5, 12)), jnp.float32)
    full = _call(layer, params, query=x)
    cache = layer.init_states(batch_size=2, max_len=5)
    steps = []
    for t in range(5):
        cache, y = _call(
            layer, params, method="extend_step", cached_states=cache, query=x[:, t : t + 1],
            time_step=jnp.full((2,), t, jnp.int32),
        )
        steps.append(y)
    np.testing.assert_allclose(jnp.concatenate(steps, axis=1), full, rtol=1e-4, atol=1e-4)


def test_sigmoid_attention_rejects_cudnn_with_its_path():
    with pytest.raises(ConfigError, match=r"layer\.attention_implementation: 'cudnn'"):
        _build(_sigmoid_attention(attention_implementation="cudnn"))


def test_axlearn_alibi_and_sigmoid_golden_lines_parse_and_instantiate():
    text = textwrap.dedent(
        """\
        decoder.attention_mask.klass: 'axlearn.common.attention.ALiBiAttentionLogitBiasLayer'
        decoder.attention_mask.num_heads: 4
        attention.klass: 'axlearn.common.attention.SigmoidAttention'
        attention.num_heads: 4
        attention.seq_len: 2048
        attention.subtract_seq_len_bias: True
        """
    )
    tree = parse_flat_text(text)
    mask = tree["decoder"]["attention_mask"]
    assert mask.klass is attn.ALiBiAttentionLogitBiasLayer and mask.num_heads == 4
    mask.set(name="mask").instantiate(parent=None)
    sigmoid = tree["attention"].set(query_dim=8, key_dim=8, value_dim=8, output_dim=8)
    assert sigmoid.klass is attn.SigmoidAttention and sigmoid.seq_len == 2048
    sigmoid.set(name="attention").instantiate(parent=None)


@pytest.mark.parametrize("implementation", [pytest.param("cudnn", marks=pytest.mark.slow), "xla"])
def test_grouped_softmax_attention_with_alibi_biases_matches_numpy(monkeypatch, implementation):
    calls = []
    monkeypatch.setattr(jax.nn, "dot_product_attention", _cudnn_on_xla(calls))
    cfg = attn.GroupedQueryAttention.default_config().set(
        query_dim=12, key_dim=12, value_dim=12, output_dim=10, num_heads=4,
        attention_implementation=implementation,
    )
    cfg.input_linear = attn.GroupedQKVLinear.default_config().set(num_kv_heads=2)
    layer, params = _build(cfg)
    params = _randomize(params)
    x = RNG.normal(size=(2, 6, 12))
    segment_ids, positions = np.array([[1, 1, 1, 2, 2, 2]] * 2), np.array([[0, 1, 2, 0, 1, 2]] * 2)
    biases = np_alibi_biases(segment_ids, positions, 4)
    alibi, _ = _build(attn.ALiBiAttentionLogitBiasLayer.default_config().set(num_heads=4))
    layer_biases = _call(
        alibi, {}, segment_ids=jnp.asarray(segment_ids), positions=jnp.asarray(positions)
    )
    out = _call(
        layer, params, query=jnp.asarray(x, jnp.float32), attention_logit_biases=layer_biases
    )
    if implementation == "cudnn":
        assert [c["implementation"] for c in calls] == ["cudnn"] and calls[0]["bias"] is not None
    else:
        assert not calls
    p = jax.tree_util.tree_map(lambda a: np.asarray(a, np.float64), params)
    q, k, v = (
        np.einsum("btd,dnh->btnh", x, p["i_proj"][n]["weight"]) + p["i_proj"][n]["bias"]
        for n in ("q_proj", "k_proj", "v_proj")
    )
    k, v = np.repeat(k, 2, axis=2), np.repeat(v, 2, axis=2)
    logits = np.einsum("btnh,bsnh->bnts", q / np.sqrt(3.0), k) + biases
    probs = np.exp(logits - logits.max(-1, keepdims=True))
    probs /= probs.sum(-1, keepdims=True)
    context = np.einsum("bnts,bsnh->btnh", probs, v)
    expected = np.einsum("btnh,dnh->btd", context, p["o_proj"]["weight"]) + p["o_proj"]["bias"]
    np.testing.assert_allclose(out, expected, rtol=1e-4, atol=1e-4)
