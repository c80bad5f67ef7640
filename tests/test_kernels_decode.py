"""Tests of the decoding kernels (axlearn.common.kernels.decode_attention, the RMSNorm
forward kernel), interpreted on the CPU: against NumPy alone, and inside a generator
against transformers' greedy tokens."""

import jax.numpy as jnp
import numpy as np
import pytest

from axlearn.common import attention, generate, hf_llama
from axlearn.common.kernels import dispatch
from axlearn.common.kernels.decode_attention import (
    decode_attention,
    decode_attention_mode,
    decode_attention_supported,
    decode_step_attention,
    decode_step_mode,
)
from axlearn.common.kernels.rms_norm import rms_norm_forward, rms_norm_forward_supported
from tools import kernel_check

RNG = np.random.default_rng(0)


@pytest.mark.parametrize(
    "batch, keys, kv_heads, heads, head_dim, block",
    [
        (2, 200, 2, 4, 32, 64),  # A cache that is no multiple of the block: its end overlaps.
        (3, 48, 1, 1, 16, 128),  # Fewer keys than a block; one head.
        (1, 256, 8, 16, 128, 128),  # gpt_1b's heads.
        (2, 100, 4, 8, 64, 32),
    ],
)
def test_decode_attention_equals_numpy_over_each_row_s_length(
    batch, keys, kv_heads, heads, head_dim, block
):
    q = RNG.normal(size=(batch, heads, head_dim)).astype(np.float32) * 0.3
    k, v = (RNG.normal(size=(batch, keys, kv_heads, head_dim)).astype(np.float32) for _ in "kv")
    lengths = RNG.integers(0, keys + 1, size=batch).astype(np.int32)
    lengths[0] = keys  # One full row; the others may be empty.
    got = decode_attention(*map(jnp.asarray, (q, k, v, lengths)), block_keys=block, interpret=True)
    np.testing.assert_allclose(np.asarray(got), kernel_check.decode_attention_reference(q, k, v, lengths), atol=1e-5)


@pytest.mark.parametrize(
    "q_shape, k_shape, supported",
    [
        ((1, 16, 128), (1, 256, 8, 128), True),
        ((1, 16, 48), (1, 256, 8, 48), False),  # A head of no power of two.
        ((1, 12, 64), (1, 256, 8, 64), False),  # Heads no multiple of the kv heads.
        ((1, 16, 64), (1, 8, 8, 64), False),  # Fewer keys than a matmul tile.
        ((1, 16, 128), (1, 2080, 8, 128), False),  # A cache that cuDNN's kernel walks faster.
        ((32, 16, 128), (32, 256, 8, 128), False),  # A batch that cuDNN's kernel runs faster.
    ],
)
def test_decode_attention_takes_the_shapes_it_supports_and_only_interpreted_on_a_cpu(
    q_shape, k_shape, supported
):
    q, k = jnp.zeros(q_shape, jnp.bfloat16), jnp.zeros(k_shape, jnp.bfloat16)
    assert decode_attention_supported(q_shape, k_shape) == supported
    assert decode_attention_mode(q, k) is None  # No GPU here.
    with dispatch.interpreted():
        assert decode_attention_mode(q, k) is (True if supported else None)


def _rotate_halves(x, sin, cos):
    half = x.shape[-1] // 2
    x1, x2 = x[..., :half], x[..., half:]
    return np.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1)


