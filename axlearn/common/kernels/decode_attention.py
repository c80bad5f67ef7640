"""One decoding step's attention (a query a row against a KV cache) as one Pallas kernel.

At batch 1 a step's attention reads little (the cache holds a few hundred keys), so its
cost is the launch and the passes, not bandwidth: each program takes one row and one
key/value head, holds that head's group of queries, and walks the valid keys once with an
online softmax, reading no key past the row's length. `MultiheadAttention._attend` takes it
where `decode_attention_mode` says so.

`decode_step_attention` does the whole step in the kernel: it rotates the token's query
and key (RoPE), writes its key and value into the cache in place and attends, where XLA
would emit the rotation, two cache writes and the slices of the fused projection as
kernels of their own; given the projection's input, it also finishes the RMSNorm the
projection took unfinished (`layers.RMSNorm.unfinished`), a norm kernel fewer a layer.
`MultiheadAttention.extend_step` takes it where `decode_step_mode` says so, and
`decode_attention` for the steps it does not take.
"""

import functools
from collections.abc import Sequence
from typing import Any, Optional

import jax
import jax.numpy as jnp
import numpy as np

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
# The longest cache the kernels take: a program walks its head's keys alone, where cuDNN's
# splits them over programs. gpt_1b on an H200 at batch 1 decodes 1,048 tokens/s through
# `decode_step_attention` and 1,001 through `decode_attention` at 640 keys against 1,040
# through cuDNN, and 673 through `decode_attention` at 2,080 keys against 931.
MAX_KEYS = 512


def decode_attention_supported(q_shape: Sequence[int], k_shape: Sequence[int]) -> bool:
    """Whether the kernel takes q [B,N,H] against k/v [B,S,K,H]: at most `MAX_BATCH` rows, a
    head of a power of two from 16 to 256, N a multiple of K, and from `_MIN_ROWS` to
    `MAX_KEYS` keys."""
    batch, num_heads, head_dim = q_shape
    _, num_keys, num_kv_heads, _ = k_shape
    return (
        batch <= MAX_BATCH
        and head_dim & (head_dim - 1) == 0
        and 16 <= head_dim <= 256
        and num_heads % num_kv_heads == 0
        and _MIN_ROWS <= num_keys <= MAX_KEYS
    )


def decode_attention_mode(q: Tensor, k: Tensor) -> Optional[bool]:
    """How a decoding step should attend: None for the other paths, else the kernel's
    `interpret` flag (interpreted under `dispatch.interpreted()`, compiled on a GPU with
    Pallas's Triton backend, on one device)."""
    if dispatch.several_devices() or not decode_attention_supported(q.shape, k.shape):
        return None
    return dispatch.interpret_flag()


def decode_step_mode(q_shape: Sequence[int], key_cache: Tensor) -> Optional[bool]:
    """Whether `decode_step_attention` takes q [B,N,H] against key_cache [B,S,K,H]: None
    if not, else its `interpret` flag. It takes what `decode_attention` does with groups of
    at most `_MIN_ROWS` queries a key/value head and, compiled, 16-bit caches."""
    num_heads, num_kv_heads = q_shape[1], key_cache.shape[2]
    if num_heads // max(num_kv_heads, 1) > _MIN_ROWS:
        return None
    interpret = decode_attention_mode(
        jax.ShapeDtypeStruct(tuple(q_shape), key_cache.dtype), key_cache
    )
    # Compiled, a float32 cache would be multiplied in TF32: 16-bit caches only.
    if interpret is False and jnp.dtype(key_cache.dtype).itemsize != 2:
        return None
    return interpret


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
    block = _keys_a_block(block_keys, num_keys)
    queries = q.reshape(batch, num_kv_heads, group, head_dim)
    if rows != group:
        queries = jnp.pad(queries, ((0, 0), (0, 0), (0, rows - group), (0, 0)))
    load = _masked_load(interpret)

    def kernel(length_ref, q_ref, k_ref, v_ref, o_ref):
        length = length_ref[0]

        def step(i, carry):
            keys, valid = _key_block(i, block, num_keys, length)
            logits = jnp.dot(
                q_ref[...], load(k_ref.at[keys, :], valid).T, preferred_element_type=jnp.float32
            )
            return _softmax_update(carry, logits, load(v_ref.at[keys, :], valid), valid)

        init = _softmax_start(rows, head_dim)
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


def _keys_a_block(block_keys: int, num_keys: int) -> int:
    """The keys a program reads at a time: `block_keys`, or the largest power of two in a
    shorter cache."""
    return min(block_keys, 1 << (num_keys.bit_length() - 1))


