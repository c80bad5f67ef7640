"""A decoding step's matmul, y = x @ w^T for a few rows of x, as one Pallas kernel.

A decoding step multiplies a handful of vectors by each weight matrix, so the matmul's
cost is one read of the weight. XLA reads an int8 weight in a reduction (cuBLAS takes no
int8 x bf16 product) that stays well under HBM's bandwidth. This kernel streams the
weight as it lies, rows last ([N, K]: each output's K values contiguous, as
`QuantizedWeight.rows_last` stores them), converts each block to the product's dtype in
registers, sums in float32 and applies the per-row scales once at the end.
`base_layer.weight_einsum` takes it for int8 weights where `dispatch.kernel_mode` says so.

Each program computes `block_n` outputs of every row, walking K in steps of `block_k`.
The product is a tensor-core dot with x padded to `DOT_ROWS` rows (Triton's smallest dot
operand; the padding is not read), or with `dot=False` (by default up to
`REDUCE_MAX_ROWS` rows) elementwise products on the CUDA cores summed along each weight
row. Blocks past the weight's edges are masked.
"""

from collections.abc import Sequence
from typing import Optional

import jax
import jax.numpy as jnp

from axlearn.common.kernels.dispatch import compiler_params, pallas_triton
from axlearn.common.module import Tensor

# Triton's smallest dot operand side: x is padded to it for the tensor-core product.
DOT_ROWS = 16
# The most rows the kernel takes: up to a dot operand's rows, W is still read once.
MAX_ROWS = DOT_ROWS
# Up to this many rows, elementwise products and sums (`dot=False`); none by default:
# Triton pipelines only a dot's loads (cp.async), and the sums hold many registers.
REDUCE_MAX_ROWS = 0

# Outputs a program computes at most: 32 rows of int8 at block_k 512 are a 16 KiB load.
_BLOCK_N = 32
# Fewer outputs a program where N is small, down to this: a dot operand's side.
_MIN_BLOCK_N = 16
# At least this many programs where N allows: one or more per SM of an H100/H200 (132).
_MIN_PROGRAMS = 128
# K values a step loads: 512 int8 values are 32 16-byte loads along each weight row.
_BLOCK_K = 512
# Warps and pipelined loads of a program: 4 warps and 3 steps in flight keep ~48 KiB of
# weight in transit per SM, about what HBM's latency asks at full bandwidth.
_NUM_WARPS = 4
_NUM_STAGES = 3


def _power_of_two_at_most(n: int) -> int:
    return 1 << (max(n, 1).bit_length() - 1)


def _next_power_of_two(n: int) -> int:
    return 1 << max(n - 1, 0).bit_length()


