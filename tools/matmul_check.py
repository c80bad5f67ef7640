r"""Times each matrix multiply of a gpt_1b step alone, and one of them back to back.

    PYTHONPATH=. python benchmarks/matmul_check.py [--back_to_back=1500] [--stacked_mlp_input=400] \
        [--json_out=mm.json]

For every weight of the layer and the LM head, the three matmuls a step runs with it:
forward (x·W), input gradient (dy·Wᵀ) and weight gradient (xᵀ·dy), each as GPU time from
a profiler trace of 10 calls, with the kernel XLA picked. Their sum over a step is what
the step's matmuls would take on a cold card.

`--back_to_back=N` then calls the MLP weight-gradient matmul N times without a pause and
prints its time per tenth of the calls: on a card that reaches its power limit the later
calls run slower, which is what the step's profile sees (docs/benchmarks.md).

`--stacked_mlp_input=N` times the gated MLP's two input projections, in each layout, as
two matmuls (and, for the input gradient, their sum) against one matmul on the weights
stacked side by side, [input, 2 × hidden]: N calls back to back per side, on a card first
warmed to its power limit, four rounds with the order flipped each round.
"""

import argparse
import tempfile
import time

import jax
import jax.numpy as jnp
import numpy as np

from axlearn.bench import gpu_kernel_events, gpu_time_ms, write_json

# gpt_1b: 16,384 tokens a step; weight name -> (input dim, output dim, uses a step).
_TOKENS = 16384
_WEIGHTS = {
    "qkv_proj": (2048, 4096, 16),
    "o_proj": (2048, 2048, 16),
    "mlp_input (each of 2)": (2048, 8192, 32),
    "mlp_output": (8192, 2048, 16),
    "lm_head": (2048, 32768, 1),
}
# Layout -> (its operands from x, w, dy; the matmul).
_MATMULS = {
    "forward": (lambda x, w, dy: (x, w), jax.jit(lambda x, w: x @ w)),
    "input_grad": (lambda x, w, dy: (dy, w), jax.jit(lambda dy, w: jnp.einsum("mo,io->mi", dy, w))),
    "weight_grad": (lambda x, w, dy: (x, dy), jax.jit(lambda x, dy: jnp.einsum("mi,mo->io", x, dy))),
}


def _back_to_back_ms(fn, args, calls: int) -> list[float]:
    """GPU time of each of `calls` back-to-back calls of `fn`, in order."""
    jax.block_until_ready(fn(*args))
    with tempfile.TemporaryDirectory() as trace_dir:
        with jax.profiler.trace(trace_dir):
            outs = [fn(*args) for _ in range(calls)]
            jax.block_until_ready(outs)
        del outs  # Free the card before whatever runs next.
        events = gpu_kernel_events(trace_dir)
    return [e.ms for e in events if not e.name.startswith("Memset")]


