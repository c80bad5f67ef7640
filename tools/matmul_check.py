r"""Times each matrix multiply of a gpt_1b train step alone, on the local GPU.

Matmuls are most of a GPT step's time. Run this on new hardware, or after a jax or CUDA
upgrade, to see the rate each of the step's matmul shapes reaches and which kernel XLA
picks for it, and to compare with the step's own matmul time in `tools/op_profile.py`:

    PYTHONPATH=. python tools/matmul_check.py [--back_to_back=1500] [--json_out=mm.json]

For every weight of a gpt_1b layer and the LM head (16,384 tokens a step, bf16), the
three matmuls a step runs with it: forward (x·W), input gradient (dy·Wᵀ) and weight
gradient (xᵀ·dy). Each line: GPU ms per call (kernel time in a profiler trace of 10
calls), TFLOP/s, and the kernel. Last, the sum over all matmuls of a step: what they
would take on a card that stays at full clock.

`--back_to_back=N` then calls the MLP weight-gradient matmul N times without a pause and
prints its mean time per tenth of the calls. A card that reaches its power limit lowers
its clock under a long run of matmuls: the later tenths then run slower, as the matmuls
of a real step do. Compare the last tenth with the first to see how much.
"""

import tempfile
from collections.abc import Sequence
from typing import Any, Optional

import jax
import jax.numpy as jnp
import numpy as np
from absl import flags

from axlearn.bench import gpu_kernel_events, gpu_time_ms, write_json
from axlearn.common.command_flags import parse_command_flags, usage_error

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


def define_flags(flag_values: flags.FlagValues) -> None:
    """The check's flags."""
    fv = dict(flag_values=flag_values)
    flags.DEFINE_integer(
        "back_to_back", 0, "Then time this many back-to-back calls of one matmul (0: skip).",
        lower_bound=0, **fv,
    )
    flags.DEFINE_string("json_out", None, "Write every entry as JSON.", **fv)


def main(argv: Optional[Sequence[str]] = None) -> dict[str, Any]:
    """The command line `argv` (None: sys.argv's) run; returns every entry."""
    program = "tools/matmul_check.py"
    args, _ = parse_command_flags(
        define_flags, argv, program=program, doc=f"usage: matmul_check.py [flags]\n\n{__doc__}"
    )
    if jax.default_backend() != "gpu":
        usage_error(
            program, f"it times GPU kernels; this machine's backend is {jax.default_backend()}"
        )
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
    write_json(args.json_out, results)
    return results


if __name__ == "__main__":
    main()
