"""Times the gated MLP's elementwise work fused into Pallas (Triton) matmuls, at gpt_1b's
shapes, against cuBLAS with the elementwise work in separate kernels.

    PYTHONPATH=. python benchmarks/fused_mlp_check.py [--rounds=2] [--json_out=fused_mlp.json] \
        [--match=Mosaic]

The question it answers: would the step gain from matmuls that do the gated product in
their epilogues? Forward, one kernel computes a = x @ w0 and b = x @ w1 for the same
output tile and writes a, b and h = silu(a) * b, so h no longer takes a pass that
re-reads a and b (536 MB a gpt_1b layer). Backward, one kernel computes dh = dy @ w2ᵀ and
writes the cotangents of a and b from it, so dh is neither written nor read back (another
536 MB). Together at most ~5.7 ms of a gpt_1b step (17 GB at 3 TB/s), if the matmuls
inside the kernels run as fast as cuBLAS's.

It prints each variant's GPU time (profiler trace, no dispatch overhead), its model
TFLOP/s and each kernel's largest difference from the cuBLAS/XLA path. The calls are too
short to bring the card to its power limit: both sides run at its boost clock. The answer
on an H100 is in docs/benchmarks.md (the fifteenth round): no, the Triton matmuls are
20% slower than cuBLAS's, far more than the traffic saved. It also times jax's Mosaic GPU
matmul, the other Pallas backend on GPU, alone (no epilogue of ours), and the same two
fused kernels written for that backend (`benchmarks/fused_mlp_mosaic.py`; the sixteenth
round: the forward 1-2% faster than the separate path, the backward 3-7% slower).
"""

import argparse
import functools
import re
import time
from collections.abc import Callable

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from axlearn.common import gpu_kernels, layers
from axlearn.common.module import Tensor
from benchmarks import fused_mlp_mosaic

_TOKENS, _MODEL, _HIDDEN = 16384, 2048, 8192

# (block rows, block columns, block of the contracted dim, warps, pipeline stages).
_CONFIGS = (
    (128, 128, 64, 4, 4),
    (128, 128, 64, 8, 3),
    (128, 256, 64, 8, 3),
    (256, 128, 64, 8, 3),
    (128, 128, 32, 4, 5),
    (64, 128, 64, 4, 4),
    (128, 64, 64, 4, 4),
)

# The Mosaic GPU kernels' variants timed: the defaults, more epilogue stores in flight
# (fewer pipeline stages make room for them), one wgmma group in flight across steps,
# one compute warpgroup a block with one or two blocks an SM, and (backward) a's and b's
# loads issued part-way through the matmul's 32 steps.
_MOSAIC_TILES = (
    fused_mlp_mosaic.Tiles(),
    fused_mlp_mosaic.Tiles(stages=3, out_slots=4),
    fused_mlp_mosaic.Tiles(delay_release=1),
    fused_mlp_mosaic.Tiles(compute_wgs=1),
    fused_mlp_mosaic.Tiles(compute_wgs=1, blocks_per_sm=2, stages=2),
    fused_mlp_mosaic.Tiles(compute_wgs=1, blocks_per_sm=2, stages=3),
    fused_mlp_mosaic.Tiles(ab_load_step=2),
    fused_mlp_mosaic.Tiles(ab_load_step=8),
    fused_mlp_mosaic.Tiles(ab_load_step=16),
)

silu = layers.get_activation_fn("nn.silu")
swiglu_cotangents = functools.partial(
    layers.gated_product_cotangents, silu, layers.get_activation_fn("linear")
)


