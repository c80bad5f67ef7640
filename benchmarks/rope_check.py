"""Times rotary position embeddings alone at gpt_1b's and golf_baseline's query shapes.

    PYTHONPATH=. python benchmarks/rope_check.py [--json_out=rope.json]

GPU microseconds per call (kernel time in a profiler trace of 20 calls, so no dispatch
overhead) of `attention.apply_rotary_position_embeddings` followed by the query scale,
forward alone and forward with backward, and the bandwidth the forward's minimal traffic
implies (read x, write the result). Run it in two trees to compare two formulations.
"""

import argparse

import jax
import jax.numpy as jnp
import numpy as np

from axlearn.bench import gpu_time_ms, write_json
from axlearn.common import attention
from axlearn.common.module import functional

# (batch, seq, heads, head dim) of the queries of one layer.
_SHAPES = {"gpt_1b": (4, 4096, 16, 128), "golf_baseline": (512, 1024, 8, 64)}


def _sin_cos(batch: int, seq: int, head_dim: int) -> jax.Array:
    layer = attention.RoFormerSinusoidalPositionalEmbedding.default_config().set(
        name="rope", dim=head_dim
    ).instantiate(parent=None)
    positions = jnp.broadcast_to(jnp.arange(seq, dtype=jnp.int32), (batch, seq))
    sin_cos, _ = functional(layer, state={}, inputs=(positions,), prng_key=None, is_training=False)
    return sin_cos


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--json_out", default=None)
    args = parser.parse_args()
    rng = np.random.default_rng(0)
    results = {}
    for name, (batch, seq, heads, head_dim) in _SHAPES.items():
        x = jnp.asarray(rng.normal(size=(batch, seq, heads, head_dim)), jnp.bfloat16)
        dy = jnp.asarray(rng.normal(size=x.shape), jnp.bfloat16)
        sin_cos = _sin_cos(batch, seq, head_dim)
        scale = jnp.asarray(head_dim**-0.5, jnp.bfloat16)

        def rope(x_, sin_cos_=sin_cos, scale_=scale):
            return attention.apply_rotary_position_embeddings(x_, sin_cos_) * scale_

        forward = jax.jit(rope)
        backward = jax.jit(lambda x_, dy_, f=rope: jax.vjp(f, x_)[1](dy_)[0])
        forward_us = gpu_time_ms(forward, x, calls=20)[0] * 1e3
        both_us = forward_us + gpu_time_ms(backward, x, dy, calls=20)[0] * 1e3
        tb_per_s = 2 * x.nbytes / forward_us / 1e6
        results[name] = dict(forward_us=forward_us, forward_backward_us=both_us, tb_per_s=tb_per_s)
        print(
            f"{name:14s} {tuple(x.shape)}  forward {forward_us:7.1f} us ({tb_per_s:4.2f} TB/s)  "
            f"forward+backward {both_us:7.1f} us"
        )
    write_json(args.json_out, results)


if __name__ == "__main__":
    main()
