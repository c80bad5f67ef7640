"""Gradient accumulation of one weight over microbatches, two ways, on one GPU.

    PYTHONPATH=. python benchmarks/accumulate_check.py

gpt_1b's MLP output weight ([8192, 2048]) and 16,384 tokens a microbatch, 4 microbatches
in a `jax.lax.scan` as the learner runs them:

- bf16_dw_then_add: the weight gradient as a backward pass through a cast weight makes
  it (the model's, before `base_layer.WeightWithCopy`), bf16 out of the matmul, then
  converted and added to the float32 sum in a pass of its own (reading the sum and
  writing it back);
- f32_dw: the matmul writes a float32 gradient, which lets XLA fold the add into the
  cuBLAS call (C = the sum, beta = 1) so that no separate pass is left.

Prints, for each, the GPU time of one call (all microbatches), the relative error of the
sum against a float32 NumPy reference, the betas of the cuBLAS calls, the fusions of the
optimized HLO and the largest kernels. (Both also copy each microbatch's input out of the
stacked array, the `memcpy` rows; in a train step the microbatches are token ids.)

Then the same question inside a whole backward pass: an MLP of two such matmuls
([16384, 2048] -> 8192 -> 2048, relu), its float32 weights' gradients summed over the four
microbatches, with the bf16 weight copies made once before the scan as the trainer carries
them. `mlp_bf16_dw` differentiates through the copies as the model did before
`base_layer.WeightWithCopy` (bf16 weight gradients, then the float32 adds); `mlp_f32_dw`
uses `matmul_with_f32_weight_grad`, a custom VJP that computes each weight gradient in
float32 for the float32 weight, as `base_layer.weight_einsum` now does.
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


@jax.custom_vjp
def _weight_cast(weight, weight_copy):
    """weight_copy (= weight in bf16) in the forward pass; the bf16 gradient to weight."""
    del weight
    return weight_copy


_weight_cast.defvjp(
    lambda weight, copy: (copy, jnp.zeros((0,), weight.dtype)),
    lambda residual, g: (g.astype(residual.dtype), None),
)


@jax.custom_vjp
def matmul_with_f32_weight_grad(x, weight, weight_copy):
    """x @ weight_copy; the gradient of the float32 `weight` comes out of its matmul in float32."""
    del weight
    return x @ weight_copy


def _matmul_fwd(x, weight, weight_copy):
    return x @ weight_copy, (x, weight_copy)


def _matmul_bwd(residuals, dy):
    x, weight_copy = residuals
    dw = jnp.einsum("ti,to->io", x, dy, preferred_element_type=jnp.float32)
    return dy @ weight_copy.T, dw, None


matmul_with_f32_weight_grad.defvjp(_matmul_fwd, _matmul_bwd)


def mlp_gradients(f32_gradient: bool):
    """A jitted (weights, x [K, T, D]) -> the float32 weights' gradients summed over K."""
    matmul = matmul_with_f32_weight_grad if f32_gradient else lambda x, w, c: x @ _weight_cast(w, c)

    def loss(weights, copies, x):
        h = jax.nn.relu(matmul(x, weights[0], copies[0]))
        return jnp.sum(jnp.square(matmul(h, weights[1], copies[1]).astype(jnp.float32))) * 1e-6

    def run(weights, x):
        copies = [w.astype(jnp.bfloat16) for w in weights]

        def body(total, x_k):
            grads = jax.grad(loss)(weights, copies, x_k)
            return [t + g.astype(jnp.float32) for t, g in zip(total, grads)], None

        return jax.lax.scan(body, [jnp.zeros_like(w) for w in weights], x)[0]

    return jax.jit(run)


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

    x = x[..., :OUT_DIM]  # [K, T, 2048] activations
    weights = [
        jnp.asarray(rng.normal(size=shape) * shape[0] ** -0.5, jnp.float32)
        for shape in ((OUT_DIM, IN_DIM), (IN_DIM, OUT_DIM))
    ]
    sums = {}
    for name, f32_gradient in (("mlp_bf16_dw", False), ("mlp_f32_dw", True), ("mlp_bf16_dw again", False)):
        fn = mlp_gradients(f32_gradient)
        betas = re.findall(r'"beta":([0-9.]+)', fn.lower(weights, x).compile().as_text())
        sums[f32_gradient] = [np.asarray(g) for g in fn(weights, x)]
        ms, kernels = gpu_time_ms(fn, weights, x)
        print(f"{name}: {ms:.3f} ms a call ({MICROBATCHES} microbatches), cuBLAS betas {betas}")
        for kernel, kernel_ms in sorted(kernels.items(), key=lambda kv: -kv[1])[:10]:
            print(f"    {kernel_ms:.3f} {kernel[:100]}")
    for i, (a, b) in enumerate(zip(sums[False], sums[True])):
        print(f"weight {i}: bf16 against float32 gradients, relative difference "
              f"{np.linalg.norm(a - b) / np.linalg.norm(b):.2e}")


if __name__ == "__main__":
    main()