def _tile_order(row_blocks: int, col_blocks: int, group: int) -> Callable:
    """Program id -> (row block, column block), sweeping `group` row blocks across all
    column blocks together, so a weight tile is reused from L2 by the rows of a group."""

    def tile(p):
        per_group = group * col_blocks
        first = (p // per_group) * group
        size = jnp.minimum(row_blocks - first, group)
        return first + (p % per_group) % size, (p % per_group) // size

    return tile


def _call(kernel, *, shape, block, operand_specs, num_outputs, config, dtype, interpret):
    """A pallas_call over the [rows, columns] output `shape` in tiles of `block`.

    `operand_specs`: per operand, a function from the tile order to its BlockSpec, or None
    for an operand tiled like the outputs.
    """
    (rows, cols), (bm, bn) = shape, block
    tile = _tile_order(rows // bm, cols // bn, group=8)
    out_spec = pl.BlockSpec(block, tile)
    return pl.pallas_call(
        kernel,
        grid=((rows // bm) * (cols // bn),),
        in_specs=[spec(tile) if callable(spec) else out_spec for spec in operand_specs],
        out_specs=[out_spec] * num_outputs,
        out_shape=[jax.ShapeDtypeStruct(shape, dtype)] * num_outputs,
        compiler_params=plgpu.CompilerParams(num_warps=config[3], num_stages=config[4]),
        interpret=interpret,
    )


def matmul(x: Tensor, w: Tensor, *, config: tuple[int, ...], interpret: bool = False) -> Tensor:
    """x @ w ([M, K] @ [K, N]), accumulated in float32: the plain Triton matmul. `config`
    is one of `_CONFIGS`' rows, as are the fused kernels'."""
    bm, bn, bk = config[:3]
    contracted = x.shape[1]

    def kernel(x_ref, w_ref, o_ref):
        def step(k, acc):
            xs, ws = x_ref[:, pl.ds(k * bk, bk)], w_ref[pl.ds(k * bk, bk), :]
            return acc + jnp.dot(xs, ws, preferred_element_type=jnp.float32)

        acc = jax.lax.fori_loop(0, contracted // bk, step, jnp.zeros((bm, bn), jnp.float32))
        o_ref[...] = acc.astype(o_ref.dtype)

    specs = [
        lambda tile: pl.BlockSpec((bm, contracted), lambda p: (tile(p)[0], 0)),
        lambda tile: pl.BlockSpec((contracted, bn), lambda p: (0, tile(p)[1])),
    ]
    (out,) = _call(
        kernel, shape=(x.shape[0], w.shape[1]), block=(bm, bn), operand_specs=specs,
        num_outputs=1, config=config, dtype=x.dtype, interpret=interpret,
    )(x, w)
    return out


def gated_mlp_forward(
    x: Tensor, w0: Tensor, w1: Tensor, *, config: tuple[int, ...], interpret: bool = False
) -> tuple[Tensor, Tensor, Tensor]:
    """(a, b, h) = (x @ w0, x @ w1, silu(a) * b) in one kernel; h from a and b as rounded."""
    bm, bn, bk = config[:3]
    contracted = x.shape[1]

    def kernel(x_ref, w0_ref, w1_ref, a_ref, b_ref, h_ref):
        def step(k, accs):
            xs = x_ref[:, pl.ds(k * bk, bk)]
            return tuple(
                acc + jnp.dot(xs, w_ref[pl.ds(k * bk, bk), :], preferred_element_type=jnp.float32)
                for acc, w_ref in zip(accs, (w0_ref, w1_ref))
            )

        zero = jnp.zeros((bm, bn), jnp.float32)
        acc0, acc1 = jax.lax.fori_loop(0, contracted // bk, step, (zero, zero))
        a, b = acc0.astype(a_ref.dtype), acc1.astype(b_ref.dtype)
        a_ref[...], b_ref[...] = a, b
        h_ref[...] = (silu(a.astype(jnp.float32)) * b.astype(jnp.float32)).astype(h_ref.dtype)

    weight = lambda tile: pl.BlockSpec((contracted, bn), lambda p: (0, tile(p)[1]))  # noqa: E731
    specs = [lambda tile: pl.BlockSpec((bm, contracted), lambda p: (tile(p)[0], 0)), weight, weight]
    a, b, h = _call(
        kernel, shape=(x.shape[0], w0.shape[1]), block=(bm, bn), operand_specs=specs,
        num_outputs=3, config=config, dtype=x.dtype, interpret=interpret,
    )(x, w0, w1)
    return a, b, h


def gated_mlp_backward(
    dy: Tensor,
    w2: Tensor,
    a: Tensor,
    b: Tensor,
    *,
    config: tuple[int, ...],
    interpret: bool = False,
) -> tuple[Tensor, Tensor]:
    """(da, db) of silu(a) * b for dh = dy @ w2ᵀ (w2: [hidden, model]), dh rounded to the
    activations' dtype first as a separate matmul would write it, in one kernel."""
    bm, bn, bk = config[:3]
    contracted = dy.shape[1]

    def kernel(dy_ref, w2_ref, a_ref, b_ref, da_ref, db_ref):
        def step(k, acc):
            ds, ws = dy_ref[:, pl.ds(k * bk, bk)], w2_ref[:, pl.ds(k * bk, bk)]
            dims = (((1,), (1,)), ((), ()))
            return acc + jax.lax.dot_general(ds, ws, dims, preferred_element_type=jnp.float32)

        dh = jax.lax.fori_loop(0, contracted // bk, step, jnp.zeros((bm, bn), jnp.float32))
        dh = dh.astype(a_ref.dtype).astype(jnp.float32)
        da, db = swiglu_cotangents(
            a_ref[...].astype(jnp.float32), b_ref[...].astype(jnp.float32), dh
        )
        da_ref[...], db_ref[...] = da.astype(da_ref.dtype), db.astype(db_ref.dtype)

    specs = [
        lambda tile: pl.BlockSpec((bm, contracted), lambda p: (tile(p)[0], 0)),
        lambda tile: pl.BlockSpec((bn, contracted), lambda p: (tile(p)[1], 0)),
        None,  # a and b: tiled like the outputs.
        None,
    ]
    da, db = _call(
        kernel, shape=a.shape, block=(bm, bn), operand_specs=specs,
        num_outputs=2, config=config, dtype=a.dtype, interpret=interpret,
    )(dy, w2, a, b)
    return da, db


def separate_forward(x: Tensor, w0: Tensor, w1: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    """The step's way: two matmuls (cuBLAS on GPU), then h in a pass of its own."""
    a, b = x @ w0, x @ w1
    return a, b, (silu(a.astype(jnp.float32)) * b.astype(jnp.float32)).astype(a.dtype)


def separate_backward(dy: Tensor, w2: Tensor, a: Tensor, b: Tensor, *, interpret: bool = False):
    """The step's way: dh by a matmul, then `gpu_kernels.gated_product_backward`."""
    dh = dy @ w2.T
    return gpu_kernels.gated_product_backward(swiglu_cotangents, a, b, dh, interpret=interpret)


def mosaic_matmul(x: Tensor, w: Tensor, *, tiles: tuple[int, int], wg_dimension: str) -> Tensor:
    """x @ w by jax's Hopper matmul in Mosaic GPU (warp-specialized, TMA loads): whether
    that backend, the other one Pallas has on GPU, would carry an epilogue at cuBLAS's rate.
    `wg_dimension` ('M' or 'N'): how the two compute warpgroups split a block."""
    # pylint: disable-next=import-outside-toplevel
    from jax.experimental.pallas.ops.gpu import hopper_matmul_mgpu as mgpu

    dim = mgpu.MatmulDimension[wg_dimension]
    config = mgpu.TuningConfig(
        tile_m=tiles[0], tile_n=tiles[1], tile_k=64, max_concurrent_steps=4,
        grid_minor_dim=mgpu.MatmulDimension.M, grid_tile_width=16, wg_dimension=dim,
    )
    return mgpu.matmul(x, w, None, config=config)


def _max_diff(got, want) -> float:
    return max(
        float(jnp.max(jnp.abs(g.astype(jnp.float32) - w.astype(jnp.float32))))
        for g, w in zip(jax.tree.leaves(got), jax.tree.leaves(want))
    )


def main() -> None:
    from axlearn.bench import gpu_time_ms, write_json  # pylint: disable=import-outside-toplevel

    parser = argparse.ArgumentParser()
    parser.add_argument("--rounds", type=int, default=2, help="Times each variant is timed.")
    parser.add_argument("--json_out", default=None)
    parser.add_argument(
        "--match",
        default="",
        help="Times only the variants whose name has this regex (and the baselines).",
    )
    args = parser.parse_args()
    keys = jax.random.split(jax.random.key(0), 5)

    def normal(key, shape, scale):
        return (jax.random.normal(key, shape) * scale).astype(jnp.bfloat16)

    x, dy = normal(keys[0], (_TOKENS, _MODEL), 1.0), normal(keys[1], (_TOKENS, _MODEL), 1.0)
    w0, w1 = (normal(k, (_MODEL, _HIDDEN), _MODEL**-0.5) for k in keys[2:4])
    w2 = normal(keys[4], (_HIDDEN, _MODEL), _HIDDEN**-0.5)
    plain = jax.jit(lambda x, w: x @ w)
    forward, backward = jax.jit(separate_forward), jax.jit(separate_backward)
    a, b, _ = forward(x, w0, w1)

    gflop = 2 * _TOKENS * _MODEL * _HIDDEN / 1e9  # One [tokens, model] x [model, hidden] matmul.
    # name -> (function, operands, the reference it must match (None: it is one), GFLOP).
    variants = {
        "cuBLAS matmul": (plain, (x, w0), None, gflop),
        "forward: 2 cuBLAS matmuls + h": (forward, (x, w0, w1), None, 2 * gflop),
        "backward: cuBLAS dh + gated kernel": (backward, (dy, w2, a, b), None, gflop),
    }
    for tiles, wg_dimension in (((128, 128), "N"), ((128, 128), "M"), ((64, 256), "M")):
        fn = jax.jit(functools.partial(mosaic_matmul, tiles=tiles, wg_dimension=wg_dimension))
        variants[f"Mosaic GPU matmul {tiles} wg={wg_dimension}"] = (fn, (x, w0), plain, gflop)
    for tiles in _MOSAIC_TILES:
        fwd, bwd = (jax.jit(functools.partial(fn, tiles=tiles))
                    for fn in (fused_mlp_mosaic.forward, fused_mlp_mosaic.backward))
        name = (
            f"{tiles.compute_wgs} wg x {tiles.blocks_per_sm}/SM, {tiles.stages} stages, "
            f"{tiles.out_slots} slots, delay {tiles.delay_release}, loads {tiles.ab_load_step}"
        )
        if tiles.ab_load_step is None:  # The forward loads no a and b.
            variants[f"Mosaic fused forward ({name})"] = (fwd, (x, w0, w1), forward, 2 * gflop)
        if tiles.out_slots == 2:  # The backward stores from a's and b's buffers, not slots.
            variants[f"Mosaic fused backward ({name})"] = (bwd, (dy, w2, a, b), backward, gflop)
    for config in _CONFIGS:
        fns = (matmul, gated_mlp_forward, gated_mlp_backward)
        matmul_, fwd, bwd = (jax.jit(functools.partial(fn, config=config)) for fn in fns)
        variants[f"Triton matmul {config}"] = (matmul_, (x, w0), plain, gflop)
        variants[f"fused forward {config}"] = (fwd, (x, w0, w1), forward, 2 * gflop)
        variants[f"fused backward {config}"] = (bwd, (dy, w2, a, b), backward, gflop)
    variants = {
        name: variant for name, variant in variants.items()
        if variant[2] is None or re.search(args.match, name)
    }

    start = time.time()  # 8 s of matmuls first, so the first round finds the card running.
    while time.time() - start < 8:
        jax.block_until_ready([plain(x, w0) for _ in range(50)])

    results = {}
    for round_ in range(args.rounds):
        for name, (fn, operands, reference, gflop_) in variants.items():
            try:
                diff = None if reference is None else _max_diff(fn(*operands), reference(*operands))
                ms, _ = gpu_time_ms(fn, *operands, calls=30)
            except Exception as e:  # pylint: disable=broad-except  (Triton rejects some blocks)
                print(f"{name:45s} failed: {type(e).__name__}: {str(e)[:200]}", flush=True)
                continue
            results.setdefault(name, dict(ms=[], max_abs_diff=diff))["ms"].append(ms)
            rate = f"{ms:7.3f} ms {gflop_ / ms:6.1f} TFLOP/s"
            print(f"round {round_} {name:45s} {rate}  max |diff| {diff}", flush=True)
    write_json(args.json_out, results)


if __name__ == "__main__":
    main()
