"""kv_cache.KVCache: writes at each sequence's own time step, the filled-position mask and
the cache dtype, against NumPy; and the attention layer that owns one."""

import jax.numpy as jnp
import numpy as np

from axlearn.common import attention as attn
from axlearn.common.kv_cache.kv_cache import KVCache
from axlearn.common.module import functional as F

RNG = np.random.default_rng(0)
B, S, K, H = 2, 6, 2, 4


def _cache(**kwargs) -> KVCache:
    return KVCache.default_config().set(name="kv_cache", **kwargs).instantiate(parent=None)


def _call(layer, method, **inputs):
    out, _ = F(layer, state={}, inputs=inputs, prng_key=None, is_training=False, method=method)
    return out


def test_extend_step_writes_each_sequence_at_its_time_step_and_masks_the_rest():
    cache = _cache()
    states = _call(
        cache, "init_states", batch_size=B, max_len=S, num_kv_heads=K, per_head_dim=H,
        dtype=jnp.float32,
    )
    k_new = RNG.normal(size=(B, 2, K, H)).astype(np.float32)
    v_new = RNG.normal(size=(B, 2, K, H)).astype(np.float32)
    time_step = np.asarray([0, 3])
    new_states, out = _call(
        cache, "extend_step", cached_states=states, k_proj=jnp.asarray(k_new),
        v_proj=jnp.asarray(v_new), time_step=jnp.asarray(time_step),
    )
    want_k, want_v = np.zeros((B, S, K, H), np.float32), np.zeros((B, S, K, H), np.float32)
    for b, t in enumerate(time_step):
        want_k[b, t : t + 2], want_v[b, t : t + 2] = k_new[b], v_new[b]
    np.testing.assert_array_equal(new_states["key"], want_k)
    np.testing.assert_array_equal(out.v_proj, want_v)
    np.testing.assert_array_equal(out.kv_valid, np.arange(S)[None, :] < (time_step + 2)[:, None])


def test_cache_dtype_overrides_the_layer_dtype():
    states = _call(
        _cache(cache_dtype=jnp.bfloat16), "init_states", batch_size=1, max_len=S,
        num_kv_heads=K, per_head_dim=H, dtype=jnp.float32,
    )
    assert states["key"].dtype == jnp.bfloat16 and states["key"].shape == (1, S, K, H)


def test_attention_keeps_its_cache_in_the_configured_kv_cache():
    cfg = attn.GroupedQueryAttention.default_config().set(
        name="attention", query_dim=8, key_dim=8, value_dim=8, output_dim=8, num_heads=4,
        input_linear=attn.GroupedQKVLinear.default_config().set(num_kv_heads=K),
        kv_cache=KVCache.default_config().set(cache_dtype=jnp.bfloat16),
        dtype=jnp.float32,
    )
    layer = cfg.instantiate(parent=None)
    states = _call(layer, "init_states", batch_size=1, max_len=S)
    assert states["key"].dtype == jnp.bfloat16 and states["key"].shape == (1, S, K, 2)