def _key_block(i: Tensor, block: int, num_keys: int, length: Tensor) -> tuple[Any, Tensor]:
    """The cache rows of the i-th block of keys, and which of them to attend to [block, 1]:
    those below `length` not read by an earlier block (the last block ends at the cache's
    end, so it may overlap the one before)."""
    from jax.experimental import pallas as pl  # pylint: disable=import-outside-toplevel

    start = jnp.minimum(i * block, num_keys - block)
    index = start + jnp.arange(block)
    return pl.ds(start, block), ((index < length) & (index >= i * block))[:, None]


def _softmax_start(rows: int, head_dim: int) -> tuple[Tensor, Tensor, Tensor]:
    """An online softmax's (weighted values, running maximum, running sum) before any key;
    the maximum starts finite so that exp(top - new_top) never sees inf - inf."""
    return (
        jnp.zeros((rows, head_dim), jnp.float32),
        jnp.full((rows,), -1e30, jnp.float32),
        jnp.zeros((rows,), jnp.float32),
    )


def _softmax_update(carry: tuple, logits: Tensor, values: Tensor, valid: Tensor) -> tuple:
    """The online softmax after a block of float32 logits [rows, block] and its values
    [block, H], the keys where `valid` [block, 1] is False left out."""
    acc, top, total = carry
    logits = jnp.where(valid.T, logits, -jnp.inf)
    new_top = jnp.maximum(top, logits.max(axis=-1))
    probs = jnp.exp(logits - new_top[:, None])
    decay = jnp.exp(top - new_top)
    acc = acc * decay[:, None] + jnp.dot(
        probs.astype(values.dtype), values, preferred_element_type=jnp.float32
    )
    return acc, new_top, total * decay + probs.sum(axis=-1)


@functools.cache
def _masked_load(interpret: bool):
    """ref, mask -> the ref's block with zeros where mask is False: Triton's masked load when
    compiled (it reads nothing there); a plain read then a select when interpreted."""
    if interpret:
        return lambda ref, mask: jnp.where(mask, ref[...], 0)
    triton = dispatch.pallas_triton()
    return lambda ref, mask: triton.load(ref, mask=mask, other=0)


@functools.cache
def _masked_store(interpret: bool):
    """ref, value, mask -> writes value where mask is True and nothing elsewhere."""
    if interpret:
        return lambda ref, value, mask: ref.__setitem__(..., jnp.where(mask, value, ref[...]))
    triton = dispatch.pallas_triton()
    return lambda ref, value, mask: triton.store(ref, value, mask=mask)


