"""One decoding step's attention (a query a row against a KV cache) as one Pallas kernel.

At batch 1 a step's attention reads little (the cache holds a few hundred keys), so its
cost is the launch and the passes, not bandwidth: each program takes one row and one
key/value head, holds that head's group of queries, and walks the valid keys once with an
online softmax, reading no key past the row's length. `MultiheadAttention._attend` takes it
where `decode_attention_mode` says so.
"""

import functools
from collections.abc import Sequence
from typing import Optional

import jax
import jax.numpy as jnp

from axlearn.common.kernels import dispatch
from axlearn.common.module import Tensor

# Keys a program reads at a time, and its warps and pipeline stages (tuned on Hopper for a
# head of 128 and caches of a few hundred keys).
_BLOCK_KEYS = 128
_NUM_WARPS = 4
_NUM_STAGES = 2
# A Triton matmul takes at least 16 rows: the group of queries sharing a head is padded.
_MIN_ROWS = 16
# The most rows a step takes the kernel for: on an H200 at gpt_1b's heads it beats cuDNN's
# at batch 1 (6.3 against 8.0 µs) and loses at batch 32 (10.6 against 10.0).
MAX_BATCH = 8


def decode_attention_supported(q_shape: Sequence[int], k_shape: Sequence[int]) -> bool:
    """Whether the kernel takes q [B,N,H] against k/v [B,S,K,H]: at most `MAX_BATCH` rows, a
    head of a power of two from 16 to 256, N a multiple of K, and at least `_MIN_ROWS` keys."""
    batch, num_heads, head_dim = q_shape
    _, num_keys, num_kv_heads, _ = k_shape
    return (
        batch <= MAX_BATCH
        and head_dim & (head_dim - 1) == 0
        and 16 <= head_dim <= 256
        and num_heads % num_kv_heads == 0
        and num_keys >= _MIN_ROWS
    )


def decode_attention_mode(q: Tensor, k: Tensor) -> Optional[bool]:
    """How a decoding step should attend: None for the other paths, else the kernel's
    `interpret` flag (interpreted under `dispatch.interpreted()`, compiled on a GPU with
    Pallas's Triton backend, on one device)."""
    if dispatch.several_devices() or not decode_attention_supported(q.shape, k.shape):
        return None
    return dispatch.interpret_flag()


def decode_attention(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    lengths: Tensor,
    *,
    block_keys: int = _BLOCK_KEYS,
    num_warps: int = _NUM_WARPS,
    num_stages: int = _NUM_STAGES,
    interpret: bool = False,
) -> Tensor:
    """softmax(q k^T) v over the first lengths[b] keys of each row: q [B,N,H] (already
    scaled), k/v [B,S,K,H] (head n reads kv head n // (N / K)), lengths [B] -> [B,N,H].

    Logits and the softmax are float32; a row of length 0 gives zeros.
    """
    from jax.experimental import pallas as pl  # pylint: disable=import-outside-toplevel

    batch, num_heads, head_dim = q.shape
    num_keys, num_kv_heads = k.shape[1], k.shape[2]
    group = num_heads // num_kv_heads
    rows = max(_MIN_ROWS, 1 << (group - 1).bit_length())
    block = min(block_keys, 1 << (num_keys.bit_length() - 1))
    queries = q.reshape(batch, num_kv_heads, group, head_dim)
    if rows != group:
        queries = jnp.pad(queries, ((0, 0), (0, 0), (0, rows - group), (0, 0)))
    load = _masked_load(interpret)

    def kernel(length_ref, q_ref, k_ref, v_ref, o_ref):
        length = length_ref[0]

        def step(i, carry):
            acc, top, total = carry
            # The last block ends at the cache's end; keys an earlier block read are masked.
            start = jnp.minimum(i * block, num_keys - block)
            index = start + jnp.arange(block)
            valid = (index < length) & (index >= i * block)
            rows_ = (pl.ds(start, block), slice(None))
            keys = load(k_ref.at[rows_], valid[:, None])
            values = load(v_ref.at[rows_], valid[:, None])
            logits = jnp.dot(q_ref[...], keys.T, preferred_element_type=jnp.float32)
            logits = jnp.where(valid[None, :], logits, -jnp.inf)
            new_top = jnp.maximum(top, logits.max(axis=-1))
            probs = jnp.exp(logits - new_top[:, None])
            decay = jnp.exp(top - new_top)
            acc = acc * decay[:, None] + jnp.dot(
                probs.astype(values.dtype), values, preferred_element_type=jnp.float32
            )
            return acc, new_top, total * decay + probs.sum(axis=-1)

        # The running maximum starts finite so that exp(top - new_top) never sees inf - inf.
        init = (
            jnp.zeros((rows, head_dim), jnp.float32),
            jnp.full((rows,), -1e30, jnp.float32),
            jnp.zeros((rows,), jnp.float32),
        )
        acc, _, total = jax.lax.fori_loop(0, pl.cdiv(length, block), step, init)
        o_ref[...] = (acc / jnp.maximum(total, 1e-30)[:, None]).astype(o_ref.dtype)

    head_block = pl.BlockSpec((None, None, rows, head_dim), lambda b, h: (b, h, 0, 0))
    cache_block = pl.BlockSpec((None, num_keys, None, head_dim), lambda b, h: (b, 0, h, 0))
    out = pl.pallas_call(
        kernel,
        grid=(batch, num_kv_heads),
        in_specs=[pl.BlockSpec((1,), lambda b, h: (b,)), head_block, cache_block, cache_block],
        out_specs=head_block,
        out_shape=jax.ShapeDtypeStruct(queries.shape, q.dtype),
        compiler_params=dispatch.compiler_params(num_warps, interpret, num_stages=num_stages),
        interpret=interpret,
    )(lengths.astype(jnp.int32), queries, k.astype(q.dtype), v.astype(q.dtype))
    return out[:, :, :group].reshape(batch, num_heads, head_dim)


@functools.cache
def _masked_load(interpret: bool):
    """ref, mask -> the ref's block with zeros where mask is False: Triton's masked load when
    compiled (it reads nothing there); a plain read then a select when interpreted."""
    if interpret:
        return lambda ref, mask: jnp.where(mask, ref[...], 0)
    triton = dispatch.pallas_triton()
    return lambda ref, mask: triton.load(ref, mask=mask, other=0)
