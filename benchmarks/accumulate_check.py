"""Gradient accumulation of one weight over microbatches, two ways, on one GPU.

    PYTHONPATH=. python benchmarks/accumulate_check.py

gpt_1b's MLP output weight ([8192, 2048]) and 16,384 tokens a microbatch, 4 microbatches
in a `jax.lax.scan` as the learner runs them:

- bf16_dw_then_add: the weight gradient as the model's backward pass makes it today,
  bf16 out of the matmul, then converted and added to the float32 sum in a pass of its
  own (reading the sum and writing it back);
- f32_dw: the matmul writes a float32 gradient, which lets XLA fold the add into the
  cuBLAS call (C = the sum, beta = 1) so that no separate pass is left.

Prints, for each, the GPU time of one call (all microbatches), the relative error of the
sum against a float32 NumPy reference, the betas of the cuBLAS calls, the fusions of the
optimized HLO and the largest kernels. (Both also copy each microbatch's input out of the
stacked array, the `memcpy` rows; in a train step the microbatches are token ids.)
"""

import re

import jax
import jax.numpy as jnp
import numpy as np

from axlearn.bench import gpu_time_ms

MICROBATCHES, TOKENS, IN_DIM, OUT_DIM = 4, 16384, 8192, 2048


def accumulate(f32_gradient: bool):
    """A jitted (sum, x [K, T, I], dy [K, T, O]) -> sum + sum_k x_k^T dy_k in float32."""

    def run(total, x, dy):
        def body(total, xs):
            x_k, dy_k = xs
            if f32_gradient:
                dw = jnp.einsum("ti,to->io", x_k, dy_k, preferred_element_type=jnp.float32)
            else:
                dw = jnp.einsum("ti,to->io", x_k, dy_k).astype(jnp.float32)
            return total + dw, None

        return jax.lax.scan(body, total, (x, dy))[0]

    return jax.jit(run, donate_argnums=0)


def main() -> None:
    rng = np.random.default_rng(0)
    x = jnp.asarray(rng.normal(size=(MICROBATCHES, TOKENS, IN_DIM)), jnp.bfloat16)
    dy = jnp.asarray(rng.normal(size=(MICROBATCHES, TOKENS, OUT_DIM)) * 0.01, jnp.bfloat16)
    zeros = lambda: jnp.zeros((IN_DIM, OUT_DIM), jnp.float32)  # noqa: E731 (donated each call)
    # One BLAS matmul over all microbatches' tokens (np.einsum would not use BLAS here).
    want = np.asarray(x, np.float32).reshape(-1, IN_DIM).T @ np.asarray(dy, np.float32).reshape(-1, OUT_DIM)
    for name, f32_gradient in (("bf16_dw_then_add", False), ("f32_dw", True)):
        fn = accumulate(f32_gradient)
        hlo = fn.lower(zeros(), x, dy).compile().as_text()
        betas = re.findall(r'"beta":([0-9.]+)', hlo)
        fusions = [line.split("=")[0].strip() for line in hlo.splitlines() if re.search(r"= \S+ fusion\(", line)]
        got = np.asarray(fn(zeros(), x, dy))
        err = float(np.linalg.norm(got - want) / np.linalg.norm(want))
        ms, kernels = gpu_time_ms(lambda a, b: fn(zeros(), a, b), x, dy)
        print(f"{name}: {ms:.3f} ms a call ({MICROBATCHES} microbatches), relative error {err:.2e}, "
              f"cuBLAS betas {betas}, fusions {fusions}")
        for kernel, kernel_ms in sorted(kernels.items(), key=lambda kv: -kv[1])[:6]:
            print(f"    {kernel_ms:.3f} {kernel[:100]}")


if __name__ == "__main__":
    main()