def decode_step_attention(
    qkv: Tensor,
    key_cache: Tensor,
    value_cache: Tensor,
    time_step: Tensor,
    sin_cos: Optional[Tensor] = None,
    norm_input: Optional[Tensor] = None,
    *,
    num_heads: int,
    query_scale: float = 1.0,
    norm_eps: float = 0.0,
    block_keys: int = _BLOCK_KEYS,
    num_warps: int = _NUM_WARPS,
    num_stages: int = _NUM_STAGES,
    interpret: bool = False,
) -> tuple[Tensor, Tensor, Tensor]:
    """One decoding step as one kernel: rotates the token's query and key, writes its key
    and value into the cache and attends over the cache up to it.

    qkv [B, N+2K, H]: the token's projections, unrotated, N = num_heads query heads then K
    key heads then K value heads (a fused projection's output as it is, so that XLA
    writes no slices of it); sin_cos [B,H]: the rotary angles' sines then cosines (None:
    no rotation); the query is multiplied by `query_scale` after rotating.
    key_cache/value_cache [B,S,K,H], in qkv's dtype; time_step [B]: the token's position,
    where its key and value go (< S), attending to keys 0..time_step. norm_input [B,D]
    (None: qkv is complete): the input x of an RMSNorm that qkv's projection took
    unfinished, as x * scale; each row's projections are multiplied by
    rsqrt(mean(x^2) + norm_eps) first, in float32, which finishes it (`layers.RMSNorm.
    unfinished` says why). Rounds as the layers do: the rotation in float32, then to qkv's
    dtype, then the query scale. Returns
    (context [B,N,H], key_cache, value_cache), the caches updated in place.
    """
    from jax.experimental import pallas as pl  # pylint: disable=import-outside-toplevel

    batch, _, head_dim = qkv.shape
    num_keys, num_kv_heads = key_cache.shape[1], key_cache.shape[2]
    group, half = num_heads // num_kv_heads, head_dim // 2
    block = _keys_a_block(block_keys, num_keys)
    # A head's group of queries is a window of _MIN_ROWS rows (the matmul's least), masked
    # to the group; the rows are padded to at least that many.
    rows_total = max(qkv.shape[1], _MIN_ROWS)
    if rows_total != qkv.shape[1]:
        qkv = jnp.pad(qkv, ((0, 0), (0, rows_total - qkv.shape[1]), (0, 0)))
    rotate, finish_norm = sin_cos is not None, norm_input is not None
    if not rotate:
        sin_cos = jnp.zeros((batch, head_dim), jnp.float32)
    load, store = _masked_load(interpret), _masked_store(interpret)
    dtype = qkv.dtype
    scale = float(np.asarray(query_scale).astype(dtype))  # The scale as the layers round it.
    halves = (pl.ds(0, half), pl.ds(half, half))  # The pairs a rotation mixes.

    def rotated(pair, sin, cos, row_scale):
        # [x1 cos - x2 sin, x2 cos + x1 sin] in float32, rounded to the cache's dtype.
        first, second = (x.astype(jnp.float32) * row_scale for x in pair)
        if rotate:
            first, second = first * cos - second * sin, second * cos + first * sin
        return first.astype(dtype), second.astype(dtype)

    def kernel(step_ref, *refs):
        *norm_ref, sc_ref, qkv_ref, kc_ref, vc_ref, o_ref, kc_out, vc_out = refs
        position = step_ref[0]
        row_scale = 1.0
        if finish_norm:
            x = norm_ref[0][...].astype(jnp.float32)
            row_scale = jax.lax.rsqrt(jnp.mean(x * x) + norm_eps)
        head = pl.program_id(1)
        first_row = head * group
        start = jnp.minimum(first_row, rows_total - _MIN_ROWS)
        rows = start + jnp.arange(_MIN_ROWS)
        in_group = ((rows >= first_row) & (rows < first_row + group))[:, None]
        window = pl.ds(start, _MIN_ROWS)
        sin, cos = (sc_ref[h][None] for h in halves)
        query = rotated(
            [load(qkv_ref.at[window, h], in_group) for h in halves], sin, cos, row_scale
        )
        query = [(x.astype(jnp.float32) * scale).astype(dtype) for x in query]
        own_key = rotated(
            [qkv_ref[pl.ds(num_heads + head, 1), h] for h in halves], sin, cos, row_scale
        )
        own_value = qkv_ref[pl.ds(num_heads + num_kv_heads + head, 1), :]
        if finish_norm:
            own_value = (own_value.astype(jnp.float32) * row_scale).astype(dtype)
        at = pl.ds(position, 1)
        for h, key_half in zip(halves, own_key):
            kc_out[at, h] = key_half
        vc_out[at, :] = own_value

        def step(i, carry):
            keys, valid = _key_block(i, block, num_keys, position)
            logits = sum(
                jnp.dot(q, load(kc_ref.at[keys, h], valid).T, preferred_element_type=jnp.float32)
                for q, h in zip(query, halves)
            )
            return _softmax_update(carry, logits, load(vc_ref.at[keys, :], valid), valid)

        init = _softmax_start(_MIN_ROWS, head_dim)
        acc, top, total = jax.lax.fori_loop(0, pl.cdiv(position, block), step, init)
        # The token's own key, from registers: the cache row just written is not read back.
        own = sum(
            jnp.sum(q.astype(jnp.float32) * k.astype(jnp.float32), axis=-1)
            for q, k in zip(query, own_key)
        )
        new_top = jnp.maximum(top, own)
        decay, weight = jnp.exp(top - new_top), jnp.exp(own - new_top)
        acc = acc * decay[:, None] + weight[:, None] * own_value.astype(jnp.float32)
        total = total * decay + weight
        store(o_ref.at[window, :], (acc / total[:, None]).astype(o_ref.dtype), in_group)

    cache_block = pl.BlockSpec((None, num_keys, None, head_dim), lambda b, h: (b, 0, h, 0))
    per_row = pl.BlockSpec((None, rows_total, head_dim), lambda b, h: (b, 0, 0))
    norm_args = [] if norm_input is None else [norm_input]
    norm_specs = [pl.BlockSpec((None, x.shape[-1]), lambda b, h: (b, 0)) for x in norm_args]
    caches_at = 3 + len(norm_args)  # The operands' indices of the two caches.
    context, key_cache, value_cache = pl.pallas_call(
        kernel,
        grid=(batch, num_kv_heads),
        in_specs=[
            pl.BlockSpec((1,), lambda b, h: (b,)),
            *norm_specs,
            pl.BlockSpec((None, head_dim), lambda b, h: (b, 0)),
            per_row, cache_block, cache_block,
        ],
        out_specs=[per_row, cache_block, cache_block],
        out_shape=[
            jax.ShapeDtypeStruct(qkv.shape, dtype),
            jax.ShapeDtypeStruct(key_cache.shape, key_cache.dtype),
            jax.ShapeDtypeStruct(value_cache.shape, value_cache.dtype),
        ],
        input_output_aliases={caches_at: 1, caches_at + 1: 2},
        compiler_params=dispatch.compiler_params(num_warps, interpret, num_stages=num_stages),
        interpret=interpret,
    )(
        time_step.astype(jnp.int32), *norm_args, sin_cos.astype(jnp.float32), qkv, key_cache,
        value_cache,
    )
    return context[:, :num_heads], key_cache, value_cache
