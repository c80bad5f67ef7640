r"""Checks the model's GPU kernels against XLA, for correctness and speed.

The layers use five Pallas (Triton) kernels on GPU (`axlearn.common.kernels`): the
gated MLP's backward (`gated_product_backward`, SwiGLU's two input cotangents in one
pass), RMSNorm's (`rms_norm_backward`, the residual's and the norm's input gradient
and the scale's gradient, for one or two consumers of the normalized input), and for
decoding RMSNorm's forward over a step's rows (`rms_norm_forward`), a step's attention
(`decode_attention`, against cuDNN's kernel too) and the whole step's, rotation and cache
write included (`decode_step_attention`, against XLA's rotation, writes and attention; also
finishing the projections' RMSNorm). Run this on new hardware, or after a jax or Triton
upgrade, to see whether they still compile, still agree with a float64 reference as closely
as XLA does, and still beat XLA; `--sweep`
also times other block shapes and warp counts, to retune their defaults for a new card:

    PYTHONPATH=. python tools/kernel_check.py [--tokens=16384 --hidden=2048 --mlp_hidden=8192] \
        [--decode_batch=1 --heads=16 --kv_heads=8 --head_dim=128 --cache=256 --length=200] \
        [--sweep] [--json_out=kernels.json]

The defaults are gpt_1b's shapes (16,384 tokens a step, model dim 2048, MLP hidden
8192; 16 heads of 128 over 8 key/value heads, a cache of 256 keys of which 200 are
filled); give another config's to check it. One line per case: GPU ms per call (kernel
time in a profiler trace of 20 calls, so no dispatch overhead), the bandwidth the op's
minimal traffic implies (each input read once, each output written once) and the
largest error against a float64 NumPy reference, in units of the reference's largest
magnitude. The kernel should be at least as accurate as XLA and faster; a case that
fails (a block shape that does not compile) prints its error.

Alone, XLA may fuse an expression differently than inside a train step, where
`tools/op_profile.py` shows the step's kernels.
"""

import functools
from collections.abc import Callable, Sequence
from typing import Any, Optional

import jax
import jax.numpy as jnp
import numpy as np
from absl import flags

from axlearn.bench import gpu_time_ms, write_json
from axlearn.common import layers
from axlearn.common.command_flags import parse_command_flags
from axlearn.common.attention import apply_rotary_position_embeddings
from axlearn.common.kernels.decode_attention import decode_attention, decode_step_attention
from axlearn.common.kernels.gated_product import gated_product_backward
from axlearn.common.kernels.rms_norm import rms_norm_backward, rms_norm_forward

_EPS = 1e-5  # RMSNorm's epsilon in the GPT configs.


def _max_err(got: Sequence[Any], want: Sequence[np.ndarray]) -> float:
    """Largest |got - want| over all outputs, in units of the largest |want|."""
    unit = max(float(np.max(np.abs(w))) for w in want)
    errors = (np.max(np.abs(np.asarray(g, np.float64) - w)) for g, w in zip(got, want))
    return float(max(errors)) / unit


def _time_cases(
    cases: dict[str, Callable], inputs: Sequence[Any], want: Sequence[np.ndarray], min_bytes: int
) -> dict[str, dict[str, Any]]:
    """Runs, checks and times each case on `inputs`; prints and returns one entry each."""
    results = {}
    for name, fn in cases.items():
        try:
            err = _max_err(fn(*inputs), want)
            ms, _ = gpu_time_ms(fn, *inputs, calls=20)
        except Exception as e:  # pylint: disable=broad-except
            results[name] = {"error": f"{type(e).__name__}: {e}"[:500]}
            print(f"{name:60s} failed: {(str(e).splitlines() or [type(e).__name__])[0][:100]}")
            continue
        tb_per_s = min_bytes / ms / 1e9 if ms > 0 else None
        results[name] = dict(ms=ms, tb_per_s=tb_per_s, max_rel_err=err)
        rate = f"{tb_per_s:5.2f} TB/s" if tb_per_s else "   - TB/s"
        print(f"{name:60s} {ms:7.4f} ms ({rate})  max err {err:.2g}", flush=True)
    return results


# ----- The gated MLP's backward (SwiGLU) -----


