r"""Checks and times attention on the local GPU: the model's layer, and the op alone
through each flash-attention path at hand.

Run it on new hardware, or after a jax or CUDA upgrade, to see whether the cuDNN path the
configs use (`attention_implementation="cudnn"`) is still correct and still beats XLA,
and how the other flash kernels compare:

    PYTHONPATH=. python tools/attention_check.py [--part=all|layer|op] [--seq_len=4096] \
        [--json_out=attention.json]

The defaults are gpt_1b's shape: batch 4, seq 4096, 16 query and 8 KV heads of 128,
bf16, causal. Two parts, each printing one line of JSON per case:

- layer: a GroupedQueryAttention layer (QKV projection, rotary embedding, attention,
  output projection) with `attention_implementation` 'xla' and 'cudnn', without and
  with packed-document segment ids. `out_rel_err` and `grad_rel_err` are the relative
  L2 errors of the output and of the worst parameter gradient against the same layer in
  float32 on XLA; `hlo_has_cudnn_call` says whether the cuDNN kernel was really used.
- op: the attention op alone, through: xla and cudnn (`jax.nn.dot_product_attention`,
  grouped-query as the model calls it), cudnn_repeated_kv (K/V repeated to one head
  per query head), tokamax_mosaic and tokamax_triton (where tokamax is installed) and
  pallas_mosaic_gpu (jax's Pallas Mosaic GPU kernel, where it imports).
  `rel_err_out_dq_dk_dv` holds the relative L2 errors of the output and of dQ, dK, dV
  against float32 attention; `fwd_tflops` and `bwd_tflops` the rate the causal FLOPs
  imply (the backward taken as 2.5 times the forward's).

Times (`fwd_ms`, `fwd_bwd_ms`) are GPU kernel time per call from a profiler trace of 10
calls, so without dispatch overhead. Every case computes in bf16, so its errors should
be close to those of its xla counterpart; one far above them is a wrong kernel. A case
that fails prints its error and the others still run.
"""

import functools
import json
from collections.abc import Callable, Sequence
from typing import Any, Optional

import jax
import jax.numpy as jnp
import numpy as np
from absl import flags

from axlearn.bench import gpu_time_ms, write_json
from axlearn.common.attention import (
    FusedGroupedQKVLinear,
    GroupedQueryAttention,
    RoFormerQKVLinear,
)
from axlearn.common.command_flags import parse_command_flags, usage_error
from axlearn.common.module import functional
from axlearn.common.param_init import default_initializer_config

_PARTS = ("layer", "op")


def rel_err(x, ref) -> float:
    """Relative L2 error of `x` against `ref`, in float64."""
    x, ref = np.asarray(x, np.float64), np.asarray(ref, np.float64)
    return float(np.linalg.norm(x - ref) / np.linalg.norm(ref))


def _error_entry(e: Exception) -> dict[str, str]:
    return {"error": f"{type(e).__name__}: {e}"[:500]}


def _tflops(flops: float, ms: float) -> Optional[float]:
    # No GPU kernels in the trace (a CPU run): no rate.
    return flops / ms / 1e9 if ms > 0 else None


# ----- The layer -----


def build_layer(implementation: str, *, num_heads: int, num_kv_heads: int, head_dim: int, dtype):
    """A causal GroupedQueryAttention layer as the GPT configs build it (fused QKV
    projection without bias, rotary embedding on queries and keys)."""
    dim = num_heads * head_dim
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


