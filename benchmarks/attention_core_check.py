"""Times the attention op alone (no projections) through every flash path at hand.

    PYTHONPATH=. python benchmarks/attention_core_check.py [--json_out=attn.json]

gpt_1b's shape by default: batch 4, seq 4096, 16 query / 8 KV heads, head dim 128, bf16,
causal. For each path: the relative L2 error of the output and of dQ, dK, dV against a
float32 XLA reference, forward and forward+backward GPU time (profiler trace, 10 calls)
and the largest kernels. The paths:

- cudnn: `jax.nn.dot_product_attention(implementation="cudnn")`, grouped-query (the model's).
- cudnn_repeated_kv: the same with K/V repeated to one head per query head (cuDNN then
  needs no float32 dK/dV buffer, memset or head sum).
- cudnn_kv_repeated_backward: cuDNN's grouped-query forward, and its backward kernel given
  K/V repeated to one head per query head (a custom gradient over jax's private cuDNN
  module, which alone returns the softmax statistics a backward takes): no float32 dK/dV
  buffer, memset or head sum, and no repeat in the forward (tried in gpt_1b in the
  twenty-eighth round, not kept).
- cudnn_query_groups: one multi-head cuDNN call per query group (query heads g, g+G, ...
  share no K/V head), so no float32 dK/dV buffer or head sum and no repeat, but slices
  of q, an interleave of the contexts and a sum of each group's dK and dV.
- cudnn_bnth: cuDNN through jax's private entry point with the [B, N, T, H] layout.
- tokamax_mosaic / tokamax_triton: tokamax's flash attention, where tokamax is installed.
- pallas_mosaic_gpu: jax's Pallas Mosaic GPU kernel (`attention_mgpu`), where it imports.

A path that fails prints its error and the others still run.
"""

import argparse
import functools
import json

import jax
import jax.numpy as jnp
import numpy as np

from axlearn.bench import gpu_time_ms, write_json


def _repeat_kv(q, k, v):
    groups = q.shape[2] // k.shape[2]
    return jnp.repeat(k, groups, axis=2), jnp.repeat(v, groups, axis=2)