def swiglu_cotangents_reference(a, b, dh) -> tuple[np.ndarray, np.ndarray]:
    """(da, db) of h = silu(a) * b for the cotangent dh, in float64."""
    a, b, dh = (np.asarray(t, np.float64) for t in (a, b, dh))
    sigmoid = 1 / (1 + np.exp(-a))
    d_silu = sigmoid * (1 + a * (1 - sigmoid))
    return dh * b * d_silu, dh * a * sigmoid


def check_gated_product(tokens: int, hidden: int, *, sweep: bool) -> dict[str, Any]:
    """XLA's and the kernel's SwiGLU backward on [tokens, hidden] bf16 inputs."""
    rng = np.random.default_rng(0)
    a, b, dh = (jnp.asarray(rng.normal(size=(tokens, hidden)), jnp.bfloat16) for _ in range(3))
    swiglu = functools.partial(
        layers.gated_product_cotangents,
        layers.get_activation_fn("nn.silu"),
        layers.get_activation_fn("linear"),
    )
    cases = {
        "gated_product xla": jax.jit(swiglu),
        "gated_product kernel": jax.jit(
            lambda *t: gated_product_backward(swiglu, *t)
        ),
    }
    if sweep:
        for block in ((2, 4096), (8, 1024), (32, 256)):
            for warps in (4, 8):
                cases[f"gated_product kernel block={block} warps={warps}"] = jax.jit(
                    lambda *t, bl=block, w=warps: gated_product_backward(
                        swiglu, *t, block=bl, num_warps=w
                    )
                )
    want = swiglu_cotangents_reference(a, b, dh)
    min_bytes = 5 * a.nbytes  # Read a, b and dh; write da and db.
    return _time_cases(cases, (a, b, dh), want, min_bytes=min_bytes)


# ----- RMSNorm's backward -----


def rms_norm_dx_reference(x, scale, dys, dresidual) -> np.ndarray:
    """In float64, the gradient of x through (x, RMSNorm(x), RMSNorm(x), ...) for the
    cotangent `dresidual` of x and one dy of `dys` for each RMSNorm(x)."""
    x, scale, dresidual = (np.asarray(t, np.float64) for t in (x, scale, dresidual))
    dy = sum(np.asarray(t, np.float64) for t in dys)
    r = 1.0 / np.sqrt(np.mean(x * x, axis=1, keepdims=True) + _EPS)
    g = dy * scale
    return dresidual + r * g - x * r**3 * np.mean(g * x, axis=1, keepdims=True)


def _xla_rms_norm_backward(consumers: int) -> Callable:
    """What autodiff gives a layer without the kernel: the VJP of (x, norm(x), ...)."""

    def forward(x, scale):
        # forward_dtype None: normalized in the input dtype, as the GPT configs do.
        # pylint: disable-next=protected-access
        return layers._residual_and_rms_norm(x, scale, _EPS, None, consumers)

    def backward(x, scale, dys, dres):
        _, vjp = jax.vjp(forward, x, scale)
        return vjp((dres, *dys))

    return jax.jit(backward)