def check_layer(args: flags.FlagValues) -> dict[str, Any]:
    """The layer part: one entry per (implementation, segment ids or not)."""
    shape = dict(num_heads=args.num_heads, num_kv_heads=args.num_kv_heads, head_dim=args.head_dim)
    dim = args.num_heads * args.head_dim
    x = jax.random.normal(jax.random.PRNGKey(0), (args.batch, args.seq_len, dim), jnp.float32)
    # Two documents per row, split at a random point.
    cut = np.random.default_rng(0).integers(1, args.seq_len, size=(args.batch, 1))
    segment_ids = jnp.asarray((np.arange(args.seq_len)[None, :] >= cut).astype(np.int32) + 1)
    ref_layer = build_layer("xla", dtype=jnp.float32, **shape)
    params = ref_layer.initialize_parameters_recursively(jax.random.PRNGKey(1))
    params16 = jax.tree.map(lambda a: a.astype(jnp.bfloat16), params)
    x16 = x.astype(jnp.bfloat16)

    def loss_fn(layer, params, x, segment_ids):
        out, _ = functional(
            layer,
            state=params,
            inputs=dict(query=x, segment_ids=segment_ids),
            prng_key=None,
            is_training=True,
        )
        return jnp.mean(out.astype(jnp.float32) ** 2), out

    results = {}
    for with_segments in (False, True):
        seg = segment_ids if with_segments else None
        ref_fn = jax.jit(
            jax.value_and_grad(lambda p, x: loss_fn(ref_layer, p, x, seg), has_aux=True)
        )
        (_, ref_out), ref_grads = ref_fn(params, x)
        for implementation in ("xla", "cudnn"):
            name = f"{implementation}{'+segments' if with_segments else ''}"
            layer = build_layer(implementation, dtype=jnp.bfloat16, **shape)
            try:
                forward = jax.jit(lambda p, x, layer=layer: loss_fn(layer, p, x, seg)[1])
                both = jax.jit(
                    jax.value_and_grad(
                        lambda p, x, layer=layer: loss_fn(layer, p, x, seg), has_aux=True
                    )
                )
                (_, out), grads = both(params16, x16)
                hlo = forward.lower(params16, x16).compile().as_text().lower()
                entry = {
                    "out_rel_err": rel_err(out, ref_out),
                    "grad_rel_err": max(
                        rel_err(g, r)
                        for g, r in zip(jax.tree.leaves(grads), jax.tree.leaves(ref_grads))
                    ),
                    "fwd_ms": gpu_time_ms(forward, params16, x16)[0],
                    "fwd_bwd_ms": gpu_time_ms(both, params16, x16)[0],
                    "hlo_has_cudnn_call": "cudnn" in hlo,
                }
            except Exception as e:  # pylint: disable=broad-except
                entry = _error_entry(e)
            results[name] = entry
            print("layer", name, json.dumps(entry), flush=True)
    return results


# ----- The op alone -----


def _repeat_kv(q, k, v):
    """K and V repeated to one head per query head (query head i reads K/V head i // G)."""
    groups = q.shape[2] // k.shape[2]
    return jnp.repeat(k, groups, axis=2), jnp.repeat(v, groups, axis=2)


def reference(q, k, v, *, scale: float):
    """float32 causal attention of [B, T, N, H] q and [B, T, K, H] k, v."""
    q = q.astype(jnp.float32)
    k, v = (x.astype(jnp.float32) for x in _repeat_kv(q, k, v))
    logits = jnp.einsum("btnh,bsnh->bnts", q, k) * scale
    seq = q.shape[1]
    logits = jnp.where(jnp.tril(jnp.ones((seq, seq), bool)), logits, -1e30)
    return jnp.einsum("bnts,bsnh->btnh", jax.nn.softmax(logits, axis=-1), v)


def op_paths(scale: float) -> dict[str, Callable]:
    """Name -> causal attention (q, k, v) -> [B, T, N, H] output, for each flash path."""

    def jax_nn(implementation, q, k, v):
        return jax.nn.dot_product_attention(
            q, k, v, scale=scale, is_causal=True, implementation=implementation
        )

    def cudnn_repeated_kv(q, k, v):
        return jax_nn("cudnn", q, *_repeat_kv(q, k, v))

    def tokamax_path(implementation, q, k, v):
        import tokamax  # pylint: disable=import-outside-toplevel

        # tokamax reads absl's global flags, which this command (its own FlagValues) leaves
        # unparsed.
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
        )  # fmt: skip
        return attention_mgpu.attention(q * scale, k, v, config)

    return {
        "xla": functools.partial(jax_nn, "xla"),
        "cudnn": functools.partial(jax_nn, "cudnn"),
        "cudnn_repeated_kv": cudnn_repeated_kv,
        "tokamax_mosaic": functools.partial(tokamax_path, "mosaic"),
        "tokamax_triton": functools.partial(tokamax_path, "triton"),
        "pallas_mosaic_gpu": pallas_mosaic_gpu,
    }


