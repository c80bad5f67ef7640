"""Times `gpu_kernels.rms_norm_backward` against XLA at gpt_1b's residual-stream shape.

    PYTHONPATH=. python benchmarks/norm_check.py [--tokens=16384 --hidden=2048] [--json_out=norm.json]

The op is the backward pass of a pre-norm block's input x ([tokens, hidden], bf16): the
residual's gradient plus RMSNorm's input gradient, and the scale's gradient, with the
normalized x read by one consumer (the attention's fused QKV projection) or two (the
gated MLP's input projections, whose gradients are summed). GPU milliseconds per call
(kernel time in a profiler trace of 20 calls, so no dispatch overhead), the bandwidth the
op's minimal traffic implies (read x, each dy and the residual's gradient; write dx), and
the largest difference of dx from a float64 NumPy reference, in units of the largest
|dx|. Then a sweep of the kernel's elements held at once and walked through a program,
and warps (golf_baseline's norms: --tokens=524288 --hidden=256).

Alone, XLA may fuse the expression differently than inside a train step
(benchmarks/op_profile.py shows the step's kernels).
"""

import argparse

import jax
import jax.numpy as jnp
import numpy as np

from axlearn.bench import gpu_time_ms, write_json
from axlearn.common import gpu_kernels, layers

_EPS = 1e-5


def _reference_dx(x, scale, dys, dres) -> np.ndarray:
    x, scale, dres = (np.asarray(t, np.float64) for t in (x, scale, dres))
    dy = sum(np.asarray(t, np.float64) for t in dys)
    r = 1.0 / np.sqrt(np.mean(x * x, axis=1, keepdims=True) + _EPS)
    g = dy * scale
    return dres + r * g - x * r**3 * np.mean(g * x, axis=1, keepdims=True)


def _xla(consumers: int):
    """What autodiff gives a layer without the kernel: (x, norm(x), ...), all used."""

    def backward(x, scale, dys, dres):
        _, vjp = jax.vjp(
            lambda a, s: (a,) + (layers._rms_norm(a, s, _EPS, None),) * consumers, x, scale
        )
        return vjp((dres, *dys))

    return jax.jit(backward)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--tokens", type=int, default=16384)
    parser.add_argument("--hidden", type=int, default=2048)
    parser.add_argument("--json_out", default=None)
    args = parser.parse_args()
    rng = np.random.default_rng(0)
    normal = lambda: jnp.asarray(rng.normal(size=(args.tokens, args.hidden)), jnp.bfloat16)  # noqa: E731
    x, dres, dy0, dy1 = normal(), normal(), normal(), normal()
    scale = jnp.asarray(1 + 0.1 * rng.normal(size=(args.hidden,)), jnp.bfloat16)
    results = {}
    for consumers in (1, 2):
        dys = [dy0, dy1][:consumers]
        min_bytes = (3 + consumers) * x.nbytes
        want = _reference_dx(x, scale, dys, dres)
        unit = float(np.max(np.abs(want)))
        variants = {f"{consumers} dy: xla": _xla(consumers)}
        for held in (2048, 4096, 8192):
            for walked in (65536, 131072, 262144):
                for warps in (4, 8):
                    block_rows = max(1, held // args.hidden)
                    per_program = max(block_rows, walked // args.hidden)
                    name = (
                        f"{consumers} dy: kernel rows={block_rows} per_program={per_program} "
                        f"warps={warps}"
                    )
                    variants[name] = jax.jit(
                        lambda *t, b=block_rows, p=per_program, w=warps: (
                            gpu_kernels.rms_norm_backward(
                                *t, eps=_EPS, block_rows=b, rows_per_program=p, num_warps=w
                            )
                        )
                    )
        for name, fn in variants.items():
            try:
                dx, _ = fn(x, scale, dys, dres)
                ms, _ = gpu_time_ms(fn, x, scale, dys, dres, calls=20)
            except Exception as e:  # A block that does not compile is reported, not fatal.
                print(f"{name:64s} failed: {str(e).splitlines()[0][:100]}")
                continue
            err = float(np.max(np.abs(np.asarray(dx, np.float64) - want))) / unit
            results[name] = dict(ms=ms, tb_per_s=min_bytes / ms / 1e9, max_rel_err=err)
            print(f"{name:64s} {ms:7.4f} ms ({min_bytes / ms / 1e9:5.2f} TB/s)  max err {err:.2g}")
    write_json(args.json_out, results)


if __name__ == "__main__":
    main()
