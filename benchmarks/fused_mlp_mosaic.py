"""The gated MLP's elementwise work in the epilogues of Pallas Mosaic GPU matmuls (Hopper),
timed by `benchmarks/fused_mlp_check.py`.

Mosaic GPU is Pallas's warp-specialized GPU backend: in each block one warpgroup streams
operand tiles into shared memory by TMA while two compute warpgroups multiply them with
wgmma, and each block loops over output tiles (one block per SM). Its plain Hopper matmul
came within 5% of cuBLAS on an H100 where Triton's stayed 20% behind (the fifteenth round
in docs/benchmarks.md), so these two kernels ask whether that backend can carry the
gated MLP's epilogues:

- `forward(x, w0, w1) -> (a, b, h)`: a block computes a = x @ w0 and b = x @ w1 for the
  same tile and writes a, b and h = silu(a) * b from its accumulators, so h takes no pass
  of its own over a and b.
- `backward(dy, w2, a, b) -> (da, db)`: a block computes a tile of dh = dy @ w2ᵀ while
  a's and b's tiles load into shared memory, then writes the cotangents of a and b over
  them and stores them from there, so dh is never written.

Both compute in float32 from the bf16 values a separate path would write (a, b and dh
rounded first). The answer on an H100 is in docs/benchmarks.md (the sixteenth round).

They run under Mosaic GPU's interpreter on the CPU (`Tiles.interpret`), which is how
tests/test_fused_mlp_check.py checks them; the interpreter has no transposed wgmma
operand, so there the backward is given w2ᵀ (`Tiles.w2_transposed`).
"""

import dataclasses
import functools
from typing import Optional

import jax
import jax.experimental.pallas as pl
import jax.experimental.pallas.mosaic_gpu as plgpu
import jax.numpy as jnp
from jax import lax

from axlearn.common.module import Tensor


@dataclasses.dataclass(frozen=True)
class Tiles:
    """How a kernel tiles its output; the defaults ran best on an H100."""

    # Rows of a tile per compute warpgroup; the warpgroups split a block's rows.
    tile_m: int = 64
    # Warpgroups that compute (beside the one that loads): 2 share each tile; 1, with two
    # blocks an SM, is meant to run one block's epilogue during the other's matmul.
    compute_wgs: int = 2
    # Blocks on the grid per SM (when num_blocks is None).
    blocks_per_sm: int = 1
    # Columns of a tile (of each of a and b forward; of dh backward).
    tile_n: int = 128
    # The contracted dimension's block: one pipeline step.
    tile_k: int = 64
    # Pipeline steps in flight (shared-memory buffers of operand blocks).
    stages: int = 4
    # Columns of one epilogue store.
    epi_n: int = 64
    # Forward: epilogue stores in flight per warpgroup.
    out_slots: int = 2
    # wgmma groups left in flight across pipeline steps.
    delay_release: int = 0
    # Output tiles visit order: blocks sweep `grid_width` tiles of rows at a time.
    grid_width: int = 16
    # Blocks on the grid; None: `blocks_per_sm` per SM of the device.
    num_blocks: Optional[int] = None
    # Run under Mosaic GPU's interpreter (any backend).
    interpret: bool = False
    # Backward: take w2ᵀ instead of transposing w2's blocks in shared memory.
    w2_transposed: bool = False
    # Backward: the pipeline step at which a's and b's loads are issued (None: before the
    # first), so they need not queue ahead of the matmul's first operand loads.
    ab_load_step: Optional[int] = None

    @property
    def block_m(self) -> int:
        """Rows of a block's tile."""
        return self.compute_wgs * self.tile_m


def _smem_transforms(cols: int, dtype) -> tuple:
    """The tiling and swizzle of a shared-memory block `cols` wide, as wgmma and TMA want."""
    swizzle = plgpu.find_swizzle(cols * jnp.dtype(dtype).itemsize * 8)
    elems = swizzle // jnp.dtype(dtype).itemsize
    return plgpu.TilingTransform((8, elems)), plgpu.SwizzleTransform(swizzle)