def _forward_backward(attention: Callable) -> Callable:
    """jit of (q, k, v, d_out) -> (output, (dq, dk, dv))."""

    def run(q, k, v, d_out):
        out, vjp = jax.vjp(attention, q, k, v)
        return out, vjp(d_out.astype(out.dtype))

    return jax.jit(run)


def check_op(args: flags.FlagValues) -> dict[str, Any]:
    """The op part: one entry per flash path."""
    rng = np.random.default_rng(0)
    shape_q = (args.batch, args.seq_len, args.num_heads, args.head_dim)
    shape_kv = (args.batch, args.seq_len, args.num_kv_heads, args.head_dim)
    q, d_out = (jnp.asarray(rng.normal(size=shape_q), jnp.bfloat16) for _ in range(2))
    k, v = (jnp.asarray(rng.normal(size=shape_kv), jnp.bfloat16) for _ in range(2))
    scale = args.head_dim**-0.5
    want_out, want_grads = _forward_backward(functools.partial(reference, scale=scale))(
        q, k, v, d_out
    )
    # Causal: half of QKᵀ and of AV.
    fwd_flops = 4 * args.batch * args.seq_len**2 * args.num_heads * args.head_dim / 2
    results = {}
    for name, attention in op_paths(scale).items():
        try:
            both = _forward_backward(attention)
            out, grads = both(q, k, v, d_out)
            fwd_ms, _ = gpu_time_ms(jax.jit(attention), q, k, v)
            both_ms, kernels = gpu_time_ms(both, q, k, v, d_out)
            entry = {
                "rel_err_out_dq_dk_dv": [rel_err(out, want_out)]
                + [rel_err(g, w) for g, w in zip(grads, want_grads)],
                "fwd_ms": fwd_ms,
                "fwd_bwd_ms": both_ms,
                "fwd_tflops": _tflops(fwd_flops, fwd_ms),
                "bwd_tflops": _tflops(2.5 * fwd_flops, both_ms - fwd_ms),
                "largest_kernels_ms": dict(sorted(kernels.items(), key=lambda kv: -kv[1])[:10]),
            }
        except Exception as e:  # pylint: disable=broad-except
            entry = _error_entry(e)
        results[name] = entry
        print("op", name, json.dumps(entry), flush=True)
    return results


def define_flags(flag_values: flags.FlagValues) -> None:
    """The check's flags."""
    fv = dict(flag_values=flag_values)
    flags.DEFINE_enum("part", "all", ("all",) + _PARTS, "The part to run.", **fv)
    flags.DEFINE_integer("batch", 4, "Sequences.", **fv)
    flags.DEFINE_integer("seq_len", 4096, "Tokens of a sequence.", **fv)
    flags.DEFINE_integer("num_heads", 16, "Query heads.", **fv)
    flags.DEFINE_integer("num_kv_heads", 8, "Key/value heads.", **fv)
    flags.DEFINE_integer("head_dim", 128, "Dim of a head.", **fv)
    flags.DEFINE_string("json_out", None, "Write every entry as JSON.", **fv)


def main(argv: Optional[Sequence[str]] = None) -> dict[str, Any]:
    """The command line `argv` (None: sys.argv's) run; returns every entry."""
    program = "tools/attention_check.py"
    args, _ = parse_command_flags(
        define_flags, argv, program=program, doc=f"usage: attention_check.py [flags]\n\n{__doc__}"
    )
    if args.num_heads % args.num_kv_heads:
        usage_error(program, f"--num_heads={args.num_heads} is no multiple of --num_kv_heads")
    results = {"jax_version": jax.__version__, "device": jax.devices()[0].device_kind}
    checks = {"layer": check_layer, "op": check_op}
    for part in _PARTS if args.part == "all" else (args.part,):
        results[part] = checks[part](args)
    write_json(args.json_out, results)
    return results


if __name__ == "__main__":
    main()