def _cudnn_kv_repeated_backward(scale: float):
    """Grouped-query cuDNN attention whose backward runs on K/V repeated to N heads."""
    from jax._src.cudnn import fused_attention_stablehlo as fa  # pylint: disable=import-outside-toplevel

    mask_type = fa.MaskType.CAUSAL

    @jax.custom_vjp
    def attention(q, k, v):
        return fa.dot_product_attention(q, k, v, scale=scale, mask_type=mask_type)

    def forward(q, k, v):
        out, stats = fa.dot_product_attention(
            q, k, v, scale=scale, mask_type=mask_type, return_residual=True
        )
        return out, (q, k, v, out, stats)

    def backward(residuals, d_out):
        q, k, v, out, stats = residuals
        k_rep, v_rep = _repeat_kv(q, k, v)
        unused = jnp.zeros((0,), q.dtype)  # No bias, padding, segments or paged K/V.
        dq, dk, dv = fa._dot_product_attention_bwd_p_wrapper.bind(  # pylint: disable=protected-access
            q, k_rep, v_rep, *([unused] * 7), stats, out, d_out,
            scale=scale, seed=0, dropout_rate=0.0, variadic_args=(False, False),
            mask_type=mask_type, layout=fa.AttentionLayout.BTNH.value, sliding_window_length=None,
        )  # fmt: skip
        # Query head i read K/V head i // groups: sum each group's gradients.
        kv_shape = k.shape[:3] + (q.shape[2] // k.shape[2], k.shape[3])
        return (dq,) + tuple(
            g.reshape(kv_shape).sum(axis=3, dtype=jnp.float32).astype(k.dtype) for g in (dk, dv)
        )

    attention.defvjp(forward, backward)
    return attention


def reference(q, k, v, *, scale):
    """float32 causal attention, K/V heads shared by consecutive query heads."""
    q = q.astype(jnp.float32)
    k, v = (x.astype(jnp.float32) for x in _repeat_kv(q, k, v))
    logits = jnp.einsum("btnh,bsnh->bnts", q, k) * scale
    seq = q.shape[1]
    logits = jnp.where(jnp.tril(jnp.ones((seq, seq), bool)), logits, -1e30)
    return jnp.einsum("bnts,bsnh->btnh", jax.nn.softmax(logits, axis=-1), v)


def paths(scale: float) -> dict:
    def cudnn(q, k, v):
        return jax.nn.dot_product_attention(q, k, v, scale=scale, is_causal=True, implementation="cudnn")

    def cudnn_repeated_kv(q, k, v):
        return cudnn(q, *_repeat_kv(q, k, v))

    def cudnn_query_groups(q, k, v):
        # Query heads g, g+G, ... of the [B, T, K, G, H] view see K/V heads 0..K-1 one to
        # one: G multi-head calls, then the contexts interleaved back into N heads.
        batch, seq, num_heads, head_dim = q.shape
        num_kv_heads = k.shape[2]
        groups = num_heads // num_kv_heads
        q = q.reshape(batch, seq, num_kv_heads, groups, head_dim)
        contexts = [cudnn(q[:, :, :, g], k, v) for g in range(groups)]
        return jnp.stack(contexts, axis=3).reshape(q.shape[:2] + (num_heads, head_dim))

    def cudnn_bnth(q, k, v):
        from jax._src.cudnn import fused_attention_stablehlo as fa  # pylint: disable=import-outside-toplevel

        to_bnth = lambda x: jnp.transpose(x, (0, 2, 1, 3))  # noqa: E731 (its own inverse)
        out = fa.dot_product_attention(
            to_bnth(q), to_bnth(k), to_bnth(v), scale=scale, mask_type=fa.MaskType.CAUSAL, qkv_layout="BNTH"
        )
        return to_bnth(out)

    def tokamax_path(implementation, q, k, v):
        import tokamax  # pylint: disable=import-outside-toplevel
        from absl import flags  # pylint: disable=import-outside-toplevel

        # tokamax reads absl flags, which would parse our argparse command line.
        if not flags.FLAGS.is_parsed():
            flags.FLAGS.mark_as_parsed()
        return tokamax.dot_product_attention(
            q, k, v, scale=scale, is_causal=True, implementation=implementation
        )

    def pallas_mosaic_gpu(q, k, v):
        from jax.experimental.pallas.ops.gpu import attention_mgpu  # pylint: disable=import-outside-toplevel

        config = attention_mgpu.TuningConfig(
            block_q=64, block_kv=128, max_concurrent_steps=2, causal=True,
            block_q_dkv=64, block_kv_dkv=64, block_q_dq=64, block_kv_dq=64,
        )
        return attention_mgpu.attention(q * scale, k, v, config)

    return {
        "cudnn": cudnn,
        "cudnn_repeated_kv": cudnn_repeated_kv,
        "cudnn_kv_repeated_backward": lambda q, k, v: _cudnn_kv_repeated_backward(scale)(q, k, v),
        "cudnn_query_groups": cudnn_query_groups,
        "cudnn_bnth": cudnn_bnth,
        "tokamax_mosaic": functools.partial(tokamax_path, "mosaic"),
        "tokamax_triton": functools.partial(tokamax_path, "triton"),
        "pallas_mosaic_gpu": pallas_mosaic_gpu,
    }


def _forward_backward(attention):
    def run(q, k, v, d_out):
        out, vjp = jax.vjp(attention, q, k, v)
        return out, vjp(d_out.astype(out.dtype))

    return jax.jit(run)


def _rel_err(x, ref) -> float:
    x, ref = np.asarray(x, np.float64), np.asarray(ref, np.float64)
    return float(np.linalg.norm(x - ref) / np.linalg.norm(ref))


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--seq_len", type=int, default=4096)
    parser.add_argument("--num_heads", type=int, default=16)
    parser.add_argument("--num_kv_heads", type=int, default=8)
    parser.add_argument("--head_dim", type=int, default=128)
    parser.add_argument("--json_out", default=None)
    args = parser.parse_args()
    rng = np.random.default_rng(0)
    shape_q = (args.batch, args.seq_len, args.num_heads, args.head_dim)
    shape_kv = (args.batch, args.seq_len, args.num_kv_heads, args.head_dim)
    q, d_out = (jnp.asarray(rng.normal(size=shape_q), jnp.bfloat16) for _ in range(2))
    k, v = (jnp.asarray(rng.normal(size=shape_kv), jnp.bfloat16) for _ in range(2))
    scale = args.head_dim**-0.5
    want_out, want_grads = _forward_backward(functools.partial(reference, scale=scale))(q, k, v, d_out)
    # Causal: half of QKᵀ and of AV; the backward pass is 2.5 times the forward.
    fwd_flops = 4 * args.batch * args.seq_len**2 * args.num_heads * args.head_dim / 2

    results = {"jax_version": jax.__version__, "device": jax.devices()[0].device_kind}
    for name, attention in paths(scale).items():
        try:
            both = _forward_backward(attention)
            out, grads = both(q, k, v, d_out)
            fwd_ms, _ = gpu_time_ms(jax.jit(attention), q, k, v)
            both_ms, kernels = gpu_time_ms(both, q, k, v, d_out)
            entry = {
                "rel_err_out_dq_dk_dv": [_rel_err(out, want_out)]
                + [_rel_err(g, w) for g, w in zip(grads, want_grads)],
                "fwd_ms": fwd_ms,
                "fwd_bwd_ms": both_ms,
                "fwd_tflops": fwd_flops / fwd_ms / 1e9,
                "bwd_tflops": 2.5 * fwd_flops / (both_ms - fwd_ms) / 1e9,
                "largest_kernels_ms": dict(sorted(kernels.items(), key=lambda kv: -kv[1])[:10]),
            }
        except Exception as e:  # pylint: disable=broad-except
            entry = {"error": f"{type(e).__name__}: {e}"[:300]}
        results[name] = entry
        print(name, json.dumps(entry, indent=1), flush=True)
    write_json(args.json_out, results)


if __name__ == "__main__":
    main()