def _operand_spec(shape: tuple[int, int], index, tiles: Tiles, dtype) -> plgpu.BlockSpec:
    """A pipeline step's block of a matmul operand, `tile_k` wide along the contraction."""
    return plgpu.BlockSpec(
        shape, index, transforms=_smem_transforms(tiles.tile_k, dtype), memory_space=plgpu.SMEM,
        delay_release=tiles.delay_release,
    )


def _sigmoid(x: Tensor) -> Tensor:
    return 1.0 / (1.0 + jnp.exp(-x))


def _interpret_params():
    # pylint: disable-next=import-outside-toplevel
    from jax._src.pallas.mosaic_gpu.interpret.params import InterpretGPUParams

    return InterpretGPUParams()


def interpreter_available() -> bool:
    """Whether this jax has Mosaic GPU's CPU interpreter."""
    try:
        _interpret_params()
    except ImportError:
        return False
    return True


def _kernel(body, out_types, tiles: Tiles):
    num_blocks = tiles.num_blocks or tiles.blocks_per_sm * jax.devices()[0].core_count
    return plgpu.kernel(
        body,
        out_type=out_types,
        grid=(num_blocks,),
        grid_names=("block",),
        num_threads=tiles.compute_wgs + 1,  # The compute warpgroups and the one that loads.
        thread_name="wg",
        compiler_params=plgpu.CompilerParams(lowering_semantics=plgpu.LoweringSemantics.Warpgroup),
        interpret=_interpret_params() if tiles.interpret else None,
    )


def _tile_loop(tiles: Tiles, row_tiles: int, col_tiles: int, body) -> None:
    """Calls body(rows, cols, wg_rows) for each output tile this block owns."""
    from jax.experimental.pallas.ops.gpu import (  # pylint: disable=import-outside-toplevel
        hopper_matmul_mgpu as hopper,
    )

    wg = lax.axis_index("wg")

    @plgpu.nd_loop((row_tiles * col_tiles,), collective_axes="block")
    def _(info):
        (linear,) = info.index
        row, col = plgpu.planar_snake(
            linear, (row_tiles, col_tiles), hopper.MatmulDimension.M, tiles.grid_width
        )
        body(
            pl.ds(row * tiles.block_m, tiles.block_m),
            pl.ds(col * tiles.tile_n, tiles.tile_n),
            pl.ds(wg * tiles.tile_m, tiles.tile_m),
        )


def _pipeline(tiles: Tiles, k_steps: int, in_specs, mma, context):
    return plgpu.emit_pipeline_warp_specialized(
        mma,
        grid=(k_steps,),
        memory_registers=40,
        in_specs=in_specs,
        wg_axis="wg",
        num_compute_wgs=tiles.compute_wgs,
        max_concurrent_steps=tiles.stages,
        compute_context=context,
    )


def _check_shapes(m: int, k: int, n: int, tiles: Tiles) -> None:
    if m % tiles.block_m or n % tiles.tile_n or k % tiles.tile_k or tiles.tile_n % tiles.epi_n:
        raise ValueError(f"[{m}, {k}] x [{k}, {n}] does not tile exactly by {tiles}")