def check_rms_norm(tokens: int, hidden: int, *, sweep: bool) -> dict[str, Any]:
    """XLA's and the kernel's RMSNorm backward on [tokens, hidden] bf16 inputs, for one
    consumer of the normalized x (attention's QKV projection) and two (the gated MLP's
    input projections). Only dx is compared: dscale is a sum over all tokens."""
    rng = np.random.default_rng(0)
    normal = lambda: jnp.asarray(rng.normal(size=(tokens, hidden)), jnp.bfloat16)  # noqa: E731
    x, dres, dy0, dy1 = normal(), normal(), normal(), normal()
    scale = jnp.asarray(1 + 0.1 * rng.normal(size=(hidden,)), jnp.bfloat16)
    results = {}
    for consumers in (1, 2):
        dys = [dy0, dy1][:consumers]
        cases = {
            f"rms_norm {consumers} dy: xla": _xla_rms_norm_backward(consumers),
            f"rms_norm {consumers} dy: kernel": jax.jit(
                lambda *t: rms_norm_backward(*t, eps=_EPS)
            ),
        }
        if sweep:
            for held in (2048, 4096, 8192):  # Elements a program holds at once.
                for walked in (65536, 131072, 262144):  # Elements a program walks through.
                    for warps in (4, 8):
                        rows = max(1, held // hidden)
                        per_program = max(rows, walked // hidden)
                        cases[
                            f"rms_norm {consumers} dy: kernel rows={rows} "
                            f"per_program={per_program} warps={warps}"
                        ] = jax.jit(
                            lambda *t, b=rows, p=per_program, w=warps: (
                                rms_norm_backward(
                                    *t, eps=_EPS, block_rows=b, rows_per_program=p, num_warps=w
                                )
                            )
                        )
        want = [rms_norm_dx_reference(x, scale, dys, dres)]
        dx_only = {name: (lambda *t, fn=fn: fn(*t)[:1]) for name, fn in cases.items()}
        min_bytes = (3 + consumers) * x.nbytes  # Read x, dres and each dy; write dx.
        results.update(_time_cases(dx_only, (x, scale, dys, dres), want, min_bytes=min_bytes))
    return results


# ----- A decoding step's attention -----


def decode_attention_reference(q, k, v, lengths) -> np.ndarray:
    """In float64, each head's softmax(q k^T) v over the first lengths[b] keys (zeros for a
    row of none): q [B,N,H], k/v [B,S,K,H], head n reading kv head n // (N / K)."""
    q, k, v = (np.asarray(t, np.float64) for t in (q, k, v))
    group = q.shape[1] // k.shape[2]
    out = np.zeros(q.shape)
    for b, length in enumerate(np.asarray(lengths)):
        if not length:
            continue
        keys = np.repeat(k[b, :length], group, axis=1)  # [length, N, H]
        values = np.repeat(v[b, :length], group, axis=1)
        logits = np.einsum("nh,snh->ns", q[b], keys)
        probs = np.exp(logits - logits.max(axis=1, keepdims=True))
        out[b] = np.einsum("ns,snh->nh", probs / probs.sum(axis=1, keepdims=True), values)
    return out


def _xla_decode_attention(q, k, v, lengths):
    """The einsum path a decoding step takes without a kernel: masked logits, softmax."""
    batch, heads, head_dim = q.shape
    kv_heads = k.shape[2]
    qg = q.reshape(batch, kv_heads, heads // kv_heads, head_dim)
    logits = jnp.einsum("bkgh,bskh->bkgs", qg, k, preferred_element_type=jnp.float32)
    valid = jnp.arange(k.shape[1])[None, :] < lengths[:, None]
    logits = jnp.where(valid[:, None, None], logits, -jnp.inf)
    probs = jax.nn.softmax(logits, axis=-1).astype(v.dtype)
    return jnp.einsum("bkgs,bskh->bkgh", probs, v).reshape(q.shape)


def check_decode_attention(
    batch: int, heads: int, kv_heads: int, head_dim: int, cache: int, length: int, *, sweep: bool
) -> dict[str, Any]:
    """XLA's, cuDNN's (on a GPU) and the kernel's attention of one bf16 query a row against
    a cache of `cache` keys, the first `length` filled."""
    rng = np.random.default_rng(0)
    q = jnp.asarray(rng.normal(size=(batch, heads, head_dim)) * head_dim**-0.5, jnp.bfloat16)
    k, v = (
        jnp.asarray(rng.normal(size=(batch, cache, kv_heads, head_dim)), jnp.bfloat16)
        for _ in range(2)
    )
    lengths = jnp.full((batch,), length, jnp.int32)
    cases = {
        "decode_attention xla": jax.jit(_xla_decode_attention),
        "decode_attention cudnn": jax.jit(
            lambda q_, k_, v_, n: jax.nn.dot_product_attention(
                q_[:, None], k_, v_, scale=1.0, key_value_seq_lengths=n, implementation="cudnn"
            )[:, 0]
        ),
        "decode_attention kernel": jax.jit(decode_attention),
    }
    if sweep:
        for block in (32, 64, 128, 256):
            for warps in (2, 4, 8):
                for stages in (1, 2, 3):
                    cases[
                        f"decode_attention kernel block={block} warps={warps} stages={stages}"
                    ] = jax.jit(
                        lambda *t, bl=block, w=warps, st=stages: decode_attention(
                            *t, block_keys=bl, num_warps=w, num_stages=st
                        )
                    )
    want = [decode_attention_reference(q, k, v, lengths)]
    single = {name: (lambda *t, fn=fn: [fn(*t)]) for name, fn in cases.items()}
    min_bytes = 2 * q.nbytes + 2 * batch * length * kv_heads * head_dim * k.dtype.itemsize
    return _time_cases(single, (q, k, v, lengths), want, min_bytes=min_bytes)


def rotated_reference(x, sin_cos) -> np.ndarray:
    """In float64, x [..., H] rotated by the angles of sin_cos [..., H] (sines first)
    broadcast over its heads: pairs (x[i], x[i + H/2]), as the layers rotate."""
    x, sin_cos = np.asarray(x, np.float64), np.asarray(sin_cos, np.float64)
    half = x.shape[-1] // 2
    sin, cos = sin_cos[..., None, :half], sin_cos[..., None, half:]
    x1, x2 = x[..., :half], x[..., half:]
    return np.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1)


def _xla_decode_step(qkv, key_cache, value_cache, steps, sin_cos, *, heads, scale):
    """What a layer emits without the step kernel: slices of the fused projection, the
    rotation, two cache writes, the einsum attention."""
    kv_heads = key_cache.shape[2]
    q, k, v = qkv[:, :heads], qkv[:, heads : heads + kv_heads], qkv[:, heads + kv_heads :]
    q = apply_rotary_position_embeddings(q[:, None], sin_cos[:, None])[:, 0]
    k = apply_rotary_position_embeddings(k[:, None], sin_cos[:, None])
    write = jax.vmap(lambda c, n, t: jax.lax.dynamic_update_slice(c, n, (t, 0, 0)))
    key_cache, value_cache = write(key_cache, k, steps), write(value_cache, v[:, None], steps)
    q = q * jnp.asarray(scale, q.dtype)
    return _xla_decode_attention(q, key_cache, value_cache, steps + 1)


def check_decode_step(
    batch: int, heads: int, kv_heads: int, head_dim: int, cache: int, length: int, hidden: int
) -> dict[str, Any]:
    """XLA's and the kernel's whole decoding step (rotation, cache write, attention) of one
    bf16 token a row at position `length` - 1 of a cache of `cache` keys; then again with
    the projections' RMSNorm left to the step (`unfinished norm`: the kernel reads the
    [batch, hidden] input and divides by its RMS; XLA scales the projections first)."""
    rng = np.random.default_rng(0)
    qkv = jnp.asarray(rng.normal(size=(batch, heads + 2 * kv_heads, head_dim)), jnp.bfloat16)
    key_cache, value_cache = (
        jnp.asarray(rng.normal(size=(batch, cache, kv_heads, head_dim)), jnp.bfloat16)
        for _ in range(2)
    )
    steps = jnp.full((batch,), length - 1, jnp.int32)
    angles = rng.uniform(0, 2 * np.pi, size=(batch, head_dim // 2))
    sin_cos = jnp.asarray(np.concatenate([np.sin(angles), np.cos(angles)], axis=-1), jnp.float32)
    scale = head_dim**-0.5
    cases = {
        "decode_step xla": jax.jit(
            functools.partial(_xla_decode_step, heads=heads, scale=scale)
        ),
        "decode_step kernel": jax.jit(
            lambda *t: decode_step_attention(*t, num_heads=heads, query_scale=scale)[0]
        ),
    }

    def reference(projected: np.ndarray) -> list[np.ndarray]:
        q = rotated_reference(projected[:, :heads], sin_cos) * scale
        k = rotated_reference(projected[:, heads : heads + kv_heads], sin_cos)
        keys, values = np.array(key_cache, np.float64), np.array(value_cache, np.float64)
        keys[:, length - 1], values[:, length - 1] = k, projected[:, heads + kv_heads :]
        return [decode_attention_reference(q, keys, values, np.asarray(steps) + 1)]

    single = {name: (lambda *t, fn=fn: [fn(*t)]) for name, fn in cases.items()}
    min_bytes = 2 * qkv.nbytes + 2 * batch * length * kv_heads * head_dim * 2
    inputs = (qkv, key_cache, value_cache, steps, sin_cos)
    results = _time_cases(single, inputs, reference(np.asarray(qkv, np.float64)), min_bytes)
    x = jnp.asarray(rng.normal(size=(batch, hidden)), jnp.bfloat16)

    def xla_unfinished(qkv_, *rest):
        row_scale = layers.inverse_rms(rest[-1].astype(jnp.float32), _EPS)[:, :, None]
        qkv_ = (qkv_.astype(jnp.float32) * row_scale).astype(qkv_.dtype)
        return [_xla_decode_step(qkv_, *rest[:-1], heads=heads, scale=scale)]

    def kernel_unfinished(*t):
        return [decode_step_attention(*t, num_heads=heads, query_scale=scale, norm_eps=_EPS)[0]]

    unfinished = {
        "decode_step unfinished norm: xla": jax.jit(xla_unfinished),
        "decode_step unfinished norm: kernel": jax.jit(kernel_unfinished),
    }
    x64 = np.asarray(x, np.float64)
    row_scale = 1 / np.sqrt(np.mean(x64 * x64, axis=-1) + _EPS)
    want = reference(np.asarray(qkv, np.float64) * row_scale[:, None, None])
    results.update(_time_cases(unfinished, inputs + (x,), want, min_bytes + x.nbytes))
    return results


def check_rms_norm_forward(batch: int, hidden: int) -> dict[str, Any]:
    """XLA's and the kernel's RMSNorm forward (float32 inside) of a decoding step's
    [batch, hidden] bf16 rows."""
    rng = np.random.default_rng(0)
    x = jnp.asarray(rng.normal(size=(batch, hidden)), jnp.bfloat16)
    scale = jnp.asarray(1 + 0.1 * rng.normal(size=(hidden,)), jnp.bfloat16)
    cases = {
        # pylint: disable-next=protected-access
        "rms_norm forward xla": jax.jit(lambda x_, s: [layers._rms_norm(x_, s, _EPS, jnp.float32)]),
        "rms_norm forward kernel": jax.jit(lambda x_, s: [rms_norm_forward(x_, s, eps=_EPS)]),
    }
    x64, scale64 = np.asarray(x, np.float64), np.asarray(scale, np.float64)
    want = [x64 / np.sqrt(np.mean(x64 * x64, axis=1, keepdims=True) + _EPS) * scale64]
    return _time_cases(cases, (x, scale), want, min_bytes=2 * x.nbytes)


def define_flags(flag_values: flags.FlagValues) -> None:
    """The check's flags."""
    fv = dict(flag_values=flag_values)
    flags.DEFINE_integer("tokens", 16384, "Tokens (rows) of a step.", **fv)
    flags.DEFINE_integer("hidden", 2048, "Model dim (the normalized rows' width).", **fv)
    flags.DEFINE_integer("mlp_hidden", 8192, "The gated MLP's hidden dim.", **fv)
    flags.DEFINE_integer("decode_batch", 1, "Rows of a decoding step.", **fv)
    flags.DEFINE_integer("heads", 16, "Query heads.", **fv)
    flags.DEFINE_integer("kv_heads", 8, "Key/value heads.", **fv)
    flags.DEFINE_integer("head_dim", 128, "Dims a head.", **fv)
    flags.DEFINE_integer("cache", 256, "Keys the decoding cache holds.", **fv)
    flags.DEFINE_integer("length", 200, "Keys of the cache filled (attended to).", **fv)
    flags.DEFINE_bool("sweep", False, "Also time other block shapes.", **fv)
    flags.DEFINE_string("json_out", None, "Write every entry as JSON.", **fv)


def main(argv: Optional[Sequence[str]] = None) -> dict[str, Any]:
    """The command line `argv` (None: sys.argv's) run; returns every entry."""
    args, _ = parse_command_flags(
        define_flags, argv, program="tools/kernel_check.py",
        doc=f"usage: kernel_check.py [flags]\n\n{__doc__}",
    )
    results = {"jax_version": jax.__version__, "device": jax.devices()[0].device_kind}
    results.update(check_gated_product(args.tokens, args.mlp_hidden, sweep=args.sweep))
    results.update(check_rms_norm(args.tokens, args.hidden, sweep=args.sweep))
    results.update(
        check_decode_attention(
            args.decode_batch, args.heads, args.kv_heads, args.head_dim, args.cache,
            args.length, sweep=args.sweep,
        )
    )
    results.update(
        check_decode_step(
            args.decode_batch, args.heads, args.kv_heads, args.head_dim, args.cache, args.length,
            args.hidden,
        )
    )
    results.update(check_rms_norm_forward(args.decode_batch, args.hidden))
    write_json(args.json_out, results)
    return results


if __name__ == "__main__":
    main()