def _blocks(
    n: int, k: int, *, block_n: Optional[int], block_k: Optional[int], dot: bool
) -> tuple[int, int]:
    """(block_n, block_k) for a weight [n, k]: given ones, else the defaults; never past
    the weight's own (power-of-two) size, nor below a dot operand's side for the dot."""
    if block_n is None:
        block_n = max(_MIN_BLOCK_N, min(_BLOCK_N, _power_of_two_at_most(n // _MIN_PROGRAMS)))
    block_n = min(block_n, _next_power_of_two(n))
    block_k = min(block_k or _BLOCK_K, _next_power_of_two(k))
    if dot:
        block_n, block_k = max(block_n, DOT_ROWS), max(block_k, DOT_ROWS)
    return block_n, block_k


def _and(a: Optional[Tensor], b: Optional[Tensor]) -> Optional[Tensor]:
    """a & b, where None stands for all True."""
    return b if a is None else a if b is None else a & b


def decode_matmul_supported(x_shape: Sequence[int], n: int) -> bool:
    """Whether the kernel takes x of `x_shape` ([rows, K]) times a weight of `n` rows.

    Blocks that overhang the weight's edges need Triton's masked loads, which only
    `jax.experimental.pallas.triton` offers; where it does not import, only weights the
    default blocks tile exactly run the kernel (interpreted)."""
    if len(x_shape) != 2 or not 1 <= x_shape[0] <= MAX_ROWS:
        return False
    rows, k = x_shape
    block_n, block_k = _blocks(n, k, block_n=None, block_k=None, dot=rows > REDUCE_MAX_ROWS)
    return (n % block_n == 0 and k % block_k == 0) or pallas_triton() is not None


def decode_matmul(
    x: Tensor,
    w: Tensor,
    scale: Optional[Tensor] = None,
    *,
    block_n: Optional[int] = None,
    block_k: Optional[int] = None,
    num_warps: int = _NUM_WARPS,
    num_stages: Optional[int] = _NUM_STAGES,
    dot: Optional[bool] = None,
    interpret: bool = False,
) -> Tensor:
    """y [rows, N] = (x [rows, K] @ w^T) * scale in x's dtype, for w [N, K] (int8 with a
    float scale [N] per row, or a float weight without), summed in float32.

    `dot` chooses the tensor-core product (None: above `REDUCE_MAX_ROWS` rows); blocks,
    warps and pipelined stages default to the module's constants (the benchmark sweeps them).
    """
    from jax.experimental import pallas as pl  # pylint: disable=import-outside-toplevel

    rows, k = x.shape
    n = w.shape[0]
    if w.shape[1] != k or not 1 <= rows <= MAX_ROWS:
        raise ValueError(f"decode_matmul: x {x.shape} and w {w.shape} do not fit")
    dot = rows > REDUCE_MAX_ROWS if dot is None else dot
    block_n, block_k = _blocks(n, k, block_n=block_n, block_k=block_k, dot=dot)
    ragged_n, ragged_k = n % block_n != 0, k % block_k != 0
    steps = -(-k // block_k)
    # The dot multiplies in x's dtype: float32 exactly (Triton's IEEE product), bf16 as is.
    precision = jax.lax.Precision.HIGHEST if x.dtype == jnp.float32 else None
    x_rows = jnp.pad(x, ((0, DOT_ROWS - rows), (0, 0))) if dot else x

    def load(ref, index, mask):
        """ref[index]; where `mask` is given, zeros where it is False (past an edge)."""
        if mask is None:
            return ref[index]
        return pallas_triton().load(ref.at[index], mask=mask, other=0)

    def store(ref, index, value, mask):
        if mask is None:
            ref[index] = value
        else:
            pallas_triton().store(ref.at[index], value, mask=mask)

    def kernel(x_ref, w_ref, *refs):
        *scale_ref, y_ref = refs
        n0 = pl.multiple_of(pl.program_id(0) * block_n, block_n)
        outputs = pl.ds(n0, block_n)
        n_mask = (n0 + jnp.arange(block_n) < n) if ragged_n else None

        def step_blocks(i):
            """(x's columns, their mask, the weight's block) of step i."""
            k0 = pl.multiple_of(i * block_k, block_k)
            columns = pl.ds(k0, block_k)
            k_mask = (k0 + jnp.arange(block_k) < k) if ragged_k else None
            w_mask = _and(None if n_mask is None else n_mask[:, None],
                          None if k_mask is None else k_mask[None, :])
            return columns, k_mask, load(w_ref, (outputs, columns), w_mask)

        # x's padding rows masked off: Triton then reads only its real rows (of L2).
        row_mask = None
        if rows < DOT_ROWS and pallas_triton() is not None:
            row_mask = (jnp.arange(DOT_ROWS) < rows)[:, None]

        def dot_step(i, acc):
            columns, k_mask, w_block = step_blocks(i)
            x_mask = _and(row_mask, None if k_mask is None else k_mask[None, :])
            x_block = load(x_ref, (slice(None), columns), x_mask)
            return acc + jax.lax.dot_general(
                x_block, w_block.astype(x.dtype), (((1,), (1,)), ((), ())),
                precision=precision, preferred_element_type=jnp.float32,
            )

        def reduce_step(i, accs):
            columns, k_mask, w_block = step_blocks(i)
            w_block = w_block.astype(jnp.float32)
            x_mask = None if k_mask is None else k_mask[None, :]
            return tuple(
                acc + jnp.sum(
                    w_block * load(x_ref, (pl.ds(r, 1), columns), x_mask).astype(jnp.float32),
                    axis=1,
                )
                for r, acc in enumerate(accs)
            )

        # (the rows of y, their values [rows, block_n]) of each block of outputs.
        if dot:
            zeros = jnp.zeros((DOT_ROWS, block_n), jnp.float32)
            y_blocks = [(slice(None), jax.lax.fori_loop(0, steps, dot_step, zeros))]
        else:
            zeros = (jnp.zeros((block_n,), jnp.float32),) * rows
            accs = jax.lax.fori_loop(0, steps, reduce_step, zeros)
            y_blocks = [(pl.ds(r, 1), acc[None, :]) for r, acc in enumerate(accs)]
        scale_block = load(scale_ref[0], (outputs,), n_mask) if scale_ref else None
        y_mask = None if n_mask is None else n_mask[None, :]
        for y_rows, y in y_blocks:
            if scale_block is not None:
                y = y * scale_block[None, :]
            store(y_ref, (y_rows, outputs), y.astype(y_ref.dtype), y_mask)

    operands = (x_rows, w) if scale is None else (x_rows, w, scale.astype(jnp.float32))
    y = pl.pallas_call(
        kernel,
        grid=(-(-n // block_n),),
        out_shape=jax.ShapeDtypeStruct((x_rows.shape[0], n), x.dtype),
        compiler_params=compiler_params(num_warps, interpret, num_stages),
        interpret=interpret,
        name="decode_matmul",
    )(*operands)
    return y[:rows] if dot else y