@pytest.mark.parametrize(
    "batch, keys, kv_heads, heads, head_dim, block, rotary",
    [
        (2, 200, 2, 4, 32, 64, True),  # Fewer than 16 heads (padded); an overlapping end.
        (1, 256, 8, 16, 128, 128, True),  # gpt_1b's heads: windows end inside k/v rows.
        (3, 48, 1, 1, 16, 128, False),  # One head, no rotation, fewer keys than a block.
        (2, 100, 4, 32, 64, 32, True),  # Groups of 8.
        (2, 64, 4, 4, 16, 16, True),  # Multi-head (groups of one).
    ],
)
@pytest.mark.parametrize("unfinished_norm", [False, True])
def test_decode_step_attention_equals_numpy_and_writes_only_the_token_s_cache_row(
    batch, keys, kv_heads, heads, head_dim, block, rotary, unfinished_norm
):
    q = RNG.normal(size=(batch, heads, head_dim)).astype(np.float32)
    k, v = (RNG.normal(size=(batch, kv_heads, head_dim)).astype(np.float32) for _ in "kv")
    projected = np.concatenate([q, k, v], axis=1)
    norm_args, eps = [], 1e-5
    if unfinished_norm:  # The projections of x * scale: the kernel divides them by rms(x).
        x = RNG.normal(size=(batch, 256)).astype(np.float32) * 3
        inverse_rms = 1 / np.sqrt(np.mean(np.float64(x) ** 2, axis=-1) + eps)
        q, k, v = (t * inverse_rms[:, None, None] for t in (q, k, v))
        norm_args = [jnp.asarray(x)]
    caches = [RNG.normal(size=(batch, keys, kv_heads, head_dim)).astype(np.float32) for _ in "kv"]
    steps = RNG.integers(0, keys, size=batch).astype(np.int32)
    steps[0] = keys - 1  # One row at the cache's last slot, one maybe at its first.
    angles = RNG.uniform(0, 2 * np.pi, size=(batch, head_dim // 2))
    sin_cos = np.concatenate([np.sin(angles), np.cos(angles)], axis=-1).astype(np.float32)
    scale = 0.25
    context, key_cache, value_cache = decode_step_attention(
        jnp.asarray(projected), *map(jnp.asarray, caches), jnp.asarray(steps),
        jnp.asarray(sin_cos) if rotary else None, *norm_args, num_heads=heads,
        query_scale=scale, norm_eps=eps, block_keys=block, interpret=True,
    )
    sin, cos = (sin_cos[:, None, : head_dim // 2], sin_cos[:, None, head_dim // 2 :])
    if rotary:
        q, k = _rotate_halves(q, sin, cos), _rotate_halves(k, sin, cos)
    expected_k, expected_v = (c.copy() for c in caches)
    for b, t in enumerate(steps):
        expected_k[b, t], expected_v[b, t] = k[b], v[b]
    np.testing.assert_allclose(np.asarray(key_cache), expected_k, atol=1e-6)
    if unfinished_norm:  # Scaled in float32 here, in float64 by NumPy.
        np.testing.assert_allclose(np.asarray(value_cache), expected_v, rtol=1e-6)
    else:
        np.testing.assert_array_equal(np.asarray(value_cache), expected_v)
    expected = kernel_check.decode_attention_reference(q * scale, expected_k, expected_v, steps + 1)
    np.testing.assert_allclose(np.asarray(context), expected, atol=1e-5)


@pytest.mark.parametrize(
    "q_shape, cache_shape, dtype, supported",
    [
        ((1, 16, 128), (1, 256, 8, 128), jnp.bfloat16, True),
        ((1, 32, 64), (1, 256, 1, 64), jnp.bfloat16, False),  # A group of 32 queries.
        ((1, 16, 48), (1, 256, 8, 48), jnp.bfloat16, False),  # What decode_attention refuses.
        ((1, 16, 128), (1, 640, 8, 128), jnp.bfloat16, False),  # Longer than MAX_KEYS.
    ],
)
def test_decode_step_takes_groups_of_at_most_16_and_only_interpreted_on_a_cpu(
    q_shape, cache_shape, dtype, supported
):
    cache = jnp.zeros(cache_shape, dtype)
    assert decode_step_mode(q_shape, cache) is None  # No GPU here.
    with dispatch.interpreted():
        assert decode_step_mode(q_shape, cache) is (True if supported else None)


def test_rms_norm_forward_equals_numpy_in_float32():
    x = RNG.normal(size=(3, 1, 256)) * 3
    scale = RNG.normal(size=(256,))
    x16, scale16 = (jnp.asarray(t, jnp.bfloat16) for t in (x, scale))
    got = rms_norm_forward(x16, scale16, eps=1e-5, interpret=True)
    assert got.shape == x.shape and got.dtype == jnp.bfloat16
    x64, scale64 = (np.asarray(t, np.float64) for t in (x16, scale16))
    expected = x64 / np.sqrt(np.mean(x64**2, axis=-1, keepdims=True) + 1e-5) * scale64
    # The kernel rounds once, to bf16, at the end.
    np.testing.assert_allclose(np.asarray(got, np.float64), expected, rtol=2**-8, atol=1e-6)
    assert rms_norm_forward_supported((8, 1, 2048))
    assert not rms_norm_forward_supported((9, 2048))  # More rows than a decoding step's.
    assert not rms_norm_forward_supported((1, 1000))  # A row of no power of two.


@pytest.mark.slow
def test_a_generator_attending_through_the_kernel_keeps_transformers_greedy_tokens(monkeypatch):
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(3)
    config = transformers.LlamaConfig(
        vocab_size=64, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, head_dim=16, rope_theta=10000.0,
        initializer_range=0.2, bos_token_id=None, eos_token_id=None, pad_token_id=None,
    )
    hf = transformers.LlamaForCausalLM(config).eval()
    prompts = [[5, 17, 3, 40, 22], [9, 1]]
    with torch.no_grad():
        expected = [
            hf.generate(
                torch.tensor([p]), attention_mask=torch.ones(1, len(p), dtype=torch.long),
                max_new_tokens=20, do_sample=False, eos_token_id=[1], pad_token_id=1,
            )[0, len(p):].tolist()
            for p in prompts
        ]
    cfg = hf_llama.llama_config_from_hf(hf.config)
    assert hf_llama.token_id_list(cfg.decoder.eos_token_id) == [1]  # Its default EOS id.
    params = hf_llama.params_from_hf(hf.state_dict(), cfg)
    calls = []
    original = attention.decode_step_attention
    monkeypatch.setattr(
        attention, "decode_step_attention",
        lambda *a, **kw: calls.append(1) or original(*a, **kw),
    )
    with dispatch.interpreted():
        outputs, _ = generate.Generator(cfg, params).generate(
            prompts, max_new_tokens=20, batch_size=2
        )
    assert calls  # The decoding steps attended through the one-step kernel.
    assert outputs == expected