def _stacked_mlp_input_ms(rng: np.random.Generator, calls: int, rounds: int = 4) -> dict:
    """Mean ms a call of the two MLP input projections, per layout, as two matmuls
    ('<layout>/two') or one on the stacked weights ('<layout>/stacked')."""
    d_in, hidden, _ = _WEIGHTS["mlp_input (each of 2)"]
    bf16 = lambda *shape: jnp.asarray(rng.normal(size=shape), jnp.bfloat16)  # noqa: E731
    x, dh0, dh1 = bf16(_TOKENS, d_in), bf16(_TOKENS, hidden), bf16(_TOKENS, hidden)
    w0, w1 = bf16(d_in, hidden), bf16(d_in, hidden)
    w = jnp.concatenate([w0, w1], axis=1)
    dh = jnp.concatenate([dh0, dh1], axis=1)
    sides = {
        "forward/two": (jax.jit(lambda x, a, b: (x @ a, x @ b)), (x, w0, w1)),
        "forward/stacked": (jax.jit(lambda x, w: x @ w), (x, w)),
        "input_grad/two": (jax.jit(lambda a, b, u, v: a @ u.T + b @ v.T), (dh0, dh1, w0, w1)),
        "input_grad/stacked": (jax.jit(lambda d, w: d @ w.T), (dh, w)),
        "weight_grad/two": (jax.jit(lambda x, a, b: (x.T @ a, x.T @ b)), (x, dh0, dh1)),
        "weight_grad/stacked": (jax.jit(lambda x, d: x.T @ d), (x, dh)),
    }

    def run(name: str, n: int) -> float:
        """Wall ms a call over n calls back to back (each output freed by the next)."""
        fn, args = sides[name]
        start = time.perf_counter()
        for _ in range(n):
            out = fn(*args)
        jax.block_until_ready(out)
        return (time.perf_counter() - start) / n * 1e3

    for name in sides:
        run(name, 1)  # Compiles.
    run("forward/stacked", 1500)  # Brings the card to its power limit.
    times = {name: [] for name in sides}
    for round_ in range(rounds):
        for name in list(sides)[:: 1 if round_ % 2 == 0 else -1]:
            times[name].append(run(name, calls))
    return {name: float(np.mean(ms)) for name, ms in times.items()}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--back_to_back", type=int, default=0)
    parser.add_argument("--stacked_mlp_input", type=int, default=0)
    parser.add_argument("--json_out", default=None)
    args = parser.parse_args()
    rng = np.random.default_rng(0)
    results, step_ms = {}, 0.0
    for name, (d_in, d_out, uses) in _WEIGHTS.items():
        x = jnp.asarray(rng.normal(size=(_TOKENS, d_in)), jnp.bfloat16)
        w = jnp.asarray(rng.normal(size=(d_in, d_out)) / np.sqrt(d_in), jnp.bfloat16)
        dy = jnp.asarray(rng.normal(size=(_TOKENS, d_out)), jnp.bfloat16)
        flops = 2 * _TOKENS * d_in * d_out
        for layout, (operands, matmul) in _MATMULS.items():
            ms, kernels = gpu_time_ms(matmul, *operands(x, w, dy))
            kernel = max(kernels, key=kernels.get)
            step_ms += uses * ms
            results[f"{name}/{layout}"] = dict(ms=ms, tflops=flops / ms / 1e9, kernel=kernel)
            print(f"{name:22s} {layout:12s} {ms:7.3f} ms {flops / ms / 1e9:5.0f} TFLOP/s  {kernel[:60]}")
    print(f"all matmuls of one step, alone: {step_ms:.1f} ms")
    results["step_ms"] = step_ms
    if args.back_to_back:
        d_in, d_out, _ = _WEIGHTS["mlp_input (each of 2)"]
        x = jnp.asarray(rng.normal(size=(_TOKENS, d_in)), jnp.bfloat16)
        dy = jnp.asarray(rng.normal(size=(_TOKENS, d_out)), jnp.bfloat16)
        times = _back_to_back_ms(_MATMULS["weight_grad"][1], (x, dy), args.back_to_back)
        flops = 2 * _TOKENS * d_in * d_out
        tenth = max(len(times) // 10, 1)
        chunks = [float(np.mean(times[i:i + tenth])) for i in range(0, len(times), tenth)]
        for i, ms in enumerate(chunks):
            print(f"back to back, calls {i * tenth:5d}+: {ms:.3f} ms ({flops / ms / 1e9:.0f} TFLOP/s)")
        results["back_to_back_ms"] = chunks
    if args.stacked_mlp_input:
        stacked = _stacked_mlp_input_ms(rng, args.stacked_mlp_input)
        for layout in _MATMULS:
            two, one = stacked[f"{layout}/two"], stacked[f"{layout}/stacked"]
            print(f"MLP inputs, {layout:12s} two matmuls {two:.3f} ms, stacked {one:.3f} ms ({one - two:+.3f})")
        results["stacked_mlp_input_ms"] = stacked
    write_json(args.json_out, results)


if __name__ == "__main__":
    main()
