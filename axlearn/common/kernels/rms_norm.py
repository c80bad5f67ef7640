"""A pre-norm block's RMSNorm as Pallas kernels: its backward pass, and its forward pass
over the few rows of a decoding step.

An RMSNorm's backward needs a sum over each row before any of the row's outputs, which
XLA emits as a reduction pass and an elementwise pass that read the row twice. This
kernel holds whole rows and reads each input once, summing the cotangents of the norm's
consumers and of the block's residual in the same pass. `layers.RMSNorm.residual_and_norm`
takes it where `dispatch.kernel_mode` says so.

At a decoding step's few rows the forward pass costs launches, not bytes: XLA emits a
reduction and then the scaling, two kernels, where `rms_norm_forward` is one.
"""

import math
from collections.abc import Sequence
from typing import Optional

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec

from axlearn.common.kernels.dispatch import compiler_params, rows, several_devices
from axlearn.common.module import Tensor
from axlearn.common.sharding import MeshAxes, axis_names, mesh_partition_spec

# Elements of the rows a program holds at once, and of the rows it walks through, summing
# the scale's gradient on the way so that it writes one partial sum; its warps. Tuned on
# Hopper for rows of 2048.
_NORM_BLOCK_ELEMENTS = 4096
_NORM_PROGRAM_ELEMENTS = 131072
_NORM_NUM_WARPS = 8
# The widest row a program holds: a few [rows, hidden] float32 tiles in registers.
_NORM_MAX_HIDDEN = 8192
# The most rows `rms_norm_forward` takes (a decoding step's batch), one program a row, and
# its warps.
FORWARD_MAX_ROWS = 8
_FORWARD_NUM_WARPS = 4


