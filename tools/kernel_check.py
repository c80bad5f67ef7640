"""Times `gpu_kernels.gated_product_backward` against XLA at gpt_1b's MLP shape.

    PYTHONPATH=. python benchmarks/kernel_check.py [--json_out=kernels.json]

GPU milliseconds per call (kernel time in a profiler trace of 20 calls, so no dispatch
overhead), the bandwidth the op's minimal traffic implies (read a, b, dh; write da, db),
and the kernel's largest difference from XLA. Then a sweep of the kernel's block shape
and warp count.

Alone, XLA emits the expression as one kernel too; inside a train step it splits it in
two (benchmarks/op_profile.py shows it), which is why the kernel pays off there.
"""

import argparse
import functools

import jax
import jax.numpy as jnp
import numpy as np

from axlearn.bench import gpu_time_ms, write_json
from axlearn.common import gpu_kernels, layers

_TOKENS, _HIDDEN = 16384, 8192


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--json_out", default=None)
    args = parser.parse_args()
    rng = np.random.default_rng(0)
    a, b, dh = (jnp.asarray(rng.normal(size=(_TOKENS, _HIDDEN)), jnp.bfloat16) for _ in range(3))
    min_bytes = 5 * a.nbytes
    swiglu = functools.partial(
        layers.gated_product_cotangents,
        layers.get_activation_fn("nn.silu"),
        layers.get_activation_fn("linear"),
    )

    xla = jax.jit(swiglu)
    variants = {"xla": xla}
    for block in ((8, 1024), (2, 4096), (32, 256)):
        for warps in (4, 8):
            variants[f"kernel block={block} warps={warps}"] = jax.jit(
                lambda *t, bl=block, w=warps: gpu_kernels.gated_product_backward(
                    swiglu, *t, block=bl, num_warps=w
                )
            )
    want = xla(a, b, dh)
    results = {}
    for name, fn in variants.items():
        got = fn(a, b, dh)
        err = max(
            float(jnp.max(jnp.abs(g.astype(jnp.float32) - w.astype(jnp.float32))))
            for g, w in zip(got, want)
        )
        ms, _ = gpu_time_ms(fn, a, b, dh, calls=20)
        results[name] = dict(ms=ms, tb_per_s=min_bytes / ms / 1e9, max_abs_diff_from_xla=err)
        print(f"{name:36s} {ms:7.3f} ms ({min_bytes / ms / 1e9:5.2f} TB/s)  max |diff| {err:.3g}")
    write_json(args.json_out, results)


if __name__ == "__main__":
    main()
