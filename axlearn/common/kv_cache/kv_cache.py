"""The key/value cache an attention layer keeps while it decodes.

`KVCache` holds the keys and values of the positions decoded so far, [B, S, K, H] each
(batch, cache length, key/value heads, head dim). Each `extend_step` writes the new
tokens' keys and values at their positions and returns the whole cache with a mask of the
positions filled so far, which is what the attention attends over.
"""

from typing import NamedTuple, Optional

import jax
import jax.numpy as jnp

from axlearn.common.base_layer import BaseLayer
from axlearn.common.config import config_class
from axlearn.common.module import Tensor
from axlearn.common.sharding import MeshAxes, maybe_shard


class KVCacheOutput(NamedTuple):
    """The cache after a step, as the attention reads it."""

    k_proj: Tensor  # [B, S, K, H]: every cached key, the new ones included.
    v_proj: Tensor  # [B, S, K, H].
    kv_valid: Tensor  # [B, S] bool: positions written so far.
    kv_lengths: Tensor  # [B] int32: how many they are (the written positions come first).


class KVCache(BaseLayer):
    """Keeps keys and values [B, S, K, H] of past positions; has no parameters."""

    @config_class
    class Config(BaseLayer.Config):
        """Configures KVCache."""

        # Dtype the keys and values are kept in; None: that of the first keys written
        # (the attention passes its own dtype to init_states).
        cache_dtype: Optional[jnp.dtype] = None
        # Sharding of the cached [B, S, K, H] keys and values; None: left to XLA.
        kv_partition_spec: Optional[MeshAxes] = None

    def init_states(
        self,
        *,
        batch_size: int,
        max_len: int,
        num_kv_heads: int,
        per_head_dim: int,
        dtype: jnp.dtype,
    ) -> dict[str, Tensor]:
        """An empty cache: {'key', 'value'} of [batch_size, max_len, K, H] zeros."""
        shape = (batch_size, max_len, num_kv_heads, per_head_dim)
        dtype = self.config.cache_dtype or dtype
        empty = self._shard(jnp.zeros(shape, dtype))
        return dict(key=empty, value=empty)

    def extend_step(
        self,
        cached_states: dict[str, Tensor],
        *,
        k_proj: Tensor,
        v_proj: Tensor,
        time_step: Tensor,
    ) -> tuple[dict[str, Tensor], KVCacheOutput]:
        """Writes k_proj/v_proj [B, T, K, H] at positions time_step[b] + (0..T-1).

        The caller keeps time_step + T <= max_len. Returns (new cache, the cache as the
        attention reads it).
        """
        time_step = time_step.astype(jnp.int32)

        def write(cache: Tensor, new: Tensor) -> Tensor:
            updated = jax.vmap(lambda c, n, t: jax.lax.dynamic_update_slice(c, n, (t, 0, 0)))(
                cache, new.astype(cache.dtype), time_step
            )
            return self._shard(updated)

        key = write(cached_states["key"], k_proj)
        value = write(cached_states["value"], v_proj)
        filled = time_step + k_proj.shape[1]
        kv_valid = jnp.arange(key.shape[1])[None, :] < filled[:, None]
        return dict(key=key, value=value), KVCacheOutput(key, value, kv_valid, filled)

    def forward(
        self,
        cached_states: dict[str, Tensor],
        *,
        k_proj: Tensor,
        v_proj: Tensor,
        time_step: Tensor,
    ) -> tuple[dict[str, Tensor], KVCacheOutput]:
        """The same as `extend_step` (AXLearn's layers are called through forward)."""
        return self.extend_step(cached_states, k_proj=k_proj, v_proj=v_proj, time_step=time_step)

    def _shard(self, x: Tensor) -> Tensor:
        return maybe_shard(x, self.config.kv_partition_spec)