def _norm_rows(hidden: int) -> tuple[int, int]:
    """(rows a program holds at once, rows a program walks through) for rows of `hidden`."""
    block_rows = max(1, _NORM_BLOCK_ELEMENTS // hidden)
    return block_rows, max(block_rows, _NORM_PROGRAM_ELEMENTS // hidden)


def _holds_rows_of(hidden: int) -> bool:
    """Whether a program can hold rows of `hidden`: a power of two up to `_NORM_MAX_HIDDEN`."""
    return hidden & (hidden - 1) == 0 and hidden <= _NORM_MAX_HIDDEN


def rms_norm_supported(shape: Sequence[int]) -> bool:
    """Whether the norm kernel takes an array of `shape` ([..., hidden]) whole rows at a time."""
    hidden, num_rows = shape[-1], math.prod(shape[:-1])
    return len(shape) >= 2 and _holds_rows_of(hidden) and num_rows % _norm_rows(hidden)[0] == 0


def sharded_rms_norm_backward(
    x: Tensor,
    scale: Tensor,
    dys: Sequence[Tensor],
    dresidual: Tensor,
    *,
    eps: float,
    partition_spec: Optional[MeshAxes],
    interpret: bool = False,
) -> tuple[Tensor, Tensor]:
    """`rms_norm_backward` for [..., hidden] arrays split by `partition_spec` over the
    current mesh (None: unsplit; the hidden axis must not be split): each device runs the
    kernel on its own rows, and the scale's gradient is summed over the devices."""

    def local(x_, scale_, dres_, *dys_):
        dx, dscale = rms_norm_backward(
            rows(x_), scale_, [rows(t) for t in dys_], rows(dres_), eps=eps, interpret=interpret
        )
        return dx.reshape(x_.shape), dscale

    if not several_devices():
        return local(x, scale, dresidual, *dys)
    spec = mesh_partition_spec(partition_spec)
    row_axes = tuple(name for entry in spec[:-1] for name in axis_names(entry))

    def summed(*args):
        dx, dscale = local(*args)
        return dx, jax.lax.psum(dscale, row_axes) if row_axes else dscale

    replicated = PartitionSpec()
    return jax.shard_map(
        summed,
        in_specs=(spec, replicated, spec) + (spec,) * len(dys),
        out_specs=(spec, replicated),
        check_vma=False,
    )(x, scale, dresidual, *dys)


def rms_norm_backward(
    x: Tensor,
    scale: Tensor,
    dys: Sequence[Tensor],
    dresidual: Tensor,
    *,
    eps: float,
    block_rows: Optional[int] = None,
    rows_per_program: Optional[int] = None,
    num_warps: int = _NORM_NUM_WARPS,
    interpret: bool = False,
) -> tuple[Tensor, Tensor]:
    """The input and scale gradients of a pre-norm block's `x` ([rows, hidden]), in one pass.

    For y = x * r * scale with r = rsqrt(mean(x^2) + eps) over each row, read by several
    consumers (dy, the sum of `dys`, one a consumer), and x also feeding the block's
    residual add (whose gradient is `dresidual`):

        dx = dresidual + r * scale * dy - x * r^3 * mean(scale * dy * x)
        dscale = sum over rows of dy * x * r

    computed in float32 from rows read once. dx has x's dtype, dscale scale's.
    `block_rows` and `rows_per_program` default to `_norm_rows(hidden)`.
    """
    from jax.experimental import pallas as pl  # pylint: disable=import-outside-toplevel

    num_rows, hidden = x.shape
    default_block_rows, default_per_program = _norm_rows(hidden)
    block_rows = block_rows or default_block_rows
    per_program = math.gcd(num_rows, rows_per_program or default_per_program)
    if per_program % block_rows:
        raise ValueError(
            f"rms_norm_backward: {num_rows} rows do not split into blocks of {block_rows}"
        )
    steps = per_program // block_rows
    programs = num_rows // per_program

    def kernel(x_ref, scale_ref, dres_ref, *refs):
        dy_refs, (dx_ref, dscale_ref) = refs[:-2], refs[-2:]
        gamma = scale_ref[...].astype(jnp.float32)

        def step(i, dscale):
            block = (pl.ds(i * block_rows, block_rows), slice(None))
            x_, dres_ = (ref[block].astype(jnp.float32) for ref in (x_ref, dres_ref))
            dy_ = sum(ref[block].astype(jnp.float32) for ref in dy_refs)
            r = jax.lax.rsqrt(jnp.mean(x_ * x_, axis=1, keepdims=True) + eps)
            g = dy_ * gamma
            c = jnp.mean(g * x_, axis=1, keepdims=True) * r * r * r
            dx_ref[block] = (dres_ + r * g - x_ * c).astype(dx_ref.dtype)
            return dscale + jnp.sum(dy_ * x_ * r, axis=0)

        dscale = jax.lax.fori_loop(0, steps, step, jnp.zeros((hidden,), jnp.float32))
        dscale_ref[...] = dscale[None, :]

    rows_spec = pl.BlockSpec((per_program, hidden), lambda i: (i, 0))
    dx, partial = pl.pallas_call(
        kernel,
        grid=(programs,),
        in_specs=[rows_spec, pl.BlockSpec((hidden,), lambda i: (0,)), rows_spec]
        + [rows_spec] * len(dys),
        out_specs=[rows_spec, pl.BlockSpec((1, hidden), lambda i: (i, 0))],
        out_shape=[
            jax.ShapeDtypeStruct(x.shape, x.dtype),
            jax.ShapeDtypeStruct((programs, hidden), jnp.float32),
        ],
        compiler_params=compiler_params(num_warps, interpret),
        interpret=interpret,
        name="rms_norm_backward",
    )(x, scale, dresidual, *dys)
    return dx, jnp.sum(partial, axis=0).astype(scale.dtype)


def rms_norm_forward_supported(shape: Sequence[int]) -> bool:
    """Whether `rms_norm_forward` takes an array of `shape` ([..., hidden]): at most
    `FORWARD_MAX_ROWS` rows of a power of two up to `_NORM_MAX_HIDDEN`."""
    return math.prod(shape[:-1]) <= FORWARD_MAX_ROWS and _holds_rows_of(shape[-1])


def rms_norm_forward(
    x: Tensor,
    scale: Tensor,
    *,
    eps: float,
    num_warps: int = _FORWARD_NUM_WARPS,
    interpret: bool = False,
) -> Tensor:
    """x * rsqrt(mean(x^2) + eps) * scale over the last axis of x [..., hidden], one
    program a row, in float32 (as `layers.RMSNorm` with its default forward_dtype), in
    x's dtype."""
    from jax.experimental import pallas as pl  # pylint: disable=import-outside-toplevel

    flat = rows(x)
    num_rows, hidden = flat.shape

    def kernel(x_ref, scale_ref, y_ref):
        y = x_ref[...].astype(jnp.float32)
        y = y * jax.lax.rsqrt(jnp.mean(y * y, axis=1, keepdims=True) + eps)
        y_ref[...] = (y * scale_ref[...].astype(jnp.float32)).astype(y_ref.dtype)

    row = pl.BlockSpec((1, hidden), lambda i: (i, 0))
    y = pl.pallas_call(
        kernel,
        grid=(num_rows,),
        in_specs=[row, pl.BlockSpec((1, hidden), lambda i: (0, 0))],
        out_specs=row,
        out_shape=jax.ShapeDtypeStruct(flat.shape, x.dtype),
        compiler_params=compiler_params(num_warps, interpret),
        interpret=interpret,
        name="rms_norm_forward",
    )(flat, scale.reshape(1, hidden))
    return y.reshape(x.shape)
