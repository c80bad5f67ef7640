"""Checks and times the attention implementations on the local accelerator.

    PYTHONPATH=. python benchmarks/attention_check.py [--seq_len 4096]

For a GroupedQueryAttention layer in bf16 it compares the cuDNN flash path
(`jax.nn.dot_product_attention(implementation="cudnn")`) with the XLA path against a
float32 XLA reference (relative L2 error of outputs and gradients), with and without
packed-document segment ids, and times forward and forward+backward of each.
"""

import argparse
import json
import time

import jax
import jax.numpy as jnp
import numpy as np

from axlearn.bench import write_json
from axlearn.common.attention import GroupedQueryAttention, RoFormerQKVLinear, FusedGroupedQKVLinear
from axlearn.common.module import functional
from axlearn.common.param_init import default_initializer_config


def build(implementation, *, dim, num_heads, num_kv_heads, dtype):
    qkv = FusedGroupedQKVLinear.default_config().set(num_kv_heads=num_kv_heads)
    qkv.layer.bias = False
    cfg = GroupedQueryAttention.default_config().set(
        name="attention",
        query_dim=dim,
        key_dim=dim,
        value_dim=dim,
        output_dim=dim,
        num_heads=num_heads,
        causal=True,
        input_linear=RoFormerQKVLinear.default_config().set(input_linear=qkv, rotary_value=False),
        attention_implementation=implementation,
        dtype=dtype,
        param_init=default_initializer_config(),
    )
    cfg.output_linear.bias = False
    return cfg.instantiate(parent=None)


def rel_err(x, ref):
    x, ref = np.asarray(x, np.float64), np.asarray(ref, np.float64)
    return float(np.linalg.norm(x - ref) / np.linalg.norm(ref))


def timeit(fn, *args, iters=20):
    out = fn(*args)
    jax.block_until_ready(out)
    times = []
    for _ in range(iters):
        start = time.perf_counter()
        jax.block_until_ready(fn(*args))
        times.append(time.perf_counter() - start)
    return float(np.median(times))


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--seq_len", type=int, default=4096)
    parser.add_argument("--dim", type=int, default=2048)
    parser.add_argument("--num_heads", type=int, default=16)
    parser.add_argument("--num_kv_heads", type=int, default=8)
    parser.add_argument("--json_out", default=None)
    args = parser.parse_args()

    key = jax.random.PRNGKey(0)
    x = jax.random.normal(key, (args.batch, args.seq_len, args.dim), jnp.float32)
    # Two documents per row, split at a random point.
    cut = np.random.default_rng(0).integers(1, args.seq_len, size=(args.batch, 1))
    segment_ids = jnp.asarray((np.arange(args.seq_len)[None, :] >= cut).astype(np.int32) + 1)

    ref_layer = build("xla", dim=args.dim, num_heads=args.num_heads, num_kv_heads=args.num_kv_heads, dtype=jnp.float32)
    params = ref_layer.initialize_parameters_recursively(jax.random.PRNGKey(1))
    head_dim = args.dim // args.num_heads
    attention_flops = 4 * args.batch * args.seq_len * args.seq_len * args.num_heads * head_dim / 2

    def loss_fn(layer, params, x, segment_ids):
        out, _ = functional(
            layer, state=params, inputs=dict(query=x, segment_ids=segment_ids), prng_key=None, is_training=True
        )
        return jnp.mean(out.astype(jnp.float32) ** 2), out

    results = {"jax_version": jax.__version__, "device": jax.devices()[0].device_kind}
    for with_segments in (False, True):
        seg = segment_ids if with_segments else None
        ref_fn = jax.jit(jax.value_and_grad(lambda p, x: loss_fn(ref_layer, p, x, seg), has_aux=True))
        (_, ref_out), ref_grads = ref_fn(params, x)
        for implementation in ("xla", "cudnn"):
            name = f"{implementation}{'+segments' if with_segments else ''}"
            layer = build(implementation, dim=args.dim, num_heads=args.num_heads, num_kv_heads=args.num_kv_heads, dtype=jnp.bfloat16)
            p16 = jax.tree.map(lambda a: a.astype(jnp.bfloat16), params)
            x16 = x.astype(jnp.bfloat16)
            try:
                fwd = jax.jit(lambda p, x: loss_fn(layer, p, x, seg)[1])
                grad = jax.jit(jax.value_and_grad(lambda p, x: loss_fn(layer, p, x, seg), has_aux=True))
                (_, out), grads = grad(p16, x16)
                uses_cudnn = "cudnn" in fwd.lower(p16, x16).compile().as_text().lower()
                entry = {
                    "out_rel_err": rel_err(out, ref_out),
                    "grad_rel_err": max(
                        rel_err(g, r) for g, r in zip(jax.tree.leaves(grads), jax.tree.leaves(ref_grads))
                    ),
                    "fwd_ms": 1e3 * timeit(fwd, p16, x16),
                    "fwd_bwd_ms": 1e3 * timeit(grad, p16, x16),
                    "hlo_has_cudnn_call": uses_cudnn,
                }
            except Exception as e:  # pylint: disable=broad-except
                entry = {"error": f"{type(e).__name__}: {e}"[:500]}
            results[name] = entry
            print(name, json.dumps(entry), flush=True)
    results["attention_core_flops_fwd"] = attention_flops
    write_json(args.json_out, results)


if __name__ == "__main__":
    main()