def forward(x: Tensor, w0: Tensor, w1: Tensor, tiles: Tiles = Tiles()) -> tuple[Tensor, ...]:
    """(a, b, h) = (x @ w0, x @ w1, silu(a) * b) for x [M, K], w0 and w1 [K, N]."""
    (m, k), n = x.shape, w0.shape[1]
    _check_shapes(m, k, n, tiles)
    tm, tn, tk, en, slots = tiles.tile_m, tiles.tile_n, tiles.tile_k, tiles.epi_n, tiles.out_slots
    dtype = x.dtype
    spec = functools.partial(_operand_spec, tiles=tiles, dtype=dtype)
    in_specs = [
        spec((tiles.block_m, tk), lambda step: (0, step)),
        spec((tk, tn), lambda step: (step, 0)),
        spec((tk, tn), lambda step: (step, 0)),
    ]
    pipeline = functools.partial(_pipeline, tiles, k // tk, in_specs)
    nothing = lambda *_, **__: None  # noqa: E731

    def body(x_g, w0_g, w1_g, a_g, b_g, h_g):
        @functools.partial(
            pl.run_scoped,
            allocs=pipeline(nothing, nothing).get_allocations(x_g, w0_g, w1_g),
            out_smem=plgpu.SMEM(
                (tiles.compute_wgs, slots, tm, en), dtype, transforms=_smem_transforms(en, dtype)
            ),
            collective_axes="wg",
        )
        def _(allocs, out_smem):
            wg = lax.axis_index("wg")

            def tile(rows, cols, wg_rows):
                def epilogue(run_pipeline):
                    @functools.partial(
                        pl.run_scoped,
                        acc_a=plgpu.ACC((tm, tn), jnp.float32),
                        acc_b=plgpu.ACC((tm, tn), jnp.float32),
                    )
                    def _(acc_a, acc_b):
                        run_pipeline((acc_a, acc_b))
                        a, b = acc_a[...].astype(dtype), acc_b[...].astype(dtype)
                        a32 = a.astype(jnp.float32)
                        h = (a32 * _sigmoid(a32) * b.astype(jnp.float32)).astype(dtype)
                        # The previous tile's stores may still read their slots.
                        plgpu.wait_smem_to_gmem(0, wait_read_only=True)
                        stores = [(out, dst, j) for out, dst in ((a, a_g), (b, b_g), (h, h_g))
                                  for j in range(tn // en)]
                        for i, (out, dst, j) in enumerate(stores):
                            slot = i % slots
                            plgpu.wait_smem_to_gmem(slots - 1, wait_read_only=True)
                            out_smem[wg, slot] = out[:, j * en:(j + 1) * en]
                            plgpu.commit_smem()
                            plgpu.copy_smem_to_gmem(
                                out_smem.at[wg, slot],
                                dst.at[rows, cols].at[wg_rows].at[:, pl.ds(j * en, en)],
                            )

                def mma(_, x_s, w0_s, w1_s, accs):
                    plgpu.wgmma(accs[0], x_s.at[wg_rows], w0_s)
                    plgpu.wgmma(accs[1], x_s.at[wg_rows], w1_s)
                    plgpu.wgmma_wait(tiles.delay_release)
                    return accs

                pipeline(mma, epilogue)(
                    x_g.at[rows, :], w0_g.at[:, cols], w1_g.at[:, cols], allocations=allocs
                )

            _tile_loop(tiles, m // tiles.block_m, n // tn, tile)

        plgpu.wait_smem_to_gmem(0, wait_read_only=True)

    out = jax.ShapeDtypeStruct((m, n), dtype)
    return _kernel(body, (out, out, out), tiles)(x, w0, w1)


def backward(
    dy: Tensor, w2: Tensor, a: Tensor, b: Tensor, tiles: Tiles = Tiles()
) -> tuple[Tensor, Tensor]:
    """(da, db) of silu(a) * b for dh = dy @ w2ᵀ; dy [M, K], w2 [N, K], a and b [M, N]."""
    (m, k), n = dy.shape, w2.shape[0]
    _check_shapes(m, k, n, tiles)
    tm, tn, tk, en = tiles.tile_m, tiles.tile_n, tiles.tile_k, tiles.epi_n
    chunks = tn // en
    dtype = dy.dtype
    spec = functools.partial(_operand_spec, tiles=tiles, dtype=dtype)
    if tiles.w2_transposed:
        w2 = w2.T
        w2_spec = spec((tk, tn), lambda step: (step, 0))
    else:
        w2_spec = spec((tn, tk), lambda step: (0, step))
    in_specs = [spec((tiles.block_m, tk), lambda step: (0, step)), w2_spec]
    pipeline = functools.partial(_pipeline, tiles, k // tk, in_specs)
    nothing = lambda *_, **__: None  # noqa: E731

    def body(dy_g, w2_g, a_g, b_g, da_g, db_g):
        @functools.partial(
            pl.run_scoped,
            allocs=pipeline(nothing, nothing).get_allocations(dy_g, w2_g),
            # Per warpgroup, a's and b's tiles in store-wide chunks; da and db overwrite them.
            ab_smem=plgpu.SMEM(
                (tiles.compute_wgs, 2, chunks, tm, en),
                dtype,
                transforms=_smem_transforms(en, dtype),
            ),
            ab_loaded=plgpu.Barrier(num_arrivals=2 * chunks, num_barriers=tiles.compute_wgs),
            collective_axes="wg",
        )
        def _(allocs, ab_smem, ab_loaded):
            wg = lax.axis_index("wg")

            def tile(rows, cols, wg_rows):
                def chunk(ref, j):
                    return ref.at[rows, cols].at[wg_rows].at[:, pl.ds(j * en, en)]

                def load_ab():
                    # The previous tile's stores read ab_smem; then a and b load during
                    # this tile's matmul.
                    plgpu.wait_smem_to_gmem(0, wait_read_only=True)
                    for i, src in enumerate((a_g, b_g)):
                        for j in range(chunks):
                            plgpu.copy_gmem_to_smem(
                                chunk(src, j), ab_smem.at[wg, i, j], ab_loaded.at[wg]
                            )

                def epilogue(run_pipeline):
                    if tiles.ab_load_step is None:
                        load_ab()

                    @functools.partial(pl.run_scoped, acc=plgpu.ACC((tm, tn), jnp.float32))
                    def _(acc):
                        run_pipeline(acc)
                        dh = acc[...].astype(dtype)
                        plgpu.barrier_wait(ab_loaded.at[wg])
                        for j in range(chunks):
                            a32 = ab_smem[wg, 0, j].astype(jnp.float32)
                            b32 = ab_smem[wg, 1, j].astype(jnp.float32)
                            dh32 = dh[:, j * en:(j + 1) * en].astype(jnp.float32)
                            sigmoid = _sigmoid(a32)
                            da = dh32 * b32 * sigmoid * (1 + a32 * (1 - sigmoid))
                            ab_smem[wg, 0, j] = da.astype(dtype)
                            ab_smem[wg, 1, j] = (dh32 * a32 * sigmoid).astype(dtype)
                        plgpu.commit_smem()
                        for i, dst in enumerate((da_g, db_g)):
                            for j in range(chunks):
                                plgpu.copy_smem_to_gmem(ab_smem.at[wg, i, j], chunk(dst, j))

                def mma(steps, dy_s, w2_s, acc):
                    if tiles.ab_load_step is not None:
                        pl.when(steps[0] == tiles.ab_load_step)(load_ab)
                    w2_t = w2_s if tiles.w2_transposed else w2_s.transpose((1, 0))
                    plgpu.wgmma(acc, dy_s.at[wg_rows], w2_t)
                    plgpu.wgmma_wait(tiles.delay_release)
                    return acc

                w2_block = w2_g.at[:, cols] if tiles.w2_transposed else w2_g.at[cols, :]
                pipeline(mma, epilogue)(dy_g.at[rows, :], w2_block, allocations=allocs)

            _tile_loop(tiles, m // tiles.block_m, n // tn, tile)

        plgpu.wait_smem_to_gmem(0, wait_read_only=True)

    out = jax.ShapeDtypeStruct((m, n), dtype)
    return _kernel(body, (out, out), tiles)(dy, w2, a, b)
